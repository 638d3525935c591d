"""Every torchloom hook, grouped by phase in firing order, one documented function each.

Implementations are methods of a plugin marked with `torchloom.hookimpl`. An implementation may accept
any subset of a hook's parameters (pluggy's opt-in arguments) and hooks are always called by keyword, so
a hook can gain parameters without breaking plugins.

Hook families:

- ``configure_*``: set-up time; return something.
- ``on_*_start`` / ``on_*_end``: notifications; return ``None`` and do not mutate their arguments.
- ``before_*`` / ``after_*``: around one operation (backward, the optimizer step).
- ``run_*``: an overridable step with a default ``trylast`` implementation, wrapped by context-type
  techniques with ``@hookimpl(wrapper=True)``.

The plugin lifecycle (what a stateful plugin may rely on): the engine reuses the same plugin objects across
``fit``, ``validate`` and ``predict`` calls, so a plugin resets its per-fit state in ``setup(stage="fit")``, the
first hook of every fit. On a resume (``Engine.fit(ckpt_path=...)``) the engine then calls ``load_state_dict``
of every stateful plugin (a plugin with ``state_dict`` and ``load_state_dict``; a checkpoint without the state of
one of them is refused), once, after ``on_run_start`` and before ``on_fit_start``, and ``on_fit_start`` receives
``resumed``: not ``None`` exactly when they were loaded. So a plugin that resets in ``setup`` and builds what needs
the prepared model in ``on_fit_start`` from what is there needs no "was my state just loaded" flag. A state loaded
outside a call (a script's ``torchloom.load_plugin_state`` before ``Engine.fit``, no hook around it) is the
plugin's to keep for the next fit's ``setup``, as the built-in stateful plugins do.

Ordering: implementations run in the order the plugins were listed by the user; ``after_*`` and
``*_end`` hooks, and ``teardown``, run in the reverse order (first in, last out), so a plugin can undo
what it did before the plugins listed after it. ``tryfirst`` / ``trylast`` override both.

Firing order of ``Engine.fit`` for E epochs of B micro-batches, validating at the end of each epoch::

    setup                                     1x (stage "fit"): the first hook of every fit / validate / predict
    configure_accelerator                     1x
    configure_model                           1x
    configure_optimizers                      1x (first non-None result wins, else the task's)
    on_run_start                              1x: the run directory exists, the model is prepared
    (a resume: every stateful plugin's load_state_dict, once, here)
    on_fit_start                              1x (resumed: not None exactly when the states were loaded)
    sanity validation                         num_sanity_val_steps batches, no hooks, nothing logged
    for epoch in range(E):
        on_train_epoch_start                  1x per epoch
        for batch in train_dataloader:        B micro-batches
            on_train_batch_start              1x per micro-batch
            run_train_step                    1x per micro-batch; the default implementation calls:
                before_backward               1x per micro-batch
                after_window_discard          only when a step discards its window to redo it (auto_batch)
                before_optimizer_step         1x per optimizer step (when gradients sync; hooks.optimizer_step)
                after_optimizer_step          1x per optimizer step
            on_train_batch_end                1x per micro-batch
            on_log                            every log_every_n_steps optimizer steps
            on_train_step_end                 1x per optimizer step, after its on_log (and its validation,
                                              with val_check_interval); checkpoints are saved here
        on_validation_start                   1x per validation pass
            on_validation_batch_end           1x per validation batch
        on_validation_end                     1x per validation pass
        on_log                                after each validation pass that logged something
        on_train_epoch_end                    1x per epoch
    on_log                                    once more if anything is still buffered
    on_train_end                              1x, when training completed: before the model is saved
    (the model is saved here, with save_model: true)
    on_save_model                             1x, right after the save, before its folder is in place
    on_exception                              only if the fit raised
    on_fit_end                                1x, always, after the save
    teardown                                  1x, always
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from torchloom.checkpoint.lineage import Resumed
    from torchloom.config import EngineConfig
    from torchloom.module import TaskModule
    from torchloom.progress import Progress
    from torchloom.step import StepHooks

__all__ = ["HOOK_NAMES", "PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "torchloom"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: ``log(name, value, weight=1.0, reduce="mean")``: buffer a value on its device; see `TaskModule.log`.
LogFn = Callable[..., None]


# --------------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------------


@hookspec
def setup(config: EngineConfig, stage: str) -> None:
    """Called when a ``fit``, ``validate`` or ``predict`` call starts, before any other hook of that call.

    **Fires:** once per call, on every rank, first: before ``configure_accelerator`` (no Accelerator exists
    yet), and also when ``validate`` / ``predict`` reuse the model of the last fit and run no set-up hook.
    ``teardown(stage)`` ends the same call; the engine calls a plugin's hooks only between the two, so a
    plugin can open what it needs here and close it in ``teardown``, and start each call with fresh state.
    With ``stage="fit"`` this is where a plugin resets its per-fit state: on a resume, every stateful plugin's
    ``load_state_dict`` runs later (after ``on_run_start``, before ``on_fit_start``), so the reset never undoes it.

    :param config: the loop settings the call runs by (read only). In a quick-debug run
        (``fast_dev_run``) ``config.is_fast_dev_run`` is true, and ``max_epochs``, ``val_check_interval``,
        ``num_sanity_val_steps`` and ``save_model`` are those it runs by (1, ``None``, 0, false): a plugin that
        writes what outlives the run (checkpoints, tracker logs, exported files) writes nothing then, as the
        ``checkpoint`` and ``trackers`` plugins do. This is the one way the engine tells plugins.
    :param stage: ``"fit"``, ``"validate"`` or ``"predict"``.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def setup(self, config, stage):
            self.seen = 0  # per-call state, reset at every call
            self.writes = not config.is_fast_dev_run  # a fast_dev_run saves nothing
    """


@hookspec
def configure_accelerator(config: EngineConfig) -> Mapping[str, Any] | None:
    """Return keyword arguments for `accelerate.Accelerator`, or ``None``.

    **Fires:** once per run set-up, on every rank, before the Accelerator exists and before the model is
    built: at every ``fit``, and at ``validate`` / ``predict`` unless they reuse the model of the last fit.

    :param config: the loop settings (read only).

    **Returns:** a mapping such as ``{"gradient_accumulation_steps": 4}`` or
    ``{"mixed_precision": "bf16"}``. The engine merges all fragments; two plugins giving the same key
    different values is a `PluginError` naming both plugins, the key and both values. The list-valued
    ``kwargs_handlers`` and ``log_with`` are concatenated in plugin order instead.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def configure_accelerator(self):
            return {"mixed_precision": self.config.dtype}
    """


@hookspec
def configure_model(model: torch.nn.Module, task: TaskModule, accelerator: Accelerator) -> None:
    """Transform the model in place before it is prepared (wrapped for DDP / FSDP, moved to the device).

    **Fires:** once per run set-up (see ``configure_accelerator``), on every rank, after
    `TaskModule.configure_model` and before `accelerate.Accelerator.prepare`.

    :param model: the model built by the task; may be mutated in place (enable gradient checkpointing,
        freeze parameters, wrap submodules). Replacing the object itself is not supported.
    :param task: the user's task (read only).
    :param accelerator: the run's Accelerator.

    **Returns:** ``None``.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def configure_model(self, model):
            model.gradient_checkpointing_enable({"use_reentrant": False})
    """


@hookspec(firstresult=True)
def configure_optimizers(
    model: torch.nn.Module, task: TaskModule, accelerator: Accelerator, num_training_steps: int | None
) -> Any:
    """Return the optimizer (and optionally a learning-rate scheduler) to train with, or ``None``.

    **Fires:** once per ``fit``, on every rank, after ``configure_model`` and before
    `accelerate.Accelerator.prepare`. Not fired by ``validate`` or ``predict``.

    :param model: the (unprepared) model whose parameters are to be optimized.
    :param task: the user's task.
    :param accelerator: the run's Accelerator.
    :param num_training_steps: the optimizer steps this fit will take (what a learning-rate schedule spans):
        ``ceil(batches_per_process / gradient_accumulation_steps) * max_epochs``, capped by ``max_steps``,
        where ``batches_per_process`` is the train dataloader's length after sharding over the processes
        (rank 0's count) and a last partial accumulation window counts as a step. ``max_steps`` alone when
        the dataloader has no length; ``None`` when neither is known.

    **Returns:** the same forms as `TaskModule.configure_optimizers`: an optimizer, an
    ``(optimizer, scheduler)`` pair, or ``{"optimizer": ..., "lr_scheduler": ...}``. Stops at the first
    non-None result; when every plugin returns ``None`` the task's ``configure_optimizers`` is used. The
    scheduler is stepped once per optimizer step that really ran (not on micro-batches, not on steps
    the fp16 loss scaler skipped).

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def configure_optimizers(self, model):
            return torch.optim.SGD(model.parameters(), lr=self.config.lr)
    """


@hookspec
def on_run_start(accelerator: Accelerator, stage: str, run_dir: str, run_config: Mapping[str, Any]) -> None:
    """Called when a ``fit`` / ``validate`` / ``predict`` call has its run directory and prepared model.

    **Fires:** once per call, on every rank, after the set-up (``configure_*``) and before anything runs
    (``on_fit_start``, ``on_validation_start``, ``on_predict_start``); in a resumed fit, before the checkpoint
    is loaded (every stateful plugin's ``load_state_dict`` follows it). Start trackers or progress displays
    here; close them in ``teardown``. ``accelerator.project_dir`` and ``accelerator.logging_dir`` are
    ``run_dir``, so Accelerate's ``accelerator.init_trackers`` writes inside the run directory.

    :param accelerator: the run's Accelerator.
    :param stage: ``"fit"``, ``"validate"`` or ``"predict"``.
    :param run_dir: this call's directory, ``<output_dir>/version_N`` (it exists on every rank's file system
        view of the main process; only the main process writes shared files there).
    :param run_config: the resolved configuration written to ``<run_dir>/config.yaml`` (``engine``,
        ``plugins`` and, from the CLI, ``task`` and ``data``): the hyperparameters to record. Do not mutate.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def on_run_start(self, accelerator, run_dir, run_config):
            if accelerator.is_main_process:
                print(f"writing to {run_dir}")
    """


@hookspec
def on_fit_start(
    accelerator: Accelerator,
    task: TaskModule,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: Progress,
    log: LogFn,
    resumed: Resumed | None,
) -> None:
    """Called when training is about to start, after everything went through ``accelerator.prepare``.

    **Fires:** once per ``fit``, on every rank, before the first epoch; in a resumed fit, after the checkpoint
    was loaded: every stateful plugin's ``load_state_dict`` has run (after ``on_run_start``), once, and
    ``resumed`` is not ``None``. Build here what needs the prepared model from the state that is there (reset in
    ``setup``, or loaded); a plugin needs no flag to know whether its state was just loaded.

    :param accelerator: the run's Accelerator.
    :param task: the user's task.
    :param model: the prepared (possibly DDP-wrapped) model.
    :param optimizer: the prepared optimizer (`accelerate.optimizer.AcceleratedOptimizer`).
    :param scheduler: the learning-rate scheduler, or ``None``.
    :param progress: counters at the start (all zero; a resumed fit's, as its checkpoint saved them).
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging, as `TaskModule.log` does.
    :param resumed: what a resumed fit continues (`torchloom.Resumed`: the chain of runs, the values they
        logged up to the checkpoint, the whole training's samples and times); ``None`` when the fit starts from
        scratch (no plugin's ``load_state_dict`` ran in this fit's set-up). Write the earlier values to a tracker
        here (the ``trackers`` plugin does).

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def on_fit_start(self, accelerator, model):
            self._stack.enter_context(LocalSGD(accelerator, model, local_sgd_steps=8))
    """


# --------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------


@hookspec
def on_train_epoch_start(accelerator: Accelerator, progress: Progress) -> None:
    """Called at the start of every training epoch.

    **Fires:** once per epoch, on every rank, before the epoch's first micro-batch.

    :param accelerator: the run's Accelerator.
    :param progress: counters; ``progress.epoch`` is the epoch about to run.
    """


@hookspec
def on_train_batch_start(batch: Any, accelerator: Accelerator, progress: Progress) -> None:
    """Called before every training micro-batch.

    **Fires:** once per micro-batch (so ``gradient_accumulation_steps`` times per optimizer step), on
    every rank.

    :param batch: the micro-batch, already on the device; do not mutate.
    :param accelerator: the run's Accelerator.
    :param progress: counters for this micro-batch.
    """


@hookspec(firstresult=True)
def run_train_step(
    task: TaskModule,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    accelerator: Accelerator,
    batch: Any,
    progress: Progress,
    hooks: StepHooks,
) -> dict[str, Any] | None:
    """Run one training micro-batch: forward, backward and, when gradients sync, the optimizer step.

    **Fires:** once per micro-batch, on every rank.

    The default implementation (``trylast``, plugin name ``torchloom.default_step``) does::

        outputs = task.training_step(batch, progress.batch_idx)    # a loss, or a dict with "loss"
        hooks.before_backward(outputs, ...)                        # may replace outputs["loss"]
        accelerator.backward(outputs["loss"])                      # divides by gradient_accumulation_steps
        if accelerator.sync_gradients:                             # last micro-batch of a window
            hooks.optimizer_step(model, optimizer, scheduler, ...)

    where ``hooks.optimizer_step`` is the engine's part of the step: with ``nonfinite_loss="skip"`` it skips a
    window whose loss was not finite on any rank (counted as ``train/skipped_steps``); otherwise it fires
    ``before_optimizer_step`` (unscaled gradients: clip here), calls ``optimizer.step()``, steps the scheduler
    unless the fp16 loss scaler skipped the step (an overflow, counted as ``train/scaler_skipped_steps``),
    ``zero_grad(set_to_none=True)``, and fires ``after_optimizer_step``.

    An implementation that *replaces* the step (returns a result before the default runs: a two-pass SAM
    step, a GAN step) calls ``hooks.before_backward`` and ``hooks.optimizer_step`` at the same points (see
    `torchloom.StepHooks`), so that gradient clipping, LocalSGD, the accumulation rescale and learning-rate
    logging keep working, and so do the engine's ``nonfinite_loss`` setting and the loss scaler's accounting. A
    step that calls ``optimizer.step()`` itself fires ``hooks.before_optimizer_step`` / ``after_optimizer_step``
    around it, and does without those two.

    Context-type techniques wrap it instead of replacing it, the way pytest's capture plugin wraps
    ``pytest_runtest_call``:

    .. code-block:: python

        @torchloom.hookimpl(wrapper=True)
        def run_train_step(self, accelerator, model):
            with accelerator.accumulate(model):
                return (yield)

    :param task: the user's task.
    :param model: the prepared model.
    :param optimizer: the prepared optimizer.
    :param scheduler: the learning-rate scheduler, or ``None``.
    :param accelerator: the run's Accelerator; ``accelerator.sync_gradients`` says whether this
        micro-batch ends an accumulation window (set by ``accelerator.accumulate``).
    :param batch: the micro-batch, on the device.
    :param progress: counters for this micro-batch.
    :param hooks: a `torchloom.StepHooks`: ``hooks.before_backward(...)`` and ``hooks.optimizer_step(...)``, as
        above; ``hooks.before_optimizer_step(...)`` and ``hooks.after_optimizer_step(...)`` fire those hooks alone;
        ``hooks.log`` buffers a value for logging.

    **Returns:** the step's outputs as a dict whose ``"loss"`` is the raw, detached micro-batch loss
    (0-dim tensor, not divided by the accumulation steps). Stops at the first non-None result. A result that
    is not such a dict (a wrapper that forgot ``return (yield)``) is a `PluginError` naming the wrappers.
    """


@hookspec
def before_backward(
    outputs: dict[str, Any], accelerator: Accelerator, progress: Progress, model: torch.nn.Module, hooks: StepHooks
) -> None:
    """Called between the forward pass and ``accelerator.backward``.

    **Fires:** once per micro-batch, on every rank, from the default ``run_train_step`` (and from a step that
    replaces it, through ``hooks.before_backward``; a step that cuts a batch into pieces fires it once per piece).

    :param outputs: the dict returned by `TaskModule.training_step` (a bare loss is turned into
        ``{"loss": loss}``). Implementations may replace ``outputs["loss"]`` with a rescaled loss (for
        example the token-count normalisation of gradient accumulation); the replacement must keep its
        autograd graph. Implementations run in plugin order and each sees the previous one's
        replacement. The logged loss and ``on_train_batch_end`` always see the original loss.
    :param accelerator: the run's Accelerator.
    :param progress: counters for this micro-batch.
    :param model: the prepared model the step trains (for a hook on its parameters' gradients, as
        ``grad_accum`` registers for a 16-bit loss).
    :param hooks: the step's `torchloom.StepHooks`. Its one field for this hook is ``hooks.loss_reduction``
        (`torchloom.step.LossReduction`), ``"mean"`` when the hook fires: an implementation that makes
        ``outputs["loss"]`` a *sum* over the micro-batch's items, to be divided by the whole window's count before
        the optimizer step (``grad_accum``'s ``tokens`` normalisation), sets ``hooks.loss_reduction = "sum"``. A
        step that splits a batch into pieces (``auto_batch``) reads it after the hook: it gives a sum weight 1 and
        divides a mean by the number of pieces. Do not call the step methods of ``hooks`` here.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def before_backward(self, outputs, hooks):
            outputs["loss"] = outputs["loss"] * outputs["num_items"]  # a sum over the micro-batch's items
            hooks.loss_reduction = "sum"
    """


@hookspec
def after_window_discard(accelerator: Accelerator, progress: Progress) -> None:
    """Called when a training step dropped the open accumulation window's gradients, to redo the window.

    **Fires:** only from ``StepHooks.discard_window``, which a step that recovers from an out-of-memory error
    calls (the ``auto_batch`` plugin, after a `torchloom.WindowOutOfMemory`), on every rank at the same point,
    after ``optimizer.zero_grad(set_to_none=True)``; never in a fit whose steps do not discard. The micro-batches
    that follow (``before_backward`` again) are the window's only ones: a plugin that counts per window
    (``grad_accum``'s item count) starts its count again here. Nothing has stepped: no ``before_optimizer_step``
    of the discarded window follows, and the scheduler has not moved.

    :param accelerator: the run's Accelerator.
    :param progress: counters of the micro-batch being redone.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def after_window_discard(self):
            self._window_items = None  # the redone micro-batches count from zero
    """


@hookspec
def before_optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accelerator: Accelerator,
    progress: Progress,
    log: LogFn,
) -> None:
    """Called once per optimizer step, after the window's last backward and before ``optimizer.step()``.

    **Fires:** only when ``accelerator.sync_gradients`` is true, so once per accumulation window, on
    every rank. Gradients are complete (all-reduced across ranks). With fp16 loss scaling they are still
    scaled: call ``accelerator.clip_grad_norm_`` (which unscales once, then clips) rather than clipping
    ``.grad`` by hand.

    :param model: the prepared model; gradients may be modified in place.
    :param optimizer: the prepared optimizer.
    :param accelerator: the run's Accelerator.
    :param progress: counters of the window's last micro-batch.
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging (e.g. ``grad_norm``).

    **Ordering:** gradient rescaling must run before clipping: mark it ``tryfirst``.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def before_optimizer_step(self, model, accelerator, log):
            log("grad_norm", accelerator.clip_grad_norm_(model.parameters(), self.config.max_norm))
    """


@hookspec
def after_optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    accelerator: Accelerator,
    progress: Progress,
    log: LogFn,
) -> None:
    """Called right after the optimizer step, the scheduler step and ``zero_grad``.

    **Fires:** once per accumulation window, on every rank, also when the fp16 loss scaler skipped the
    step (check ``optimizer.step_was_skipped``). ``progress.global_step`` does not yet count this step.

    :param model: the prepared model; parameters may be modified in place (LocalSGD averaging, EMA).
    :param optimizer: the prepared optimizer.
    :param scheduler: the learning-rate scheduler, or ``None``.
    :param accelerator: the run's Accelerator.
    :param progress: counters of the window's last micro-batch.
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging.
    """


@hookspec
def on_train_batch_end(
    outputs: dict[str, Any], batch: Any, accelerator: Accelerator, progress: Progress, log: LogFn
) -> None:
    """Called after every training micro-batch.

    **Fires:** once per micro-batch, on every rank, after ``run_train_step``.

    :param outputs: the step's outputs; ``outputs["loss"]`` is the raw detached micro-batch loss, never
        divided by the accumulation steps. Do not mutate.
    :param batch: the micro-batch.
    :param accelerator: the run's Accelerator; ``accelerator.sync_gradients`` tells whether an optimizer
        step just happened.
    :param progress: counters for this micro-batch (``global_step`` not yet incremented).
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging.
    """


@hookspec
def on_train_step_end(accelerator: Accelerator, progress: Progress) -> None:
    """Called after each optimizer step is complete: counted, and logged and validated when at their interval.

    **Fires:** once per optimizer step, on every rank, after ``on_train_batch_end`` of the window's last
    micro-batch and after the ``on_log`` / validation of this step, before the engine checks stop requests.
    The training state is whole here (no accumulation window open), so this is where
    `torchloom.save_checkpoint` may be called during an epoch (the ``checkpoint`` plugin saves every N steps
    here).

    :param accelerator: the run's Accelerator.
    :param progress: counters after the step (``global_step`` counts it).
    """


@hookspec
def on_train_epoch_end(accelerator: Accelerator, progress: Progress, log: LogFn) -> None:
    """Called at the end of every training epoch, after that epoch's validation.

    **Fires:** once per epoch, on every rank; also for the epoch cut short by ``max_steps``. A checkpoint
    saved here (`torchloom.save_checkpoint`) resumes at the start of the next epoch.

    :param accelerator: the run's Accelerator.
    :param progress: counters after the epoch's last micro-batch.
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging.
    """


# --------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------


@hookspec
def on_validation_start(task: TaskModule, model: torch.nn.Module, accelerator: Accelerator, progress: Progress) -> None:
    """Called before a validation pass, with the model in eval mode.

    **Fires:** once per validation pass (every ``val_check_interval`` optimizer steps, or at the end of
    each epoch, or once for ``Engine.validate``), on every rank.

    :param task: the user's task.
    :param model: the prepared model (eval mode, gradients disabled).
    :param accelerator: the run's Accelerator.
    :param progress: counters at the time of validation.
    """


@hookspec
def on_validation_batch_end(outputs: Any, batch: Any, accelerator: Accelerator, progress: Progress) -> None:
    """Called after `TaskModule.validation_step` on one batch.

    **Fires:** once per validation batch, on every rank that holds a real sample of it. With several
    processes each rank sees its own shard, and the engine has already cut off the copies Accelerate pads
    the last batch with (per-sample tensors, and lists of plain items, whose first dimension is the batch
    size), so each sample reaches this hook once over all ranks; a rank whose share of the last batch is only
    copies is not called for that batch (with 32 samples in one batch of 32 on 2 processes, rank 1 is never
    called), so its metrics may hold no sample at all. So do not start a collective here (no
    ``gather_for_metrics``: the ranks' sizes differ in the last batch, and a rank may not be called): keep
    per-rank state, e.g. a torchmetrics object, and combine it at the end (``log(name, metric)`` in
    ``on_validation_end``: the engine synchronises it correctly also from a rank that holds no sample, list
    states such as AUROC's included). Read no tensor on the host here (a sync per batch): count problems on
    the device and check them once, in ``on_validation_end``, as ``eval_metrics`` does.

    :param outputs: what ``validation_step`` returned, without the padding copies (do not mutate).
    :param batch: the batch, on the device, without the padding copies.
    :param accelerator: the run's Accelerator.
    :param progress: counters at the time of validation.
    """


@hookspec
def on_validation_end(
    task: TaskModule, model: torch.nn.Module, accelerator: Accelerator, progress: Progress, log: LogFn
) -> None:
    """Called after a validation pass: compute, log and reset metrics here.

    **Fires:** once per validation pass, on every rank, before the model returns to train mode. Values
    logged here are reduced and sent to ``on_log`` right after this hook.

    :param task: the user's task.
    :param model: the prepared model.
    :param accelerator: the run's Accelerator.
    :param progress: counters at the time of validation.
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging.
    """


# --------------------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------------------


@hookspec
def on_predict_start(task: TaskModule, model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Called before ``Engine.predict`` runs `TaskModule.predict_step` over the data.

    **Fires:** once per ``predict`` call, on every rank, with the model in eval mode.

    :param task: the user's task.
    :param model: the prepared model.
    :param accelerator: the run's Accelerator.
    """


@hookspec(firstresult=True)
def run_predict_step(
    task: TaskModule, model: torch.nn.Module, batch: Any, batch_idx: int, accelerator: Accelerator
) -> Any:
    """Compute one prediction batch's outputs in place of `TaskModule.predict_step`, or return ``None``.

    **Fires:** once per prediction batch, on every rank (the padding copies of the last batch included: they are cut
    off the outputs afterwards), in eval mode under ``torch.no_grad``, before the task's ``predict_step``.

    **Returns:** the batch's outputs, as ``predict_step`` would return them, or ``None``. The first non-None result
    wins: it is the batch's outputs (``on_predict_batch_end`` gets it, ``predictions.jsonl`` writes it) and the
    task's ``predict_step`` is not called; when every implementation returns ``None`` (or none exists), the task's
    ``predict_step`` runs. An implementation should return ``None`` when the task defines its own ``predict_step``
    (the ``generate`` plugin does), so that the user's code wins.

    :param task: the user's task.
    :param model: the prepared model (a DDP wrapper: ``accelerator.unwrap_model(model)`` for ``generate``).
    :param batch: the batch, on the device.
    :param batch_idx: the batch's index in the prediction data (0-based).
    :param accelerator: the run's Accelerator.
    """


@hookspec
def on_predict_batch_end(outputs: Any, batch: Any, accelerator: Accelerator) -> None:
    """Called after `TaskModule.predict_step` on one batch.

    **Fires:** once per prediction batch, on every rank that holds a real sample of it (the padding copies of
    the last batch are cut off, as for ``on_validation_batch_end``; start no collective here).

    :param outputs: what ``predict_step`` returned, without the padding copies (do not mutate).
    :param batch: the batch, on the device, without the padding copies.
    :param accelerator: the run's Accelerator.
    """


@hookspec
def on_predict_end(predictions: list[Any], accelerator: Accelerator) -> None:
    """Called after the last prediction batch.

    **Fires:** once per ``predict`` call, on every rank.

    :param predictions: this rank's outputs, one per batch, in order (do not mutate).
    :param accelerator: the run's Accelerator.
    """


# --------------------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------------------


@hookspec
def on_log(metrics: dict[str, float], progress: Progress, accelerator: Accelerator) -> None:
    """Called with reduced logged values: write them to a tracker, or base a decision on them, here.

    **Fires:** on every rank, with the same values on every rank, when something was logged since the
    previous call: training values every ``log_every_n_steps`` optimizer steps and once more at the end of
    training; validation values after every validation pass (training and validation values are reduced
    separately). Each value is the reduction chosen in ``log`` (by default the weighted mean) over all ranks
    and over the micro-batches (or validation batches) since the previous call, of what was passed to
    ``log``; a logged torchmetrics object is its ``compute()`` over all ranks. Only names logged since the previous call
    appear. A decision taken here (early stopping, keeping the best checkpoint) is the same on every rank.
    Write files and trackers on the main process only (``accelerator.is_main_process``; Accelerate's
    ``accelerator.log`` does so itself).

    :param metrics: name -> value (plain Python floats); do not mutate.
    :param progress: counters at the time of logging (``global_step`` counts the step just taken).
    :param accelerator: the run's Accelerator.
    """


# --------------------------------------------------------------------------------------------------------
# End
# --------------------------------------------------------------------------------------------------------


@hookspec
def on_train_end(
    accelerator: Accelerator, task: TaskModule, model: torch.nn.Module, progress: Progress, log: LogFn
) -> None:
    """Called when training completed, before the final model is saved: change the final weights here.

    **Fires:** once per ``fit`` that completed (all epochs, or ``max_steps``), on every rank, after the last
    epoch and the last ``on_log`` of training values, and before `TaskModule.save_model` (with
    ``save_model: true``). Not after an exception (``on_exception`` fires instead). Values logged here
    reach ``on_log`` before the save.

    This is the place for work that changes the weights at the end of training, so that the saved model
    and the model ``fit`` returns with are the same on every rank: a last LocalSGD average, swapping in an
    EMA or SWA average. A collective here (an all-reduce) is safe: every rank reaches this hook at the same
    optimizer step. ``on_fit_end`` fires after the save and must not change the weights.

    :param accelerator: the run's Accelerator.
    :param task: the user's task.
    :param model: the prepared model; parameters may be modified in place.
    :param progress: the final counters.
    :param log: ``log(name, value, weight=1.0, reduce="mean")`` buffers a value for logging.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def on_train_end(self, model):
            self.copy_average_to(model)  # the saved model is the averaged one
    """


@hookspec
def on_save_model(directory: str, model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Called right after `TaskModule.save_model` wrote the fit's model folder: add files to it here.

    **Fires:** once per ``fit`` that completed with ``save_model: true``, on every rank, after ``on_train_end``
    and `TaskModule.save_model`, before the model card is written and the folder is renamed into place
    (``<run_dir>/model``): what is written into ``directory`` appears with the rest of the folder, or not at all.
    Write on the main process only (``accelerator.is_main_process``). Do not change the weights.

    :param directory: the folder being written (a temporary directory next to ``<run_dir>/model``).
    :param model: the prepared model.
    :param accelerator: the run's Accelerator.

    **Example:**

    .. code-block:: python

        @torchloom.hookimpl
        def on_save_model(self, directory, accelerator):
            if accelerator.is_main_process:
                self.tokenizer.save_pretrained(directory)
    """


@hookspec
def on_exception(exception: BaseException, accelerator: Accelerator, progress: Progress) -> None:
    """Called when the fit raised, before ``on_fit_end`` and ``teardown``; the exception is re-raised after.

    **Fires:** at most once per ``fit``, on the ranks where the exception happened (also for
    ``KeyboardInterrupt``, and for the error the engine raises on a non-finite loss). Every implementation
    runs even if another raises; their errors are attached as notes to the original exception.

    :param exception: the exception (read only).
    :param accelerator: the run's Accelerator.
    :param progress: counters when the exception happened.
    """


@hookspec
def on_fit_end(accelerator: Accelerator, task: TaskModule, model: torch.nn.Module, progress: Progress) -> None:
    """Called when the fit ends, whether it completed or raised: after the model was saved.

    **Fires:** once per ``fit``, on every rank that reached it, after ``on_train_end`` and the save (or
    after ``on_exception``). Every implementation runs even if another raises. Do not change the weights
    here: they have been saved already (use ``on_train_end``).

    :param accelerator: the run's Accelerator.
    :param task: the user's task.
    :param model: the prepared model.
    :param progress: the final counters.
    """


@hookspec
def teardown(accelerator: Accelerator | None, stage: str) -> None:
    """Release what the plugin holds (files, threads, contexts). Always runs, also after an exception.

    **Fires:** once at the end of every ``fit`` / ``validate`` / ``predict`` call, on every rank: it closes
    what ``setup`` opened, also when the set-up failed (then ``on_fit_end`` does not fire). Every plugin's
    ``teardown`` runs even if another's raises: the error reported is the first one (the original error of
    the run, if it failed), and the later ones are attached to it as notes.

    :param accelerator: the run's Accelerator; ``None`` when it could not be built.
    :param stage: ``"fit"``, ``"validate"`` or ``"predict"``.
    """


#: Every hook name, in the order the specs are defined above (= firing order).
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, obj in list(globals().items()) if callable(obj) and hasattr(obj, f"{PROJECT_NAME}_spec")
)
