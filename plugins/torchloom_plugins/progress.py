"""Progress display and end-of-run summary: a live bar in a terminal, plain lines elsewhere, on the main process.

Method card
-----------
- **What:** while a fit runs, the epoch (``0/2``: its 0-based index out of the last one's, the numbering of
  ``metrics.jsonl``), the optimizer step out of the total (``40/100``), the latest
  training loss, steps per second, elapsed time and ETA; a line with the values of each validation pass; at the
  end of a completed ``fit`` (and of a ``validate``) a table of every logged name with its last and its best
  value, then the optimizer steps, epochs and samples; the model's parameters (total, trainable, bytes as held:
  `torchloom.utils.count_parameters`) and the optimizer state's bytes on the main process at the end
  (`torchloom.utils.optimizer_state_bytes`); the training time (from the first epoch's start to the
  end of training, validation passes excluded) with the samples and steps per second measured over it (the HF
  Trainer's ``train_runtime`` and ``train_samples_per_second = samples / train_runtime``); the wall time of the
  whole call (set-up, validation and saving included) on a line of its own; the run directory and where the
  model is. The same summary is written to ``<run_dir>/summary.json``. A resumed fit's summary counts the
  whole training: the values, samples and times of the runs it continues up to its checkpoint (``on_fit_start``'s
  ``resumed``) and its own; ``this_run`` holds its own part.
- **Where it prints:** stdout, through one `rich.console.Console` made when the plugin is made. When rich says
  stdout is an interactive terminal, a `rich.progress.Progress` bar (redrawn ``refresh_per_second`` times a
  second by rich's own thread; ``print`` output and warnings appear above it). Otherwise (CI logs, ``| tee``,
  files, notebooks) no bar: one plain line per ``on_log`` of training values, at most one per
  ``plain_every_n_seconds``. ``NO_COLOR`` turns colours off; ``terminal`` overrides the detection. The detection
  is `torchloom.utils.is_terminal`, the rule by which the engine also keeps the libraries' own progress bars out of
  output that is not a terminal (`torchloom.utils.quiet_libraries`).
- **Cost on the hot path:** no host-device synchronisation. The step comes from ``progress.global_step``, the
  loss only from ``on_log`` (which the engine already reduced to Python floats at the logging interval), the
  sample count from the batch's shape (`accelerate.utils.find_batch_size`, a metadata read). Per micro-batch,
  on the main process: one shape read, a clock read on optimizer steps, and a bar update at most
  ``refresh_per_second`` times a second. Other processes return from every hook at once.
- **Hooks:** ``setup`` (per-call state, the ``max_epochs`` and ``save_model`` settings), ``on_run_start`` (the
  run directory; whether this process displays), ``on_fit_start`` (the total, ``task.num_training_steps``; the
  model and optimizer; what a resumed fit continues; the bar starts), ``on_train_epoch_start``,
  ``on_train_batch_end`` (samples, steps),
  ``on_validation_start`` / ``on_validation_end``, ``on_log`` (the loss, the validation line, last and best
  values), ``on_train_end`` (the training clock stops; the bar's last frame stays), ``on_exception``,
  ``on_fit_end`` (the table and ``summary.json``, only when the fit completed; after a ``fast_dev_run``, announced
  at the first ``on_train_epoch_start``, one line instead and no ``summary.json``), ``on_predict_start`` /
  ``on_predict_batch_end`` / ``on_predict_end`` (a batch counter, terminal only) and ``teardown`` (the
  ``validate`` summary; stops a bar that is still running).
- **Best values:** the smallest value for names that read as an error (a part ``loss``, ``error``,
  ``perplexity``, ``ppl``, ``mse``, ``mae``, ``rmse``, ``wer``, ``cer``), the largest for any other name, none for names
  that describe the run's state rather than a result (``lr``, ``learning_rate``, a gradient or weight ``norm``,
  a loss ``scale``, ``skipped`` steps, a size in ``bytes``): see `metric_direction`; and none for a name whose
  value never changed (a constant, or a name logged once), where a best says nothing. The best so far is
  `torchloom.Monitor`'s rule, the one of ``early_stopping`` and ``checkpoint`` (strictly better; NaN is never the
  best).
- **Sources:** Lightning's ``RichProgressBar`` and ``TQDMProgressBar`` callbacks; the HF Trainer's
  ``ProgressCallback`` / ``PrinterCallback`` (plain lines when there is no terminal); rich's ``Progress`` and
  ``Live`` documentation.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from accelerate.utils import find_batch_size
from rich import progress as rich_progress
from rich.console import Console
from rich.table import Table
from rich.text import Text

import torchloom
from torchloom_plugins import _summary_text as summary_text

__all__ = ["ProgressBar", "ProgressConfig", "batch_size", "metric_direction"]


@dataclass
class ProgressConfig:
    """Settings of the ``progress`` plugin.

    Args:
        enabled (`bool`, defaults to True): false prints nothing and writes no ``summary.json``.
        refresh_per_second (`float`, defaults to 4.0): how often the terminal bar is redrawn (and, at most, how
            often its counters are updated), per second; ``> 0``.
        plain_every_n_seconds (`float`, defaults to 0.0): without a terminal, print a training line at an
            ``on_log`` only when at least this many seconds passed since the previous one (the latest skipped
            line is printed before the next validation line and at the end); 0 prints one per ``on_log``
            (every ``log_every_n_steps`` optimizer steps); ``>= 0``.
        terminal (`bool`, *optional*): ``None`` (the default) lets rich decide whether stdout is an interactive
            terminal (it also honours ``TTY_COMPATIBLE``, ``TTY_INTERACTIVE`` and ``FORCE_COLOR``); true always
            draws the bar, false always prints plain lines.

    Raises:
        ConfigError: a value of the wrong type, ``refresh_per_second`` not a finite number > 0, or
            ``plain_every_n_seconds`` not a finite number >= 0.
    """

    enabled: bool = True  # false: print nothing, write no summary.json
    refresh_per_second: float = 4.0  # terminal bar redraws per second (> 0)
    plain_every_n_seconds: float = 0.0  # without a terminal: at most one training line per this many seconds
    terminal: bool | None = None  # null: detect; true: always the bar; false: always plain lines

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise torchloom.ConfigError(f"setting 'enabled' = {self.enabled!r}; expected true or false")
        if self.terminal is not None and not isinstance(self.terminal, bool):
            raise torchloom.ConfigError(
                f"setting 'terminal' = {self.terminal!r}; expected true, false or null (detect)"
            )
        if not _is_number(self.refresh_per_second) or not self.refresh_per_second > 0:
            raise torchloom.ConfigError(
                f"setting 'refresh_per_second' = {self.refresh_per_second!r}; expected a finite number > 0 "
                "(redraws per second)"
            )
        if not _is_number(self.plain_every_n_seconds) or not self.plain_every_n_seconds >= 0:
            raise torchloom.ConfigError(
                f"setting 'plain_every_n_seconds' = {self.plain_every_n_seconds!r}; expected a finite number "
                ">= 0 (seconds; 0 prints a line at every on_log)"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def metric_direction(name: str) -> str | None:
    """Which value of a logged name is its best: ``"min"``, ``"max"``, or ``None`` (no best: a state, not a result).

    `torchloom.Monitor.direction` with ``"max"`` for a name that reads as neither: the name is split into parts at
    ``/``, ``.``, ``_``, ``-`` and spaces, case-insensitively; a part ``lr``, ``learning`` (``learning_rate``),
    ``norm``, ``scale``, ``skipped`` or ``bytes`` gives ``None``; else a part ``loss``, ``error``, ``perplexity``,
    ``mse``, ``mae``, ``rmse``, ``wer``, ``cer`` ..., or one ending in ``loss`` (``logloss``), gives ``"min"``; any
    other name gives ``"max"`` (accuracy, F1, BLEU).

    Example: ``metric_direction("val/loss") == "min"``, ``metric_direction("val/accuracy") == "max"``,
    ``metric_direction("lr-AdamW") is None``, ``metric_direction("grad_norm") is None``,
    ``metric_direction("optimizer/state_bytes") is None``.
    """
    return torchloom.Monitor.direction(name, default="max")


def batch_size(batch: Any) -> int | None:
    """The number of samples in a batch (the first dimension of its first tensor, found by
    `accelerate.utils.find_batch_size`), or ``None`` when the batch holds no tensor with a batch dimension.
    Reads the shape only: no host-device synchronisation."""
    try:
        return int(find_batch_size(batch))
    except (TypeError, ValueError, IndexError):
        return None


@dataclass
class _Track:
    """The last and the best value of one logged name, and whether its value ever changed."""

    direction: str | None
    last: float = math.nan
    last_step: int = 0
    best: float | None = None
    best_step: int | None = None
    first: float | None = None
    changed: bool = False  # a value differed from the first one (a constant, or a single value, has no best)

    def add(self, value: float, step: int) -> None:
        if self.first is None:
            self.first = value
        elif not self.changed and not _same(value, self.first):
            self.changed = True
        self.last, self.last_step = value, step
        if self.direction is not None and torchloom.Monitor.is_better(value, self.best, self.direction):
            self.best, self.best_step = value, step  # NaN is never the best value

    def shown_best(self) -> tuple[float | None, int | None]:
        """The best value and its step, or ``(None, None)`` for a name without a best or whose value never
        changed."""
        return (self.best, self.best_step) if self.changed else (None, None)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class ProgressBar(torchloom.Plugin):
    """Show a progress bar (plain lines when stdout is not a terminal) and a summary table at the end of a run.

    On the main process only. See the module docstring and ``docs/plugins/progress.md``. The torchloom command
    enables it for ``fit``, ``validate`` and ``predict`` unless the config names it.

    Args:
        config (`ProgressConfig`, *optional*): ready-made settings, or pass them as keywords.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(max_epochs=3, plugins={"progress": {}})
        engine.fit(task)  # a bar while training, then the summary table; <run_dir>/summary.json

    Attributes:
        console (`rich.console.Console`): where everything is printed (stdout).
        summary (`dict` or ``None``): the summary of the last completed ``fit`` / ``validate``, as written to
            ``summary.json``; ``None`` when disabled, on other processes, or when the run failed.
    """

    name = "progress"
    Config = ProgressConfig

    def __init__(self, config: ProgressConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        terminal = self.config.terminal
        # Writes to whatever sys.stdout is at the time (file=None); NO_COLOR is rich's own. No markup or emoji
        # codes: metric names are printed as they are.
        self.console = Console(
            force_terminal=terminal, force_interactive=terminal, markup=False, emoji=False, highlight=False
        )
        self.summary: dict[str, Any] | None = None
        self._reset("fit", None)
        if not self.config.enabled:  # the per-batch hooks would return at once
            self.inactive_hooks = frozenset({"on_train_batch_end", "on_predict_batch_end"})

    # ------------------------------------------------------------------------------------------- state

    def _reset(self, stage: str, config: Any) -> None:
        """Fresh state for one ``fit`` / ``validate`` / ``predict`` call."""
        self._stage = stage
        self._max_epochs = getattr(config, "max_epochs", None)
        self._save_model = bool(getattr(config, "save_model", False))
        self._fast_dev_run: int | None = getattr(config, "fast_dev_run_batches", None)  # a quick-debug fit's batches
        self._active = False  # this process displays (main process, enabled): known at on_run_start
        self._bar_mode = False
        self._bar: rich_progress.Progress | None = None
        self._bar_task: Any = None
        self._run_dir: str | None = None
        self._num_processes = 1
        self._total: int | None = None
        self._epoch = 0
        self._samples: int | None = 0  # this process's training samples; None once a batch had no batch size
        self._tracks: dict[str, _Track] = {}
        self._resumed: Any = None  # what a resumed fit continues (torchloom.Resumed)
        self._failed = False
        self._validated = False
        self._next_log_is_validation = False
        self._predicted = 0
        now = time.perf_counter()
        self._started = now
        self._train_start: float | None = None  # the first epoch starts (after the sanity check)
        self._train_end: float | None = None  # on_train_end
        self._val_start, self._val_time = now, 0.0
        self._drawn = -math.inf  # when the bar's counters were last updated
        self._line_time, self._line_steps = -math.inf, 0  # the last plain training line printed
        self._pending: str | None = None  # a training line held back by plain_every_n_seconds
        self.summary = None
        self._model: Any = None  # the fit's model and optimizer (on_fit_start), sized at the end
        self._optimizer: Any = None

    @torchloom.hookimpl
    def setup(self, config, stage: str) -> None:
        self._stop_bar()
        self._reset(stage, config)

    @torchloom.hookimpl
    def on_run_start(self, accelerator, run_dir: str) -> None:
        self._active = self.config.enabled and accelerator.is_main_process
        self._run_dir, self._num_processes = run_dir, accelerator.num_processes
        if self.config.terminal is not None:
            self._bar_mode = self.config.terminal
        else:  # stdout is a terminal that can redraw a line: torchloom's one rule, rich's detection
            self._bar_mode = torchloom.utils.is_terminal(self.console.file)

    # -------------------------------------------------------------------------------------------- fit

    @torchloom.hookimpl
    def on_fit_start(self, task, model, optimizer, resumed) -> None:
        if not self._active:
            return
        self._resumed = resumed
        self._model, self._optimizer = model, optimizer
        for step, _, values in resumed.logged() if resumed is not None else ():  # the earlier runs' values
            self._track(values, step)
        self._total = task.num_training_steps
        if self._bar_mode:
            self._start_bar(
                rich_progress.TextColumn("{task.description}"),
                rich_progress.BarColumn(),
                rich_progress.MofNCompleteColumn(),
                rich_progress.TextColumn("loss {task.fields[loss]}"),
                _RateColumn("steps"),
                rich_progress.TimeElapsedColumn(),
                rich_progress.TextColumn("ETA"),
                rich_progress.TimeRemainingColumn(),
                total=self._total,
                loss="-",
            )

    @torchloom.hookimpl
    def on_train_epoch_start(self, progress) -> None:
        if not self._active:
            return
        if self._train_start is None:  # after the sanity check: the training clock starts here
            self._train_start = time.perf_counter()
            if self._fast_dev_run is not None:  # after the command's own first line (the run directory)
                n = self._fast_dev_run
                self._say(
                    f"fast_dev_run: {n} training and {n} validation batch{'es' if n != 1 else ''} per process, one "
                    "epoch; no sanity pass, no checkpoints, no trackers, no saved model"
                )
        self._epoch = progress.epoch
        self._describe()

    @torchloom.hookimpl
    def on_train_batch_end(self, batch, accelerator, progress) -> None:
        if not self._active:
            return
        self._next_log_is_validation = False  # a validation that logged nothing sends no on_log
        if self._samples is not None:
            n = batch_size(batch)
            self._samples = None if n is None else self._samples + n
        if self._bar is not None and accelerator.sync_gradients:  # an optimizer step just happened
            now = time.perf_counter()
            if now - self._drawn >= 1.0 / self.config.refresh_per_second:
                self._drawn = now
                self._bar.update(self._bar_task, completed=progress.global_step + 1)

    @torchloom.hookimpl
    def on_validation_start(self, progress) -> None:
        if not self._active:
            return
        self._flush_pending()
        self._val_start = time.perf_counter()
        self._describe("validating")
        if self._bar is not None and self._stage == "fit":  # the frame the validation line is printed above
            self._bar.update(self._bar_task, completed=progress.global_step)
            self._bar.refresh()

    @torchloom.hookimpl
    def on_validation_end(self) -> None:
        if not self._active:
            return
        if self._train_start is not None and self._train_end is None:  # not training time
            self._val_time += time.perf_counter() - self._val_start
        self._validated = True
        self._next_log_is_validation = True  # the engine reduces the pass's values right after this hook
        self._describe()

    @torchloom.hookimpl
    def on_log(self, metrics: dict[str, float], progress) -> None:
        if not self._active:
            return
        validation, self._next_log_is_validation = self._next_log_is_validation, False
        self._track(metrics, progress.global_step)
        if validation:
            self._say(self._validation_line(metrics, progress))
        elif self._bar is not None:
            loss = metrics.get("train/loss")
            fields: dict[str, Any] = {} if loss is None else {"loss": summary_text.short(loss)}
            self._drawn = time.perf_counter()
            self._bar.update(self._bar_task, completed=progress.global_step, **fields)
        elif self._stage == "fit" and self._train_end is None:
            self._plain_training_line(metrics, progress)

    @torchloom.hookimpl
    def on_train_end(self, progress) -> None:
        if not self._active:
            return
        self._train_end = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._bar_task, completed=progress.global_step)
        self._stop_bar()  # its last frame stays on the screen
        self._flush_pending()

    @torchloom.hookimpl
    def on_exception(self) -> None:
        self._failed = True
        self._stop_bar()

    @torchloom.hookimpl
    def on_fit_end(self, progress) -> None:
        self._stop_bar()
        if not self._active or self._failed:
            return
        self._flush_pending()
        summary = self._fit_summary(progress)
        if self._fast_dev_run is not None:  # one line, no table, no summary.json: a check, not a result
            self.summary = summary
            self._say(summary_text.fast_dev_run_line(summary, self._fast_dev_run))
            return
        self._finish(summary)

    # ------------------------------------------------------------------------------------ predict

    @torchloom.hookimpl
    def on_predict_start(self) -> None:
        if self._active and self._bar_mode:
            self._start_bar(
                rich_progress.TextColumn("predict"),
                rich_progress.TextColumn("{task.completed:.0f} batches"),
                _RateColumn("batches"),
                rich_progress.TimeElapsedColumn(),
                total=None,
                transient=True,
            )

    @torchloom.hookimpl
    def on_predict_batch_end(self) -> None:
        if self._bar is None:
            return
        self._predicted += 1
        now = time.perf_counter()
        if now - self._drawn >= 1.0 / self.config.refresh_per_second:
            self._drawn = now
            self._bar.update(self._bar_task, completed=self._predicted)

    @torchloom.hookimpl
    def on_predict_end(self) -> None:
        self._stop_bar()

    # ------------------------------------------------------------------------------------------- end

    @torchloom.hookimpl
    def teardown(self, stage: str) -> None:
        self._stop_bar()
        if stage == "validate" and self._active and self._validated:
            self._finish(self._validate_summary())
        self._active = False

    # ----------------------------------------------------------------------------------------- helpers

    def _track(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            track = self._tracks.get(name)
            if track is None:
                track = self._tracks[name] = _Track(metric_direction(name))
            track.add(float(value), step)

    def _start_bar(self, *columns: Any, total: int | None, transient: bool = False, **fields: Any) -> None:
        self._bar = rich_progress.Progress(
            *columns,
            console=self.console,
            refresh_per_second=self.config.refresh_per_second,
            transient=transient,
        )
        self._bar_task = self._bar.add_task(self._description(), total=total, **fields)
        self._bar.start()

    def _stop_bar(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.stop()  # draws the last frame and gives stdout / stderr back

    def _description(self, phase: str = "") -> str:
        return summary_text.epoch_label(self._epoch, self._max_epochs) + (f" {phase}" if phase else "")

    def _describe(self, phase: str = "") -> None:
        if self._bar is not None and self._stage == "fit":
            self._bar.update(self._bar_task, description=self._description(phase))

    def _say(self, line: str) -> None:
        self.console.print(line, soft_wrap=True)  # never wrapped or cut: paths stay whole

    def _where(self, progress: Any) -> str:
        total = f"/{self._total}" if self._total is not None else ""
        return f"{summary_text.epoch_label(progress.epoch, self._max_epochs)}  step {progress.global_step}{total}"

    def _plain_training_line(self, metrics: dict[str, float], progress: Any) -> None:
        now = time.perf_counter()
        parts = [self._where(progress)]
        if "train/loss" in metrics:
            parts.append(f"loss {summary_text.short(metrics['train/loss'])}")
        since = self._line_time if self._line_time > -math.inf else (self._train_start or self._started)
        steps = progress.global_step - self._line_steps
        if steps > 0 and now > since:
            rate = steps / (now - since)
            parts.append(f"{summary_text.rate(rate)} steps/s")
            if self._total is not None:
                eta = max(self._total - progress.global_step, 0) / rate
                parts.append(f"ETA {datetime.timedelta(seconds=round(eta))}")
        line = "  ".join(parts)
        if now - self._line_time >= self.config.plain_every_n_seconds:
            self._say(line)
            self._line_time, self._line_steps, self._pending = now, progress.global_step, None
        else:
            self._pending = line

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self._say(self._pending)
            self._pending = None
            self._line_time = time.perf_counter()

    def _validation_line(self, metrics: dict[str, float], progress: Any) -> str:
        values = "  ".join(f"{name} {summary_text.short(value)}" for name, value in metrics.items())
        if self._stage != "fit":
            return f"validation  {values}"
        return f"validation  {self._where(progress)}  {values}"

    def _metrics_summary(self) -> dict[str, Any]:
        return {
            name: {
                "last": t.last,
                "last_step": t.last_step,
                "best": t.shown_best()[0],
                "best_step": t.shown_best()[1],
                "direction": t.direction,
            }
            for name, t in self._tracks.items()
        }

    def _fit_summary(self, progress: Any) -> dict[str, Any]:
        """The whole training's counts (a resumed fit adds the runs it continues, up to its checkpoint), and
        this run's own under ``this_run``."""
        now = time.perf_counter()
        start = self._train_start if self._train_start is not None else now
        own = summary_text.counts(
            progress.global_step - (self._resumed.global_step if self._resumed is not None else 0),
            None if self._samples is None else self._samples * self._num_processes,
            max((self._train_end or now) - start - self._val_time, 0.0),
            now - self._started,
        )
        whole = own
        if self._resumed is not None:
            before = self._resumed
            samples = None if own["samples"] is None or before.samples is None else before.samples + own["samples"]
            train_time, wall_time = before.train_time_s + own["train_time_s"], before.wall_time_s + own["wall_time_s"]
            whole = summary_text.counts(progress.global_step, samples, train_time, wall_time)
        assert self._run_dir is not None  # set at on_run_start, before any display
        trained = self._train_start is not None or self._resumed is not None
        return {
            "stage": "fit",
            "metrics": self._metrics_summary(),
            "optimizer_steps": whole["optimizer_steps"],
            "epochs": progress.epoch + 1 if trained else 0,
            **whole,
            "this_run": own,
            "runs": 1 + (len(self._resumed.chain) if self._resumed is not None else 0),
            "resumed_from": self._resumed.checkpoint if self._resumed is not None else None,
            "run_dir": self._run_dir,
            "model_dir": os.path.join(self._run_dir, torchloom.utils.MODEL_DIR) if self._save_model else None,
            **self._sizes(),
        }

    def _sizes(self) -> dict[str, Any]:
        """The model's parameters (total, trainable, bytes as held: the whole model's and this process's) and the
        optimizer's state in bytes (the whole state's and this process's: they differ under FSDP2, whose processes
        each hold a shard), at the end of the fit (tensor metadata only)."""
        if self._model is None:
            return {"parameters": None, "optimizer_state_bytes": None}
        counts = torchloom.utils.count_parameters(self._model)
        return {
            "parameters": {key: counts[key] for key in ("total", "trainable", "bytes", "process_bytes")},
            "optimizer_state_bytes": torchloom.utils.optimizer_state_bytes(self._optimizer),
            "optimizer_state_process_bytes": torchloom.utils.optimizer_state_bytes(self._optimizer, per_process=True),
        }

    def _validate_summary(self) -> dict[str, Any]:
        return {
            "stage": "validate",
            "metrics": self._metrics_summary(),
            "wall_time_s": time.perf_counter() - self._started,
            "run_dir": self._run_dir,
        }

    def _finish(self, summary: dict[str, Any]) -> None:
        """Print the summary table and write ``summary.json`` (main process)."""
        self.summary = summary
        self.console.print(Text(f"{summary['stage']} summary", style="bold"), soft_wrap=True)
        self.console.print(self._table(summary))
        for line in summary_text.info_lines(summary):
            self._say(line)
        summary_text.write_json(os.path.join(summary["run_dir"], torchloom.utils.SUMMARY_FILE), summary)

    def _table(self, summary: dict[str, Any]) -> Table:
        fit = summary["stage"] == "fit"
        table = Table()
        table.add_column("metric")
        table.add_column("last" if fit else "value", justify="right")
        if fit:
            table.add_column("best", justify="right")
            table.add_column("at step", justify="right")
        for name, m in sorted(summary["metrics"].items()):
            row = [name, f"{m['last']:.6g}"]
            if fit:
                best = m["best"]
                row += ["-", ""] if best is None else [f"{best:.6g}", str(m["best_step"])]
            table.add_row(*(Text(cell) for cell in row))
        return table


class _RateColumn(rich_progress.ProgressColumn):
    """Completed units per second, over rich's speed window (the last 30 s)."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: rich_progress.Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"- {self.unit}/s" if speed is None else f"{summary_text.rate(speed)} {self.unit}/s")
