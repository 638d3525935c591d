"""What FSDP2 (``torch.distributed.fsdp.fully_shard``, through Accelerate) does to one process's memory, for
`torchloom.estimate_memory` with ``dp_shard_size`` > 1.

Method, from FSDP2's code (torch 2.13, ``torch/distributed/fsdp/_fully_shard``) and checked against measured
per-process memory of 2-process CPU runs (``tests/test_memory_shard.py``):

- **Shards.** Each parameter is split on its first dimension into ``dp_shard_size`` chunks (`torch.chunk`); every
  process stores a chunk padded to ``ceil(size(0) / dp_shard_size)`` rows (`shard_bytes`), the largest chunk,
  which is rank 0's. Buffers are not sharded. The optimizer state is built on the local shards: it is estimated
  on a model whose parameters have the shard's shape (`as_shards`), which is exact for element-wise optimizers
  (AdamW, SGD); Adafactor's factored state is estimated on the shard's shape as well.
- **Units.** The modules of the classes in ``transformer_layer_cls_to_wrap`` (by default the model's
  ``_no_split_modules``, as the ``fsdp`` plugin and Accelerate's ``TRANSFORMER_BASED_WRAP`` choose) are each
  sharded as one unit; the parameters outside them form the root unit.
- **Gathered parameters.** A unit's full parameters exist while it runs (`UnitSimulation`): all-gathered before its
  forward (the all-gather output and the unsharded parameters both exist for a moment) and freed after it (the
  default ``reshard_after_forward``); gathered again before its backward, with the next unit of the backward
  prefetched; freed after its gradients are reduce-scattered (through a flat copy of them). The root unit stays
  gathered from the start of the forward to the end of the backward.
- **Gradients.** On the micro-batch that synchronises (the only one without accumulation), each unit's full
  gradients exist from their computation until its reduce-scatter, which creates the shard (``zero_grad`` freed
  the shards of the step before): the gradient column holds the shards, and the activation column is the peak of
  the micro-batch less them, so that the total counts each shard from its reduce-scatter on. Inside an
  accumulation window Accelerate's ``no_sync`` calls ``set_requires_gradient_sync(False)`` and FSDP2 keeps every
  full gradient, accumulated, until the window's last micro-batch: the gradient column then holds full gradients,
  as under DDP, and each micro-batch's own full gradients exist besides from their computation until the unit's
  post-backward adds them in.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from torchloom.errors import ConfigError

__all__ = ["ShardPlan", "Sharding", "UnitSimulation", "as_shards", "plan_units", "shard_bytes"]


@dataclass(frozen=True)
class Sharding:
    """What `torchloom.estimate_memory` was asked about FSDP2: ``processes`` (``dp_shard_size``, >= 2), the layer
    classes of the units (``None``: the model's ``_no_split_modules``) and whether the micro-batch accumulates."""

    processes: int
    layer_classes: tuple[str, ...] | None
    accumulating: bool


def shard_bytes(p: torch.Tensor, processes: int) -> int:
    """Bytes one process stores of parameter ``p`` sharded over ``processes``: ``ceil(size(0) / processes)`` rows
    (FSDP2 pads every chunk to the first one's size); a 0-dim parameter is stored whole."""
    if p.dim() == 0:
        return p.element_size()
    rows = p.shape[0]
    return math.ceil(rows / processes) * (p.numel() // rows if rows else 0) * p.element_size()


def _full_bytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@dataclass(frozen=True)
class ShardPlan:
    """How FSDP2 shards a model: ``processes`` (``dp_shard_size``), the units' parameters in model order (index 0
    is the root unit: the parameters of no layer), and whether the micro-batch accumulates (no reduce-scatter).

    Attributes:
        processes (`int`): processes the parameters are sharded over, >= 2.
        groups (`tuple[tuple[torch.nn.Parameter, ...], ...]`): each unit's parameters; ``groups[0]`` the root's.
        layers (`tuple[torch.nn.Module, ...]`): the layer modules of ``groups[1:]``.
        accumulating (`bool`): inside an accumulation window (full gradients kept, nothing reduce-scattered).
    """

    processes: int
    groups: tuple[tuple[torch.nn.Parameter, ...], ...]
    layers: tuple[torch.nn.Module, ...]
    accumulating: bool = False

    def parameter_bytes(self, model: torch.nn.Module) -> int:
        """One process's sharded parameters and its (whole) buffers, in bytes."""
        params = sum(shard_bytes(p, self.processes) for group in self.groups for p in group)
        return params + sum(b.numel() * b.element_size() for b in model.buffers())

    def gradient_bytes(self) -> int:
        """One process's gradients held between micro-batches: the shards, or inside an accumulation window the
        full gradients (`ShardPlan.accumulating`)."""
        trainable = [p for group in self.groups for p in group if p.requires_grad]
        if self.accumulating:
            return _full_bytes(trainable)
        return sum(shard_bytes(p, self.processes) for p in trainable)


def plan_units(
    model: torch.nn.Module, layer_classes: Sequence[str] | None, processes: int, accumulating: bool
) -> ShardPlan:
    """The `ShardPlan` of ``model`` with units of the classes named in ``layer_classes`` (``None``: the model's
    ``_no_split_modules``); nested matches belong to the outermost one.

    Raises:
        ConfigError: no classes given and the model names none (not a transformers model), or a class that
            matches no module of the model (the message lists the model's module classes).
    """
    names = list(layer_classes) if layer_classes is not None else list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ConfigError(
            f"transformer_layer_cls_to_wrap: {type(model).__name__} names no layer classes (_no_split_modules); give "
            "the class names of its repeated layers, e.g. ['LlamaDecoderLayer'], as the fsdp plugin takes them"
        )
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing and layer_classes is not None:
        raise ConfigError(
            f"transformer_layer_cls_to_wrap = {list(layer_classes)!r}: {', '.join(map(repr, missing))} matches no "
            f"module of {type(model).__name__}; its module classes: {', '.join(sorted(present))}"
        )
    wanted, layers, inside = set(names), [], set[int]()
    for module in model.modules():
        if type(module).__name__ in wanted and id(module) not in inside:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    if not layers:
        raise ConfigError(
            f"transformer_layer_cls_to_wrap: none of {names!r} is a module of {type(model).__name__}; its module "
            f"classes: {', '.join(sorted(present))}"
        )
    groups = [tuple(dict.fromkeys(layer.parameters())) for layer in layers]
    in_layer = {id(p) for group in groups for p in group}
    root = tuple(p for p in dict.fromkeys(model.parameters()) if id(p) not in in_layer)
    return ShardPlan(processes, (root, *groups), tuple(layers), accumulating)


@contextlib.contextmanager
def as_shards(model: torch.nn.Module, processes: int) -> Iterator[torch.nn.Module]:
    """``model`` with every parameter replaced, while active, by a ``meta`` parameter of its shard's shape (the
    first dimension ``ceil(size(0) / processes)``; tied parameters stay tied), for the optimizer estimators."""
    replaced: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    shards: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in shards:
                shape = (math.ceil(p.shape[0] / processes), *p.shape[1:]) if p.dim() else ()
                shard = torch.empty(shape, dtype=p.dtype, device="meta")
                shards[id(p)] = torch.nn.Parameter(shard, requires_grad=p.requires_grad)
            replaced.append((module, name, p))
            module._parameters[name] = shards[id(p)]
    try:
        yield model
    finally:
        for module, name, p in replaced:
            module._parameters[name] = p


class UnitSimulation:
    """FSDP2's gathering, freeing and reduce-scattering of each unit during one micro-batch, as byte counts added
    to ``add`` (the activation trace's live-bytes counter) from module and gradient hooks.

    Call `install` on the traced model (the plan's parameters must be that model's), then `start` before its
    forward and `finish` after its backward; `remove` takes the hooks off.
    """

    def __init__(self, plan: ShardPlan, add: Callable[[int], None]) -> None:
        self.plan, self.add = plan, add
        self._gathered: dict[int, bool] = {}
        self._forward_order: list[int] = []
        self._pending: dict[int, set[int]] = {}
        self._handles: list[object] = []

    def install(self) -> None:
        for i, layer in enumerate(self.plan.layers, start=1):
            before_forward = functools.partial(_module_hook, self._before_forward, i)
            after_forward = functools.partial(_module_hook, self._reshard, i)
            before_backward = functools.partial(_module_hook, self._before_backward, i)
            self._handles += [
                layer.register_forward_pre_hook(before_forward),
                layer.register_forward_hook(after_forward),
                layer.register_full_backward_pre_hook(before_backward),
            ]
            trainable = [p for p in self.plan.groups[i] if p.requires_grad]
            self._pending[i] = {id(p) for p in trainable}
            for p in trainable:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_accumulated(i)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()  # type: ignore[attr-defined]
        self._handles.clear()

    def start(self) -> None:
        """The root unit is gathered before the forward and stays so until the end of the backward."""
        self._unshard(0)

    def finish(self) -> None:
        """The root unit's reduce-scatter, after the whole backward."""
        self._post_backward(0)

    def _unshard(self, i: int) -> None:
        if self._gathered.get(i):
            return
        full = _full_bytes(self.plan.groups[i])
        self.add(full)  # the all-gather output
        self.add(full)  # the unsharded parameters it is copied into
        self.add(-full)  # the output, freed
        self._gathered[i] = True

    def _reshard(self, i: int) -> None:
        if self._gathered.get(i):
            self.add(-_full_bytes(self.plan.groups[i]))
            self._gathered[i] = False

    def _before_forward(self, i: int) -> None:
        self._unshard(i)
        self._forward_order.append(i)

    def _before_backward(self, i: int) -> None:
        self._unshard(i)
        position = self._forward_order.index(i) if i in self._forward_order else 0
        if position > 0:  # FSDP2 prefetches the unit the backward reaches next
            self._unshard(self._forward_order[position - 1])

    def _on_accumulated(self, i: int) -> Callable[[torch.Tensor], None]:
        def accumulated(p: torch.Tensor) -> None:  # the unit's post-backward, once all its gradients are in
            pending = self._pending[i]
            pending.discard(id(p))
            if not pending:
                self._post_backward(i)

        return accumulated

    def _post_backward(self, i: int) -> None:
        trainable = [p for p in self.plan.groups[i] if p.requires_grad]
        full = _full_bytes(trainable)
        self.add(full)  # the flat reduce-scatter input, a copy of the full gradients
        self.add(-full)
        for p in trainable:  # this micro-batch's full gradients are dropped (added into the accumulated ones)
            p.grad = None
        if not self.plan.accumulating:  # their shards are created (zero_grad freed the step before's)
            self.add(sum(shard_bytes(p, self.plan.processes) for p in trainable))
        self._reshard(i)


def _module_hook(act: Callable[[int], None], unit: int, *_hook_args: object) -> None:
    """A module hook (any of forward-pre, forward and backward-pre: their arguments are not needed) that acts on
    ``unit``; it returns ``None``, so the module's inputs, outputs and gradients stay as they are."""
    act(unit)
