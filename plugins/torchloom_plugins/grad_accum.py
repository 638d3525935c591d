"""Gradient accumulation: several micro-batches per optimizer step, with exact loss normalisation.

Method card
-----------
- **What:** sum the gradients of ``steps`` micro-batches, then take one optimizer step, so that the update
  equals the one a single batch ``steps`` times larger would give, at the memory cost of one micro-batch.
- **Mechanism:** `accelerate.Accelerator` with ``gradient_accumulation_steps=steps`` and
  ``accelerator.accumulate(model)`` around every micro-batch (no DDP gradient all-reduce until the window's
  last micro-batch; ``accelerator.backward`` divides every loss by ``steps``). On top of that this plugin
  corrects the two cases Accelerate leaves inexact:

  * the last, partial window of an epoch (Accelerate syncs at the end of the dataloader but still divides by
    ``steps``): its gradients are multiplied by ``steps / k`` for a window of ``k`` micro-batches;
  * token- or item-level losses (``normalization="tokens"`` / ``"items"``): each micro-batch's loss (a mean
    over its ``num_items``) is turned back into a sum before backward, and once per window the gradients
    are multiplied by ``steps * world_size / N``, where ``N`` is the number of items in the whole window
    over all ranks (one all-reduce of a 0-dim tensor per window, on device, no host sync). Every item then
    has weight ``1 / N``, exactly as in one big batch. A bf16 / fp16 loss is not multiplied: backward would
    cast the factor back to 16 bits (bf16 rounds 257 to 256), so the count multiplies each parameter's
    gradient instead, in the parameter's dtype, where backward forms it (``Tensor.register_hook`` for that
    micro-batch only, before the gradient is accumulated and before DDP all-reduces it).

- **Hooks:** ``configure_accelerator`` (the Accelerator setting), ``run_train_step`` (wrapper: the
  ``accumulate`` context; removes a micro-batch's gradient hooks), ``before_backward`` (token-sum loss, or the
  gradient hooks of a 16-bit loss, on the ``model`` it receives; declares the loss a sum,
  ``hooks.loss_reduction = "sum"``), ``before_optimizer_step``
  (``tryfirst``: the window rescale, so that clipping and every other plugin see the final gradients),
  ``after_window_discard`` (a step that redoes its window, ``auto_batch``: the count starts again).
- **Epoch shorter than ``steps``:** the window is flushed at the end of every epoch (Accelerate's
  ``sync_with_dataloader`` behaviour), scaled by its real size, and a ``UserWarning`` says so once per fit.
- **Sources:** huggingface/transformers PR #34191 and blog PR #2414 (token-count normalisation over the
  whole window), meta-pytorch/torchtune PR #1875; Lightning-AI/pytorch-lightning issues #19987 and #21808
  (the last partial window); huggingface/accelerate issue #963 (the scheduler steps once per window);
  Accelerate's gradient accumulation guide.

Functional use, without the engine::

    scale = token_window_scale(accumulation_steps=4, world_size=2, num_items=global_count)
    scale_gradients_(model.parameters(), scale)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

import torchloom

__all__ = [
    "GradientAccumulation",
    "GradientAccumulationConfig",
    "mean_window_scale",
    "scale_gradients_",
    "token_window_scale",
]


@dataclass
class GradientAccumulationConfig:
    """Settings of the ``grad_accum`` plugin.

    Args:
        steps (`int`, defaults to 1): micro-batches per optimizer step (per rank); at least 1.
        normalization (`str`, defaults to ``"mean"``): how the window's gradient is normalised.
            ``"mean"``: each micro-batch's loss is a mean and all micro-batches have the same size; the
            window's gradient is the mean over its micro-batches. ``"tokens"`` or ``"items"`` (the same
            thing under two names): ``training_step`` returns ``{"loss": mean over its items,
            "num_items": count}``; the window's gradient is the sum over every item of the window, on all
            ranks, divided by their total count.

    Raises:
        ConfigError: ``steps`` below 1.
    """

    steps: int = 1  # micro-batches per optimizer step, >= 1
    normalization: Literal["mean", "tokens", "items"] = "mean"  # mean over micro-batches, or over items

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise torchloom.ConfigError(f"setting 'steps' = {self.steps!r}; expected an integer >= 1")


# ------------------------------------------------------------------------------------------ functional core


def mean_window_scale(accumulation_steps: int, micro_batches: int) -> float:
    """The factor that turns ``accelerator.backward``'s accumulated gradient into the mean over a window.

    ``accelerator.backward`` divides every micro-batch loss by ``accumulation_steps``, also in a last
    window that has fewer micro-batches; multiplying by this factor makes it a division by the real count.

    Args:
        accumulation_steps (`int`): the divisor ``accelerator.backward`` applied (``gradient_accumulation_steps``).
        micro_batches (`int`): micro-batches really accumulated in the window, ``1 <= micro_batches``.

    Returns:
        `float`: ``accumulation_steps / micro_batches`` (1.0 for a full window).

    Raises:
        ValueError: ``micro_batches`` below 1.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches = {micro_batches!r}; expected at least 1")
    return accumulation_steps / micro_batches


