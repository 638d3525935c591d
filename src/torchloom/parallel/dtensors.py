"""Values that may be DTensors: the parameters, gradients and optimizer states of a sharded (FSDP2) run are
``torch.distributed.tensor.DTensor``; each process holds its shard (`local_tensor`), the whole value exists only
when gathered (`full_tensor`). Everything in torchloom that reads such a value goes through these, so a plain tensor
and a DTensor give the same answer. Plugins reach both on ``torchloom.utils``.

``torch.distributed.tensor`` is not imported here: while no code has imported it, no value can be a DTensor.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["full", "full_tensor", "is_dtensor", "local", "local_nbytes", "local_tensor"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (a sharded or replicated tensor of a device
    mesh), without importing that module."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def local_tensor(value: Any) -> Any:
    """This process's part of ``value``: a DTensor's local shard (``to_local()``: no communication; a replicated
    DTensor's whole value, a sharded one's shard), anything else as it is."""
    return value.to_local() if is_dtensor(value) else value


def full_tensor(value: Any) -> Any:
    """The whole value of ``value``: a DTensor gathered and reduced into a plain tensor (``full_tensor()``, a
    collective when the DTensor is sharded or a partial sum: every process of its mesh calls this at the same
    point), anything else as it is.

    Returns:
        `torch.Tensor` (or ``value`` unchanged): the same shape and dtype as the DTensor's global shape.
    """
    return value.full_tensor() if is_dtensor(value) else value


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` held by this process (a DTensor's local shard)."""
    part = local_tensor(tensor)
    return int(part.numel() * part.element_size())


#: Short names for the core's own uses.
local, full = local_tensor, full_tensor
