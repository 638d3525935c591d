"""The activations of one training micro-batch, measured on fake tensors (`trace_activations`): a dispatch mode adds
the bytes of every storage an operation creates and subtracts them when it is freed; the figure is the peak. See
`torchloom.tools.memory_plan` for the method and its limits."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchloom.errors import ConfigError, TorchloomError
from torchloom.plugins import HookRelay, enable_plugins
from torchloom.tools.memory_shard import Sharding, UnitSimulation, plan_units
from torchloom.tools.memory_source import CHECKPOINTING, Source, capable_plugin, fake_copy

__all__ = ["trace_activations"]


class _LiveBytes(TorchDispatchMode):
    """The bytes of storages created by operations while active and not yet freed, and their peak.

    Each storage counts once, from the operation that returns it to its deallocation (a `weakref.finalize` on
    the storage, which PyTorch keeps as one Python object for the storage's life). Storages in ``skip``
    (weights, gradients, the batch) are not counted.
    """

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.live, self.peak = skip, 0, 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage._cdata, storage.nbytes()
                if nbytes and key not in self.skip and key not in self.seen:
                    self.seen.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (fewer, if negative) that no operation returned, e.g. FSDP2's gathered units."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Run `torch.nn.functional.scaled_dot_product_attention` with ``dropout_p=0`` while active: the CPU then picks
    its fused (flash) kernel, which keeps for backward what CUDA's fused kernels keep (output and logsumexp, no
    attention matrix; CUDA's kernels apply dropout inside the kernel and store no mask).

    The function is replaced on its module for the duration (and restored), because the recomputation of a
    checkpointed block runs inside backward, where no torch function mode is active; code that calls it through
    ``torch.nn.functional`` (as transformers does) is affected, code holding its own reference is not.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def without_dropout(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        else:
            kwargs["dropout_p"] = 0.0
        return original(*args, **kwargs)

    functional.scaled_dot_product_attention = without_dropout
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _storage_keys(tensors: Iterable[Any]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def trace_activations(
    source: Source,
    mode: Any,
    batch_size: int,
    seq_len: int | None,
    autocast_dtype: torch.dtype | None,
    checkpoint: dict[str, Any] | None,
    fused_attention: bool,
    sharding: Sharding | None = None,
) -> int:
    """Peak activation bytes of one forward + backward of a fresh fake copy of the model (see the module docstring);
    with ``sharding``, on one process of FSDP2 (`torchloom.tools.memory_shard`: its gathered units counted too)."""
    with mode:
        model = fake_copy(source.prototype, mode)
        if checkpoint is not None:
            if source.checkpoint_plugin is None:  # the installed plugin that checkpoints activations, asked once
                source.checkpoint_plugin = capable_plugin(CHECKPOINTING)
            assert source.checkpoint_plugin is not None  # among the installed ones: found, or raised
            HookRelay(enable_plugins({source.checkpoint_plugin: checkpoint})).call(
                "configure_model", model=model, task=None, accelerator=None
            )
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        plan = None if sharding is None else plan_units(
            model, sharding.layer_classes, sharding.processes, sharding.accumulating
        )  # fmt: skip
        if plan is None:  # allocated before the micro-batch, as in a gradient-accumulation window
            for p in params:  # (FSDP2 keeps them apart from each micro-batch's own: `UnitSimulation`)
                p.grad = torch.zeros_like(p)
        batch = source.make_batch(model, batch_size, seq_len) if source.make_batch is not None else None
        if autocast_dtype is not None:  # as accelerate.Accelerator.prepare_model wraps the forward
            from accelerate.utils import convert_outputs_to_fp32

            model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=autocast_dtype)(model.forward))
        skip = _storage_keys([*model.parameters(), *model.buffers(), *(p.grad for p in params)])
        skip |= _storage_keys(tree_flatten(batch)[0])
        live = _LiveBytes(skip)
        units = None if plan is None else UnitSimulation(plan, live.add)
        attention = _fused_attention() if fused_attention else contextlib.nullcontext()
        try:
            with live, attention:
                if units is not None:
                    units.install()
                    units.start()
                loss = source.loss(model, batch, batch_size, seq_len)
                _check_loss(loss, source.label)
                with warnings.catch_warnings():  # a first layer whose input needs no gradient: the hook still fires
                    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
                    loss.backward()
                if units is not None:
                    units.finish()
                    units.remove()
        except TorchloomError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"estimate_memory: the forward and backward of {source.label} (micro-batch {batch_size}, seq_len "
                f"{seq_len}) failed on fake tensors: {type(exc).__name__}: {exc}"
            ) from exc
        if plan is not None and not plan.accumulating:  # the shards created during the backward: their own column
            return live.peak - plan.gradient_bytes()
        return live.peak


def _check_loss(loss: Any, label: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"estimate_memory: the forward of {label} returned {what}; expected a scalar loss tensor")
    if not loss.requires_grad:
        raise ConfigError(f"estimate_memory: the loss of {label} does not require grad (no trainable parameters?)")
