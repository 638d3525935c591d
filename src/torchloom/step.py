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
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from torchloom._agreement import RankAgreement
    from torchloom.plugins import HookRelay
    from torchloom.progress import Progress

__all__ = [
    "LossReduction",
    "StepHooks",
    "StepOutcome",
    "WindowOutOfMemory",
    "direct_optimizer",
    "is_out_of_memory",
]

#: How a micro-batch's loss is reduced over its items, as `StepHooks.loss_reduction` declares it: ``"mean"`` (what
#: ``training_step`` returns) or ``"sum"`` (a ``before_backward`` implementation made it a sum over the items, which
#: the whole window's item count divides before the optimizer step).
LossReduction = Literal["mean", "sum"]

#: What the allocators' out-of-memory errors say when they are raised as a plain ``RuntimeError`` (the CPU's
#: ``DefaultCPUAllocator``, cuDNN / cuBLAS failing to allocate, MPS and XPU); CUDA's own is `torch.OutOfMemoryError`.
#: The list follows ``accelerate.utils.memory.should_reduce_batch_size``.
OUT_OF_MEMORY_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA out of memory.",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "MPS backend out of memory",
    "XPU out of memory.",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error: `torch.OutOfMemoryError` (CUDA's, also a
    ``RuntimeError``), `MemoryError`, or a ``RuntimeError`` whose message is one of `OUT_OF_MEMORY_MESSAGES` (the
    CPU allocator's ``DefaultCPUAllocator: can't allocate memory``)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_MESSAGES)


class WindowOutOfMemory(RuntimeError):
    """An out-of-memory error on one or more processes, known to every process at the same point of the step
    (`StepHooks.agree_out_of_memory`): the accumulation window's gradients are incomplete.

    Attributes:
        phases (`dict[int, str]`): rank -> where its error happened (``"forward"``, ``"backward"``, ``"step"``, or
            ``"step (after updating)"`` when ``optimizer.step()`` had already changed that process's optimizer
            state), for the ranks that had one.
        redoable (`bool`): whether discarding the window (`StepHooks.discard_window`) leaves every process exactly
            as it was before the window: true for errors in forward and backward, and in the optimizer step only
            when every process failed there before updating anything.
    """

    def __init__(self, phases: dict[int, str], redoable: bool) -> None:
        self.phases, self.redoable = dict(phases), redoable
        where = ", ".join(f"rank {rank} ({phase})" for rank, phase in sorted(self.phases.items()))
        super().__init__(f"out of memory on {where}")


