"""`FitLoop`: the training loop of one fit, and the only writer of its `FitState`.

Epochs, micro-batches through ``run_train_step``, optimizer-step boundaries (logging, validation, checkpoints, stop
checks), the end of training, and the two ways the fit crosses a checkpoint: `FitLoop.save_checkpoint` (what
`torchloom.save_checkpoint` calls) and `FitLoop.resume`, both over one mapping (`FitLoop.stateful`, written and
loaded by `torchloom.checkpoint.store`). Where the training data stands, and how a resumed epoch starts, is
`torchloom.checkpoint.data_position.DataPosition`'s: the epoch loop only loops. The hooks get a frozen
`torchloom.Progress`, built from the state once per micro-batch and once per optimizer step.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from accelerate.utils import find_batch_size

from torchloom._accelerator import note_run_failed
from torchloom._context import RunContext, activate
from torchloom._evaluation import validation_pass
from torchloom._fit_state import FitState
from torchloom._guards import (
    NEGATIVE_ITEMS,
    EmptyMicroBatches,
    check_same_length,
    check_step_outputs,
    check_training,
)
from torchloom._logbuffer import WEIGHT_PREFIX
from torchloom._schedule import after_epoch, after_validation
from torchloom._setup import log_data_values, sanity_check
from torchloom._warn import warn
from torchloom.checkpoint.async_save import PendingCheckpoint
from torchloom.checkpoint.data_position import DataPosition
from torchloom.checkpoint.entries import AccelerateFiles, LogBufferState, Part, RandomStates
from torchloom.checkpoint.lineage import Resumed, read_resumed, training_record, write_resumed
from torchloom.checkpoint.manifest import ranking
from torchloom.checkpoint.plugin_state import stateful_plugins
from torchloom.checkpoint.replicas import divergent
from torchloom.checkpoint.store import load, write
from torchloom.errors import ConfigError, RunFileError
from torchloom.rundir.layout import CHECKPOINTS_DIR
from torchloom.rundir.runfiles import finish_fit
from torchloom.step import StepHooks

__all__ = ["FitLoop"]


class FitLoop:
    """Trains ``task`` on a prepared ``run`` (see `torchloom._setup.Run`) by the engine's ``config``.

    Attributes:
        state (`FitState`): the fit's counters; only this object writes them.
        data (`DataPosition`): where the training data stands: it starts each epoch's loader (a resumed one where
            the checkpoint stopped).
        context (`RunContext`): what the fit exposes ambiently (its ``saver`` is `save_checkpoint`).
        hooks (`StepHooks`): what ``run_train_step`` implementations receive.
        resumed (`torchloom.Resumed` or ``None``): what the fit continues, once `resume` loaded a checkpoint.

    ``started``: when the fit call started (``time.perf_counter()``; by default, now): its wall time counts from
    there.
    """

    def __init__(
        self, config: Any, run: Any, task: Any, logs: Any, plugins: list[Any], started: float | None = None
    ) -> None:
        self.config, self.run, self.task, self.logs, self.plugins = config, run, task, logs, plugins
        self.state = FitState()
        self.data = DataPosition(run.accelerator, run.train_dataloader, run.train_batches)
        self.resumed: Resumed | None = None
        # This run's part of the whole training, for the next resume (a checkpoint's manifest): wall and training
        # clocks, validation time, and the main process's samples (None once a batch had no size).
        self._started = time.perf_counter() if started is None else started
        self._train_start: float | None = None
        self._val_time = 0.0
        self._samples: int | None = 0 if run.accelerator.is_main_process else None
        self.context = RunContext(
            logs, run.agreement, saver=self.save_checkpoint, async_saver=self.save_checkpoint_async
        )
        self.hooks = StepHooks(run.relay, logs.log, config.nonfinite_loss == "skip", run.agreement, run.model)
        self.empty = EmptyMicroBatches()  # where a micro-batch with no loss token had a non-finite loss (device)
        self._save_point = False  # a checkpoint may be saved now (the data position is known: self.data)
        self._last_saved: tuple[int, str] | None = None  # (global_step, path) of this fit's latest checkpoint
        self._batch_start = run.relay.hook("on_train_batch_start")  # call lists: skipped while empty
        self._batch_end = run.relay.hook("on_train_batch_end")
        self._in_flight: PendingCheckpoint | None = None  # an asynchronous save not yet complete (at most one)
        self.skipped_saves: list[int] = []  # steps whose checkpoint was not written: non-finite state (skip / ignore)
        #: A failure of ``on_fit_end`` itself, after a fit that succeeded (the engine raises it after ``teardown``).
        self.cleanup_failure: BaseException | None = None

    # ------------------------------------------------------------------------------------------ training

    def fit(self) -> None:
        """The fit from where `data` stands (a resume: where `resume` left it): ``on_fit_start``, the sanity pass,
        the epochs, the end of training, the saved model and ``latest`` link; ``on_exception`` if any of it raises;
        ``on_fit_end`` always (a failure of its own is kept in `cleanup_failure` for the engine to raise after
        ``teardown``)."""
        run, end = self.run, self._end_args()
        error: BaseException | None = None
        try:
            with activate(self.context):
                begin = {"optimizer": run.optimizer, "scheduler": run.scheduler, "log": self.logs.log}
                start_args = {"progress": self.state.progress(), "resumed": self.resumed}
                run.relay.call("on_fit_start", **end, **begin, **start_args)
                log_data_values(run.datamodule, self.logs)
                sanity_check(self.task, run, self.config.num_sanity_val_steps, self.logs)
                self.train()
                self.end()
                self.settle_save()  # the end of training waits for a save still in flight
                finish_fit(self.task, run, self.config, self.logs)  # the model (save_model: true), the latest link
                run.accelerator.wait_for_everyone()  # no process reports success before every process has finished
        except BaseException as exc:
            error = exc
            note_run_failed()
            self._settle_after_failure()
            progress = self.state.progress()
            run.relay.call_cleanup("on_exception", error, exception=exc, accelerator=run.accelerator, progress=progress)
            raise
        finally:
            self.cleanup_failure = run.relay.call_cleanup("on_fit_end", error, **end, progress=self.state.progress())

    def train(self) -> None:
        """The epochs from `data`'s, until ``max_epochs``, ``max_steps`` or a stop agreed over the processes."""
        self._train_start = time.perf_counter()
        for epoch in range(self.data.epoch, self.config.max_epochs):
            if self.config.max_steps is not None and self.state.global_step >= self.config.max_steps:
                break  # a resumed fit that had finished
            if self._epoch(epoch):
                break

    def end(self) -> None:
        """The end of training: what is still logged, ``on_train_end``, its logs, and a final validation if the
        last optimizer step was not validated (the returned metrics describe the saved model)."""
        self.log_training()
        self.run.relay.call("on_train_end", **self._end_args(), progress=self.state.progress(), log=self.logs.log)
        self.log_training()
        if self.state.validated_at != self.state.global_step:
            self.validate()

    def _end_args(self) -> dict[str, Any]:
        return {"accelerator": self.run.accelerator, "task": self.task, "model": self.run.model}

    def _epoch(self, epoch: int) -> bool:
        """Train one epoch (validating at the configured interval); return whether to stop. A resumed epoch starts
        where the checkpoint stopped (`DataPosition.start_epoch`)."""
        run, state, relay, data = self.run, self.state, self.run.relay, self.data
        check_same_length(run.agreement, run.train_dataloader, "training")
        batches = data.start_epoch(run.train_dataloader, epoch)
        state.epoch, state.batch_idx = epoch, data.batches_done
        relay.call("on_train_epoch_start", accelerator=run.accelerator, progress=state.progress())
        done = False
        for batch_idx, batch in batches:
            state.batch_idx = batch_idx
            if self._micro_batch(batch):
                data.stop()
                done = True
                break
        if data.batches_done == 0:  # no batch trained, none skipped
            raise ConfigError(f"fit: the training dataloader yielded no batches in epoch {epoch}; nothing was trained")
        if self.config.val_check_interval is None:
            self.validate()
        after_epoch(run.scheduler)  # an epoch-interval schedule, before an epoch-end checkpoint saves it
        data.end_epoch(finished=not done)
        self._save_point = True
        try:
            relay.call("on_train_epoch_end", accelerator=run.accelerator, progress=state.progress(), log=self.logs.log)
        finally:
            self._save_point = False
        return self._stop_agreed() or done

    def _micro_batch(self, batch: Any) -> bool:
        """One micro-batch and, when it ends an accumulation window, the optimizer-step boundary; return whether to
        stop."""
        run, state = self.run, self.state
        progress = state.progress()
        if self._batch_start.impls:
            run.relay.call("on_train_batch_start", batch=batch, accelerator=run.accelerator, progress=progress)
        outputs = self._train_step(batch, progress)
        self._count(self.hooks.take_outcome())
        if self._samples is not None:  # the main process: the batch's size from its shape (no device sync)
            self._samples = _batch_size(batch, self._samples)
        if self._batch_end.impls:
            run.relay.call(
                "on_train_batch_end",
                outputs=outputs,
                batch=batch,
                accelerator=run.accelerator,
                progress=progress,
                log=self.logs.log,
            )
        state.micro_step += 1
        return run.accelerator.sync_gradients and self._step_boundary()  # not inside an accumulation window

    def _train_step(self, batch: Any, progress: Any) -> dict[str, Any]:
        """``run_train_step``; buffer its loss for logging (no host-device sync)."""
        run, state = self.run, self.state
        outputs = run.relay.call(
            "run_train_step",
            task=self.task,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            accelerator=run.accelerator,
            batch=batch,
            progress=progress,
            hooks=self.hooks,
        )
        if not isinstance(outputs, dict) or "loss" not in outputs:
            check_step_outputs(outputs, run.relay.wrappers("run_train_step"))  # raises
        loss, items = outputs["loss"], outputs.get("num_items", 1.0)
        # A micro-batch with num_items 0 (no loss token: every label -100) has the loss 0 / 0 = NaN from a mean such
        # as transformers' (whose gradient is 0); it weighs nothing in train/loss rather than making it NaN, on the
        # device (no sync). A non-finite loss of one with items is a divergence, seen at the logging step.
        kept = _has_items(items)
        if self.config.nonfinite_loss == "skip":  # the skipped micro-batches do not count in train/loss
            finite = torch.isfinite(loss)
            kept = finite & kept if isinstance(kept, torch.Tensor) else finite if kept in (None, True) else False
            items = finite.to(loss.dtype) * items
        elif self.config.nonfinite_loss == "error":
            self.empty.note(loss, items, kept, (state.epoch, state.batch_idx, state.global_step + 1))
        if isinstance(kept, torch.Tensor):
            loss = torch.where(kept, loss, torch.zeros_like(loss))
        elif kept is False:
            loss = torch.zeros_like(loss)
        self.logs.train.log("train/loss", loss, items)  # kept on the device, folded at the logging interval
        if isinstance(items, torch.Tensor):  # its sign is checked at the logging interval, on the device
            self.logs.train.log(NEGATIVE_ITEMS, (items < 0).to(torch.float32))
        return outputs

    def _count(self, outcome: Any) -> None:
        """Count what the micro-batch's optimizer step did (`StepHooks.take_outcome`)."""
        state = self.state
        state.scaler_skipped_steps += outcome.scaler_skips
        if outcome.empty_skips:
            state.skipped_steps += outcome.empty_skips
            if self.run.accelerator.is_main_process:
                warn(
                    f"nonfinite_loss='skip': skipped optimizer step {state.global_step + 1} (epoch {state.epoch}): "
                    "its window had no loss token (num_items 0) on any process, so nothing moved; "
                    f"{state.skipped_steps} step(s) skipped in this fit",
                )
        if outcome.nonfinite_skips:
            state.skipped_steps += outcome.nonfinite_skips
            if self.run.accelerator.is_main_process:
                warn(
                    f"nonfinite_loss='skip': skipped optimizer step {state.global_step + 1} (epoch {state.epoch}): "
                    f"the loss was not finite; {state.skipped_steps} step(s) skipped in this fit",
                )

    def _step_boundary(self) -> bool:
        """After an optimizer step: count it, log and validate at their intervals; return whether to stop."""
        cfg, state, run = self.config, self.state, self.run
        state.global_step += 1
        logged = state.global_step % cfg.log_every_n_steps == 0
        if logged:
            self.log_training()
        if cfg.val_check_interval and state.global_step % cfg.val_check_interval == 0:
            self.validate()
            logged = True
        if run.relay.implemented("on_train_step_end"):
            self._save_point = True  # self.data: after batch state.batch_idx of the epoch
            try:
                run.relay.call("on_train_step_end", accelerator=run.accelerator, progress=state.progress())
            finally:
                self._save_point = False
        if logged and self._stop_agreed():
            return True
        return cfg.max_steps is not None and state.global_step >= cfg.max_steps

    def _stop_agreed(self) -> bool:
        """Whether any process asked to stop (`torchloom.request_stop`): the same answer on every process, which
        all call this at the same points (`RankAgreement.first`)."""
        reason = self.run.agreement.first(self.context.stop_reason)
        self.state.stop_reason = reason
        return reason is not None

    def log_training(self) -> None:
        """Reduce the training values (every process), send them to ``on_log``, and check them (`check_training`).

        Also logged, once per reduction and only when something else was: ``train/skipped_steps`` (with
        ``nonfinite_loss="skip"``) and ``train/scaler_skipped_steps`` (with a loss scaler), the fit's counts so
        far, the same on every process (host numbers: no device sync)."""
        state, logs, run = self.state, self.logs, self.run
        if logs.train:
            if self.config.nonfinite_loss == "skip":
                logs.train.log("train/skipped_steps", float(state.skipped_steps), reduce="last")
            if run.accelerator.scaler is not None:
                logs.train.log("train/scaler_skipped_steps", float(state.scaler_skipped_steps), reduce="last")
        metrics, internal = logs.report(logs.train, run, state.progress(), weights=("train/loss",))
        steps = (state.checked_step + 1, state.global_step)
        overflowed = state.scaler_skipped_steps > state.checked_scaler_skips
        state.checked_step, state.checked_scaler_skips = state.global_step, state.scaler_skipped_steps
        check_training(
            metrics.get("train/loss"),
            internal.get(NEGATIVE_ITEMS, 0.0),
            internal.get(WEIGHT_PREFIX + "train/loss"),  # train/loss is weighted by num_items: the items trained on
            steps,
            state.epoch,
            overflowed,
            self.config.nonfinite_loss,
            culprit=lambda: self.empty.culprit(run.agreement),
        )

    def validate(self) -> dict[str, float]:
        """A validation pass at this point of the fit (none without validation data); return its values.

        The training values of the optimizer steps since the last logging interval are logged first, so that every
        ``on_log`` of training values up to this step comes before the validation's (the HF Trainer logs, then
        evaluates, at a step that does both): a progress line for step N, then the validation at step N."""
        if self.run.val_dataloader is None:
            return {}
        if self.state.checked_step != self.state.global_step:  # host counters: the same decision on every rank
            self.log_training()
        self.state.validated_at = self.state.global_step
        progress = self.state.progress()
        began = time.perf_counter()
        try:
            validation_pass(self.task, self.run, self.logs, progress)
            values = self.logs.report(self.logs.val, self.run, progress)[0]
            after_validation(self.run.scheduler, self.logs.latest)  # ReduceLROnPlateau: one value on every process
            return values
        finally:
            self._val_time += time.perf_counter() - began

    # ------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str | None) -> str | None:
        """`torchloom.save_checkpoint` during this fit: the fit state next to the run's and the plugins' states
        (``None``: not finite, skipped under ``nonfinite_loss`` ``"skip"`` / ``"ignore"``).

        Raises:
            RuntimeError: called outside ``on_train_step_end`` / ``on_train_epoch_end``.
        """
        saved = self._save(directory, asynchronous=False)
        assert saved is None or isinstance(saved, str)
        return saved

    def save_checkpoint_async(self, directory: str | None) -> PendingCheckpoint | None:
        """`torchloom.save_checkpoint_async` during this fit: as `save_checkpoint`, written in the background."""
        saved = self._save(directory, asynchronous=True)
        assert saved is None or isinstance(saved, PendingCheckpoint)
        return saved

    def settle_save(self) -> None:
        """Wait for the save in flight, if any, and make it complete (every process: `PendingCheckpoint.result`)."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.result()

    def _settle_after_failure(self) -> None:
        """A fit that fails waits for its save in flight: on one process it is completed (its state was copied
        before the failure), on several it is abandoned (a failure on one process would leave the others in the
        agreement); an error of the save is a warning then, not the fit's error."""
        pending, self._in_flight = self._in_flight, None
        if pending is None or pending.settled:  # settled already (its error, if any, may be the fit's)
            return
        if self.run.accelerator.num_processes > 1:
            pending.abandon()
            if self.run.accelerator.is_main_process:
                warn(f"the fit failed while checkpoint {pending.path!r} was written in the background: discarded")
            return
        try:
            pending.result()
        except Exception as exc:
            warn(f"the fit failed, and so did the background save of checkpoint {pending.path!r}: {exc}")

    def _save(self, directory: str | None, asynchronous: bool) -> str | PendingCheckpoint | None:
        if not self._save_point:
            raise RuntimeError(
                "save_checkpoint() must be called from on_train_step_end or on_train_epoch_end, where no "
                "accumulation window is open and the data position is known"
            )
        run, state = self.run, self.state
        if directory is None:
            self.settle_save()  # at most one save in flight: a save waits for the previous one
            saved = self._saved_here()
            if saved is not None:
                return PendingCheckpoint(saved) if asynchronous else saved
            name = f"step-{state.global_step:08d}" + ("-epoch-end" if self.data.finished else "")
            directory = os.path.join(run.run_dir, CHECKPOINTS_DIR, name)
        self.settle_save()
        path = write(
            directory,
            self.stateful(),
            accelerator=run.accelerator,
            agreement=run.agreement,
            metrics=self.logs.latest,
            training=self._training(),
            ranking=ranking(self.plugins),
            nonfinite_loss=self.config.nonfinite_loss,
            skipped=self.skipped_saves,
            asynchronous=asynchronous,
        )
        if isinstance(path, PendingCheckpoint):
            self._in_flight = path
        if path is not None:  # None: the state is not finite, nothing written (nonfinite_loss "skip" / "ignore")
            self._last_saved = (state.global_step, path if isinstance(path, str) else path.path)
        return path

    def stateful(self) -> dict[str, Any]:
        """What a checkpoint of this fit holds (`torchloom.checkpoint.entries`): the model, optimizer and loss
        scaler (each process's own copy too where a plugin lets them differ), the fit state, the data position,
        the scheduler, the log buffer, the random states (last: restored after everything else), then every
        stateful plugin.

        Raises:
            PluginError: two stateful plugins share a name, or a name cannot be a file name.
        """
        run = self.run
        replicas = run.accelerator.num_processes > 1 and divergent(self.plugins)
        engine: dict[str, Any] = {
            "engine/model": AccelerateFiles(run.accelerator, run.model, run.optimizer, replicas=replicas),
            "engine/fit_state": Part(self.state, main="engine", process="process"),
            "engine/data_position": Part(self.data, main="engine", process="process"),
        }
        if run.scheduler is not None:
            engine["engine/lr_scheduler"] = Part(run.scheduler, main="lr_scheduler")
        engine["engine/log_buffer"] = Part(LogBufferState(self.logs.train, run.accelerator.device), process="process")
        engine["engine/random_states"] = Part(RandomStates(), process="process")
        return {**engine, **stateful_plugins(self.plugins)}

    def _saved_here(self) -> str | None:
        """The path of this fit's latest checkpoint when it is the one to save now: an epoch cut short (max_steps,
        a stop) ends where its last step's checkpoint was saved, with the same position and weights, and the same
        name; nothing was trained since, so that one is it. ``None`` otherwise."""
        last = self._last_saved
        if self.data.finished or last is None or last[0] != self.state.global_step or not os.path.isdir(last[1]):
            return None
        return last[1]

    def _training(self) -> dict[str, Any]:
        """The whole training up to now, as a checkpoint's manifest records it (`training_record`)."""
        now, acc = time.perf_counter(), self.run.accelerator
        trained = 0.0 if self._train_start is None else max(now - self._train_start - self._val_time, 0.0)
        samples = None if self._samples is None else self._samples * acc.num_processes
        return training_record(self.resumed, len(self.logs.history), samples, trained, now - self._started)

    def resume(self, path: str, reset_optimizer: bool) -> None:
        """Load the checkpoint at ``path`` into the prepared run and this loop's `stateful` entries (`data` then
        starts where it stopped; the plugins' ``load_state_dict`` run here, after ``on_run_start`` and before
        ``on_fit_start``).

        Also reads what the fit continues (`resumed`: the chain of runs, their records up to the checkpoint, the
        whole training's totals) and, on the main process, writes its records at the top of this run's
        ``metrics.jsonl`` and the chain to ``resumed_from.json`` (`torchloom.checkpoint.lineage`).

        Raises:
            CheckpointError: the checkpoint cannot continue this run (see `torchloom.checkpoint.store.load`).
            RunFileError: on every process, when the main process cannot write those files.
        """
        run = self.run
        manifest = load(path, self.stateful(), accelerator=run.accelerator, reset_optimizer=reset_optimizer)
        if reset_optimizer and run.accelerator.is_main_process:
            warn(f"resuming from {path!r} with reset_optimizer=True: the optimizer starts with fresh state")
        self.resumed = read_resumed(path, manifest, warn=run.accelerator.is_main_process)
        failure = None
        if run.accelerator.is_main_process:
            try:
                write_resumed(run.run_dir, self.resumed)
            except RunFileError as exc:
                failure = str(exc)
        failure = run.agreement.first(failure)  # a failed write fails every process alike
        if failure is not None:
            raise RunFileError(failure)


def _has_items(items: Any) -> torch.Tensor | bool | None:
    """``num_items != 0`` (a device tensor, or a host bool for a number); ``None`` for the default weight 1."""
    if isinstance(items, torch.Tensor):
        return items != 0
    return None if items == 1.0 else items != 0


def _batch_size(batch: Any, counted: int) -> int | None:
    """``counted`` plus the samples of ``batch`` (the first dimension of its first tensor, a shape read), or
    ``None`` when the batch has no tensor with a batch dimension."""
    try:
        return counted + int(find_batch_size(batch))
    except (TypeError, ValueError, IndexError):
        return None
