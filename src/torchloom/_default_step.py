"""The default ``run_train_step``, registered like any plugin (pytest's runner.py pattern). It holds no state: the
engine's part of a step (the non-finite skip, the loss scaler's accounting, the scheduler) is in `StepHooks`, which
a step that replaces this one calls the same way."""

from __future__ import annotations

import math
from typing import Any

import torch

from torchloom.errors import TaskError
from torchloom.hookspecs import hookimpl

__all__ = ["DefaultTrainStep", "as_outputs"]


class DefaultTrainStep:
    """The default ``run_train_step``: forward, ``hooks.before_backward``, backward and, when gradients sync,
    ``hooks.optimizer_step`` (see `torchloom.StepHooks`)."""

    name = "torchloom.default_step"

    @hookimpl(trylast=True)
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks) -> dict[str, Any]:
        outputs = as_outputs(task.training_step(batch, progress.batch_idx), "training_step")
        loss = outputs["loss"]
        hooks.before_backward(outputs, accelerator, progress, model)
        accelerator.backward(outputs["loss"])  # divides by gradient_accumulation_steps
        if accelerator.sync_gradients:
            hooks.optimizer_step(model, optimizer, scheduler, accelerator, progress)
        outputs["loss"] = loss.detach()
        return outputs


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
