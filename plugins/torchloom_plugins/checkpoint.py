"""Checkpoints on a schedule, the last and the best kept, and a checkpoint before a preempted job exits.

Method card
-----------
- **What:** save everything a fit needs to continue exactly (`torchloom.save_checkpoint`: the model, the optimizer,
  the scheduler, the fp16 loss scaler, every process's random states, the data position, the engine's counters and
  every stateful plugin's ``state_dict``) every ``every_n_steps`` optimizer steps and / or every ``every_n_epochs``
  epochs, into ``<run_dir>/checkpoints/``; keep the ``keep_last`` most recent, plus the ``keep_best`` best by a
  monitored logged value, and with ``keep_across_runs`` at most that many of the most recent over all the runs of
  the ``output_dir`` (`torchloom.prune_checkpoints`), as the HF Trainer's ``save_total_limit`` bounds an
  ``output_dir``; on SIGTERM (what SLURM and Kubernetes send before they stop a job) or Ctrl-C, save at the
  next optimizer-step boundary on every process and stop with `torchloom.TrainingInterrupted`, which the
  ``torchloom`` command turns into exit status 128 + the signal (143, 130). ``torchloom fit --resume`` continues;
  ``--resume auto`` continues when there is a checkpoint and starts fresh otherwise, so a scheduler restarts the
  job with the same command line. ``keep_last`` counts the training, not the run: a resumed fit also deletes the
  checkpoints of the runs it continues (in its ``output_dir``) beyond the newest ``keep_last``
  (`torchloom.prune_lineage`; the one it resumed from once training ends), so a job preempted any number of times
  keeps ``keep_last`` in all, one more while a resumed fit runs. Under SLURM (``SLURM_JOB_ID`` set), ``requeue``
  queues the job again after the save on a signal (``scontrol requeue $SLURM_JOB_ID``, main process), and every
  fit records the job and its restart counter (``SLURM_RESTART_COUNT``) in ``<run_dir>/slurm.json``.
- **Hooks:** ``setup`` notes a ``fast_dev_run`` (the engine's ``config.is_fast_dev_run``), in which the plugin
  saves nothing and installs no signal handler; ``on_run_start`` notes the ``output_dir``; ``on_fit_start`` notes
  the checkpoint a resumed fit continues (never deleted while it trains) and the runs it continues, records
  the SLURM job (main process) and installs the signal handlers (main thread); ``on_log`` records the monitored
  value;
  ``on_train_step_end`` saves on the step schedule and acts on an interrupt; ``on_train_epoch_end`` saves on the
  epoch schedule; ``on_train_end`` completes a save in flight (``async_save``) and marks the fit completed (and,
  in a resumed fit, bounds the earlier runs' checkpoints by ``keep_last``, the one resumed from included) and
  ``on_fit_end`` warns (main process) when ``monitor`` was never logged or no save came at a step where it was
  logged (`torchloom.Monitor`, which also warns when the plugin is made if ``mode`` reads wrong for the name);
  ``teardown`` puts the previous signal handlers back.
- **Processes:** every process calls `torchloom.save_checkpoint` at the same step (a schedule of steps and epochs is
  the same everywhere). A signal reaches the processes at different moments, so the flag is agreed over them
  (`torchloom.RankAgreement.max_later`: a max all-reduce on the run's CPU group), started without waiting at each
  optimizer step and read at the next one: no step waits for it, and every process sees the same answer one step
  after the signal. Only the main process
  deletes old checkpoints; with ``keep_across_runs`` and several processes it tells the others which (one gather
  per save).
- **Atomic:** a checkpoint is complete or absent (see `torchloom.checkpoint.store`); old ones are deleted only after
  a new one is complete, each by a rename out of sight first, so a kill at any moment leaves the newest complete
  checkpoint loadable. ``keep_across_runs`` deletes nothing of a run that another process is still running (its
  run directory is marked in use while its fit runs). Retention counts complete checkpoints only (a failed save,
  or one gone since, is not counted), so the newest complete one is never deleted. ``keep_best`` ranks the
  training: in a resumed fit, the checkpoints of the runs it continues by the score each was saved with, with its
  own.
- **Finite:** `torchloom.save_checkpoint` checks the weights, the optimizer state and the plugins' states first
  (one fused flag, one all-reduce): a non-finite state stops the fit (``nonfinite_loss="error"``) or is skipped
  with a warning and returns ``None`` (``"skip"`` / ``"ignore"``), which the plugin neither records nor counts.
- **Background:** with ``async_save`` the state is copied to host memory at the save step and written by a
  thread (`torchloom.save_checkpoint_async`); the manifest, the rename and the retention come at the next save or
  at the end of training, at most one save in flight.
- **Sources:** Lightning's ``ModelCheckpoint`` (``every_n_train_steps``, ``every_n_epochs``, ``save_top_k`` with
  ``monitor`` / ``mode``, ``save_last``) and its SIGTERM handling and auto-requeue for SLURM
  (``SLURMEnvironment(auto_requeue=True)``: ``scontrol requeue``); the HF Trainer's ``save_steps`` /
  ``save_total_limit``; Accelerate's ``save_state``.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

import torchloom

__all__ = ["Checkpoint", "CheckpointConfig"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Accelerate's distributed types whose checkpoints cannot be written in the background (sharded saves).
ASYNC_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")
#: What a fit under SLURM writes into its run directory: the job id and its restart counter.
SLURM_FILE = "slurm.json"
#: The file that makes a checkpoint directory complete (`torchloom.checkpoint.store`: written last, then one rename).
MANIFEST = "manifest.json"


@dataclass
class CheckpointConfig:
    """Settings of the ``checkpoint`` plugin.

    Args:
        every_n_steps (`int`, *optional*): save after every this many optimizer steps; ``None``: not by steps.
        every_n_epochs (`int`, *optional*, defaults to 1): save at the end of every this many epochs (after the
            epoch's validation); ``None``: not by epochs.
        keep_last (`int`, *optional*, defaults to 2): how many of the most recent checkpoints of the training to
            keep: of the run, and of a resumed fit's earlier runs in the ``output_dir`` (those it continues) too, the
            checkpoint it resumed from only once training ends; ``None`` keeps them all.
        monitor (`str`, *optional*): a logged value (``val/loss``, ``val/auroc``) that ranks the checkpoints; its
            latest value when a checkpoint is saved is the checkpoint's score.
        mode (`str`, defaults to ``"min"``): ``"min"`` or ``"max"``: whether a lower or a higher ``monitor`` is
            better.
        keep_best (`int`, defaults to 1): with ``monitor``, also keep this many best-scoring checkpoints of the
            training: a resumed fit ranks those of the runs it continues, by the score each was saved with, with its
            own.
        keep_across_runs (`int`, *optional*): keep at most this many checkpoints over all the run directories of
            the ``output_dir`` (every ``version_N``): after each save, delete the oldest beyond the most recent
            ``keep_across_runs``, in earlier runs too, except the checkpoint the fit resumed from, the ``keep_best``
            best by ``monitor`` (in this fit, and over the runs by the value each checkpoint recorded), and those
            of a run still running in another process. ``None`` (the default) leaves other runs' checkpoints
            alone.
        save_on_interrupt (`bool`, defaults to True): on SIGTERM or SIGINT (Ctrl-C) during a fit, save at the next
            optimizer step and stop with `torchloom.TrainingInterrupted`; a second Ctrl-C stops at once.
        async_save (`bool`, defaults to False): save in the background (`torchloom.save_checkpoint_async`): the
            state is copied once to host memory at the save step (memory: one copy of the model, optimizer and
            plugin states), then written by a thread while training goes on; the manifest and the rename come at
            the next save or at the end of training. At most one save is in flight (a save waits for the one
            before); ``keep_last`` / ``keep_best`` count a checkpoint once it is complete; the save on SIGTERM is
            synchronous. One process or DDP only (not FSDP / DeepSpeed).
        requeue (`bool`, defaults to False): under SLURM (``SLURM_JOB_ID`` set), after the save on a signal, queue
            the job again with ``scontrol requeue $SLURM_JOB_ID`` (main process; a failure warns): the job restarts
            with its command line, which ``torchloom fit --resume auto`` makes a resume. Outside SLURM: a warning.
            Under SLURM, every process of a fit stopped this way ignores SIGTERM from then on: SLURM ends the job
            it requeued with a SIGTERM of its own, which would otherwise kill the process before it reports the
            interruption (exit status 143) or returns; the job is ended anyway (SIGKILL after SLURM's
            ``KillWait``).

    Raises:
        ConfigError: a count below 1 (``keep_across_runs`` included), no schedule at all, an unknown ``mode``,
            ``keep_best`` without ``monitor``, an empty ``monitor``.
    """

    every_n_steps: int | None = None  # save every this many optimizer steps (None: not by steps)
    every_n_epochs: int | None = 1  # save at the end of every this many epochs (None: not by epochs)
    keep_last: int | None = 2  # keep the most recent ones (None: all)
    monitor: str | None = None  # a logged value that ranks the checkpoints
    mode: str = "min"  # min or max: which direction of monitor is better
    keep_best: int = 1  # with monitor: also keep this many best ones
    keep_across_runs: int | None = None  # at most this many over all the runs of output_dir (None: no bound)
    save_on_interrupt: bool = True  # SIGTERM / Ctrl-C: save at the next optimizer step, then stop
    async_save: bool = False  # copy the state at the save step, write it in a background thread
    requeue: bool = False  # under SLURM: scontrol requeue the job after the save on a signal

    def __post_init__(self) -> None:
        for setting in ("every_n_steps", "every_n_epochs", "keep_last", "keep_across_runs"):
            value = getattr(self, setting)
            if value is not None and value < 1:
                raise torchloom.ConfigError(f"setting {setting!r} = {value!r}; expected an integer >= 1 or null")
        if self.every_n_steps is None and self.every_n_epochs is None and not self.save_on_interrupt:
            raise torchloom.ConfigError(
                "settings every_n_steps and every_n_epochs are both null and save_on_interrupt is false: the plugin "
                "would never save; set one of them"
            )
        if self.mode not in torchloom.Monitor.MODES:
            raise torchloom.ConfigError(
                f"setting 'mode' = {self.mode!r}; expected one of {', '.join(torchloom.Monitor.MODES)}"
            )
        if self.requeue and not self.save_on_interrupt:
            raise torchloom.ConfigError(
                "setting 'requeue' = true needs save_on_interrupt = true (the job is requeued after the save on a "
                "signal); set save_on_interrupt: true or requeue: false"
            )
        if self.keep_best < 1:
            raise torchloom.ConfigError(f"setting 'keep_best' = {self.keep_best!r}; expected an integer >= 1")
        if self.monitor is not None and not self.monitor:
            raise torchloom.ConfigError("setting 'monitor' = ''; expected a logged name such as 'val/loss', or null")


class Checkpoint(torchloom.Plugin):
    """Save checkpoints on a schedule and before a preempted fit exits; keep the last and the best.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(
            val_check_interval=500,
            plugins={"checkpoint": {"every_n_steps": 500, "keep_last": 2, "monitor": "val/loss"}},
        )
        engine.fit(task)  # killed? engine.fit(task, ckpt_path=engine.config.output_dir) continues it

    Attributes:
        saved (`list[str]`): the checkpoints this plugin wrote in the current fit and still keeps, oldest first.
        scores (`dict[str, float]`): checkpoint -> the ``monitor`` value it was saved with.
        resumed_from (`str` or ``None``): the checkpoint the current fit resumed from (never deleted while it
            trains; at its end, when ``keep_last`` newer ones exist).
    """

    name = "checkpoint"
    Config = CheckpointConfig
    capabilities = frozenset({"outside_sweeps"})  # a throw-away sweep writes no checkpoints

    def __init__(self, config: CheckpointConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.saved: list[str] = []
        self.scores: dict[str, float] = {}
        self.resumed_from: str | None = None
        self._resumed: Any = None  # the torchloom.Resumed of a resumed fit: the runs it continues
        self._run_dir: str | None = None
        self._output_dir: str | None = None  # the run's output_dir (on_run_start)
        self._value: float | None = None  # the latest monitored value
        # the monitored name: logged or not, fresh at the saves or not (warns here if the mode reads wrong)
        monitor, mode = self.config.monitor, self.config.mode
        self._monitor = None if monitor is None else torchloom.Monitor(self.name, monitor, mode)
        # what each checkpoint's manifest records, and ckpt_path="best" picks by (torchloom.Plugin)
        self.checkpoint_ranking = None if monitor is None else (monitor, mode)
        self._completed = False  # on_train_end fired in this fit
        self._signal: int | None = None  # the first signal received in this fit
        self._previous_handlers: dict[int, Any] = {}
        self._requeued = False  # this fit stopped on a signal with requeue set: SIGTERM is ignored after it
        self._pending: Any = None  # the interrupt flag's agreement started at the last step (several processes)
        self._off = False  # a fast_dev_run (the engine's is_fast_dev_run, at setup): nothing is saved
        self._max_epochs: int | None = None  # the engine's max_epochs (at setup)
        # async_save: the checkpoint in flight, with the step and the monitored value it was saved with
        self._in_flight: tuple[torchloom.PendingCheckpoint, int, float | None] | None = None
        self._accelerator: Any = None  # the fit's (on_fit_start), for a save still in flight at teardown
        # a resumed fit: the score each checkpoint of the runs it continues was saved with, ranked with its own
        self._lineage_scores: dict[str, float] = {}
        self._main = True  # the fit's main process (on_fit_start): the one that sees and deletes the checkpoints
        if self.config.every_n_steps is None and not self.config.save_on_interrupt:  # saves at epoch ends only
            self.inactive_hooks = frozenset({"on_train_step_end"})

    # ----------------------------------------------------------------------------------------------- fit

    @torchloom.hookimpl
    def setup(self, config) -> None:
        self._off = bool(getattr(config, "is_fast_dev_run", False))
        self._max_epochs = getattr(config, "max_epochs", None)

    @torchloom.hookimpl
    def on_run_start(self, run_dir: str) -> None:
        self._run_dir, self._output_dir = run_dir, os.path.dirname(run_dir)  # <output_dir>/version_N

    @torchloom.hookimpl
    def on_fit_start(self, accelerator, resumed, task, progress) -> None:
        self.saved, self.scores, self._value, self._signal, self._pending = [], {}, None, None, None
        self._in_flight, self._accelerator = None, accelerator
        self._main = bool(accelerator.is_main_process)
        self.resumed_from = None if resumed is None else resumed.checkpoint
        self._resumed = resumed
        self._lineage_scores = {}
        if resumed is not None and self.config.monitor is not None:  # the whole training's scores and latest value
            self._lineage_scores = resumed.scores(self.config.monitor, self._output_dir)
            for _, _, values in resumed.logged():
                if self.config.monitor in values:
                    self._value = float(values[self.config.monitor])
        self._completed = False
        kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
        if self.config.async_save and kind in ASYNC_UNSUPPORTED:  # refused before anything is written
            raise torchloom.ConfigError(
                f"setting 'async_save' = true: a run with {kind} saves its shards with collectives of its own, "
                "which a background save cannot run; set async_save: false"
            )
        if not self._off and accelerator.is_main_process:
            self._warn_if_never_saved(task.num_training_steps, progress)
        if not self._off and accelerator.is_main_process and os.environ.get("SLURM_JOB_ID"):
            self._record_slurm_job()
        if self._monitor is not None:
            self._monitor.start()
        if self._off or not self.config.save_on_interrupt:  # a fast_dev_run: Ctrl-C stops it as any program
            return
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread
            for number in SIGNALS:
                self._previous_handlers[number] = signal.signal(number, self._on_signal)

    def _warn_if_never_saved(self, total: int | None, progress: Any) -> None:
        """Warn once when neither schedule saves in this fit (whose last optimizer step is ``total``): ``every_n_steps``
        beyond its steps and ``every_n_epochs`` beyond ``max_epochs`` (a fit that ``max_steps`` ends earlier is not
        counted as shorter: no warning that could be wrong)."""
        steps, epochs = self.config.every_n_steps, self.config.every_n_epochs
        max_epochs = self._max_epochs
        if total is None or total <= progress.global_step or max_epochs is None:
            return
        if steps is None and epochs is None:  # saves on a signal only, as configured: nothing unexpected
            return
        if (steps is not None and total // steps > progress.global_step // steps) or (
            epochs is not None and max_epochs // epochs > progress.epoch // epochs
        ):
            return
        schedules = [
            f"every_n_steps = {steps} (this fit ends at optimizer step {total})" if steps is not None else "",
            f"every_n_epochs = {epochs} (it ends after epoch {max_epochs})" if epochs is not None else "",
        ]
        torchloom.utils.warn(
            f"checkpoint: no checkpoint will be saved in this fit: {' and '.join(s for s in schedules if s)}; only a "
            "stop by a signal would save one. Lower every_n_steps or every_n_epochs, or train longer",
        )

    def _on_signal(self, number: int, frame: Any) -> None:
        if self._signal is not None and number == signal.SIGINT:  # a second Ctrl-C: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self._signal = number

    @torchloom.hookimpl
    def on_log(self, metrics: dict[str, float], progress) -> None:
        if self._monitor is not None:
            value = self._monitor.observe(metrics, progress.global_step)
            if value is not None:
                self._value = value

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator, progress) -> None:
        if self._off:
            return
        interrupted = self._interrupt(accelerator)
        steps = self.config.every_n_steps
        if interrupted is not None or (steps is not None and progress.global_step % steps == 0):
            path = self._save(accelerator, progress.global_step, wait=interrupted is not None)
            if interrupted is not None:
                if self.config.requeue:
                    self._requeued = bool(os.environ.get("SLURM_JOB_ID"))  # only SLURM sends the SIGTERM to ignore
                    if accelerator.is_main_process:
                        self._requeue()
                raise torchloom.TrainingInterrupted(interrupted, path, progress.global_step)

    @torchloom.hookimpl
    def on_train_epoch_end(self, accelerator, progress) -> None:
        epochs = self.config.every_n_epochs
        if not self._off and epochs is not None and (progress.epoch + 1) % epochs == 0:
            self._save(accelerator, progress.global_step)

    @torchloom.hookimpl
    def on_train_end(self, accelerator) -> None:
        self._settle(accelerator)  # the end of training waits for the save in flight
        self._completed = True
        if accelerator.is_main_process:  # training is over: the checkpoint resumed from may go now
            self._bound_lineage(spare_resumed=False)

    @torchloom.hookimpl
    def on_fit_end(self, accelerator) -> None:
        monitor, completed, self._completed = self._monitor, self._completed, False
        if monitor is None or not completed or self._off or not accelerator.is_main_process:
            return
        if monitor.warn_if_never_logged("no checkpoint was ranked by it and none was kept as the best"):
            return
        saves = [step for step, _ in monitor.uses]
        if saves and not any(fresh for _, fresh in monitor.uses):
            torchloom.utils.warn(
                f"checkpoint: monitor {monitor.name!r} was logged at {monitor.describe_steps(monitor.steps)}, but "
                f"none of the {len(saves)} checkpoints of this fit (at {monitor.describe_steps(saves)}) was saved at "
                "a step where it was logged: each one's score is a value of earlier weights, or none, and keep_best "
                f"ranks them by it. Save where {monitor.name!r} is logged: every_n_steps a multiple of "
                "val_check_interval (or of log_every_n_steps for a training value), or every_n_epochs with "
                "validation at the end of each epoch",
            )

    @torchloom.hookimpl
    def teardown(self) -> None:
        self._after_failure()
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers.clear()
        if self._requeued:  # SLURM ends the job it requeued with a SIGTERM: it must not cut the report short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._requeued = False
        self._pending = None  # a fit that failed on one process: never wait for the others here

    # ----------------------------------------------------------------------------------------- internals

    def _interrupt(self, accelerator) -> int | None:
        """The signal to act on at this step, the same on every process; ``None`` if there is none. The flag's
        agreement (`torchloom.RankAgreement.max_later`) is started at each step and read at the next one, by when
        it has long finished: no step waits for it."""
        if not self.config.save_on_interrupt:
            return None
        if accelerator.num_processes == 1:
            return self._signal
        agreed = self._pending.result() or None if self._pending is not None else None
        self._pending = torchloom.rank_agreement().max_later(self._signal or 0)
        return agreed

    def _save(self, accelerator, step: int, wait: bool = False) -> str | None:
        """Save now (``wait``, or without ``async_save``) or start a background save; the bookkeeping of a
        checkpoint (``saved``, ``scores``, retention) comes once it is complete. ``None``: nothing was written (the
        state was not finite, under the engine's ``nonfinite_loss`` ``"skip"`` / ``"ignore"``): no retention."""
        self._settle(accelerator)  # at most one in flight: the previous one is complete first
        if self.config.async_save and not wait:
            pending = torchloom.save_checkpoint_async()
            if pending is None:  # non-finite state, skipped (nonfinite_loss "skip" / "ignore"): nothing to count
                return None
            self._use(step)
            self._in_flight = (pending, step, self._value)
            return pending.path
        path = torchloom.save_checkpoint()
        if path is None:
            return None
        self._use(step)
        self._record(accelerator, path, self._value)
        return path

    def _use(self, step: int) -> None:
        if self._monitor is not None:
            self._monitor.use(step)  # whether this checkpoint's score was logged at its own step

    def _after_failure(self) -> None:
        """A fit that failed with a save in flight: the engine completed it (one process) or discarded it (several);
        a completed one is kept and counted as any other (on one process: no collective)."""
        in_flight, accelerator, self._in_flight = self._in_flight, self._accelerator, None
        if in_flight is None or accelerator is None or accelerator.num_processes > 1 or not in_flight[0].settled:
            return
        try:
            path = in_flight[0].result()
        except Exception:  # failed or discarded: the engine warned
            return
        try:
            self._record(accelerator, path, in_flight[2])
        except Exception as exc:  # a deletion failed: the fit's own error stays the one raised
            torchloom.utils.warn(f"checkpoint: after the fit failed, keeping {path!r}: {exc}")

    def _settle(self, accelerator) -> None:
        """Wait for the save in flight (every process, at the same point) and keep it as a complete checkpoint."""
        if self._in_flight is None:
            return
        (pending, _, value), self._in_flight = self._in_flight, None
        self._record(accelerator, pending.result(), value)

    def _record(self, accelerator, path: str, value: float | None) -> None:
        """A complete checkpoint: kept as the newest, scored, and the expired ones deleted."""
        if path in self.saved:  # an epoch cut short at a step just saved: the same checkpoint, kept once
            self.saved.remove(path)
        self.saved.append(path)
        if value is not None and not math.isnan(value):
            self.scores[path] = value
        expired = self._expired()  # the main process deletes; the others only forget them
        self.saved = [p for p in self.saved if p not in expired]
        if accelerator.is_main_process:
            for old in expired:
                if self._complete(old):  # else deleted already (by another run's keep_across_runs, by hand)
                    torchloom.delete_checkpoint(old)
        if accelerator.is_main_process:
            self._bound_lineage(spare_resumed=True)
        if self.config.keep_across_runs is not None:
            self._bound_across_runs(accelerator)

    def _bound_lineage(self, spare_resumed: bool) -> None:
        """``keep_last`` over the training (main process): delete the checkpoints of the runs a resumed fit
        continues, in this ``output_dir``, beyond the newest ``keep_last`` counted with this fit's (none while it has
        saved none); the checkpoint it resumed from only once training has ended (``spare_resumed`` false)."""
        if self._resumed is None or self.config.keep_last is None or self._off or not self.saved:
            return  # a fit that saved nothing (resumed at the end of training, say) leaves the earlier runs alone
        spare = [*self._best(), *([self.resumed_from] if spare_resumed and self.resumed_from else [])]
        torchloom.prune_lineage(
            self._resumed, self.config.keep_last, self.saved, output_dir=self._output_dir, spare=spare
        )

    def _record_slurm_job(self) -> None:
        """``<run_dir>/slurm.json``: the SLURM job this fit runs in and how often it was restarted (requeued)."""
        if self._run_dir is None:
            return
        environ = os.environ
        try:
            restarts = int(environ.get("SLURM_RESTART_COUNT") or 0)
        except ValueError:
            restarts = 0
        record = {
            "job_id": environ["SLURM_JOB_ID"],
            "restart_count": restarts,
            "array_job_id": environ.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": environ.get("SLURM_ARRAY_TASK_ID"),
            "node": environ.get("SLURMD_NODENAME"),
            "resumed_from": self.resumed_from,
        }
        torchloom.utils.write_atomically(
            os.path.join(self._run_dir, SLURM_FILE), torchloom.utils.json_dumps(record, indent=1) + "\n"
        )

    def _requeue(self) -> None:
        """``scontrol requeue $SLURM_JOB_ID`` after the save on a signal (main process); warns when it cannot."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            torchloom.utils.warn(
                "checkpoint: requeue is set but SLURM_JOB_ID is not: not a SLURM job, nothing requeued"
            )
            return
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            torchloom.utils.warn(f"checkpoint: cannot requeue SLURM job {job}: no 'scontrol' on PATH")
            return
        try:
            done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            torchloom.utils.warn(f"checkpoint: cannot requeue SLURM job {job}: scontrol requeue {job}: {exc}")
            return
        if done.returncode != 0:
            why = " ".join((done.stderr or done.stdout).split()) or f"exit status {done.returncode}"
            torchloom.utils.warn(f"checkpoint: cannot requeue SLURM job {job}: scontrol requeue {job}: {why}")
            return
        print(f"checkpoint: requeued SLURM job {job} (scontrol requeue {job})", flush=True)

    def _bound_across_runs(self, accelerator) -> None:
        """``keep_across_runs``: the main process deletes the oldest checkpoints of the ``output_dir``'s runs
        beyond the bound (sparing the one resumed from and the best kept) and tells the others which."""
        deleted: list[str] | None = None
        if accelerator.is_main_process:
            assert self._output_dir is not None  # on_run_start came first
            spare = [p for p in (self.resumed_from, *self._best()) if p is not None]
            deleted = torchloom.prune_checkpoints(
                self._output_dir,
                self.config.keep_across_runs,
                spare=spare,
                monitor=self.config.monitor,
                mode=self.config.mode,
                keep_best=self.config.keep_best,
            )
        if accelerator.num_processes > 1:
            deleted = torchloom.rank_agreement().first(deleted)  # the main process's list, on every process
        gone = {os.path.realpath(p) for p in deleted or ()}
        self.saved = [p for p in self.saved if os.path.realpath(p) not in gone]
        self.scores = {p: v for p, v in self.scores.items() if os.path.realpath(p) not in gone}

    def _best(self) -> list[str]:
        """The training's ``keep_best`` best checkpoints by ``monitor`` (none without one): this fit's, ranked with
        those of the runs a resumed fit continues by the score each was saved with (Lightning's ``ModelCheckpoint``
        restores its best scores on a resume the same way), an earlier one first on a tie."""
        if self.config.monitor is None:
            return []
        lineage = {p: v for p, v in self._lineage_scores.items() if p not in self.scores}
        scores = {p: v for p, v in {**lineage, **self.scores}.items() if self._complete(p)}
        ranked = sorted(scores, key=scores.__getitem__, reverse=self.config.mode == "max")
        return ranked[: self.config.keep_best]

    def _complete(self, path: str) -> bool:
        """Whether ``path`` is a complete checkpoint (it has its manifest), as the main process sees it: retention
        counts and deletes only those, so the newest complete checkpoint is never deleted for one that is gone or
        was never complete. The other processes delete nothing and count every checkpoint (no file-system read,
        which may differ between nodes, decides anything there)."""
        return not self._main or os.path.isfile(os.path.join(path, MANIFEST))

    def _expired(self) -> list[str]:
        """The checkpoints of this fit that neither the last ``keep_last`` complete ones nor the best ``keep_best``
        include (those no longer complete, deleted by hand, are forgotten)."""
        keep_last = self.config.keep_last
        alive = [p for p in self.saved if self._complete(p)]
        keep = set(alive if keep_last is None else alive[-keep_last:]) | set(self._best())
        expired = [p for p in self.saved if p not in keep]
        for path in expired:
            self.scores.pop(path, None)
        return expired
