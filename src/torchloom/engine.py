"""`Engine`: builds one Accelerator, runs fit / validate / predict and calls the hooks.

The engine knows no technique by name. Gradient accumulation, mixed precision, clipping and the rest are
plugins that contribute Accelerator settings, transform the model, or wrap ``run_train_step``.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DataLoaderConfiguration, set_seed, str_to_bool

from torchloom._default_step import DefaultTrainStep, MetricsFile
from torchloom._guards import (
    check_finite_parameters,
    check_model,
    check_optimizer_parameters,
    check_same_length,
    eval_mode,
    nonfinite_loss_error,
    optimizer_steps,
    split_optimizers,
    stop_iteration,
    train_mode_unless_chosen,
)
from torchloom._logbuffer import LogBuffer
from torchloom.config import EngineConfig
from torchloom.data.module import DataModule
from torchloom.errors import ConfigError, PluginError, TaskError
from torchloom.module import TaskModule
from torchloom.plugins import HookRelay, PluginSpec, enable_plugins, plugin_name
from torchloom.progress import Progress

__all__ = ["Engine"]

#: Internal log name: the share of micro-batches whose tensor ``num_items`` was negative (checked at each flush).
NEGATIVE_ITEMS = "torchloom/negative_num_items"


@dataclass
class _Run:
    """What one fit / validate / predict call built."""

    accelerator: Accelerator
    relay: HookRelay
    model: torch.nn.Module
    optimizer: Any = None
    scheduler: Any = None
    train_dataloader: Any = None
    val_dataloader: Any = None
    predict_dataloader: Any = None


class Engine:
    """Runs a `TaskModule` with plugins over one `accelerate.Accelerator`.

    Args:
        config (`EngineConfig`, *optional*): the loop settings; or pass them as keyword arguments.
        plugins (*optional*): the plugins to enable, in order: ``{"name": {settings}, ...}``, or a list of
            names, plugin objects and ``{"name": {settings}}`` entries. Only these are imported.
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
        history (`list[dict]`): every ``on_log`` record of the last run (``step``, ``epoch``, names).
        logged_metrics (`dict[str, float]`): the latest value of every logged name.
    """

    def __init__(self, config: EngineConfig | None = None, *, plugins: PluginSpec = None, **settings: Any) -> None:
        if config is not None and settings:
            raise ConfigError("Engine: pass either config=EngineConfig(...) or keyword settings, not both")
        if config is None:
            known = {f.name for f in dataclasses.fields(EngineConfig)}
            unknown = sorted(set(settings) - known)
            if unknown:
                raise ConfigError(f"unknown engine setting {unknown[0]!r}; valid settings: {', '.join(sorted(known))}")
            config = EngineConfig(**settings)
        self.config = config
        self.plugins = enable_plugins(plugins)
        #: The resolved run configuration written to ``config.yaml`` (the CLI sets the full one).
        self.run_config: dict[str, Any] | None = None
        self.progress = Progress()
        self.history: list[dict[str, Any]] = []
        self.logged_metrics: dict[str, float] = {}
        self._buffer = LogBuffer()
        self._run: _Run | None = None
        self._checked_step = 0  # the optimizer steps up to here were checked for a non-finite loss
        self._scaler_skips = 0  # fp16 loss-scaler skips up to _checked_step
        self._default_step: DefaultTrainStep | None = None

    @property
    def accelerator(self) -> Accelerator | None:
        """The Accelerator of the last run (``None`` before the first)."""
        return self._run.accelerator if self._run is not None else None

    # -------------------------------------------------------------------------------------------- fit

    def fit(
        self,
        task: TaskModule,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        datamodule: DataModule | None = None,
    ) -> dict[str, float]:
        """Train ``task``; validate at the configured interval; return the latest logged values.

        Args:
            task (`TaskModule`): what to train.
            train_dataloader (`torch.utils.data.DataLoader`, *optional*): else the datamodule's or task's.
            val_dataloader (`torch.utils.data.DataLoader`, *optional*): else the datamodule's or task's.
            datamodule (`DataModule`, *optional*): prepared on the main process first, then set up on all.

        Raises:
            ConfigError: no training data, a training dataloader without batches, validation data without a
                ``validation_step``, a ``val_check_interval`` beyond the run's optimizer steps.
            TaskError: the task returned something that cannot be trained on, the training loss became
                non-finite (``nonfinite_loss="error"``), or the processes iterate different numbers of batches.
            PluginError: a plugin failed, returned something invalid, or two plugins answered one set-up hook.
        """
        run = self._setup(task, "fit", datamodule, train_dataloader, val_dataloader)
        relay, acc, model = run.relay, run.accelerator, run.model
        self.progress, self._checked_step, self._scaler_skips = Progress(), 0, 0
        error: BaseException | None = None
        try:
            relay.call(
                "on_fit_start",
                accelerator=acc,
                task=task,
                model=model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                progress=self.progress,
                log=self._buffer.log,
            )
            self._sanity_check(task, run)
            for epoch in range(self.config.max_epochs):
                if self._train_epoch(task, run, epoch):
                    break
            self._flush(relay, acc)
            relay.call(
                "on_train_end", accelerator=acc, task=task, model=model, progress=self.progress, log=self._buffer.log
            )
            self._flush(relay, acc)
            self._save_model(task, run)
            acc.wait_for_everyone()  # no process reports success before every process has finished
        except BaseException as exc:
            error = exc
            _note_run_failed()
            self._cleanup(relay, "on_exception", error, exception=exc, accelerator=acc, progress=self.progress)
            raise
        finally:
            failure = self._cleanup(
                relay, "on_fit_end", error, accelerator=acc, task=task, model=model, progress=self.progress
            )
            failure = self._cleanup(relay, "teardown", failure, accelerator=acc, stage="fit")
            if failure is not error:
                raise failure  # a clean-up hook failed after a run that succeeded
        return dict(self.logged_metrics)

    def _train_epoch(self, task: TaskModule, run: _Run, epoch: int) -> bool:
        """Train one epoch (validating at the configured interval); return whether ``max_steps`` was reached."""
        cfg, relay, acc, loader = self.config, run.relay, run.accelerator, run.train_dataloader
        batch_start, batch_end = relay.implemented("on_train_batch_start"), relay.implemented("on_train_batch_end")
        check_same_length(acc, loader, "training")
        p = self.progress = Progress(epoch, self.progress.global_step, 0, self.progress.micro_step)
        relay.call("on_train_epoch_start", accelerator=acc, progress=p)
        done, batches = False, 0
        for batch_idx, batch in enumerate(loader):
            batches += 1
            p = self.progress = Progress(epoch, p.global_step, batch_idx, p.micro_step)
            if batch_start:
                relay.call("on_train_batch_start", batch=batch, accelerator=acc, progress=p)
            outputs = self._train_step(task, run, batch, p)
            if batch_end:
                relay.call(
                    "on_train_batch_end",
                    outputs=outputs,
                    batch=batch,
                    accelerator=acc,
                    progress=p,
                    log=self._buffer.log,
                )
            p = self.progress = dataclasses.replace(p, micro_step=p.micro_step + 1)
            if not acc.sync_gradients:
                continue  # inside an accumulation window: no optimizer step happened
            p = self.progress = dataclasses.replace(p, global_step=p.global_step + 1)
            if p.global_step % cfg.log_every_n_steps == 0:
                self._flush(relay, acc)
            if cfg.val_check_interval and p.global_step % cfg.val_check_interval == 0:
                self._validate(task, run)
            if cfg.max_steps is not None and p.global_step >= cfg.max_steps:
                stop_iteration(loader)
                done = True
                break
        if batches == 0:
            raise ConfigError(f"fit: the training dataloader yielded no batches in epoch {epoch}; nothing was trained")
        if cfg.val_check_interval is None:
            self._validate(task, run)
        relay.call("on_train_epoch_end", accelerator=acc, progress=p, log=self._buffer.log)
        return done

    def _train_step(self, task: TaskModule, run: _Run, batch: Any, progress: Progress) -> dict[str, Any]:
        """One micro-batch through ``run_train_step``; buffer its loss for logging (no host-device sync)."""
        relay = run.relay
        outputs = relay.call(
            "run_train_step",
            task=task,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            accelerator=run.accelerator,
            batch=batch,
            progress=progress,
        )
        if not isinstance(outputs, dict) or "loss" not in outputs:
            wrappers = relay.wrappers("run_train_step")
            who = f"plugin {wrappers[0]!r}" if len(wrappers) == 1 else f"one of the plugins {wrappers}"
            raise PluginError(
                f"run_train_step returned {type(outputs).__name__} instead of the step's outputs (a dict with "
                f"'loss'): {who} wraps run_train_step and must return the inner result, `return (yield)`"
            )
        loss, items = outputs["loss"], outputs.get("num_items", 1.0)
        if self.config.nonfinite_loss == "skip":  # the skipped micro-batches do not count in train/loss
            finite = torch.isfinite(loss)
            loss, items = torch.where(finite, loss, 0.0), finite * items
        self._buffer.log("train/loss", loss, items)
        if isinstance(items, torch.Tensor):  # its sign is checked at the logging interval, on the device
            self._buffer.log(NEGATIVE_ITEMS, items < 0)
        return outputs

    def _sanity_check(self, task: TaskModule, run: _Run) -> None:
        """Run ``validation_step`` on ``num_sanity_val_steps`` batches before training: nothing logged, no hooks,
        module modes and random state as they were (so the run trains exactly as without it)."""
        n, loader, acc = self.config.num_sanity_val_steps, run.val_dataloader, run.accelerator
        if n == 0 or loader is None:
            return
        check_same_length(acc, loader, "validation")
        devices = [acc.device.index or 0] if acc.device.type == "cuda" else []
        log_fn, task._log_fn = task._log_fn, LogBuffer().log  # logged values are checked, then dropped
        try:
            with eval_mode(run.model), torch.no_grad(), torch.random.fork_rng(devices=devices):
                for batch_idx, batch in zip(range(n), loader):
                    task.validation_step(batch, batch_idx)
        finally:
            stop_iteration(loader)
            task._log_fn = log_fn

    def _save_model(self, task: TaskModule, run: _Run) -> None:
        """``save_model: true``: write ``<output_dir>/model``, unless the weights are not finite."""
        if not self.config.save_model:
            return
        if self.config.nonfinite_loss != "ignore":
            check_finite_parameters(run.model.parameters(), run.accelerator, "it is not saved")
        task.save_model(os.path.join(self.config.output_dir, "model"))

    def _cleanup(self, relay: HookRelay, hook_name: str, error: BaseException | None, **kwargs: Any) -> Any:
        """Call every implementation of a clean-up hook, even after one raised; return the error in charge.

        With ``error`` (the run already failed), failures are attached to it as notes and it stays the one
        reported. Otherwise the first failure is returned (the later ones as its notes), for the caller to
        raise once every clean-up hook has run.
        """
        for failure in relay.call_all(hook_name, **kwargs):
            if error is None:
                error = failure
            elif hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"torchloom: during clean-up, hook {hook_name!r} also raised {failure!r}")
        return error

    # --------------------------------------------------------------------------------- validate / predict

    def validate(
        self, task: TaskModule, dataloader: Any = None, datamodule: DataModule | None = None
    ) -> dict[str, float]:
        """Run one validation pass and return the values logged during it (reduced over ranks).

        Reuses the model of the last ``fit`` of the same task; otherwise builds and prepares it.

        Raises:
            ConfigError: no validation data, or a task without ``validation_step``.
        """
        self._buffer.clear()  # only what this validation logs
        run = self._reuse_or_setup(task, "validate", datamodule, val_dataloader=dataloader)
        error: BaseException | None = None
        try:
            if run.val_dataloader is None:
                raise ConfigError(
                    "validate: no validation data (pass a dataloader, a datamodule, or define val_dataloader)"
                )
            _check_validation_step(task)
            return self._validate(task, run)
        except BaseException as exc:
            error = exc
            raise
        finally:
            failure = self._cleanup(run.relay, "teardown", error, accelerator=run.accelerator, stage="validate")
            if failure is not error:
                raise failure

    def predict(self, task: TaskModule, dataloader: Any = None, datamodule: DataModule | None = None) -> list[Any]:
        """Run `TaskModule.predict_step` over the data; return this rank's outputs, one per batch.

        The model is in eval mode during prediction; every module gets its own mode back afterwards.

        Raises:
            ConfigError: no prediction data.
        """
        run = self._reuse_or_setup(task, "predict", datamodule, predict_dataloader=dataloader)
        relay, acc = run.relay, run.accelerator
        predictions: list[Any] = []
        error: BaseException | None = None
        try:
            if run.predict_dataloader is None:
                raise ConfigError("predict: no data (pass a dataloader, a datamodule, or define predict_dataloader)")
            with eval_mode(run.model), torch.no_grad():
                relay.call("on_predict_start", task=task, model=run.model, accelerator=acc)
                for batch_idx, batch in enumerate(run.predict_dataloader):
                    outputs = task.predict_step(batch, batch_idx)
                    if relay.implemented("on_predict_batch_end"):
                        relay.call("on_predict_batch_end", outputs=outputs, batch=batch, accelerator=acc)
                    predictions.append(outputs)
                relay.call("on_predict_end", predictions=predictions, accelerator=acc)
        except BaseException as exc:
            error = exc
            raise
        finally:
            failure = self._cleanup(relay, "teardown", error, accelerator=acc, stage="predict")
            if failure is not error:
                raise failure
        return predictions

    # ---------------------------------------------------------------------------------------- internals

    def _validate(self, task: TaskModule, run: _Run) -> dict[str, float]:
        if run.val_dataloader is None:
            return {}
        relay, acc, model, p = run.relay, run.accelerator, run.model, self.progress
        check_same_length(acc, run.val_dataloader, "validation")
        with eval_mode(model):  # every submodule gets its own mode back (a frozen BatchNorm stays in eval)
            relay.call("on_validation_start", task=task, model=model, accelerator=acc, progress=p)
            with torch.no_grad():
                for batch_idx, batch in enumerate(run.val_dataloader):
                    outputs = task.validation_step(batch, batch_idx)
                    if relay.implemented("on_validation_batch_end"):
                        relay.call("on_validation_batch_end", outputs=outputs, batch=batch, accelerator=acc, progress=p)
            relay.call("on_validation_end", task=task, model=model, accelerator=acc, progress=p, log=self._buffer.log)
        return self._flush(relay, acc)

    def _flush(self, relay: HookRelay, accelerator: Accelerator) -> dict[str, float]:
        """Reduce the buffered values (one sync) and send them to ``on_log`` on the main process.

        Then check what was trained since the previous flush: a non-finite ``train/loss`` (with
        ``nonfinite_loss="error"``) or a negative ``num_items`` raises a `TaskError` on every rank (the values are
        reduced over the ranks, so every rank decides alike).
        """
        if not self._buffer:
            return {}
        metrics = self._buffer.reduce(accelerator)
        negative_items = metrics.pop(NEGATIVE_ITEMS, 0.0)
        self.logged_metrics.update(metrics)
        p = self.progress
        self.history.append({"step": p.global_step, "epoch": p.epoch, **metrics})
        if accelerator.is_main_process:
            relay.call("on_log", metrics=metrics, progress=p)
        first, self._checked_step = self._checked_step + 1, p.global_step
        skips = self._default_step.scaler_skipped_steps if self._default_step is not None else 0
        overflowed, self._scaler_skips = skips > self._scaler_skips, skips
        if negative_items > 0:
            raise TaskError(
                f"training_step returned a negative num_items in {optimizer_steps(first, p.global_step)}; "
                "num_items counts the items (samples, labelled tokens) its loss is a mean over: it must be >= 0"
            )
        loss = metrics.get("train/loss")
        # Under fp16, a non-finite loss also gives non-finite gradients, which the loss scaler skips (and lowers its
        # scale): an overflow it handles, not a failure.
        if loss is not None and self.config.nonfinite_loss == "error" and not math.isfinite(loss) and not overflowed:
            raise nonfinite_loss_error(loss, first, p.global_step, p.epoch)
        return metrics

    def _reuse_or_setup(self, task: TaskModule, stage: str, datamodule: Any, **loaders: Any) -> _Run:
        run = self._run
        if run is not None and getattr(task, "model", None) is run.model and datamodule is None:
            if stage == "validate":
                loader = loaders.get("val_dataloader")
                if loader is not None:  # else: the fit's validation data
                    run.val_dataloader = run.accelerator.prepare(loader)
            else:
                loader = loaders.get("predict_dataloader")
                loader = task.predict_dataloader() if loader is None else loader
                run.predict_dataloader = run.accelerator.prepare(loader) if loader is not None else None
            return run
        return self._setup(task, stage, datamodule, **loaders)

    def _setup(
        self,
        task: TaskModule,
        stage: str,
        datamodule: Any,
        train_dataloader: Any = None,
        val_dataloader: Any = None,
        predict_dataloader: Any = None,
    ) -> _Run:
        cfg = self.config
        default_step = self._default_step = DefaultTrainStep(skip_nonfinite=cfg.nonfinite_loss == "skip")
        metrics_file = MetricsFile(os.path.join(cfg.output_dir, "metrics.jsonl"))
        relay = HookRelay([*self.plugins, default_step, metrics_file])
        default_step.relay, default_step.log = relay, self._buffer.log
        accelerator = _build_accelerator(relay, cfg)
        self.history, self.logged_metrics = [], {}
        self._buffer.clear()  # nothing logged by an earlier (failed) run leaks into this one
        try:
            return self._prepare(
                task, stage, datamodule, relay, accelerator, train_dataloader, val_dataloader, predict_dataloader
            )
        except BaseException as exc:
            _note_run_failed()
            self._cleanup(relay, "teardown", exc, accelerator=accelerator, stage=stage)  # teardown always runs
            raise

    def _prepare(
        self,
        task: TaskModule,
        stage: str,
        datamodule: Any,
        relay: HookRelay,
        accelerator: Accelerator,
        train_dataloader: Any,
        val_dataloader: Any,
        predict_dataloader: Any,
    ) -> _Run:
        """Data, model, optimizer and ``accelerator.prepare``; ``config.yaml`` last (nothing half-written)."""
        cfg = self.config
        if cfg.seed is not None:
            set_seed(cfg.seed)

        if datamodule is not None:
            with accelerator.main_process_first():
                datamodule.prepare_data()
            datamodule.setup(stage)
        sources = [s for s in (datamodule, task) if s is not None]
        if stage == "fit":
            train_dataloader = _first(sources, "train_dataloader") if train_dataloader is None else train_dataloader
            if train_dataloader is None:
                raise ConfigError(
                    "fit: no training data (pass train_dataloader, a datamodule, or define train_dataloader)"
                )
            val_dataloader = _first(sources, "val_dataloader") if val_dataloader is None else val_dataloader
        elif stage == "validate":
            val_dataloader = _first(sources, "val_dataloader") if val_dataloader is None else val_dataloader
        else:
            predict_dataloader = (
                _first(sources, "predict_dataloader") if predict_dataloader is None else predict_dataloader
            )

        if stage == "fit" and _length(train_dataloader) == 0:
            raise ConfigError(
                "fit: the training dataloader has no batches (an empty dataset, or fewer samples than batch_size "
                "with drop_last=True); nothing would be trained"
            )
        if val_dataloader is not None:
            _check_validation_step(task)
        model = check_model(task.configure_model(), task)
        task.model, task.accelerator, task._log_fn = model, accelerator, self._buffer.log
        relay.call("configure_model", model=model, task=task, accelerator=accelerator)

        optimizer = scheduler = None
        if stage == "fit":
            train_mode_unless_chosen(model)
            task.num_training_steps = steps = _num_training_steps(cfg, train_dataloader, accelerator)
            if val_dataloader is not None and cfg.val_check_interval and steps and cfg.val_check_interval > steps:
                raise ConfigError(
                    f"engine setting 'val_check_interval': got {cfg.val_check_interval}, but this fit takes only "
                    f"{steps} optimizer steps, so validation would never run; use a value <= {steps}, or null to "
                    "validate at the end of each epoch"
                )
            optimizer, scheduler = self._configure_optimizers(task, model, relay, accelerator)
            check_optimizer_parameters(optimizer, model)
            model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
            # The scheduler is stepped by the default step once per real optimizer step, so it is not
            # prepared (Accelerate would step it num_processes times per call); it is still checkpointed.
            if scheduler is not None:
                accelerator.register_for_checkpointing(scheduler)
        else:
            model = accelerator.prepare(model)
        if val_dataloader is not None:
            val_dataloader = accelerator.prepare(val_dataloader)
        if predict_dataloader is not None:
            predict_dataloader = accelerator.prepare(predict_dataloader)
        task.model = model
        # Written last, so that a run that fails to start leaves nothing in output_dir; a fit starts a fresh
        # metrics.jsonl at the same moment, so config.yaml and metrics.jsonl always belong to one run.
        if accelerator.is_main_process and stage == "fit":
            _write_run_config(cfg.output_dir, self.run_config or self._default_run_config())
            open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w").close()
        self._run = _Run(
            accelerator, relay, model, optimizer, scheduler, train_dataloader, val_dataloader, predict_dataloader
        )
        return self._run

    def _configure_optimizers(
        self, task: TaskModule, model: torch.nn.Module, relay: HookRelay, accelerator: Accelerator
    ) -> tuple[torch.optim.Optimizer, Any]:
        """The optimizer and scheduler from the one plugin that answers ``configure_optimizers``, else the task.

        Raises:
            PluginError: two plugins answered (the first would silently win).
            TaskError: the answer is not an optimizer, ``(optimizer, scheduler)`` or a dict of them.
        """
        answers = [
            (name, spec)
            for name, spec in relay.call_each(
                "configure_optimizers",
                model=model,
                task=task,
                accelerator=accelerator,
                num_training_steps=task.num_training_steps,
            )
            if spec is not None
        ]
        if len(answers) > 1:
            raise PluginError(
                f"plugins {answers[0][0]!r} and {answers[1][0]!r} both answer configure_optimizers; enable one of "
                "them (each would build the optimizer)"
            )
        if answers:
            return split_optimizers(answers[0][1], f"plugin {answers[0][0]!r}: configure_optimizers")
        return split_optimizers(task.configure_optimizers(), f"{type(task).__name__}.configure_optimizers()")

    def resolved_plugin_settings(self) -> dict[str, Any]:
        """The enabled plugins in order, name -> every setting (defaults filled in), as written to config.yaml."""
        return {plugin_name(p): _config_dict(getattr(p, "config", None)) for p in self.plugins}

    def _default_run_config(self) -> dict[str, Any]:
        return {"engine": dataclasses.asdict(self.config), "plugins": self.resolved_plugin_settings()}


# -------------------------------------------------------------------------------------------- helpers


#: Accelerator arguments that are lists: fragments from several plugins are concatenated, not compared.
LIST_KWARGS = ("kwargs_handlers", "log_with")


def _build_accelerator(relay: HookRelay, config: EngineConfig) -> Accelerator:
    """Merge the plugins' Accelerator settings and build the Accelerator.

    Two plugins giving one key different values is a `PluginError` naming both; list-valued keys
    (`LIST_KWARGS`) are concatenated in plugin order.
    """
    kwargs: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for name, fragment in relay.call_each("configure_accelerator", config=config):
        if fragment is None:
            continue
        if not isinstance(fragment, Mapping):
            raise PluginError(f"plugin {name!r}: configure_accelerator returned {fragment!r}; expected a dict or None")
        for key, value in fragment.items():
            if key in LIST_KWARGS:  # handlers and trackers from several plugins add up
                kwargs[key] = [*kwargs.get(key, []), *value]
                owners[key] = f"{owners[key]}, {name}" if key in owners else name
                continue
            if key in kwargs and kwargs[key] != value:
                raise PluginError(
                    f"plugins {owners[key]!r} and {name!r} both set Accelerator({key}=...): "
                    f"{kwargs[key]!r} vs {value!r}; configure it in one plugin"
                )
            kwargs[key], owners[key] = value, name
    if config.seed is not None:
        # The shuffle of every epoch is drawn from seed + epoch (Accelerate's SeedableRandomSampler, as in the HF
        # Trainer), not from a generator that Accelerate would otherwise attach to the user's sampler and that
        # keeps advancing: the same seed gives the same data order, also with the same DataLoader passed again.
        kwargs.setdefault(
            "dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed)
        )
    if _cpu_only_multiprocess_launch():
        # Without cpu=True, Accelerate on a machine without GPUs would run every torchrun process as an
        # independent single-process job. With it, the processes form one gloo data-parallel group.
        kwargs.setdefault("cpu", True)
    # AcceleratorState is a per-process singleton: clear the previous run's settings (mixed precision,
    # accumulation) so that several engines can run one after another in one process. The process group
    # (PartialState) is kept.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    try:
        accelerator = Accelerator(**kwargs)
    except (TypeError, ValueError) as exc:
        who = ", ".join(f"{k} from {owners[k]!r}" for k in kwargs if k in owners)
        raise ConfigError(f"cannot build the Accelerator ({who or 'defaults'}): {exc}") from None
    if accelerator.num_processes > 1:
        _release_process_group_at_exit()
    return accelerator


def _num_training_steps(config: EngineConfig, train_dataloader: Any, accelerator: Accelerator) -> int | None:
    """Optimizer steps the fit will take (see the ``configure_optimizers`` hook), before anything is prepared."""
    try:
        batches = len(train_dataloader)
    except TypeError:  # an iterable dataset without a length
        return config.max_steps
    if accelerator.num_processes > 1 and not accelerator.split_batches:  # the shard of rank 0
        n = accelerator.num_processes
        batches = batches // n if getattr(train_dataloader, "drop_last", False) else math.ceil(batches / n)
    total = math.ceil(batches / accelerator.gradient_accumulation_steps) * config.max_epochs
    return total if config.max_steps is None else min(total, config.max_steps)


_PROCESS_GROUP_RELEASE_REGISTERED = False
_RUN_FAILED = False  # a fit / validate / predict raised in this process: do not wait for the others at exit


def _note_run_failed() -> None:
    global _RUN_FAILED
    _RUN_FAILED = True


def _release_process_group_at_exit() -> None:
    """Destroy the default process group when the process ends (registered once, on a multi-process run).

    A process that exits with its gloo / NCCL process group still alive can abort in the C++ destructors
    ("terminate called without an active exception"), making ``torchrun`` report a failure after a
    successful run. PyTorch asks for ``destroy_process_group()`` at the end of a program; several fits in
    one process share the group, so this waits until the process ends.
    """
    global _PROCESS_GROUP_RELEASE_REGISTERED
    if _PROCESS_GROUP_RELEASE_REGISTERED:
        return
    _PROCESS_GROUP_RELEASE_REGISTERED = True

    def release() -> None:
        state = PartialState()
        # sys.last_value is set by an uncaught exception; _RUN_FAILED by a run that raised, even if caught.
        exiting_on_error = _RUN_FAILED or getattr(sys, "last_value", None) is not None
        if torch.distributed.is_available() and torch.distributed.is_initialized() and not exiting_on_error:
            # Every process reaches the end before any tears its connections down; otherwise a peer still
            # holding the group can abort (gloo: "terminate called without an active exception") when the
            # first one closes it. Skipped after an error: the other processes may never get here.
            torch.distributed.barrier()
        state.destroy_process_group()  # Accelerate's, with its fork-launch guard

    atexit.register(release)


def _cpu_only_multiprocess_launch() -> bool:
    """A launch of several processes (``WORLD_SIZE`` > 1) on a machine without CUDA, unless the user set
    ``ACCELERATE_USE_CPU`` to a false value (read as Accelerate reads it)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    explicit = os.environ.get("ACCELERATE_USE_CPU")
    try:
        opted_out = explicit is not None and not str_to_bool(explicit, to_bool=True)
    except ValueError:  # not a boolean word: Accelerate would reject it itself
        opted_out = False
    return world_size > 1 and not torch.cuda.is_available() and not opted_out


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:  # an iterable dataset without a length
        return None


def _check_validation_step(task: TaskModule) -> None:
    if type(task).validation_step is TaskModule.validation_step:
        raise ConfigError(
            f"{type(task).__name__} got validation data but defines no validation_step(batch, batch_idx); define "
            "it, or pass no validation data"
        )


def _first(sources: list[Any], method: str) -> Any:
    for source in sources:
        loader = getattr(source, method)()
        if loader is not None:
            return loader
    return None


def _config_dict(config: Any) -> Any:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config


def _write_run_config(output_dir: str, run_config: Mapping[str, Any]) -> None:
    """Write ``config.yaml`` atomically (a crash never leaves half a file)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "config.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(_plain(run_config), f, sort_keys=False)
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    """Turn tuples and other YAML-unsafe containers into lists / strings."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
