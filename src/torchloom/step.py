"""`StepHooks`: how an implementation of ``run_train_step`` fires the hooks inside a training step.

The default step (``torchloom.default_step``) fires ``before_backward``, ``before_optimizer_step`` and
``after_optimizer_step`` through the `StepHooks` it receives. A plugin that *replaces* the step (a two-pass
SAM step, a GAN step) receives the same object and fires them at the same points, so that the plugins built
on them (gradient clipping, LocalSGD, the accumulation window's rescale, learning-rate logging) keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from torchloom.plugins import HookRelay
    from torchloom.progress import Progress

__all__ = ["StepHooks"]


class StepHooks:
    """Fires the step hooks of one run from a ``run_train_step`` implementation. Made by the engine.

    Each method calls every plugin's implementation of that hook, in the documented order, and skips the call
    when no plugin implements it (a set lookup: the hot path pays nothing for hooks nobody uses).

    Attributes:
        log (`Callable`): buffers a value for logging, ``log(name, value, weight=1.0)``; see `TaskModule.log`.

    Example:

    .. code-block:: python

        @torchloom.hookimpl
        def run_train_step(self, task, model, optimizer, accelerator, batch, progress, hooks):
            outputs = {"loss": task.training_step(batch, progress.batch_idx)}
            hooks.before_backward(outputs, accelerator, progress)
            accelerator.backward(outputs["loss"])
            hooks.before_optimizer_step(model, optimizer, accelerator, progress)  # clipping happens here
            optimizer.step()
            optimizer.zero_grad()
            hooks.after_optimizer_step(model, optimizer, None, accelerator, progress)  # LocalSGD, EMA
            return outputs
    """

    def __init__(self, relay: HookRelay, log: Any) -> None:
        self._call = relay.call_with
        self.log = log
        self._before_backward = relay.implemented("before_backward")
        self._before_optimizer_step = relay.implemented("before_optimizer_step")
        self._after_optimizer_step = relay.implemented("after_optimizer_step")

    def before_backward(self, outputs: dict[str, Any], accelerator: Accelerator, progress: Progress) -> None:
        """Fire ``before_backward``: call it after the forward pass, before ``accelerator.backward``; it may
        replace ``outputs["loss"]`` (read it again afterwards)."""
        if self._before_backward:
            self._call("before_backward", {"outputs": outputs, "accelerator": accelerator, "progress": progress})

    def before_optimizer_step(
        self, model: torch.nn.Module, optimizer: Any, accelerator: Accelerator, progress: Progress
    ) -> None:
        """Fire ``before_optimizer_step``: call it once per optimizer step, after the last backward of the window
        and before ``optimizer.step()``."""
        if self._before_optimizer_step:
            self._call(
                "before_optimizer_step",
                {
                    "model": model,
                    "optimizer": optimizer,
                    "accelerator": accelerator,
                    "progress": progress,
                    "log": self.log,
                },
            )

    def after_optimizer_step(
        self, model: torch.nn.Module, optimizer: Any, scheduler: Any, accelerator: Accelerator, progress: Progress
    ) -> None:
        """Fire ``after_optimizer_step``: call it once per optimizer step, after ``optimizer.step()``, the
        scheduler step and ``zero_grad``."""
        if self._after_optimizer_step:
            self._call(
                "after_optimizer_step",
                {
                    "model": model,
                    "optimizer": optimizer,
                    "scheduler": scheduler,
                    "accelerator": accelerator,
                    "progress": progress,
                    "log": self.log,
                },
            )
