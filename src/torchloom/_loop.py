"""`FitLoop`: the training loop of one fit, and the only writer of its `FitState`.

Epochs, micro-batches through ``run_train_step``, optimizer-step boundaries (logging, validation, checkpoints, stop
checks), the end of training, and the two ways the fit state crosses a checkpoint: `FitLoop.save_checkpoint` (what
`torchloom.save_checkpoint` calls) and `FitLoop.resume`. The hooks get a frozen `torchloom.Progress`, built from
the state once per micro-batch and once per optimizer step.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import torch
from accelerate.data_loader import get_sampler
from accelerate.utils import find_batch_size

from torchloom._accelerator import note_run_failed
from torchloom._batch_limits import limited
from torchloom._context import RunContext, activate
from torchloom._evaluation import validation_pass
from torchloom._fit_state import FitState
from torchloom._guards import (
    NEGATIVE_ITEMS,
    EmptyMicroBatches,
    check_same_length,
    check_step_outputs,
    check_training,
    stop_iteration,
)
from torchloom._logbuffer import WEIGHT_PREFIX
from torchloom._schedule import after_epoch, after_validation
from torchloom._setup import log_data_values, sanity_check
from torchloom._warn import warn
from torchloom.checkpoint.async_save import PendingCheckpoint, start_async_save
from torchloom.checkpoint.data_position import data_order, position, resume_point
from torchloom.checkpoint.fetch_states import Watch, resume_source
from torchloom.checkpoint.lineage import Resumed, read_resumed, training_record, write_resumed
from torchloom.checkpoint.random_states import set_random_states
from torchloom.checkpoint.store import SaveRequest, load_checkpoint, write_checkpoint
from torchloom.errors import ConfigError, RunFileError
from torchloom.rundir.layout import CHECKPOINTS_DIR
from torchloom.rundir.runfiles import finish_fit
from torchloom.step import StepHooks

__all__ = ["FitLoop", "Start", "data_generators"]


class Start(NamedTuple):
    """Where a fit starts: the epoch, the batches of it to skip, and for a resume the random states to restore once
    the epoch's loader has started and the data generators' states as that epoch started."""

    epoch: int = 0
    skip: int = 0
    random_states: dict[str, Any] | None = None
    generators: dict[str, torch.Tensor] | None = None
    fetch_states: dict[str, Any] | None = (
        None  # before the look-ahead fetch (`torchloom.checkpoint.fetch_states.Watch`)
    )


class FitLoop:
    """Trains ``task`` on a prepared ``run`` (see `torchloom._setup.Run`) by the engine's ``config``.

    Attributes:
        state (`FitState`): the fit's counters and positions; only this object writes them.
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
        # (epoch, batches done in it, epoch finished) while a checkpoint may be saved, else None
        self._save_point: tuple[int, int, bool] | None = None
        self._watch = Watch()  # the epoch's states before the look-ahead fetch, for a checkpoint
        self._last_saved: tuple[int, str] | None = None  # (global_step, path) of this fit's latest checkpoint
        self._batch_start = run.relay.hook("on_train_batch_start")  # call lists: skipped while empty
        self._batch_end = run.relay.hook("on_train_batch_end")
        self._in_flight: PendingCheckpoint | None = None  # an asynchronous save not yet complete (at most one)
        self.skipped_saves: list[int] = []  # steps whose checkpoint was not written: non-finite state (skip / ignore)
        #: A failure of ``on_fit_end`` itself, after a fit that succeeded (the engine raises it after ``teardown``).
        self.cleanup_failure: BaseException | None = None

    # ------------------------------------------------------------------------------------------ training

    def fit(self, start: Start) -> None:
        """The fit from ``start``: ``on_fit_start``, the sanity pass, the epochs, the end of training, the saved model
        and ``latest`` link; ``on_exception`` if any of it raises; ``on_fit_end`` always (a failure of its own is
        kept in `cleanup_failure` for the engine to raise after ``teardown``)."""
        run, end = self.run, self._end_args()
        error: BaseException | None = None
        try:
            with activate(self.context):
                begin = {"optimizer": run.optimizer, "scheduler": run.scheduler, "log": self.logs.log}
                start_args = {"progress": self.state.progress(), "resumed": self.resumed}
                run.relay.call("on_fit_start", **end, **begin, **start_args)
                log_data_values(run.datamodule, self.logs)
                sanity_check(self.task, run, self.config.num_sanity_val_steps, self.logs)
                self.train(start)
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

    def train(self, start: Start) -> None:
        """The epochs from ``start``, until ``max_epochs``, ``max_steps`` or a stop agreed over the processes."""
        skip, rng, generators, fetch = start.skip, start.random_states, start.generators, start.fetch_states
        self._train_start = time.perf_counter()
        for epoch in range(start.epoch, self.config.max_epochs):
            if self.config.max_steps is not None and self.state.global_step >= self.config.max_steps:
                break  # a resumed fit that had finished
            if self._epoch(epoch, skip, rng, generators, fetch):
                break
            skip, rng, generators, fetch = 0, None, None, None

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

    def _epoch(
        self, epoch: int, skip: int, rng: Any, generators: dict[str, torch.Tensor] | None, fetch: Any = None
    ) -> bool:
        """Train one epoch (validating at the configured interval); return whether to stop. ``skip``: batches of
        the epoch a resumed checkpoint already trained on; ``rng``: the random states to restore once the epoch's
        loader has started; ``generators``: the data generators' states as that epoch started; ``fetch``: the
        states before the look-ahead fetch after the checkpoint (`torchloom.checkpoint.fetch_states`; all for a
        resume)."""
        run, state, relay = self.run, self.state, self.run.relay
        loader = run.train_dataloader
        check_same_length(run.agreement, loader, "training")
        if hasattr(loader, "set_epoch"):  # the epoch's own shuffle (seed + epoch), also in a resumed fit
            loader.set_epoch(epoch)
        found = data_generators(loader)
        for name, saved in (generators or {}).items():  # what the loader draws as it starts: as the saved run drew it
            if name in found:
                found[name].set_state(saved)
        state.epoch_generators = {name: generator.get_state() for name, generator in found.items()}
        if rng is not None and skip == 0:
            set_random_states(rng)
            rng = None
        state.epoch, state.batch_idx = epoch, skip
        relay.call("on_train_epoch_start", accelerator=run.accelerator, progress=state.progress())
        done, batches, limit = False, 0, run.train_batches
        # A resume skips by index; the data's draws from the global generators are restored in its sampler, or
        # it starts the loader again and fetches one batch more (`again`), untrained
        # (`torchloom.checkpoint.fetch_states`).
        self._watch = watch = Watch(full=bool(fetch and not fetch["first"] and "python" in fetch["states"]))
        source, again, restoring = (
            resume_source(run.accelerator, loader, skip, fetch, rng) if skip else (loader, 0, None)
        )
        fresh = restoring is None and not (skip and not again)  # the loader starts from the epoch's start
        if fresh:
            watch.before_first()
        # Under a batch limit (limit_train_batches, overfit_batches, fast_dev_run) the epoch ends after its
        # last batch, which ends an open accumulation window with an optimizer step, as a whole epoch's last does.
        for batch_idx, batch in enumerate(limited(source, limit, skip - again, end_of_data=True), skip - again):
            if fresh:  # did the loader's first call (its first two fetches) move Python's or numpy's state?
                watch.after_first()
                fresh = False
            if rng is not None:  # as they were when the checkpoint was saved: starting the loader drew from them
                if restoring is None or not restoring.applied:
                    set_random_states(rng)
                if again:  # the batch the checkpoint trained: fetched again only for its draws, not trained
                    rng, again = None, 0
                    watch.before_next()
                    continue
                watch.continued(rng)
                rng = None
            batches, state.batch_idx = batches + 1, batch_idx
            if self._micro_batch(batch):
                stop_iteration(source)
                done = True
                break
            watch.before_next()
        if batches == 0 and skip == 0:
            raise ConfigError(f"fit: the training dataloader yielded no batches in epoch {epoch}; nothing was trained")
        if rng is not None:  # a checkpoint of the epoch's last step: nothing left to train in it
            set_random_states(rng)
        if self.config.val_check_interval is None:
            self.validate()
        after_epoch(run.scheduler)  # an epoch-interval schedule, before an epoch-end checkpoint saves it
        self._save_point = (epoch, skip + batches, not done)
        try:
            relay.call("on_train_epoch_end", accelerator=run.accelerator, progress=state.progress(), log=self.logs.log)
        finally:
            self._save_point = None
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
            self._save_point = (state.epoch, state.batch_idx + 1, False)
            try:
                run.relay.call("on_train_step_end", accelerator=run.accelerator, progress=state.progress())
            finally:
                self._save_point = None
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
        if self._save_point is None:
            raise RuntimeError(
                "save_checkpoint() must be called from on_train_step_end or on_train_epoch_end, where no "
                "accumulation window is open and the data position is known"
            )
        run, state = self.run, self.state
        epoch, batches_done, finished = self._save_point
        if directory is None:
            last = self._last_saved
            self.settle_save()  # at most one save in flight: a save waits for the previous one
            if not finished and last is not None and last[0] == state.global_step and os.path.isdir(last[1]):
                # An epoch cut short (max_steps, a stop) ends where its last step's checkpoint was saved: the
                # same position and weights, and the same name; nothing was trained since, so that one is it.
                return PendingCheckpoint(last[1]) if asynchronous else last[1]
            name = f"step-{state.global_step:08d}" + ("-epoch-end" if finished else "")
            directory = os.path.join(run.run_dir, CHECKPOINTS_DIR, name)
        order = data_order(run.train_dataloader, run.accelerator.num_processes, run.train_batches)
        # This process's data generators as the epoch to resume in starts: this one's, or (at its end) the next's.
        generators = (
            {name: g.get_state() for name, g in data_generators(run.train_dataloader).items()}
            if finished
            else dict(state.epoch_generators)
        )
        self.settle_save()
        request = SaveRequest(
            accelerator=run.accelerator,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            plugins=self.plugins,
            engine_state={**state.state_dict(), "position": position(epoch, batches_done, finished, order)},
            metrics=self.logs.latest,
            agreement=run.agreement,
            training=self._training(),
            nonfinite_loss=self.config.nonfinite_loss,
            skipped=self.skipped_saves,
            process_state={
                **state.process_state_dict(),
                "epoch_generators": generators,
                "fetch_random_states": None if finished else self._watch.state_dict(),
                "log_buffer": self.logs.train.state_dict(),
            },
        )
        path = (start_async_save if asynchronous else write_checkpoint)(directory, request)
        if path is None:  # the state is not finite: nothing written (nonfinite_loss "skip" / "ignore": warned)
            return None
        if isinstance(path, PendingCheckpoint):
            self._in_flight = path
            self._last_saved = (state.global_step, path.path)
        else:
            self._last_saved = (state.global_step, path)
        return path

    def _training(self) -> dict[str, Any]:
        """The whole training up to now, as a checkpoint's manifest records it (`training_record`)."""
        now, acc = time.perf_counter(), self.run.accelerator
        trained = 0.0 if self._train_start is None else max(now - self._train_start - self._val_time, 0.0)
        samples = None if self._samples is None else self._samples * acc.num_processes
        return training_record(self.resumed, len(self.logs.history), samples, trained, now - self._started)

    def resume(self, path: str, reset_optimizer: bool) -> Start:
        """Load the checkpoint at ``path`` into the prepared run and this loop's state; return where to start.

        Also reads what the fit continues (`resumed`: the chain of runs, their records up to the checkpoint, the
        whole training's totals) and, on the main process, writes its records at the top of this run's
        ``metrics.jsonl`` and the chain to ``resumed_from.json`` (`torchloom.checkpoint.lineage`).

        Raises:
            CheckpointError: the checkpoint cannot continue this run (see `torchloom.checkpoint.store.load_checkpoint`).
            RunFileError: on every process, when the main process cannot write those files.
        """
        run = self.run
        order = data_order(run.train_dataloader, run.accelerator.num_processes, run.train_batches)
        saved, manifest = load_checkpoint(
            path,
            accelerator=run.accelerator,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            plugins=self.plugins,
            reset_optimizer=reset_optimizer,
            data=order,
        )
        if reset_optimizer and run.accelerator.is_main_process:
            warn(
                f"resuming from {path!r} with reset_optimizer=True: the optimizer starts with fresh state",
            )
        self.state.load_state_dict(saved)
        self.logs.train.load_state_dict(saved["log_buffer"], run.accelerator.device)
        sampler, seed = get_sampler(run.train_dataloader), saved["position"]["order"]["sampler_seed"]
        if seed is not None and hasattr(sampler, "initial_seed"):
            sampler.initial_seed = seed  # every later epoch is drawn as the checkpoint's run drew it
        epoch, skip = resume_point(saved["position"], order)
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
        return Start(epoch, skip, saved["random_states"], saved["epoch_generators"], saved.get("fetch_random_states"))


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


def data_generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators the training loader draws from as an epoch starts, each once, by name: the shuffling
    sampler's (Accelerate's ``synchronized_generator``: ``DataLoader(shuffle=True, generator=...)`` when ``seed`` is
    ``None``), the DataLoader's own (its workers' base seed), and torch's global one (a sampler without a generator
    seeds itself from it; so does the base seed then). A checkpoint keeps their states as its epoch started, so
    that the resumed epoch draws its order again exactly before the random states are restored."""
    found: dict[str, torch.Generator] = {}
    for name, generator in (
        ("sampler", getattr(loader, "synchronized_generator", None)),
        ("dataloader", getattr(loader, "generator", None)),
        ("torch", torch.default_generator),
    ):
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found.values()):
            found[name] = generator
    return found
