"""`Engine`: runs fit / validate / predict over one Accelerator and calls the hooks.

The engine knows no technique by name: techniques are plugins. Set-up lives in ``_setup``, the Accelerator and
process group in ``_accelerator``, logged values in ``_logging``, run files in ``_runfiles``, checks in ``_guards``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import get_sampler
from accelerate.utils import gather_object

from torchloom._accelerator import build_accelerator, note_run_failed
from torchloom._data_position import data_order, position, resume_point
from torchloom._default_plugins import with_default_plugins
from torchloom._default_step import DefaultTrainStep
from torchloom._guards import (
    NEGATIVE_ITEMS,
    TrainingChecks,
    check_same_length,
    check_step_outputs,
    eval_mode,
    stop_iteration,
)
from torchloom._logbuffer import WEIGHT_PREFIX
from torchloom._logging import RunLog
from torchloom._padding import batch_size, real_rows, real_rows_in_metrics, take_rows
from torchloom._runfiles import (
    MetricsFile,
    config_dict,
    create_run_dir,
    discard_run_dir,
    finish_fit,
    write_predictions,
)
from torchloom._setup import Run, engine_relay, prepare_run, reuse_run, sanity_check
from torchloom.checkpoint import (
    CHECKPOINTS_DIR,
    active_saver,
    find_checkpoint,
    load_checkpoint,
    set_random_states,
    write_checkpoint,
)
from torchloom.config import EngineConfig
from torchloom.data.module import DataModule
from torchloom.errors import ConfigError
from torchloom.hookspecs import HOOK_NAMES
from torchloom.module import TaskModule
from torchloom.plugins import PluginSpec, enable_plugins, plugin_name
from torchloom.progress import Progress
from torchloom.step import StepHooks

__all__ = ["Engine"]


class Engine:
    """Runs a `TaskModule` with plugins over one `accelerate.Accelerator`.

    Args:
        config (`EngineConfig`, *optional*): the loop settings; or pass them as keyword arguments.
        plugins (*optional*): the plugins to enable, in order: ``{"name": {settings}, ...}``, or a list of
            names, plugin objects and ``{"name": {settings}}`` entries. Only these are imported, and the default
            plugins (``progress``) that the list does not name: name one with its settings to change or switch it
            off (``{"progress": {"enabled": False}}``).
        default_plugins (`bool`, defaults to True): also enable the default plugins (as the ``torchloom``
            command does); False enables exactly ``plugins``.
        **settings: `EngineConfig` fields (``max_epochs=3, output_dir="runs/x"``).

    Raises:
        ConfigError: an unknown or bad engine or plugin setting.
        PluginError: an unknown, failing, duplicate or conflicting plugin.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(max_epochs=2, plugins={"grad_accum": {"steps": 4}})
        engine.fit(MyTask(), train_dataloader=train_dl, val_dataloader=val_dl)
        print(engine.history[-1])

    Attributes:
        progress (`Progress`): the counters of the last run.
        history (`list[dict]`): every reduction of logged values in the last run (``step``, ``epoch``, names);
            the same list on every rank.
        logged_metrics (`dict[str, float]`): the latest value of every logged name.
        stop_reason (`str` or ``None``): why the last fit stopped before ``max_epochs`` / ``max_steps``, when a
            plugin or the task asked it to (`torchloom.request_stop`); ``None`` otherwise.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        plugins: PluginSpec = None,
        default_plugins: bool = True,
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise ConfigError("Engine: pass either config=EngineConfig(...) or keyword settings, not both")
        self.config = config if config is not None else EngineConfig.from_settings(settings)
        self.plugins = enable_plugins(with_default_plugins(plugins) if default_plugins else plugins)
        #: The resolved run configuration written to ``config.yaml`` (the CLI sets the full one).
        self.run_config: dict[str, Any] | None = None
        self.progress = Progress()
        self.logs = RunLog()
        self.history, self.logged_metrics = self.logs.history, self.logs.latest  # the same objects, kept up to date
        self._run: Run | None = None
        self._step_hooks: StepHooks | None = None
        self._default_step = DefaultTrainStep()
        self._metrics_file = MetricsFile()
        self._checks = TrainingChecks(self.config.nonfinite_loss)
        self.stop_reason: str | None = None
        self._validated_at = -1  # the global_step of the last validation of this fit
        #: The checkpoint the last fit resumed from (``fit(..., ckpt_path=...)``), ``None`` for a fresh fit.
        self.resumed_from: str | None = None
        #: The weights the last ``predict(..., ckpt_path=...)`` loaded, ``(kind, path)`` with kind ``"checkpoint"`` or
        #: ``"model"``; ``None`` without ``ckpt_path``.
        self.weights_from: tuple[str, str] | None = None
        # The data position while a checkpoint may be saved (on_train_step_end / on_train_epoch_end), else None.
        self._position: dict[str, Any] | None = None
        # The states of the data generators (`_data_generators`) at the start of the current epoch, and those a
        # resumed checkpoint gives the first epoch it trains.
        self._epoch_generators: dict[str, torch.Tensor] = {}
        self._resumed_generators: dict[str, torch.Tensor] | None = None

    @property
    def accelerator(self) -> Accelerator | None:
        """The Accelerator of the last run (``None`` before the first)."""
        return self._run.accelerator if self._run is not None else None

    @property
    def run_dir(self) -> str | None:
        """The directory of the last ``fit`` / ``validate`` / ``predict`` call, ``<output_dir>/version_N``."""
        return self._run.run_dir if self._run is not None else None

    # -------------------------------------------------------------------------------------------- fit

    def fit(
        self,
        task: TaskModule,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        reset_optimizer: bool = False,
    ) -> dict[str, float]:
        """Train ``task``; validate at the configured interval; return the latest logged values.

        Args:
            task (`TaskModule`): what to train.
            train_dataloader (`torch.utils.data.DataLoader`, *optional*): else the datamodule's or task's.
            val_dataloader (`torch.utils.data.DataLoader`, *optional*): else the datamodule's or task's.
            datamodule (`DataModule`, *optional*): prepared once per machine, then set up on every process.
            ckpt_path (`str` or `os.PathLike`, *optional*): resume from this checkpoint (see
                `torchloom.checkpoint.find_checkpoint`: a checkpoint, a run directory or an ``output_dir``, whose
                latest checkpoint is taken). The model, optimizer, scheduler, loss scaler, random states, plugin
                states, counters and data position are restored; the fit goes on from the next batch, in a new run
                directory, exactly as if it had never stopped.
            reset_optimizer (`bool`, defaults to False): with ``ckpt_path``, start the optimizer with fresh state
                (required when its class changed; a warning says so).

        Raises:
            ConfigError: missing or empty training data, validation data without ``validation_step``, a bad setting.
            TaskError: untrainable returns, a non-finite loss (``nonfinite_loss="error"``), ranks that disagree.
            PluginError: a plugin failed, returned something invalid, or two plugins answered one set-up hook.
            CheckpointError: ``ckpt_path`` names no complete checkpoint, or one that this run cannot continue.
        """
        resume_path = find_checkpoint(ckpt_path) if ckpt_path is not None else None
        run = self._start(task, "fit", datamodule, train_dataloader=train_dataloader, val_dataloader=val_dataloader)
        relay, acc, model = run.relay, run.accelerator, run.model
        self.progress, self._checks = Progress(), TrainingChecks(self.config.nonfinite_loss)
        self.stop_reason, self._validated_at, self.resumed_from = None, -1, resume_path
        self._resumed_generators = None  # a resume sets them (nothing left from a fit that failed early)
        first_epoch, skip, rng, counters = (
            self._resume(run, resume_path, reset_optimizer) if resume_path else (0, 0, None, None)
        )
        end = {"accelerator": acc, "task": task, "model": model}
        error: BaseException | None = None
        try:
            with self.logs.active(), active_saver(lambda directory: self._save_checkpoint(run, directory)):
                start = {"optimizer": run.optimizer, "scheduler": run.scheduler, "log": self.logs.log}
                relay.call("on_fit_start", **end, **start, progress=self.progress)
                if counters:  # after on_fit_start, which starts the default step's counters at 0
                    self._default_step.skipped_steps, self._default_step.scaler_skipped_steps = counters
                sanity_check(task, run, self.config.num_sanity_val_steps, self.logs)
                max_steps = self.config.max_steps
                for epoch in range(first_epoch, self.config.max_epochs):
                    if max_steps is not None and self.progress.global_step >= max_steps:  # a resumed finished fit
                        break
                    if self._train_epoch(task, run, epoch, skip, rng):
                        break
                    skip, rng = 0, None
                self._log_training(run)
                relay.call("on_train_end", **end, progress=self.progress, log=self.logs.log)
                self._log_training(run)
                if self._validated_at != self.progress.global_step:  # the returned metrics describe the saved model
                    self._validate(task, run)
                finish_fit(task, run, self.config)  # the model (save_model: true), then the latest link
                acc.wait_for_everyone()  # no process reports success before every process has finished
        except BaseException as exc:
            error = exc
            note_run_failed()
            relay.call_cleanup("on_exception", error, exception=exc, accelerator=acc, progress=self.progress)
            raise
        finally:
            failure = relay.call_cleanup("on_fit_end", error, **end, progress=self.progress)
            self._end(run, "fit", error, failure)
        return dict(self.logs.latest)

    def _train_epoch(self, task: TaskModule, run: Run, epoch: int, skip: int = 0, rng: Any = None) -> bool:
        """Train one epoch (validating at the configured interval); return whether to stop (``max_steps``, a stop
        request). ``skip``: batches of the epoch a resumed checkpoint already trained on; ``rng``: the random
        states to restore once the epoch's data loader has started (a resume)."""
        relay, acc, loader = run.relay, run.accelerator, run.train_dataloader
        batch_start, batch_end = relay.implemented("on_train_batch_start"), relay.implemented("on_train_batch_end")
        check_same_length(acc, loader, "training")
        if hasattr(loader, "set_epoch"):  # the epoch's own shuffle (seed + epoch), also in a resumed fit
            loader.set_epoch(epoch)
        generators = _data_generators(loader)
        if self._resumed_generators is not None:  # what the loader draws as it starts: as the checkpoint's run drew it
            for name, state in self._resumed_generators.items():
                if name in generators:
                    generators[name].set_state(state)
            self._resumed_generators = None
        self._epoch_generators = {name: generator.get_state() for name, generator in generators.items()}
        if rng is not None and skip == 0:
            set_random_states(rng)
            rng = None
        p = self.progress = Progress(epoch, self.progress.global_step, skip, self.progress.micro_step)
        relay.call("on_train_epoch_start", accelerator=acc, progress=p)
        done, batches = False, 0
        for batch_idx, batch in enumerate(acc.skip_first_batches(loader, skip) if skip else loader, start=skip):
            if rng is not None:  # as they were when the checkpoint was saved: starting the loader drew from them
                set_random_states(rng)
                rng = None
            batches += 1
            p = self.progress = Progress(epoch, p.global_step, batch_idx, p.micro_step)
            if batch_start:
                relay.call("on_train_batch_start", batch=batch, accelerator=acc, progress=p)
            outputs = self._train_step(task, run, batch, p)
            if batch_end:
                relay.call(
                    "on_train_batch_end", outputs=outputs, batch=batch, accelerator=acc, progress=p, log=self.logs.log
                )
            p = self.progress = dataclasses.replace(p, micro_step=p.micro_step + 1)
            if acc.sync_gradients and self._step_boundary(task, run):  # not inside an accumulation window
                stop_iteration(loader)
                done = True
                break
            p = self.progress
        if batches == 0 and skip == 0:
            raise ConfigError(f"fit: the training dataloader yielded no batches in epoch {epoch}; nothing was trained")
        if rng is not None:  # a checkpoint of the epoch's last step: nothing left to train in it
            set_random_states(rng)
        if self.config.val_check_interval is None:
            self._validate(task, run)
        self._position = {"epoch": epoch, "batches_done": skip + batches, "epoch_finished": not done}
        try:
            relay.call("on_train_epoch_end", accelerator=acc, progress=self.progress, log=self.logs.log)
        finally:
            self._position = None
        return self._stop_requested(run) or done

    def _train_step(self, task: TaskModule, run: Run, batch: Any, progress: Progress) -> dict[str, Any]:
        """One micro-batch through ``run_train_step``; buffer its loss for logging (no host-device sync)."""
        outputs = run.relay.call(
            "run_train_step",
            task=task,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            accelerator=run.accelerator,
            batch=batch,
            progress=progress,
            hooks=self._step_hooks,
        )
        if not isinstance(outputs, dict) or "loss" not in outputs:
            check_step_outputs(outputs, run.relay.wrappers("run_train_step"))  # raises
        loss, items = outputs["loss"], outputs.get("num_items", 1.0)
        if self.config.nonfinite_loss == "skip":  # the skipped micro-batches do not count in train/loss
            finite = torch.isfinite(loss)
            loss, items = torch.where(finite, loss, 0.0), finite.to(loss.dtype) * items
        self.logs.train.log("train/loss", loss, items)  # kept on the device, folded at the logging interval
        if isinstance(items, torch.Tensor):  # its sign is checked at the logging interval, on the device
            self.logs.train.log(NEGATIVE_ITEMS, (items < 0).to(torch.float32))
        return outputs

    def _step_boundary(self, task: TaskModule, run: Run) -> bool:
        """After an optimizer step: count it, log and validate at their intervals; return whether to stop."""
        cfg = self.config
        p = self.progress = dataclasses.replace(self.progress, global_step=self.progress.global_step + 1)
        logged = p.global_step % cfg.log_every_n_steps == 0
        if logged:
            self._log_training(run)
        if cfg.val_check_interval and p.global_step % cfg.val_check_interval == 0:
            self._validate(task, run)
            logged = True
        if run.relay.implemented("on_train_step_end"):
            self._position = {"epoch": p.epoch, "batches_done": p.batch_idx + 1, "epoch_finished": False}
            try:
                run.relay.call("on_train_step_end", accelerator=run.accelerator, progress=p)
            finally:
                self._position = None
        if logged and self._stop_requested(run):
            return True
        return cfg.max_steps is not None and p.global_step >= cfg.max_steps

    def _stop_requested(self, run: Run) -> bool:
        """Whether any rank asked to stop (`torchloom.request_stop`): the same answer on every rank, which all
        call this at the same points (one small object gather with several processes)."""
        reasons = [self.logs.stop_reason]
        if run.accelerator.num_processes > 1:
            reasons = gather_object(reasons)
        self.stop_reason = next((r for r in reasons if r is not None), None)
        return self.stop_reason is not None

    def _log_training(self, run: Run) -> None:
        """Reduce the training values (every rank), send them to ``on_log``, and check them (`TrainingChecks`)."""
        metrics, internal = self._reduce(run, self.logs.train, weights=("train/loss",))
        skips = self._default_step.scaler_skipped_steps
        # train/loss is weighted by num_items: its summed weight is the items trained on (0: none at all)
        negative, items = internal.get(NEGATIVE_ITEMS, 0.0), internal.get(WEIGHT_PREFIX + "train/loss")
        self._checks.check(metrics.get("train/loss"), negative, self.progress, skips, items)

    # ---------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, run: Run, directory: str | None) -> str:
        """`torchloom.save_checkpoint` during this fit: the engine's state next to the run's and the plugins'."""
        if self._position is None:
            raise RuntimeError(
                "save_checkpoint() must be called from on_train_step_end or on_train_epoch_end, where no "
                "accumulation window is open and the data position is known"
            )
        p = self.progress
        if directory is None:
            name = f"step-{p.global_step:08d}" + ("-epoch-end" if self._position["epoch_finished"] else "")
            directory = os.path.join(run.run_dir, CHECKPOINTS_DIR, name)
        order = data_order(run.train_dataloader, run.accelerator.num_processes)
        state = {
            "progress": dataclasses.asdict(p),
            "position": position(**self._position, order=order),
            "validated_at": self._validated_at,
            "checks": {"checked_step": self._checks.checked_step, "scaler_skips": self._checks.scaler_skips},
            "default_step": [self._default_step.skipped_steps, self._default_step.scaler_skipped_steps],
        }
        # This process's data generators as the epoch to resume in starts: this one's, or (at its end) the next's.
        generators = (
            {name: g.get_state() for name, g in _data_generators(run.train_dataloader).items()}
            if self._position["epoch_finished"]
            else dict(self._epoch_generators)
        )
        return write_checkpoint(
            directory,
            accelerator=run.accelerator,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            plugins=self.plugins,
            engine_state=state,
            metrics=self.logs.latest,
            process_state={"log_buffer": self.logs.train.state_dict(), "data_generators": generators},
        )

    def _resume(self, run: Run, path: str, reset_optimizer: bool) -> tuple[int, int, Any, tuple[int, int]]:
        """Load the checkpoint at ``path`` into the prepared run; return ``(epoch, batches to skip in it, random
        states to restore once its loader started, the default step's counters)``. Part of the set-up: a refused
        checkpoint removes the run directory and fires ``teardown`` (nothing was trained)."""
        try:
            return self._load_checkpoint(run, path, reset_optimizer)
        except BaseException as exc:
            note_run_failed()
            discard_run_dir(run.run_dir, run.accelerator)
            self._end(run, "fit", exc)
            raise

    def _load_checkpoint(self, run: Run, path: str, reset_optimizer: bool) -> tuple[int, int, Any, tuple[int, int]]:
        order = data_order(run.train_dataloader, run.accelerator.num_processes)
        state, _ = load_checkpoint(
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
            warnings.warn(
                f"resuming from {path!r} with reset_optimizer=True: the optimizer starts with fresh state",
                UserWarning,
                stacklevel=4,
            )
        rng = state["random_states"]  # as load_checkpoint restored them
        self.progress = Progress(**state["progress"])
        self._validated_at = state["validated_at"]
        self._checks.checked_step, self._checks.scaler_skips = (
            state["checks"]["checked_step"],
            state["checks"]["scaler_skips"],
        )
        self.logs.train.load_state_dict(state["log_buffer"], run.accelerator.device)
        sampler, saved_seed = get_sampler(run.train_dataloader), state["position"]["order"]["sampler_seed"]
        if saved_seed is not None and hasattr(sampler, "initial_seed"):
            sampler.initial_seed = saved_seed  # every later epoch is drawn as the checkpoint's run drew it
        self._resumed_generators = state.get("data_generators")
        epoch, skip = resume_point(state["position"], order)
        return epoch, skip, rng, tuple(state["default_step"])

    # --------------------------------------------------------------------------------- validate / predict

    def validate(
        self, task: TaskModule, dataloader: Any = None, datamodule: DataModule | None = None
    ) -> dict[str, float]:
        """Run one validation pass and return the values logged during it (reduced over ranks).

        Reuses the model of the last ``fit`` of the same task; otherwise builds and prepares it.

        Raises:
            ConfigError: no validation data, or a task without ``validation_step``.
        """
        run = self._start(task, "validate", datamodule, val_dataloader=dataloader)
        self.logs.val.clear()  # only what this validation logs
        with self._stage(run, "validate"), self.logs.active():
            return self._validate(task, run)

    def predict(
        self,
        task: TaskModule,
        dataloader: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """Run `TaskModule.predict_step` over the data; return this rank's outputs, one per batch.

        The model is in eval mode during prediction; every module gets its own mode back afterwards. With several
        processes each sample is predicted once: the copies Accelerate pads the last batch with are cut off the
        outputs of ``predict_step`` (a process whose share is only copies drops its output). The outputs are
        also written to ``<run_dir>/predictions.jsonl``, one JSON line per sample (see the user guide).

        Args:
            task (`TaskModule`): what to predict with; its model is built by ``configure_model`` (or is the last
                fit's, for the same task without a datamodule).
            dataloader (`torch.utils.data.DataLoader`, *optional*): else the datamodule's or task's
                ``predict_dataloader``.
            datamodule (`DataModule`, *optional*): prepared once per machine, then set up on every process.
            ckpt_path (`str` or `os.PathLike`, *optional*): load these weights into the model first (after
                ``setup`` and before ``on_predict_start``): a checkpoint directory (its model weights; its files
                are checked against its manifest first), an exported model (what `TaskModule.save_model` or
                ``save_pretrained`` writes, or a ``.safetensors`` file; loaded with `TaskModule.load_model`), a run
                directory (its ``model/`` when the fit saved one, else its latest checkpoint), or an ``output_dir``
                (its latest checkpoint). Only safetensors are read. ``weights_from`` then holds what was loaded.

        Raises:
            ConfigError: no prediction data; ``ckpt_path`` does not exist, an exported model whose weight files are
                not safetensors or are damaged (named before anything loads), or one that does not fit.
            CheckpointError: ``ckpt_path`` holds no weights (the message says what it may name), a checkpoint
                changed since it was written, or weights that do not fit the model (keys or shapes).
        """
        from torchloom._export import load_weights, resolve_weights

        weights = resolve_weights(ckpt_path) if ckpt_path is not None else None  # before a run directory exists
        #: The weights the last ``predict`` loaded (``(kind, path)``: ``"checkpoint"`` or ``"model"``), else None.
        self.weights_from = weights
        run = self._start(task, "predict", datamodule, predict_dataloader=dataloader)
        relay, acc = run.relay, run.accelerator
        predictions: list[Any] = []
        with self._stage(run, "predict"), self.logs.active(), eval_mode(run.model), torch.no_grad():
            if weights is not None:
                try:
                    load_weights(acc.unwrap_model(run.model), *weights)
                except BaseException:
                    discard_run_dir(run.run_dir, acc)  # nothing was predicted: a failed set-up leaves no directory
                    raise
            relay.call("on_predict_start", task=task, model=run.model, accelerator=acc)
            for batch_idx, batch in enumerate(run.predict_dataloader):
                outputs = task.predict_step(batch, batch_idx)
                rows = real_rows(run.predict_dataloader, acc)  # the outputs lose Accelerate's padding copies
                if rows == 0:  # only copies on this process
                    continue
                if rows is not None and (size := batch_size(batch)) is not None:
                    outputs, batch = take_rows(outputs, rows, size), take_rows(batch, rows, size)
                if relay.implemented("on_predict_batch_end"):
                    relay.call("on_predict_batch_end", outputs=outputs, batch=batch, accelerator=acc)
                predictions.append(outputs)
            relay.call("on_predict_end", predictions=predictions, accelerator=acc)
            write_predictions(run.run_dir, predictions, acc)
        return predictions

    def _validate(self, task: TaskModule, run: Run) -> dict[str, float]:
        if run.val_dataloader is None:
            return {}
        relay, acc, model, p = run.relay, run.accelerator, run.model, self.progress
        check_same_length(acc, run.val_dataloader, "validation")
        self._validated_at = p.global_step
        loader, batch_end = run.val_dataloader, relay.implemented("on_validation_batch_end")
        with eval_mode(model), self.logs.validating():  # every module gets its own mode back afterwards
            relay.call("on_validation_start", task=task, model=model, accelerator=acc, progress=p)
            with torch.no_grad():
                for batch_idx, batch in enumerate(loader):
                    rows = real_rows(loader, acc)  # Accelerate's padding copies are cut off: each sample counts once
                    size = batch_size(batch) if rows is not None else None
                    if rows is None or size is None or rows == size:
                        outputs = task.validation_step(batch, batch_idx)
                    else:  # the whole batch (gather_for_metrics works), but the task's metrics get the real rows
                        with real_rows_in_metrics(task, rows, size, self.logs.val.fail):
                            outputs = task.validation_step(batch, batch_idx)
                    if batch_end and rows != 0:
                        if rows is not None and size is not None:
                            outputs, batch = take_rows(outputs, rows, size), take_rows(batch, rows, size)
                        relay.call("on_validation_batch_end", outputs=outputs, batch=batch, accelerator=acc, progress=p)
            relay.call("on_validation_end", task=task, model=model, accelerator=acc, progress=p, log=self.logs.log)
        return self._reduce(run, self.logs.val)[0]

    # ------------------------------------------------------------------------------------ run lifetime

    def _start(self, task: TaskModule, stage: str, datamodule: Any, **loaders: Any) -> Run:
        """Fire ``setup``, create this call's run directory, and build the run, or reuse the last fit's model
        (``validate`` / ``predict`` of the same task without a datamodule). A failure after ``setup`` removes the
        run directory and fires ``teardown`` before it propagates."""
        cfg, run = self.config, self._run
        if stage == "fit" or run is None or getattr(task, "model", None) is not run.model or datamodule is not None:
            run, self._default_step = None, DefaultTrainStep(skip_nonfinite=cfg.nonfinite_loss == "skip")
            relay = engine_relay(self.plugins, self._default_step, self._metrics_file)
            self._step_hooks = StepHooks(relay, self.logs.log)
            self.logs.clear()  # nothing logged by an earlier (failed) run leaks into this one
        else:
            relay = run.relay
        relay.call("setup", config=cfg, stage=stage)
        accelerator, run_dir = (run.accelerator if run is not None else None), None
        try:
            accelerator = accelerator or build_accelerator(relay, cfg)
            run_dir = create_run_dir(cfg.output_dir, accelerator)  # before any data or model is built
            self._metrics_file.start(os.path.join(run_dir, "metrics.jsonl"))
            project = accelerator.project_configuration  # Accelerate's trackers write inside the run directory
            project.project_dir = project.logging_dir = run_dir
            config = self.run_config or {"engine": dataclasses.asdict(cfg), "plugins": self.resolved_plugin_settings()}
            if run is not None:
                run = reuse_run(run, task, stage, loaders, run_dir, config)
            else:
                run = prepare_run(task, stage, cfg, relay, accelerator, datamodule, loaders, config, run_dir)
                self._run = run
            relay.call("on_run_start", accelerator=accelerator, stage=stage, run_dir=run_dir, run_config=config)
            return run
        except BaseException as exc:
            note_run_failed()
            if accelerator is not None:
                discard_run_dir(run_dir, accelerator)
            relay.call_cleanup("teardown", exc, accelerator=accelerator, stage=stage)  # teardown always runs
            raise

    @contextmanager
    def _stage(self, run: Run, stage: str) -> Iterator[None]:
        """Run a ``validate`` / ``predict`` body, then ``teardown`` whatever happens."""
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._end(run, stage, error)

    def _end(self, run: Run, stage: str, error: BaseException | None, failure: BaseException | None = None) -> None:
        """Fire ``teardown``; raise a clean-up failure of a run that itself succeeded (``error`` is ``None``)."""
        failure = run.relay.call_cleanup("teardown", failure or error, accelerator=run.accelerator, stage=stage)
        if failure is not None and failure is not error:
            raise failure

    def _reduce(
        self, run: Run, buffer: Any, weights: tuple[str, ...] = ()
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Reduce a buffer over the ranks (every rank enters) and send what it holds to ``on_log``."""
        p = self.progress
        metrics, internal = self.logs.reduce(buffer, run.accelerator, p.global_step, p.epoch, weights)
        if metrics:
            run.relay.call("on_log", metrics=metrics, progress=p, accelerator=run.accelerator)
        return metrics, internal

    def hook_order(self) -> dict[str, list[str]]:
        """Every implemented hook -> the plugins implementing it, in the order a run of this engine calls them
        (the engine's own implementations, ``torchloom.default_step`` and ``torchloom.metrics_file``, included).
        Builds nothing and runs no hook."""
        relay = engine_relay(self.plugins, DefaultTrainStep(), MetricsFile())
        return {name: relay.call_order(name) for name in HOOK_NAMES if relay.implemented(name)}

    def resolved_plugin_settings(self) -> dict[str, Any]:
        """The enabled plugins in order, name -> every setting (defaults filled in), as written to config.yaml."""
        return {plugin_name(p): config_dict(getattr(p, "config", None)) for p in self.plugins}


def _data_generators(loader: Any) -> dict[str, torch.Generator]:
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