def token_window_scale(accumulation_steps: int, world_size: int, num_items: torch.Tensor) -> torch.Tensor:
    """The factor that normalises a window's summed token (item) losses by the window's total count.

    Each rank's micro-batch loss was multiplied by its item count (so it is a sum over items) and divided by
    ``accumulation_steps`` by ``accelerator.backward``; DDP then averaged the gradients over ``world_size``
    ranks. Multiplying by ``accumulation_steps * world_size / num_items`` gives the gradient of
    ``(sum of the per-item losses over the window and all ranks) / num_items``.

    Args:
        accumulation_steps (`int`): the divisor ``accelerator.backward`` applied.
        world_size (`int`): number of data-parallel processes whose gradients were averaged.
        num_items (`torch.Tensor`): 0-dim, the window's item count summed over all ranks (any real dtype,
            on the gradients' device). A count of 0 is treated as 1 (all gradients are then 0 anyway).

    Returns:
        `torch.Tensor`: 0-dim, on ``num_items``' device; computed without a host-device sync.
    """
    count = num_items.to(torch.float64 if num_items.device.type != "mps" else torch.float32)
    return (accumulation_steps * world_size) / count.clamp_min(1)


def scale_gradients_(parameters: Iterable[torch.nn.Parameter], scale: float | torch.Tensor) -> None:
    """Multiply every existing ``.grad`` in place by ``scale`` (no host-device sync).

    Args:
        parameters (`Iterable[torch.nn.Parameter]`): parameters whose ``.grad`` (if not ``None``) is scaled.
        scale (`float` or `torch.Tensor`): a number or a 0-dim tensor (moved to each gradient's device and
            dtype).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in groups.items():
        factor = scale.to(device=device, dtype=dtype) if isinstance(scale, torch.Tensor) else scale
        torch._foreach_mul_(grads, factor)


def _times(count: torch.Tensor | float, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor * count`` in ``tensor``'s dtype (also the gradient hook of a 16-bit loss)."""
    return tensor * (count.to(tensor.dtype) if isinstance(count, torch.Tensor) else float(count))


# ------------------------------------------------------------------------------------------------- plugin


