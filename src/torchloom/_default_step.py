"""The default ``run_train_step``, registered like any plugin (pytest's runner.py pattern)."""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch

from torchloom.errors import TaskError
from torchloom.hookspecs import hookimpl

__all__ = ["DefaultTrainStep", "as_outputs", "direct_optimizer"]


class DefaultTrainStep:
    """The default ``run_train_step``: forward, backward and, when gradients sync, the optimizer step.

    Args:
        skip_nonfinite (`bool`, defaults to False): skip the optimizer step of a window in which any rank's
            loss was not finite (``nonfinite_loss="skip"``): one host-device sync, and on several processes one
            small all-reduce, per optimizer step.
    """

    name = "torchloom.default_step"

    def __init__(self, skip_nonfinite: bool = False) -> None:
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss in this fit
        self.scaler_skipped_steps = 0  # optimizer steps the fp16 loss scaler skipped (an overflow) in this fit
        self._window_nonfinite: torch.Tensor | None = None  # on the device: a non-finite loss in this window
        self._wrapped: Any = None  # the optimizer `_direct` was decided for
        self._direct: Any = None  # what `optimizer.step` / `zero_grad` call inside Accelerate's wrapper, or None

    @hookimpl
    def on_fit_start(self) -> None:
        self.skipped_steps, self.scaler_skipped_steps, self._window_nonfinite = 0, 0, None

    @hookimpl(trylast=True)
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks) -> dict[str, Any]:
        outputs = as_outputs(task.training_step(batch, progress.batch_idx), "training_step")
        loss = outputs["loss"]
        if self.skip_nonfinite:
            bad = ~torch.isfinite(loss.detach())
            self._window_nonfinite = bad if self._window_nonfinite is None else self._window_nonfinite | bad
        hooks.before_backward(outputs, accelerator, progress)
        accelerator.backward(outputs["loss"])  # divides by gradient_accumulation_steps
        if accelerator.sync_gradients and self.skip_nonfinite and self._skip_window(accelerator, progress):
            optimizer.zero_grad(set_to_none=True)  # the window's gradients are dropped; nothing else moves
        elif accelerator.sync_gradients:
            hooks.before_optimizer_step(model, optimizer, accelerator, progress)
            if optimizer is not self._wrapped:
                self._wrapped, self._direct = optimizer, direct_optimizer(optimizer, accelerator)
            # What the wrapper would do, without its per-step look-ups, where that is all it does.
            target = optimizer if self._direct is None else self._direct
            target.step()
            # An fp16 overflow makes the loss scaler skip optimizer.step(); the schedule must not advance. (Only
            # with a scaler is this more than False, and then Accelerate has already synced to find out.)
            if optimizer.step_was_skipped:
                self.scaler_skipped_steps += 1
            elif scheduler is not None:
                scheduler.step()
            target.zero_grad(set_to_none=True)
            hooks.after_optimizer_step(model, optimizer, scheduler, accelerator, progress)
        outputs["loss"] = loss.detach()
        return outputs

    def _skip_window(self, accelerator, progress) -> bool:
        """Whether any rank saw a non-finite loss in this window (one sync; every rank decides alike)."""
        flag, self._window_nonfinite = self._window_nonfinite, None
        if flag is None:
            return False
        flag = flag.to(torch.float32)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="sum")
        if not bool(flag):
            return False
        self.skipped_steps += 1
        if accelerator.is_main_process:
            warnings.warn(
                f"nonfinite_loss='skip': skipped optimizer step {progress.global_step + 1} (epoch {progress.epoch}): "
                f"the loss was not finite; {self.skipped_steps} step(s) skipped in this fit",
                UserWarning,
                stacklevel=2,
            )
        return True


def direct_optimizer(optimizer: Any, accelerator: Any) -> Any:
    """The optimizer inside Accelerate's `AcceleratedOptimizer` when, at a step where gradients sync, the wrapper's
    ``step()`` / ``zero_grad(set_to_none=True)`` would only call the inner ones; else ``None`` (call the wrapper).

    That is the case for the wrapper itself (not DeepSpeed's or Megatron-LM's subclasses, whose step differs)
    without a loss scaler (fp16), off XLA, and for an optimizer other than LOMO's, whose step the wrapper skips
    (accelerate 1.x, ``accelerate/optimizer.py``). Decided once per optimizer: the wrapper itself looks up the
    optional ``lomo_optim`` package with importlib twice per ``step()`` and reads ``inspect.signature`` of the
    inner ``zero_grad`` at every ``zero_grad()``, about 40 µs per optimizer step on a CPU (see
    docs/performance.md); calling the inner optimizer directly gives the same parameters, bit for bit.
    """
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, is_lomo_available

    if type(optimizer) is not AcceleratedOptimizer or optimizer.scaler is not None:
        return None
    if accelerator.distributed_type == DistributedType.XLA:
        return None
    inner = optimizer.optimizer
    if is_lomo_available():
        from lomo_optim import AdaLomo, Lomo

        if isinstance(inner, Lomo | AdaLomo):
            return None
    try:
        accepts = "set_to_none" in inspect.signature(inner.zero_grad).parameters
    except (TypeError, ValueError):
        accepts = False
    return inner if accepts else None


def as_outputs(result: Any, where: str) -> dict[str, Any]:
    """Normalise what a step returned to a dict with a 0-dim floating ``"loss"`` tensor that has a gradient.

    Only tensor metadata is read: no host-device sync.

    Raises:
        TaskError: no loss, a loss that is not a tensor, not a scalar, not floating point, or without grad.
    """
    outputs = dict(result) if isinstance(result, dict) else {"loss": result}
    loss = outputs.get("loss")
    if not isinstance(loss, torch.Tensor):
        keys = f" (its keys: {sorted(map(str, outputs))})" if isinstance(result, dict) else ""
        raise TaskError(
            f"{where} must return a loss tensor or a dict with a 'loss' tensor; got {type(loss).__name__}{keys}"
        )
    if not loss.is_floating_point():
        raise TaskError(f"{where} returned a loss of dtype {loss.dtype}; expected a floating-point tensor")
    if not loss.requires_grad:
        raise TaskError(
            f"{where} returned a loss that does not require grad (computed under no_grad, detached, or from "
            "frozen parameters only); return the loss of the model's forward"
        )
    if loss.ndim != 0:
        raise TaskError(
            f"{where} returned a loss of shape {tuple(loss.shape)}; expected a scalar (0-dim) tensor: "
            "reduce it, e.g. with .mean()"
        )
    if "num_items" in outputs:
        _check_num_items(outputs["num_items"], where)
    return outputs


def _check_num_items(count: Any, where: str) -> None:
    """A Python number must be finite and >= 0 here; a tensor must be one real number (its sign is checked on
    the device and read at the logging interval, so that no step waits for it)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.is_complex() or count.dtype == torch.bool:
            raise TaskError(
                f"{where} returned num_items of shape {tuple(count.shape)} and dtype {count.dtype}; expected one "
                "real number (e.g. (labels != -100).sum())"
            )
    elif isinstance(count, bool) or not isinstance(count, int | float) or not math.isfinite(count) or count < 0:
        raise TaskError(
            f"{where} returned num_items={count!r}; expected the number of items (samples, labelled tokens) its "
            "loss is a mean over: an integer >= 0 or a 0-dim tensor"
        )
