"""Experiment trackers (TensorBoard, W&B, MLflow, Aim, ...) through Accelerate's tracker API.

Method card
-----------
- **What:** every value that reaches ``on_log`` (``train/loss``, ``val/*``, ``grad_norm``, ...) is also written to
  the trackers named in ``log_with``, at ``step = progress.global_step`` (optimizer steps); the run's resolved
  configuration is recorded once as the hyperparameters. ``metrics.jsonl`` is written by the engine either way.
- **Resumed fits:** a fit resumed from a checkpoint first writes the values the runs it continues logged up to
  the checkpoint (``on_fit_start``'s ``resumed``: the records its ``metrics.jsonl`` carries over), each at its
  own step, so the new run's tracker log holds the whole curve, as its ``metrics.jsonl`` does.
- **Continued runs:** a resumed fit continues the W&B and MLflow runs of the fit it resumes (their ids are recorded
  in ``<run_dir>/trackers.json``), and sends them nothing they already hold: `torchloom_plugins._tracker_runs`.
- **Mechanism:** ``Accelerator(log_with=[...])`` (the ``configure_accelerator`` fragment; fragments from several
  plugins are concatenated), ``accelerator.init_trackers(project_name, config=hparams, init_kwargs=...)`` in
  ``on_run_start`` (``validate``) or ``on_fit_start`` (``fit``: the first hook that knows what it resumes), each
  started tracker's ``log(metrics, step=...)`` in ``on_fit_start`` (the carried-over values of a resumed fit, to
  the trackers that start fresh) and ``on_log``, and each started tracker's ``finish()`` in ``teardown``, which
  also runs after a failed run.
- **Where:** the engine points ``accelerator.logging_dir`` at the run directory, so TensorBoard writes
  ``<run_dir>/<project_name>/events.out.tfevents.*`` and Aim its repository in ``<run_dir>``. Trackers that log to a
  service start offline, writing inside the run directory, unless the user chose otherwise (`tracker_init_kwargs`).
- **Quick-debug runs:** under the engine's ``fast_dev_run`` (``config.is_fast_dev_run``, read at ``setup``) no
  tracker is started and nothing is written to one.
- **Stages:** ``fit`` and ``validate`` start trackers, each call in its own run directory; ``predict`` logs nothing
  and starts none.
- **Processes:** only the main process starts trackers, so only it writes. Accelerate's ``init_trackers`` and
  ``log`` already run on the main process alone (``@on_main_process``; its W&B, SwanLab and trackio classes set
  ``main_process_only = False``, which matters only to code that starts them directly); the plugin also skips the
  other processes itself, so they hold no tracker and finish none.
- **Not** ``accelerator.end_training()``: besides finishing the trackers it destroys the process group, which the
  engine keeps for later runs in the same process and releases itself at exit.
- **Sources:** `accelerate.tracking` and Accelerate's "Experiment trackers" guide; Lightning's loggers
  (``log_hyperparams`` with flattened keys, rank-zero-only writes).

Functional use, without the engine: ``Accelerator(log_with="tensorboard", project_dir=...)``, then
``accelerator.init_trackers(...)``, ``accelerator.log(...)``, ``accelerator.end_training()``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import utils as accelerate_utils

import torchloom
from torchloom_plugins._tracker_runs import Continued, continue_kwargs, read_runs, run_ids, write_runs

__all__ = ["TRACKERS", "Trackers", "TrackersConfig", "flatten_config", "tracker_init_kwargs"]

#: Tracker name (as Accelerate's ``LoggerType`` spells it) -> (Accelerate's availability check, the pip package).
TRACKERS: dict[str, tuple[Callable[[], bool], str]] = {
    "tensorboard": (accelerate_utils.is_tensorboard_available, "tensorboard"),
    "wandb": (accelerate_utils.is_wandb_available, "wandb"),
    "mlflow": (accelerate_utils.is_mlflow_available, "mlflow"),
    "aim": (accelerate_utils.is_aim_available, "aim"),
    "comet_ml": (accelerate_utils.is_comet_ml_available, "comet-ml"),
    "clearml": (accelerate_utils.is_clearml_available, "clearml"),
    "dvclive": (accelerate_utils.is_dvclive_available, "dvclive"),
    "swanlab": (accelerate_utils.is_swanlab_available, "swanlab"),
    "trackio": (accelerate_utils.is_trackio_available, "trackio"),
}

#: The calls that start trackers: ``predict`` logs no values.
STAGES = ("fit", "validate")


@dataclass
class TrackersConfig:
    """Settings of the ``trackers`` plugin.

    Args:
        log_with (`list[str]`, defaults to ``["tensorboard"]``): the trackers to write to, by Accelerate's names:
            ``tensorboard``, ``wandb``, ``mlflow``, ``aim``, ``comet_ml``, ``clearml``, ``dvclive``, ``swanlab``,
            ``trackio``. Each must be installed.
        project_name (`str`, defaults to ``"torchloom"``): the name passed to ``accelerator.init_trackers``:
            TensorBoard's subdirectory of the run directory, the W&B / SwanLab / trackio / Comet project, the MLflow
            experiment, the Aim run name. One path component (no ``/``).
        init_kwargs (`dict[str, dict]`, defaults to ``{}``): per tracker, keyword arguments for its start
            (``SummaryWriter``, ``wandb.init``, ...), e.g. ``{"wandb": {"tags": ["baseline"]}}``; they override the
            offline defaults. Keys must be names in ``log_with``.

    Raises:
        ConfigError: an unknown or repeated tracker name, one that is not installed, an empty ``log_with``, a
            ``project_name`` that is not one path component, or ``init_kwargs`` for a tracker not in ``log_with``.
    """

    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])  # tracker names, each installed
    project_name: str = "torchloom"  # run name / project / experiment; one path component
    init_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per tracker: kwargs for its start

    def __post_init__(self) -> None:
        valid = ", ".join(TRACKERS)
        if not self.log_with:
            raise torchloom.ConfigError(f"setting 'log_with' = []; expected one or more of: {valid}")
        for name in self.log_with:
            if name not in TRACKERS:
                close = torchloom.utils.closest_name(str(name), TRACKERS)
                hint = (
                    " (list the trackers by name)" if name == "all" else f" (did you mean {close!r}?)" if close else ""
                )
                raise torchloom.ConfigError(
                    f"setting 'log_with': unknown tracker {name!r}{hint}; valid trackers: {valid}"
                )
            if self.log_with.count(name) > 1:
                raise torchloom.ConfigError(f"setting 'log_with' = {self.log_with!r}: {name!r} is listed twice")
        for name in self.log_with:
            available, package = TRACKERS[name]
            if not available():
                raise torchloom.ConfigError(f"setting 'log_with': {name!r} is not installed; pip install {package}")
        if not self.project_name or self.project_name in (".", "..") or any(s in self.project_name for s in "/\\"):
            raise torchloom.ConfigError(
                f"setting 'project_name' = {self.project_name!r}; expected a non-empty name without '/' or '\\', "
                "not '.' or '..' (it names a directory in the run directory)"
            )
        for name, kwargs in self.init_kwargs.items():
            if name not in self.log_with:
                raise torchloom.ConfigError(
                    f"setting 'init_kwargs' has an entry for {name!r}, which is not in log_with {self.log_with!r}"
                )
            if not isinstance(kwargs, Mapping):
                raise torchloom.ConfigError(
                    f"setting 'init_kwargs' = {{{name!r}: {kwargs!r}}}; expected a mapping of keyword arguments"
                )


class Trackers(torchloom.Plugin):
    """Write every logged value and the run's configuration to Accelerate's experiment trackers.

    Implements ``setup``, ``configure_accelerator``, ``on_run_start``, ``on_fit_start``, ``on_log`` and
    ``teardown``. See the module docstring and ``docs/plugins/trackers.md``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"trackers": {"log_with": ["tensorboard"]}})
        engine.fit(task)  # then: tensorboard --logdir <engine.run_dir>
    """

    name = "trackers"
    capabilities = frozenset({"outside_sweeps"})  # a throw-away sweep logs to no tracker
    Config = TrackersConfig

    def __init__(self, config: TrackersConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._accelerator: Any = None  # the Accelerator whose trackers this plugin started (main process)
        self._first = 0  # index of the first of them in accelerator.trackers
        self._off = False  # a fast_dev_run (the engine's is_fast_dev_run, at setup): no tracker starts
        self._fit: tuple[Any, str, Mapping[str, Any]] | None = None  # a fit's start, made in on_fit_start
        self._run_dir: str | None = None  # where trackers.json goes (a fit's run directory)
        self._runs: dict[str, dict[str, Any]] = {}  # the continuable tracker runs started (_tracker_runs.run_ids)
        self._continued: dict[str, Continued] = {}  # tracker name -> the earlier run it continues
        self._resumed_step = 0  # the step of the checkpoint a resumed fit continues
        self._last_step: int | None = None  # the highest step logged

    @torchloom.hookimpl
    def setup(self, config) -> None:
        self._off = bool(getattr(config, "is_fast_dev_run", False))

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        return {"log_with": list(self.config.log_with)}

    @torchloom.hookimpl
    def on_run_start(self, accelerator, stage: str, run_dir: str, run_config: Mapping[str, Any]) -> None:
        if self._off or stage not in STAGES or not accelerator.is_main_process:
            return
        if stage == "fit":  # started in on_fit_start, which knows whether the fit continues earlier runs
            self._fit = (accelerator, run_dir, run_config)
            return
        self._start(accelerator, run_dir, run_config, {})

    @torchloom.hookimpl
    def on_fit_start(self, accelerator, resumed) -> None:
        if self._fit is None:  # not the main process, a fast_dev_run, or started already
            return
        fit, self._fit = self._fit, None
        earlier = resumed.chain[-1]["run_dir"] if resumed is not None and resumed.chain else None
        self._start(*fit, read_runs(earlier, os.environ))
        self._run_dir, self._resumed_step = fit[1], resumed.global_step if resumed is not None else 0
        self._runs = run_ids(accelerator.trackers[self._first :])
        if self._runs:  # named at once, so that a run killed before its teardown can be continued too
            write_runs(self._run_dir, self._runs, None)
        if resumed is None:
            return
        for step, _, values in resumed.logged():  # the earlier runs' values, up to the checkpoint, at their steps
            if values:  # to the trackers that start fresh; a continued run holds them already
                self._log(values, step, fresh_only=True)

    @torchloom.hookimpl
    def on_log(self, metrics: dict[str, float], progress, accelerator) -> None:
        if self._accelerator is not None:  # started: main process, fit or validate
            self._log(metrics, progress.global_step, fresh_only=False)

    @torchloom.hookimpl
    def teardown(self) -> None:
        accelerator, self._accelerator, self._fit = self._accelerator, None, None
        if accelerator is None:
            return
        started = accelerator.trackers[self._first :]
        del accelerator.trackers[self._first :]  # a validate that reuses this Accelerator starts its own
        error: Exception | None = None
        if self._runs and self._run_dir is not None:  # the highest step, for the fit that resumes this one
            steps = [s for s in (self._last_step, *(r.last_step for r in self._continued.values())) if s is not None]
            try:
                write_runs(self._run_dir, self._runs, max(steps, default=self._resumed_step))
            except Exception as exc:
                error = exc
        for tracker in started:  # every one is finished (its files closed) even if another fails
            try:
                tracker.finish()
            except Exception as exc:
                error = error or exc
        self._runs, self._continued, self._run_dir, self._last_step = {}, {}, None, None
        if error is not None:
            raise error

    def _start(
        self, accelerator: Any, run_dir: str, run_config: Mapping[str, Any], continued: Mapping[str, Continued]
    ) -> None:
        """``accelerator.init_trackers`` with the offline defaults, continuing the runs of ``continued``."""
        environ = os.environ
        init_kwargs = tracker_init_kwargs(self.config.log_with, self.config.init_kwargs, run_dir, environ)
        continued = {name: run for name, run in continued.items() if name in self.config.log_with}
        names = continue_kwargs(init_kwargs, continued)
        self._continued = {name: continued[name] for name in names}
        mlflow = self._continued.get("mlflow")
        _offline_process_defaults(self.config.log_with, run_dir, environ, mlflow.tracking_uri if mlflow else None)
        # Recorded before the start, so that teardown finishes what a start that fails half-way did open.
        self._accelerator, self._first = accelerator, len(accelerator.trackers)
        accelerator.init_trackers(self.config.project_name, config=flatten_config(run_config), init_kwargs=init_kwargs)

    def _log(self, values: Mapping[str, float], step: int, fresh_only: bool) -> None:
        """Log ``values`` at ``step`` to the trackers started here (as ``accelerator.log`` does, main process); a
        continued run gets only what it does not hold (`Continued.holds`), nothing with ``fresh_only``."""
        if not fresh_only:
            self._last_step = step if self._last_step is None else max(self._last_step, step)
        for tracker in self._accelerator.trackers[self._first :]:
            run = self._continued.get(tracker.name)
            if run is not None and (fresh_only or run.holds(step, self._resumed_step)):
                continue
            tracker.log(dict(values), step=step)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """The run configuration as one flat mapping of scalars, the hyperparameters every tracker accepts.

    Nested keys are joined with dots (``{"engine": {"max_epochs": 2}}`` -> ``{"engine.max_epochs": 2}``); bools,
    ints, floats and strings stay as they are; an empty mapping becomes ``"{}"`` (an enabled plugin without
    settings stays visible), ``None`` becomes ``"None"``, lists and tuples their JSON text (``'["tensorboard"]'``),
    anything else its ``str``.

    Example:

    .. code-block:: python

        flatten_config({"engine": {"seed": None}, "plugins": {"trackers": {"log_with": ["tensorboard"]}}})
        # {"engine.seed": "None", "plugins.trackers.log_with": '["tensorboard"]'}
    """
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if value:
                flat.update(flatten_config(value, f"{name}."))
            else:
                flat[name] = "{}"
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        elif value is None:
            flat[name] = "None"
        elif isinstance(value, list | tuple):
            flat[name] = json.dumps(value, default=str)
        else:
            flat[name] = str(value)
    return flat


def tracker_init_kwargs(
    log_with: list[str], user: Mapping[str, Mapping[str, Any]], run_dir: str, environ: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """The ``init_kwargs`` for ``accelerator.init_trackers``: the user's, over offline defaults in ``run_dir``.

    A default is added only when neither the user's ``init_kwargs`` nor the tracker's own environment variable
    chose it:

    - ``wandb``: ``mode="offline"`` (unless ``WANDB_MODE``), ``dir=run_dir`` (unless ``WANDB_DIR``);
    - ``comet_ml``: ``online=False``;
    - ``swanlab``: ``mode="offline"`` (unless ``SWANLAB_MODE``), ``logdir=<run_dir>/swanlog``;
    - ``dvclive``: ``dir=<run_dir>/dvclive``.

    ``tensorboard`` and ``aim`` write to Accelerate's logging directory, the run directory; ``mlflow`` and
    ``clearml`` are set offline per process (their start takes no such argument); ``trackio`` is local unless given
    a ``space_id``.
    """
    kwargs = {name: dict(user.get(name, {})) for name in log_with}
    for name, given in kwargs.items():
        if name == "wandb":
            if "WANDB_MODE" not in environ:
                given.setdefault("mode", "offline")
            if "WANDB_DIR" not in environ:
                given.setdefault("dir", run_dir)
        elif name == "comet_ml":
            given.setdefault("online", False)
        elif name == "swanlab":
            if "SWANLAB_MODE" not in environ:
                given.setdefault("mode", "offline")
            given.setdefault("logdir", os.path.join(run_dir, "swanlog"))
        elif name == "dvclive":
            given.setdefault("dir", os.path.join(run_dir, "dvclive"))
    return {name: given for name, given in kwargs.items() if given}


def _offline_process_defaults(
    log_with: list[str], run_dir: str, environ: Mapping[str, str], mlflow_uri: str | None = None
) -> None:
    """Offline defaults that are process settings, not start arguments (main process, before the start).

    - ``mlflow``: unless ``MLFLOW_TRACKING_URI`` is set, the tracking URI ``mlflow_uri`` (the store of the run a
      resumed fit continues), else ``file://<run_dir>/mlruns``: MLflow's file store, which MLflow 3 keeps in
      maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE=true`` (set here unless set; it works with
      ``mlflow-skinny`` too, which has no database driver);
    - ``clearml``: ``Task.set_offline(True)``, unless ``CLEARML_OFFLINE_MODE`` is set.
    """
    if "mlflow" in log_with and "MLFLOW_TRACKING_URI" not in environ:
        import mlflow

        uri = mlflow_uri or Path(run_dir, "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
    if "clearml" in log_with and "CLEARML_OFFLINE_MODE" not in environ:
        from clearml import Task

        Task.set_offline(offline_mode=True)
