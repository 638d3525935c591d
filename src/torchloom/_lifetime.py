"""The lifetime of one ``fit`` / ``validate`` / ``predict`` call: ``setup``, the run directory, the run built (or the
last fit's reused), ``on_run_start``; then ``teardown`` whatever happens. ``export`` goes through the same
``setup``, accelerator, thread count and ``teardown`` (`RunStarter.bare`), without a run directory or data.

A failure during set-up (building the run, or loading the checkpoint a fit resumes from) removes the call's run
directory, since nothing was trained or written there, and fires ``teardown`` alone before it propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from torchloom._accelerator import build_accelerator, note_run_failed, restore_launch_environment
from torchloom._default_step import DefaultTrainStep
from torchloom._setup import Run, engine_relay, prepare_run, reuse_run
from torchloom._threads import apply_num_threads
from torchloom.rundir.runfiles import MetricsFile, create_run_dir, discard_run_dir, release_run_dir

__all__ = ["RunStarter"]

T = TypeVar("T")


class RunStarter:
    """Starts and ends the calls of one `torchloom.Engine`, and keeps the last fit's run for ``validate`` /
    ``predict`` to reuse.

    Attributes:
        run (`Run` or ``None``): the last call's run.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._metrics_file = MetricsFile()
        self.run: Run | None = None
        self._threads_before: int | None = None  # torch's thread count before the current call set its own

    def start(self, task: Any, stage: str, datamodule: Any, **loaders: Any) -> Run:
        """Fire ``setup``, create this call's run directory, and build the run, or reuse the last fit's model
        (``validate`` / ``predict`` of the same task without a datamodule). A failure after ``setup`` removes the
        run directory and fires ``teardown`` before it propagates."""
        engine, run = self._engine, self.run
        if stage == "fit" or run is None or getattr(task, "model", None) is not run.model or datamodule is not None:
            run, relay = None, self._relay()
            engine.logs.clear()  # nothing logged by an earlier (failed) run leaks into this one
        else:
            relay = run.relay
        cfg = self._setup(relay, stage)
        accelerator, run_dir = (run.accelerator if run is not None else None), None
        try:
            accelerator = accelerator or build_accelerator(relay, cfg)
            # before any data or model is built; a fit's is marked in use while it runs (its checkpoints are kept)
            run_dir = create_run_dir(cfg.output_dir, accelerator, in_use=stage == "fit")
            self._metrics_file.start(os.path.join(run_dir, "metrics.jsonl"))
            project = accelerator.project_configuration  # Accelerate's trackers write inside the run directory
            project.project_dir = project.logging_dir = run_dir
            config = engine.run_config or {
                "engine": dataclasses.asdict(engine.config),
                "plugins": engine.resolved_plugin_settings(),
            }
            if run is not None:
                run = reuse_run(run, task, stage, loaders, run_dir, config)
            else:
                run = prepare_run(task, stage, cfg, relay, accelerator, datamodule, loaders, config, run_dir)
                self.run = run
            relay.call("on_run_start", accelerator=accelerator, stage=stage, run_dir=run_dir, run_config=config)
            return run
        except BaseException as exc:
            note_run_failed()
            if accelerator is not None:
                discard_run_dir(run_dir, accelerator)
            relay.call_cleanup("teardown", exc, accelerator=accelerator, stage=stage)  # teardown always runs
            self._restore_threads()
            raise

    @contextlib.contextmanager
    def bare(self, stage: str) -> Iterator[tuple[Any, Any, Any]]:
        """A call that builds no run (``Engine.export``): ``setup``, the thread count and the accelerator as `start`
        sets them up, yielded as ``(config, relay, accelerator)``; no run directory, data or ``on_run_start``. Then
        ``teardown`` whatever happens, as `end` fires it (a clean-up failure of a call that succeeded is raised)."""
        relay = self._relay()
        cfg = self._setup(relay, stage)
        accelerator, error = None, None
        try:
            accelerator = build_accelerator(relay, cfg)
            yield cfg, relay, accelerator
        except BaseException as exc:
            note_run_failed()
            error = exc
            raise
        finally:
            self._teardown(relay, accelerator, stage, error)

    def _relay(self) -> Any:
        """A new call's hook relay: the engine's plugins, the default step and the metrics file."""
        return engine_relay(self._engine.plugins, DefaultTrainStep(), self._metrics_file)

    def _setup(self, relay: Any, stage: str) -> Any:
        """The call's settings (a fast_dev_run's one epoch, no sanity pass, no saved model), its thread count set
        before anything is built (undone by the teardown), and ``setup`` fired."""
        cfg = self._engine.config.for_run()
        self._threads_before = apply_num_threads(cfg.num_threads)
        relay.call("setup", config=cfg, stage=stage)
        return cfg

    def _teardown(self, relay: Any, accelerator: Any, stage: str, error: BaseException | None) -> None:
        """Fire ``teardown`` and restore the thread count; raise a clean-up failure of a call that succeeded."""
        failure = relay.call_cleanup("teardown", error, accelerator=accelerator, stage=stage)
        self._restore_threads()
        if failure is not None and failure is not error:
            raise failure

    def set_up(self, run: Run, stage: str, step: Callable[..., T], *args: Any) -> T:
        """Run ``step(*args)`` as part of the set-up of ``run`` (a fit's resume): if it fails, the run directory is
        removed and ``teardown`` fires (nothing was trained)."""
        try:
            return step(*args)
        except BaseException as exc:
            note_run_failed()
            discard_run_dir(run.run_dir, run.accelerator)
            self.end(run, stage, exc)
            raise

    @contextlib.contextmanager
    def stage(self, run: Run, stage: str) -> Iterator[None]:
        """Run a ``validate`` / ``predict`` body, then ``teardown`` whatever happens."""
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.end(run, stage, error)

    def end(self, run: Run, stage: str, error: BaseException | None, failure: BaseException | None = None) -> None:
        """Fire ``teardown``, then release the run directory; raise a clean-up failure of a call that itself
        succeeded (``error`` is ``None``)."""
        failure = run.relay.call_cleanup("teardown", failure or error, accelerator=run.accelerator, stage=stage)
        release_run_dir(run.run_dir, run.accelerator)
        self._restore_threads()
        if failure is not None and failure is not error:
            raise failure

    def _restore_threads(self) -> None:
        """The end of a call: torch's thread count and the launch environment as they were before it."""
        restore_launch_environment()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
