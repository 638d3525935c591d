"""`StepHooks`: what an implementation of ``run_train_step`` calls inside a training step, the engine's own behaviour
included.

The default step (``torchloom.default_step``) does the forward, then ``hooks.before_backward``, the backward and,
when gradients sync, ``hooks.optimizer_step``: the optimizer step with everything the engine owns around it. A
plugin that *replaces* the step (a two-pass SAM step, a GAN step) receives the same object and calls the same
methods at the same points, so that the plugins built on the step hooks (gradient clipping, LocalSGD, the
accumulation window's rescale, learning-rate logging) and the engine's settings (``nonfinite_loss``, the fp16 loss
scaler's accounting) keep working.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from torchloom._agreement import RankAgreement
    from torchloom.plugins import HookRelay
    from torchloom.progress import Progress

__all__ = ["StepHooks", "StepOutcome", "direct_optimizer"]


@dataclass
class StepOutcome:
    """What the optimizer steps of one micro-batch did, for the loop to count (`StepHooks.take_outcome`).

    Attributes:
        nonfinite_skips (`int`): steps skipped because a loss of their window was not finite (on any process).
        scaler_skips (`int`): steps the fp16 loss scaler skipped (an overflow).
    """

    nonfinite_skips: int = 0
    scaler_skips: int = 0


class StepHooks:
    """What a ``run_train_step`` implementation calls: the step hooks, and the engine's part of a step. Made by the
    engine, one per fit.

    Each hook method calls every plugin's implementation of that hook, in the documented order, and skips the call
    when no plugin implements it (a set lookup: the hot path pays nothing for hooks nobody uses).

    Args:
        relay: the run's hook relay.
        log (`Callable`): buffers a value for logging (see `TaskModule.log`).
        skip_nonfinite (`bool`): ``nonfinite_loss="skip"``: `optimizer_step` skips a window whose loss was not
            finite on any process.
        agreement (`RankAgreement`): how the processes agree on such a skip.

    Attributes:
        log (`Callable`): buffers a value for logging, ``log(name, value, weight=1.0, reduce="mean")``; see
            `TaskModule.log`.

    Example (a step that replaces the default one, and keeps what the engine does around the optimizer step):

    .. code-block:: python

        @torchloom.hookimpl
        def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks):
            outputs = {"loss": task.training_step(batch, progress.batch_idx)}
            hooks.before_backward(outputs, accelerator, progress)
            accelerator.backward(outputs["loss"])
            if accelerator.sync_gradients:
                hooks.optimizer_step(model, optimizer, scheduler, accelerator, progress)  # clipping, skips, LR
            outputs["loss"] = outputs["loss"].detach()
            return outputs
    """

    def __init__(self, relay: HookRelay, log: Any, skip_nonfinite: bool, agreement: RankAgreement) -> None:
        self._run = relay.run
        self.log = log
        #: the relay's call lists of the three hooks (kept up to date by the relay; empty: nobody implements it)
        self._before_backward = relay.hook("before_backward")
        self._before_optimizer_step = relay.hook("before_optimizer_step")
        self._after_optimizer_step = relay.hook("after_optimizer_step")
        self._skip_nonfinite, self._agreement = skip_nonfinite, agreement
        self._window_nonfinite: torch.Tensor | None = None  # on the device: a non-finite loss in this window
        self._outcome = StepOutcome()
        self._wrapped: Any = None  # the optimizer `_direct` was decided for
        self._direct: Any = None  # what `optimizer.step` / `zero_grad` call inside Accelerate's wrapper, or None

    def before_backward(self, outputs: dict[str, Any], accelerator: Accelerator, progress: Progress) -> None:
        """Call it after the forward pass, before ``accelerator.backward``: it fires ``before_backward`` (which may
        replace ``outputs["loss"]``: read it again afterwards), and with ``nonfinite_loss="skip"`` notes on the
        device whether this micro-batch's loss is finite (no sync), for `optimizer_step`."""
        if self._skip_nonfinite:
            bad = ~torch.isfinite(outputs["loss"].detach())
            self._window_nonfinite = bad if self._window_nonfinite is None else self._window_nonfinite | bad
        if self._before_backward.impls:
            self._run(self._before_backward, {"outputs": outputs, "accelerator": accelerator, "progress": progress})

    def optimizer_step(
        self, model: torch.nn.Module, optimizer: Any, scheduler: Any, accelerator: Accelerator, progress: Progress
    ) -> bool:
        """The optimizer step of a window, with what the engine does around it; call it once per optimizer step,
        after the window's last backward (when ``accelerator.sync_gradients``). Returns whether the optimizer
        stepped.

        1. With ``nonfinite_loss="skip"``: when any process saw a non-finite loss in this window (one sync and one
           agreement per step, `RankAgreement.any`), the gradients are dropped and nothing else moves; the loop
           counts the skip (``train/skipped_steps``).
        2. ``before_optimizer_step`` (the gradients are unscaled: clipping happens here), ``optimizer.step()``.
        3. When the fp16 loss scaler skipped the step (an overflow), the scheduler does not step and the loop
           counts it (``train/scaler_skipped_steps``; a tolerated overflow, not a non-finite-loss error);
           otherwise ``scheduler.step()``.
        4. ``optimizer.zero_grad(set_to_none=True)``, then ``after_optimizer_step`` (LocalSGD, EMA).
        """
        if self._skip_nonfinite:
            flag, self._window_nonfinite = self._window_nonfinite, None
            if flag is not None and self._agreement.any(bool(flag)):
                optimizer.zero_grad(set_to_none=True)  # the window's gradients are dropped; nothing else moves
                self._outcome.nonfinite_skips += 1
                return False
        self.before_optimizer_step(model, optimizer, accelerator, progress)
        if optimizer is not self._wrapped:
            self._wrapped, self._direct = optimizer, direct_optimizer(optimizer, accelerator)
        target = optimizer if self._direct is None else self._direct  # what the wrapper would call, directly
        target.step()
        # Only with a scaler is this more than False, and then Accelerate has already synced to find out.
        if optimizer.step_was_skipped:
            self._outcome.scaler_skips += 1
        elif scheduler is not None:
            scheduler.step()
        target.zero_grad(set_to_none=True)
        self.after_optimizer_step(model, optimizer, scheduler, accelerator, progress)
        return True

    def before_optimizer_step(
        self, model: torch.nn.Module, optimizer: Any, accelerator: Accelerator, progress: Progress
    ) -> None:
        """Fire ``before_optimizer_step`` (for a step that calls ``optimizer.step()`` itself instead of
        `optimizer_step`): once per optimizer step, after the last backward of the window and before
        ``optimizer.step()``."""
        if self._before_optimizer_step.impls:
            self._run(
                self._before_optimizer_step,
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
        """Fire ``after_optimizer_step`` (for a step that calls ``optimizer.step()`` itself): once per optimizer
        step, after ``optimizer.step()``, the scheduler step and ``zero_grad``."""
        if self._after_optimizer_step.impls:
            self._run(
                self._after_optimizer_step,
                {
                    "model": model,
                    "optimizer": optimizer,
                    "scheduler": scheduler,
                    "accelerator": accelerator,
                    "progress": progress,
                    "log": self.log,
                },
            )

    def take_outcome(self) -> StepOutcome:
        """What the optimizer steps did since the last call (the loop's, after each micro-batch)."""
        outcome, self._outcome = self._outcome, StepOutcome()
        return outcome


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
