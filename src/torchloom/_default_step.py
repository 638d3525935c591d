"""The engine's own hook implementations, registered like any plugin (pytest's runner.py pattern)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from torchloom.errors import TaskError
from torchloom.hookspecs import hookimpl

__all__ = ["DefaultTrainStep", "MetricsFile"]


class DefaultTrainStep:
    """The default ``run_train_step``: forward, backward and, when gradients sync, the optimizer step."""

    name = "torchloom.default_step"

    def __init__(self) -> None:
        self.relay: Any = None  # set by the engine once the relay exists
        self.log: Any = None

    @hookimpl(trylast=True)
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress) -> dict[str, Any]:
        relay = self.relay
        outputs = as_outputs(task.training_step(batch, progress.batch_idx), "training_step")
        loss = outputs["loss"]
        if relay.implemented("before_backward"):
            relay.call("before_backward", outputs=outputs, accelerator=accelerator, progress=progress)
        accelerator.backward(outputs["loss"])  # divides by gradient_accumulation_steps
        if accelerator.sync_gradients:
            kwargs = dict(model=model, optimizer=optimizer, accelerator=accelerator, progress=progress, log=self.log)
            if relay.implemented("before_optimizer_step"):
                relay.call("before_optimizer_step", **kwargs)
            optimizer.step()
            # An fp16 overflow makes the loss scaler skip optimizer.step(); the schedule must not advance.
            if scheduler is not None and not optimizer.step_was_skipped:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if relay.implemented("after_optimizer_step"):
                relay.call("after_optimizer_step", scheduler=scheduler, **kwargs)
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
    return outputs


class MetricsFile:
    """Writes every ``on_log`` call as one JSON line to ``<output_dir>/metrics.jsonl`` (main process)."""

    name = "torchloom.metrics_file"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: Any = None  # appends: the engine empties the file when a fit starts

    @hookimpl
    def on_log(self, metrics: dict[str, float], progress) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in teardown)
        record = {"step": progress.global_step, "epoch": progress.epoch, **metrics}
        # Strict JSON: a non-finite value (a NaN loss, an fp16 overflow's inf gradient norm) is written as the
        # string "NaN" / "Infinity" / "-Infinity", which float() reads back.
        record = {
            k: v
            if not isinstance(v, float) or math.isfinite(v)
            else str(v).replace("inf", "Infinity").replace("nan", "NaN")
            for k, v in record.items()
        }
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    @hookimpl
    def teardown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