class GradientAccumulation(torchloom.Plugin):
    """Accumulate gradients over ``steps`` micro-batches per optimizer step, normalised exactly.

    Implements ``configure_accelerator``, ``configure_model`` (under DeepSpeed: refuses ``normalization`` by
    items), ``run_train_step`` (wrapper), ``before_backward`` and
    ``before_optimizer_step`` (``tryfirst``). See the module docstring for the method and
    ``docs/plugins/grad_accum.md`` for the settings.

    Raises:
        PluginError: (during the fit) ``normalization`` is ``"tokens"`` / ``"items"`` and ``training_step``
            returned no ``"num_items"``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"grad_accum": {"steps": 8, "normalization": "tokens"}})
    """

    name = "grad_accum"
    Config = GradientAccumulationConfig

    def __init__(self, config: GradientAccumulationConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._micro_batches = 0  # micro-batches in the current window (host int, no sync)
        self._num_items: torch.Tensor | float | None = None  # this rank's item count in the window
        self._warned_short_epoch = False
        self._count_hooks: list[Any] = []  # gradient hooks of the current micro-batch (a 16-bit loss)
        if not self._by_items:  # a plain mean: no loss to rescale per micro-batch
            inactive = {"before_backward"}
            if self.config.steps == 1:  # one micro-batch per step: nothing to do at all
                inactive |= {"run_train_step", "before_optimizer_step"}
            self.inactive_hooks = frozenset(inactive)

    @property
    def _by_items(self) -> bool:
        return self.config.normalization != "mean"

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        return {"gradient_accumulation_steps": self.config.steps}

    @torchloom.hookimpl
    def configure_model(self, accelerator) -> None:
        if self._by_items and str(getattr(accelerator.distributed_type, "value", "")) == "DEEPSPEED":
            raise torchloom.ConfigError(
                f"plugin 'grad_accum': setting 'normalization' = {self.config.normalization!r} under DeepSpeed: it "
                "rescales the window's gradients by its item count before the optimizer step, and DeepSpeed has "
                "already stepped inside accelerator.backward by then; use normalization 'mean' under DeepSpeed "
                "(DeepSpeed divides each micro-batch's loss by steps)"
            )

    @torchloom.hookimpl
    def on_fit_start(self) -> None:
        self._micro_batches, self._num_items, self._warned_short_epoch = 0, None, False

    @torchloom.hookimpl(wrapper=True)
    def run_train_step(self, accelerator, model, progress):
        # accumulate() decides sync_gradients (every `steps` micro-batches, and at the end of the
        # dataloader) and, on the other micro-batches, enters DDP's no_sync: no gradient all-reduce.
        with accelerator.accumulate(model):
            self._micro_batches += 1
            try:
                outputs = yield
            finally:
                self._remove_count_hooks()
        if accelerator.sync_gradients:
            if self._micro_batches < self.config.steps and progress.batch_idx + 1 < self.config.steps:
                self._warn_short_epoch(accelerator, progress.batch_idx + 1)
            self._micro_batches, self._num_items = 0, None
        return outputs

    @torchloom.hookimpl
    def before_backward(self, outputs: dict[str, Any], model: torch.nn.Module | None, hooks: Any) -> None:
        if not self._by_items:
            return
        if "num_items" not in outputs:
            raise torchloom.PluginError(
                f"plugin 'grad_accum': normalization={self.config.normalization!r} needs training_step to "
                "return a dict with 'num_items' (the number of items or labelled tokens its loss is a mean "
                f"over); got the keys {sorted(outputs)}. Return it, or use normalization='mean'."
            )
        loss, count = outputs["loss"], outputs["num_items"]
        if isinstance(count, torch.Tensor):  # stays on its device: no sync
            count = count.to(device=loss.device, dtype=torch.float64 if loss.device.type != "mps" else torch.float32)
        # (a Python number stays one: no host-to-device copy per micro-batch; one per window, at the rescale)
        # A step that runs several pieces of a batch in one run_train_step (auto_batch) calls this once per piece:
        # the hooks of the piece before are done with (its backward ran) and must not multiply this one's.
        self._remove_count_hooks()
        hooks.loss_reduction = "sum"  # the window's count divides it (before_optimizer_step), not the pieces
        if torch.finfo(loss.dtype).bits >= 32 or model is None:
            outputs["loss"] = _times(count, loss)  # mean -> sum over this micro-batch's items, exact in float32
        else:
            # A bf16 / fp16 loss: backward would cast any factor on the loss back to 16 bits (bf16 holds integers
            # exactly only up to 256), so the count multiplies each parameter's gradient where it is formed, in
            # the parameter's dtype, before it is accumulated (and before DDP all-reduces it).
            self._count_hooks = [
                p.register_hook(functools.partial(_times, count)) for p in model.parameters() if p.requires_grad
            ]
        self._num_items = count if self._num_items is None else self._num_items + count

    def _remove_count_hooks(self) -> None:
        for handle in self._count_hooks:
            handle.remove()
        self._count_hooks = []

    @torchloom.hookimpl
    def after_window_discard(self) -> None:
        # The window's gradients were dropped to redo it from the current micro-batch (auto_batch, after an
        # out-of-memory error): its item count starts again, and only this micro-batch is in it.
        self._remove_count_hooks()
        self._num_items = None
        self._micro_batches = 1 if self._micro_batches else 0

    @torchloom.hookimpl(tryfirst=True)
    def before_optimizer_step(self, model: torch.nn.Module, accelerator) -> None:
        steps = accelerator.gradient_accumulation_steps
        if self._by_items:
            if self._num_items is None:
                return
            count = torch.as_tensor(self._num_items, device=accelerator.device)  # one copy per window at most
            if accelerator.num_processes > 1:
                count = accelerator.reduce(count, reduction="sum")  # one collective per window
            scale_gradients_(model.parameters(), token_window_scale(steps, accelerator.num_processes, count))
        elif self._micro_batches != steps and self._micro_batches > 0:
            if str(getattr(accelerator.distributed_type, "value", "")) == "DEEPSPEED":
                # DeepSpeed stepped inside accelerator.backward with the gradients divided by `steps`
                raise torchloom.PluginError(
                    f"grad_accum: a window of {self._micro_batches} micro-batches, fewer than steps={steps}, "
                    "ended the epoch under DeepSpeed, which has already stepped on its gradients divided by "
                    f"{steps} (its own accumulation), not by {self._micro_batches}; make the micro-batches of an "
                    "epoch on each process a multiple of steps (the batch size, drop_last, or steps)"
                )
            scale_gradients_(model.parameters(), mean_window_scale(steps, self._micro_batches))

    def _warn_short_epoch(self, accelerator, epoch_micro_batches: int) -> None:
        if self._warned_short_epoch:
            return
        self._warned_short_epoch = True
        if accelerator.is_local_main_process:
            torchloom.utils.warn(
                f"grad_accum: an epoch has only {epoch_micro_batches} micro-batches, fewer than steps="
                f"{self.config.steps}; each epoch's window is flushed at the end of the epoch with "
                f"{epoch_micro_batches} micro-batches (gradients scaled by its real size), so every optimizer "
                f"step accumulates {epoch_micro_batches}, not {self.config.steps}. Use more data per epoch or "
                "a smaller 'steps'.",
            )