@dataclass
class StepOutcome:
    """What the optimizer steps of one micro-batch did, for the loop to count (`StepHooks.take_outcome`).

    Attributes:
        nonfinite_skips (`int`): steps skipped because a loss of their window was not finite (on any process).
        scaler_skips (`int`): steps the fp16 loss scaler skipped (an overflow).
        empty_skips (`int`): steps skipped because no micro-batch of their window had a loss token (``num_items``
            0 everywhere, on every process; with ``nonfinite_loss="skip"``).
    """

    nonfinite_skips: int = 0
    scaler_skips: int = 0
    empty_skips: int = 0


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

        model (`torch.nn.Module`, *optional*): the fit's (prepared) model, which the ``before_backward`` hook
            receives when a step calls `before_backward` without its own.

    Attributes:
        log (`Callable`): buffers a value for logging, ``log(name, value, weight=1.0, reduce="mean")``; see
            `TaskModule.log`.
        loss_reduction (`str`): how the ``outputs["loss"]`` that the last `before_backward` call left is reduced over
            its micro-batch's items: ``"mean"`` (what ``training_step`` returns; the default, set again at every
            `before_backward` call) or ``"sum"``, set by a ``before_backward`` implementation that turned it into a
            sum to be divided by the whole window's item count before the optimizer step (``grad_accum`` with
            ``normalization: tokens``). A step that splits a batch into pieces (``auto_batch``) reads it after each
            `before_backward`: it divides a mean by its number of pieces, and gives a sum weight 1. See
            `LossReduction`.

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

    def __init__(
        self,
        relay: HookRelay,
        log: Any,
        skip_nonfinite: bool,
        agreement: RankAgreement,
        model: torch.nn.Module | None = None,
    ) -> None:
        self._run = relay.run
        self.log = log
        self._model = model  # the fit's model: ``before_backward``'s when a step does not pass its own
        self.loss_reduction: LossReduction = "mean"
        #: the relay's call lists of these hooks (kept up to date by the relay; empty: nobody implements it)
        self._before_backward = relay.hook("before_backward")
        self._after_window_discard = relay.hook("after_window_discard")
        self._before_optimizer_step = relay.hook("before_optimizer_step")
        self._after_optimizer_step = relay.hook("after_optimizer_step")
        self._skip_nonfinite, self._agreement = skip_nonfinite, agreement
        self._window_nonfinite: torch.Tensor | None = None  # on the device: a non-finite loss in this window
        self._window_items: torch.Tensor | bool | None = None  # a micro-batch of this window had num_items != 0
        self._outcome = StepOutcome()
        self._wrapped: Any = None  # the optimizer `_direct` was decided for
        self._direct: Any = None  # what `optimizer.step` / `zero_grad` call inside Accelerate's wrapper, or None

    def before_backward(
        self,
        outputs: dict[str, Any],
        accelerator: Accelerator,
        progress: Progress,
        model: torch.nn.Module | None = None,
    ) -> None:
        """Call it after the forward pass, before ``accelerator.backward``: it fires ``before_backward`` (which may
        replace ``outputs["loss"]``: read it again afterwards, and `loss_reduction` with it), and with
        ``nonfinite_loss="skip"`` notes on the device whether this micro-batch's loss is finite (no sync), for
        `optimizer_step`. A micro-batch whose ``num_items`` is 0 (no loss token) is not a non-finite loss: its mean
        over no token is NaN (0 / 0) with a zero gradient (transformers' loss), and it is only noted as having no
        items.

        ``model`` is the model the step trains, which the hook receives; a step that does not pass it gives the hook
        the fit's model (the ``model`` of ``run_train_step``)."""
        self.loss_reduction = "mean"
        if self._skip_nonfinite:
            bad = ~torch.isfinite(outputs["loss"].detach())
            if "num_items" in outputs:
                count = outputs["num_items"]
                has: torch.Tensor | bool = (
                    (count != 0).to(bad.device) if isinstance(count, torch.Tensor) else count != 0
                )
                bad = bad & has
                before = self._window_items
                self._window_items = (
                    has if before is None or before is False else before if has is False else has | before
                )
            self._window_nonfinite = bad if self._window_nonfinite is None else self._window_nonfinite | bad
        if self._before_backward.impls:
            self._run(
                self._before_backward,
                {
                    "outputs": outputs,
                    "accelerator": accelerator,
                    "progress": progress,
                    "model": self._model if model is None else model,
                    "hooks": self,
                },
            )

    def optimizer_step(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        accelerator: Accelerator,
        progress: Progress,
        agree_out_of_memory: bool = False,
    ) -> bool:
        """The optimizer step of a window, with what the engine does around it; call it once per optimizer step,
        after the window's last backward (when ``accelerator.sync_gradients``). Returns whether the optimizer
        stepped.

        1. With ``nonfinite_loss="skip"``: when any process saw a non-finite loss in this window (one sync and one
           agreement per step, `RankAgreement.max`), or when no micro-batch of the window had a loss token
           (``num_items`` 0 everywhere, on every process: an update from zero gradients would still move the
           weights through momentum and weight decay), the gradients are dropped and nothing else moves (nor the
           scheduler); the loop counts the skip (``train/skipped_steps``).
        2. ``before_optimizer_step`` (the gradients are unscaled: clipping happens here), ``optimizer.step()``.
        3. When the fp16 loss scaler skipped the step (an overflow), the scheduler does not step and the loop
           counts it (``train/scaler_skipped_steps``; a tolerated overflow, not a non-finite-loss error);
           otherwise ``scheduler.step()``.
        4. ``optimizer.zero_grad(set_to_none=True)``, then ``after_optimizer_step`` (LocalSGD, EMA).

        With ``agree_out_of_memory=True`` (a step that recovers from out-of-memory errors, such as the
        ``auto_batch`` plugin's), an out-of-memory error (`is_out_of_memory`) in ``before_optimizer_step`` or
        ``optimizer.step()`` is caught, and every process learns of any process's error in one agreement right
        after ``optimizer.step()`` (`agree_out_of_memory`), before the scheduler steps and before
        ``after_optimizer_step`` (whose plugins may run collectives): each then raises `WindowOutOfMemory`, with
        ``redoable`` true only when every process failed before its optimizer had changed anything (checked
        from the optimizer's state: how many parameters have state, and the first one's ``step`` counter). The
        caller discards the window (`discard_window`) or gives up. The agreement costs one all-reduce of one
        integer per optimizer step, on the host.
        """
        if self._skip_nonfinite:
            flag, self._window_nonfinite = self._window_nonfinite, None
            items, self._window_items = self._window_items, None
            if flag is not None:
                # One sync and one agreement: 2 when this process saw a non-finite loss, else 1 when it had items
                # (or no num_items), else 0; the largest over the processes decides.
                if isinstance(items, torch.Tensor):
                    bad, has = (bool(x) for x in torch.stack([flag, items.to(flag.device)]).tolist())
                else:
                    bad, has = bool(flag), items is None or bool(items)
                verdict = self._agreement.max(2 if bad else int(has))
                if verdict != 1:
                    optimizer.zero_grad(set_to_none=True)  # the window's gradients are dropped; nothing else moves
                    if verdict == 2:
                        self._outcome.nonfinite_skips += 1
                    else:
                        self._outcome.empty_skips += 1
                    return False
        if optimizer is not self._wrapped:
            self._wrapped, self._direct = optimizer, direct_optimizer(optimizer, accelerator)
        target = optimizer if self._direct is None else self._direct  # what the wrapper would call, directly
        if agree_out_of_memory:
            self._guarded_step(model, optimizer, accelerator, progress, target)
        else:
            self.before_optimizer_step(model, optimizer, accelerator, progress)
            target.step()
        # Only with a scaler is this more than False, and then Accelerate has already synced to find out.
        if optimizer.step_was_skipped:
            self._outcome.scaler_skips += 1
        elif scheduler is not None:
            scheduler.step()
        target.zero_grad(set_to_none=True)
        self.after_optimizer_step(model, optimizer, scheduler, accelerator, progress)
        return True

    def _guarded_step(
        self, model: torch.nn.Module, optimizer: Any, accelerator: Accelerator, progress: Progress, target: Any
    ) -> None:
        """``before_optimizer_step`` and ``target.step()`` with their out-of-memory errors agreed (`optimizer_step`)."""
        before = _state_mark(optimizer)
        failed = None
        try:
            self.before_optimizer_step(model, optimizer, accelerator, progress)
            target.step()
        except Exception as exc:  # only an out-of-memory error is caught (and not kept: its frames hold tensors)
            if not is_out_of_memory(exc):
                raise
            failed = "step" if _same_mark(before, _state_mark(optimizer)) else "step (after updating)"
        # Redoable only if no process updated anything: every one failed, and before its optimizer changed.
        everywhere = self._agreement.num_processes
        self.agree_out_of_memory(
            failed, redoable=lambda phases: len(phases) == everywhere and set(phases.values()) == {"step"}
        )

    def agree_out_of_memory(self, phase: str | None, redoable: Any = None) -> None:
        """Every process calls it at the same point of a step, with where its out-of-memory error happened
        (``"forward"``, ``"backward"``, ...) or ``None``: when any process had one, every process raises
        `WindowOutOfMemory` (naming each process's phase), so that none is left waiting in a collective the
        others never reach. One all-reduce of one integer on the host (`RankAgreement.any`; nothing on one
        process), and a gather of the phases only when some process failed.

        Args:
            phase (`str`, *optional*): this process's error, or ``None``.
            redoable (`Callable[[dict[int, str]], bool]`, *optional*): decides `WindowOutOfMemory.redoable` from
                the phases; by default true (forward and backward change nothing but the gradients).

        Raises:
            WindowOutOfMemory: on every process, when any process had an error.
        """
        if not self._agreement.any(phase is not None):
            return
        phases = {rank: p for rank, p in enumerate(self._agreement.gather(phase)) if p is not None}
        raise WindowOutOfMemory(phases, True if redoable is None else bool(redoable(phases)))

    def discard_window(self, optimizer: Any, accelerator: Accelerator, progress: Progress) -> None:
        """Drop the open accumulation window, to redo it: ``optimizer.zero_grad(set_to_none=True)``, forget the
        window's non-finite-loss flag, and fire ``after_window_discard`` so that the plugins that keep state per
        window (``grad_accum``'s item count) start it again. Call it on every process at the same point (after a
        `WindowOutOfMemory`); the micro-batches redone after it are the window's only ones."""
        optimizer.zero_grad(set_to_none=True)
        self._window_nonfinite = self._window_items = None
        if self._after_window_discard.impls:
            self._run(self._after_window_discard, {"accelerator": accelerator, "progress": progress})

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


def _state_mark(optimizer: Any) -> tuple[int, Any]:
    """How many parameters have optimizer state, and a copy of the first one's ``step`` counter (a copy of one
    number: on the host for torch's default optimizers, a device copy without a sync otherwise)."""
    state = getattr(optimizer, "optimizer", optimizer).state
    step = next((s["step"] for s in state.values() if isinstance(s, dict) and "step" in s), None)
    return len(state), step.clone() if isinstance(step, torch.Tensor) else step


def _same_mark(before: tuple[int, Any], after: tuple[int, Any]) -> bool:
    if before[0] != after[0]:
        return False
    a, b = before[1], after[1]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(torch.equal(a, b))  # only after an out-of-memory error: a sync is no cost then
    return a == b


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
