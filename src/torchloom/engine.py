"""`Engine`: the public surface. ``fit`` / ``validate`` / ``predict`` each start a run and hand it to the loop or to
an evaluation pass.

The engine knows no technique by name: techniques are plugins. Set-up lives in ``_setup`` (with the call's
lifetime in ``_lifetime``), the training loop and its state in ``_loop`` and ``_fit_state``, the evaluation passes
in ``_evaluation``, logged values in ``_logging``, run files in ``_runfiles``, checks in ``_guards``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from accelerate import Accelerator

from torchloom._context import RunContext, activate
from torchloom._default_plugins import with_default_plugins
from torchloom._default_step import DefaultTrainStep
from torchloom._evaluation import prediction_pass
from torchloom._fit_state import FitState
from torchloom._lifetime import RunStarter
from torchloom._logging import RunLog
from torchloom._loop import FitLoop
from torchloom._output import quiet_libraries
from torchloom._setup import Run, engine_relay
from torchloom.config import EngineConfig
from torchloom.data.module import DataModule
from torchloom.errors import ConfigError
from torchloom.hookspecs import HOOK_NAMES
from torchloom.module import TaskModule
from torchloom.plugins import PluginSpec, enable_plugins, plugin_name
from torchloom.progress import Progress
from torchloom.rundir.runfiles import MetricsFile, config_dict, discard_run_dir, write_predictions

__all__ = ["AUTO", "Engine"]

#: ``fit(ckpt_path="auto")`` / ``torchloom fit --resume auto``: resume when the ``output_dir`` has a checkpoint.
AUTO = "auto"


class Engine:
    """Runs a `TaskModule` with plugins over one `accelerate.Accelerator`.

    ``fit``, ``validate`` and ``predict`` run inside `torchloom.utils.quiet_libraries`: when stderr is not a terminal,
    the progress bars of ``datasets``, transformers and ``huggingface_hub`` and transformers' colour codes stay out
    of the output during the call, unless the user set those libraries' own variables or verbosity.

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
        history (`list[dict]`): every reduction of logged values in the last run (``step``, ``epoch``, names);
            the same list on every rank.
        logged_metrics (`dict[str, float]`): the latest value of every logged name.
        resumed_from (`str` or ``None``): the checkpoint the last fit resumed from (``ckpt_path``).
        weights_from (`tuple[str, str]` or ``None``): the weights the last ``validate(..., ckpt_path=...)`` or
            ``predict(..., ckpt_path=...)`` loaded, ``(kind, path)`` with kind ``"checkpoint"`` or ``"model"``.
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
        self.logs = RunLog()
        self.history, self.logged_metrics = self.logs.history, self.logs.latest  # the same objects, kept up to date
        self.resumed_from: str | None = None
        self.weights_from: tuple[str, str] | None = None
        self._state = FitState()  # the last fit's (a fresh one before any)
        self._starter = RunStarter(self)

    @property
    def accelerator(self) -> Accelerator | None:
        """The Accelerator of the last run (``None`` before the first)."""
        return self._starter.run.accelerator if self._starter.run is not None else None

    @property
    def run_dir(self) -> str | None:
        """The directory of the last ``fit`` / ``validate`` / ``predict`` call, ``<output_dir>/version_N``."""
        return self._starter.run.run_dir if self._starter.run is not None else None

    @property
    def progress(self) -> Progress:
        """The counters of the last fit (`Progress`)."""
        return self._state.progress()

    @property
    def stop_reason(self) -> str | None:
        """Why the last fit stopped before ``max_epochs`` / ``max_steps``, when a plugin or the task asked it to
        (`torchloom.request_stop`); ``None`` otherwise."""
        return self._state.stop_reason

    # -------------------------------------------------------------------------------------------- fit

    @quiet_libraries()  # off a terminal, no library progress bars or colour codes during the call
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
                `torchloom.checkpoint.store.find_checkpoint`: a checkpoint, a run directory or an ``output_dir``, whose
                latest checkpoint is taken). The model, optimizer, scheduler, loss scaler, random states, plugin
                states, counters and data position are restored; the fit goes on from the next batch, in a new run
                directory, exactly as if it had never stopped. That directory's ``metrics.jsonl`` starts with the
                records of the runs it continues up to the checkpoint (marked ``carried_over_from``), and its
                ``resumed_from.json`` names them (see `torchloom.Resumed`). ``"auto"``: the latest complete
                checkpoint of the engine's ``output_dir`` when it has one, else a fit from scratch (what a job that a
                scheduler restarts passes every time, first start included; a directory named ``auto`` is
                ``./auto``). Checkpoints that cannot be used are not "none": when the latest checkpoint there is
                unusable (an unreadable ``manifest.json``, another format version; `torchloom.checkpoint.scan`),
                the fit is refused with a `CheckpointError` naming each such checkpoint and why, even when an older
                one is usable (as Lightning's and the HF Trainer's resume from the latest checkpoint fails on a
                damaged one); move them away, name a checkpoint, or fit without ``ckpt_path`` to start over.
                Not with ``fast_dev_run`` (a `ConfigError`), except ``"auto"`` over an ``output_dir`` without
                checkpoints.
            reset_optimizer (`bool`, defaults to False): with ``ckpt_path``, start the optimizer with fresh state
                (required when its class changed; a warning says so).

        Raises:
            ConfigError: missing or empty training data, validation data without ``validation_step``, a bad setting,
                ``fast_dev_run`` with a checkpoint to resume from.
            TaskError: untrainable returns, a non-finite loss (``nonfinite_loss="error"``), ranks that disagree.
            PluginError: a plugin failed, returned something invalid, or two plugins answered one set-up hook.
            CheckpointError: ``ckpt_path`` names no complete checkpoint, or one that this run cannot continue; its
                (or, with ``"auto"``, the ``output_dir``'s) latest checkpoint is unusable.
        """
        from torchloom.checkpoint.scan import scan_checkpoints
        from torchloom.checkpoint.store import find_checkpoint

        started = time.perf_counter()  # the fit's wall time, as the next resume carries it over
        if ckpt_path == AUTO:  # the output_dir's latest checkpoint, or none: the same call on every (re)start
            # Checkpoints that are all unusable are not "none": find_checkpoint refuses them, naming each and why
            scan = scan_checkpoints(self.config.output_dir)
            ckpt_path = self.config.output_dir if scan.usable or scan.unusable else None
        if ckpt_path is not None and self.config.is_fast_dev_run:
            raise ConfigError(
                f"fit: fast_dev_run = {self.config.fast_dev_run!r} cannot be combined with a resume (ckpt_path "
                f"{os.fspath(ckpt_path)!r}, --resume): a fast_dev_run trains its batches from the start of one epoch "
                "and saves nothing, so it would continue none of the training; expected fast_dev_run false to resume, "
                "or no ckpt_path (no --resume) to check the run from scratch with fast_dev_run"
            )
        self.resumed_from = find_checkpoint(ckpt_path) if ckpt_path is not None else None
        run = self._starter.start(
            task, "fit", datamodule, train_dataloader=train_dataloader, val_dataloader=val_dataloader
        )
        loop = FitLoop(self.config.for_run(), run, task, self.logs, self.plugins, started)
        self._state = loop.state
        path = self.resumed_from
        if path:
            self._starter.set_up(run, "fit", loop.resume, path, reset_optimizer)
        error: BaseException | None = None
        try:
            loop.fit()  # on_fit_start ... the saved model, on_exception, on_fit_end
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._starter.end(run, "fit", error, loop.cleanup_failure)
        return dict(self.logs.latest)

    # --------------------------------------------------------------------------------- validate / predict

    @quiet_libraries()
    def validate(
        self,
        task: TaskModule,
        dataloader: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float]:
        """Run one validation pass and return the values logged during it (reduced over ranks).

        Reuses the model of the last ``fit`` of the same task; otherwise builds and prepares it.

        Args:
            task (`TaskModule`): what to validate.
            dataloader (`torch.utils.data.DataLoader`, *optional*): else the datamodule's or task's
                ``val_dataloader``.
            datamodule (`DataModule`, *optional*): prepared once per machine, then set up on every process.
            ckpt_path (`str` or `os.PathLike`, *optional*): load these weights into the model first (after
                ``setup`` and before ``on_validation_start``), as Lightning's ``trainer.validate(ckpt_path=...)``:
                what ``predict``'s ``ckpt_path`` may name (a checkpoint, an exported model, a run directory, an
                ``output_dir``), or ``"last"`` / ``"best"``: the latest checkpoint of the engine's ``output_dir``,
                or the one with the best value of the ``checkpoint`` plugin's ``monitor`` (without that plugin's
                ``monitor``, the one the checkpoints recorded in their manifests). ``weights_from`` then holds what
                was loaded.

        Raises:
            ConfigError: no validation data, or a task without ``validation_step``; ``ckpt_path`` does not exist,
                or is ``"best"`` without a ``checkpoint`` plugin ``monitor`` and with checkpoints that record none.
            CheckpointError: ``ckpt_path`` holds no weights (the message says what it may name), a checkpoint
                whose files do not match its manifest, or weights that do not fit the model.
        """
        from torchloom._evaluation import validation_pass

        weights = self._weights(ckpt_path, "validate")  # before a run directory exists
        run = self._starter.start(task, "validate", datamodule, val_dataloader=dataloader)
        self.logs.val.clear()  # only what this validation logs
        with self._starter.stage(run, "validate"), activate(RunContext(self.logs, run.agreement)):
            self._load_weights(run, weights)
            progress = self._state.progress()
            validation_pass(task, run, self.logs, progress)
            return self.logs.report(self.logs.val, run, progress)[0]

    @quiet_libraries()
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
                directory (its ``model/`` when the fit saved one, else its latest checkpoint), an ``output_dir``
                (its latest checkpoint), or ``"last"`` / ``"best"`` (the latest checkpoint of the engine's
                ``output_dir``, or the one with the best value of the ``checkpoint`` plugin's ``monitor``, else of
                the monitor the checkpoints recorded in their manifests). Only
                safetensors are read. ``weights_from`` then holds what was loaded.

        Raises:
            ConfigError: no prediction data; ``ckpt_path`` does not exist, an exported model whose weight files are
                not safetensors or are damaged (named before anything loads), or one that does not fit; ``"best"``
                without a ``checkpoint`` plugin ``monitor`` and with checkpoints that record none.
            CheckpointError: ``ckpt_path`` holds no weights (the message says what it may name), a checkpoint
                changed since it was written, or weights that do not fit the model (keys or shapes).
        """
        weights = self._weights(ckpt_path, "predict")  # before a run directory exists
        run = self._starter.start(task, "predict", datamodule, predict_dataloader=dataloader)
        with self._starter.stage(run, "predict"), activate(RunContext(self.logs, run.agreement)):
            self._load_weights(run, weights)
            predictions = prediction_pass(task, run)
            write_predictions(run.run_dir, predictions, run.accelerator)
        return predictions

    @quiet_libraries()
    def export(self, task: TaskModule, checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str]) -> str:
        """Write the model of ``checkpoint`` into the new folder ``directory``, as a fit with ``save_model: true``
        that ended there would have written ``<run_dir>/model``; return ``directory``.

        The model is built as a fit builds it (the seed, ``configure_model``, the plugins' ``configure_model``: the
        ``peft`` plugin's adapter), the checkpoint's weights are loaded, and `TaskModule.save_model` writes it: a
        transformers model as an ordinary transformers folder (``save_pretrained``), any other module as
        ``model.safetensors``, a model with an adapter as the adapter in peft's format (with the ``peft`` plugin's
        ``merge``, also ``merged/``: the merged model); then the plugins' ``on_save_model`` and the model card
        ``torchloom_model.json`` (the run's config, the checkpoint's values, step and epoch, ``exported_from``).
        No run directory is made; nothing is written unless all of it is.

        Args:
            task (`TaskModule`): the task whose model the checkpoint holds.
            checkpoint (`str` or `os.PathLike`): a checkpoint directory (with ``manifest.json``).
            directory (`str` or `os.PathLike`): where to write; must not exist, or be empty.

        Raises:
            ConfigError: ``checkpoint`` does not exist; ``directory`` exists and is not empty; several processes.
            CheckpointError: not a complete checkpoint; one whose files do not match its manifest (refused before
                anything loads); weights or an adapter that do not fit the task's model.
            RunFileError: the folder cannot be written (a full disk): nothing of it is left.
        """
        from torchloom.rundir.export_checkpoint import export_checkpoint

        return export_checkpoint(lambda: self._starter.bare("predict"), task, checkpoint, directory, self.run_config)

    def _weights(self, ckpt_path: str | os.PathLike[str] | None, command: str) -> tuple[str, str] | None:
        """What ``ckpt_path`` names (`torchloom.rundir.export.resolve_weights`; ``"best"`` by the ranking an enabled
        plugin declares, ``checkpoint_ranking``, else by the one the checkpoints recorded), kept in ``weights_from``."""
        from torchloom.checkpoint.manifest import ranking
        from torchloom.rundir.export import resolve_weights

        weights = None
        if ckpt_path is not None:
            declared = ranking(self.plugins) or {}
            weights = resolve_weights(
                ckpt_path,
                command,
                output_dir=self.config.output_dir,
                monitor=declared.get("monitor"),
                mode=declared.get("mode", "min"),
            )
        self.weights_from = weights
        return weights

    @staticmethod
    def _load_weights(run: Run, weights: tuple[str, str] | None) -> None:
        """Load ``weights`` into the run's model; a failure leaves no run directory (nothing was run)."""
        from torchloom.rundir.export import load_weights

        if weights is None:
            return
        try:
            load_weights(run.accelerator.unwrap_model(run.model), *weights)
        except BaseException:
            discard_run_dir(run.run_dir, run.accelerator)
            raise

    # ------------------------------------------------------------------------------------------ inspection

    def hook_order(self) -> dict[str, list[str]]:
        """Every implemented hook -> the plugins implementing it, in the order a run of this engine calls them
        (the engine's own implementations, ``torchloom.default_step`` and ``torchloom.metrics_file``, included).
        Builds nothing and runs no hook."""
        relay = engine_relay(self.plugins, DefaultTrainStep(), MetricsFile())
        return {name: relay.call_order(name) for name in HOOK_NAMES if relay.implemented(name)}

    def resolved_plugin_settings(self) -> dict[str, Any]:
        """The enabled plugins in order, name -> every setting (defaults filled in), as written to config.yaml."""
        return {plugin_name(p): config_dict(getattr(p, "config", None)) for p in self.plugins}

    @property
    def _run(self) -> Run | None:  # the last call's run (tests and the CLI read it)
        return self._starter.run
