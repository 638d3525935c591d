"""Copies of a model that FSDP2 sharded (`copy_module`), for the tools that trace a copy on fake or ``meta``
tensors (`torchloom.estimate_flops`, `torchloom.estimate_memory`, the ``throughput`` plugin's FLOP count).

``fully_shard`` gives each module it wraps a class of its own, ``FSDP<Class>`` (``FSDPModule`` first in its method
resolution order), whose ``__deepcopy__`` raises ("FSDP does not support deepcopy"), and hooks on the module that
gather and free its parameters through the process group. A copy for tracing wants neither: it is the model as
its author wrote it, with whole parameters (`copy_module` leaves the parameters to the caller's ``memo``: give a
DTensor parameter's copy its global shape, ``DTensor.shape``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["copy_module"]

#: The hook tables of `torch.nn.Module` that FSDP2 registers its hooks in; a copy of a sharded module gets them empty.
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


#: The prefix of the attribute where ``torch.distributed._composable_state`` keeps a module's FSDP2 state (its mesh,
#: process group and parameter groups: nothing a copy for tracing may share or copy).
_COMPOSABLE_STATE = "__composable_api_state_key"


def _original_class(module: torch.nn.Module) -> type | None:
    """The class that ``fully_shard`` replaced on ``module`` (``None`` for a module it did not wrap)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if not issubclass(cls, FSDPModule):
        return None
    return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]


def copy_module(model: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """``copy.deepcopy(model, memo)``, also of a model that FSDP2 sharded: each module ``fully_shard`` wrapped is
    copied as its original class, without FSDP2's hooks (every hook of that module: FSDP2 registers its own in the
    same tables) and without FSDP2's state (the mesh, process group and parameter groups each managed module
    keeps), and ``model`` itself is left as it was.

    Args:
        model (`torch.nn.Module`): the model.
        memo (`dict[int, Any]`): ``copy.deepcopy``'s memo, e.g. the copies of the parameters by ``id``.

    Returns:
        `torch.nn.Module`: the copy.
    """
    wrapped = [(m, cls) for m in model.modules() if (cls := _original_class(m)) is not None]
    if not wrapped:
        return copy.deepcopy(model, memo)
    for module in model.modules():  # torch.distributed's composable APIs keep their state (FSDPState) here
        for key, value in vars(module).items():
            if key.startswith(_COMPOSABLE_STATE):
                memo[id(value)] = OrderedDict()
    for module, _ in wrapped:
        for name in _HOOK_TABLES:
            table = module.__dict__.get(name)
            if table is not None:
                memo[id(table)] = OrderedDict()
    swapped = [(module, type(module)) for module, _ in wrapped]
    try:
        for module, original in wrapped:
            module.__class__ = original
        return copy.deepcopy(model, memo)
    finally:
        for module, cls in swapped:
            module.__class__ = cls
