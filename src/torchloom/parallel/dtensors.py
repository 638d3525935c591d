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

__all__ = [
    "full",
    "full_tensor",
    "is_dtensor",
    "local",
    "local_nbytes",
    "local_tensor",
    "reshard_module",
    "shard_like",
]


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


def shard_like(whole: torch.Tensor, reference: Any) -> Any:
    """``whole`` laid out as ``reference``: when ``reference`` is a DTensor, the DTensor of its mesh and placements
    whose value is ``whole`` (this process keeps its part of ``whole``: no communication, so every process must pass
    the same ``whole``, as every process reads the same saved file); else ``whole`` on ``reference``'s device.

    Args:
        whole (`torch.Tensor`): a plain tensor of ``reference``'s global shape (a DTensor is returned as it is).
        reference (`torch.Tensor`): a DTensor or a plain tensor.

    Returns:
        `torch.Tensor`: a DTensor like ``reference`` (the dtype of ``whole``), or a plain tensor.

    Raises:
        ValueError: ``whole``'s shape is not ``reference``'s global shape.
    """
    if is_dtensor(whole) or not isinstance(reference, torch.Tensor):
        return whole
    if tuple(whole.shape) != tuple(reference.shape):
        raise ValueError(
            f"shard_like: a tensor of shape {tuple(whole.shape)} cannot take the layout of one of shape "
            f"{tuple(reference.shape)}"
        )
    if not is_dtensor(reference):
        return whole.to(reference.device)
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = reference.device_mesh, reference.placements  # type: ignore[attr-defined]
    return distribute_tensor(whole.to(reference.device), mesh, placements, src_data_rank=None)


def reshard_module(module: torch.nn.Module) -> torch.nn.Module:
    """Put every FSDP2 module in ``module`` (itself included) back in its sharded state (``FSDPModule.reshard()``):
    the unsharded parameters that a forward without a backward leaves in place (FSDP2 does not reshard the root
    module after its forward) are freed, and the module's parameters are the sharded DTensors again, so a write into
    them is what the next forward gathers. Local, no communication; nothing to do without FSDP2.

    Returns:
        `torch.nn.Module`: ``module``.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is not None:
        for sub in module.modules():
            if isinstance(sub, fsdp_module):
                sub.reshard()
    return module


#: Short names for the core's own uses.
local, full = local_tensor, full_tensor
