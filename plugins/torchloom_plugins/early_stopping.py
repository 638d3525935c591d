"""Early stopping: end the fit when a logged value has stopped improving.

Method card
-----------
- **What:** watch one logged value (``monitor``, by default ``val/loss``) and stop the fit when it has not
  improved for ``patience`` checks in a row, when it is NaN or infinite (``check_finite``), when it beats
  ``stopping_threshold`` or when it gets worse than ``divergence_threshold``. A *check* is one ``on_log`` call
  that carries the monitored name: for a validation value, one per validation pass (every
  ``val_check_interval`` optimizer steps, or at the end of each epoch); for a training value, one per
  ``log_every_n_steps``. A value improves when it beats the best so far by more than ``min_delta``
  (``mode: min``: ``value < best - min_delta``; ``mode: max``: ``value > best + min_delta``); the first finite
  value of a fit is always the first best.
- **Mechanism:** ``on_log`` receives the values reduced over all processes, the same on every process, so every
  process takes the same decision; the plugin then calls `torchloom.request_stop` with a reason naming the
  monitored value, its best and the step of the best. The engine combines the requests over the processes and
  stops every process after the same optimizer step (the step of the check). The fit ends as a success:
  ``on_train_end``, the model save, ``on_fit_end``; `Engine.stop_reason` holds the reason.
- **Hooks:** ``setup`` (a fit's) resets ``best`` / ``wait``, or starts them from a state loaded outside a fit
  (a resume loads its state after ``setup``, as the plugin lifecycle states); ``on_fit_start`` starts the fit's
  bookkeeping; ``on_log`` checks; ``on_train_end`` marks the end of training (the values of the
  final validation after it are still tracked, but no stop is requested any more: nothing is left to stop);
  ``on_fit_end`` warns once, on the main process, when the fit completed without ever logging ``monitor``, or
  checked it too few times while training for ``patience`` ever to stop it. The monitored value, its best so far
  and these checks are a `torchloom.Monitor` (which warns when the plugin is made if ``mode`` reads wrong for the
  name), the helper ``checkpoint`` uses too.
  ``on_log`` outside a fit (``Engine.validate``) changes nothing.
- **State:** ``state_dict`` / ``load_state_dict`` carry ``best``, ``best_step``, ``wait`` and ``stopped_step``
  (plain numbers, saved as JSON by ``torchloom.save_plugin_state``), so a resumed run keeps counting its patience.
- **Source:** Lightning's ``EarlyStopping`` callback (``lightning.pytorch.callbacks.early_stopping``): the same
  ``monitor`` / ``mode`` / ``patience`` / ``min_delta`` / ``check_finite`` / ``stopping_threshold`` /
  ``divergence_threshold`` settings and its order of the checks (non-finite, thresholds, patience; ``best`` and
  ``wait`` are updated first here). The decision is taken on the value reduced over the processes, where
  Lightning decides on each rank's own value and stops all ranks if any one decides to.

Run: ``plugins: {early_stopping: {monitor: val/loss, patience: 3}}`` with ``val_check_interval`` set, or with the
default validation at the end of each epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torchloom
from torchloom import ConfigError, PluginError

__all__ = ["EarlyStopping", "EarlyStoppingConfig"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class EarlyStoppingConfig:
    """Settings of the ``early_stopping`` plugin.

    Args:
        monitor (`str`, defaults to ``"val/loss"``): the logged name to watch, as it appears in ``engine.history``.
        mode (`str`, defaults to ``"min"``): ``"min"`` (lower is better) or ``"max"`` (higher is better).
        patience (`int`, defaults to 3): stop at the ``patience``-th check in a row whose value does not improve
            on the best (with 3: best, no, no, no -> stop at that third "no").
        min_delta (`float`, defaults to 0.0): an improvement must beat the best by more than this; a change of
            exactly ``min_delta`` does not count.
        check_finite (`bool`, defaults to `True`): stop at once when the monitored value is NaN or infinite.
        stopping_threshold (`float`, *optional*): stop at once when the value is strictly better than this.
        divergence_threshold (`float`, *optional*): stop at once when the value is strictly worse than this.

    Raises:
        ConfigError: an empty or internal ``monitor``, an unknown ``mode``, ``patience`` < 1, ``min_delta`` < 0
            or not finite, a threshold that is not finite, or thresholds on the wrong side of each other.
    """

    monitor: str = "val/loss"  # the logged name to watch (a key of engine.history)
    mode: str = "min"  # "min": lower is better; "max": higher is better
    patience: int = 3  # stop at the patience-th check in a row without improvement
    min_delta: float = 0.0  # an improvement beats the best by more than this
    check_finite: bool = True  # stop at once on a NaN or infinite value
    stopping_threshold: float | None = None  # stop at once when the value is strictly better than this
    divergence_threshold: float | None = None  # stop at once when the value is strictly worse than this

    def __post_init__(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor.strip():
            raise ConfigError(f"setting 'monitor' = {self.monitor!r}: expected a logged name such as 'val/loss'")
        if self.monitor.startswith(torchloom.utils.INTERNAL_PREFIX):
            raise ConfigError(
                f"setting 'monitor' = {self.monitor!r}: names under {torchloom.utils.INTERNAL_PREFIX!r} are the "
                "engine's own checks and never reach on_log; monitor a name the task or a plugin logs"
            )
        if self.mode not in torchloom.Monitor.MODES:
            close = torchloom.utils.closest_name(str(self.mode), torchloom.Monitor.MODES)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(f"setting 'mode' = {self.mode!r}{hint}: expected 'min' (lower is better) or 'max'")
        if not _is_int(self.patience) or self.patience < 1:
            raise ConfigError(
                f"setting 'patience' = {self.patience!r}: expected an integer >= 1 (checks in a row without "
                "improvement)"
            )
        if not _is_number(self.min_delta) or not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise ConfigError(f"setting 'min_delta' = {self.min_delta!r}: expected a finite number >= 0")
        self.min_delta = float(self.min_delta)
        if not isinstance(self.check_finite, bool):
            raise ConfigError(f"setting 'check_finite' = {self.check_finite!r}: expected true or false")
        for name in ("stopping_threshold", "divergence_threshold"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_number(value) or not math.isfinite(value):
                raise ConfigError(f"setting {name!r} = {value!r}: expected a finite number, or null (off)")
            setattr(self, name, float(value))
        stop, diverge = self.stopping_threshold, self.divergence_threshold
        if stop is not None and diverge is not None and not (stop < diverge if self.mode == "min" else stop > diverge):
            side = "below" if self.mode == "min" else "above"
            raise ConfigError(
                f"setting 'stopping_threshold' = {stop!r} with 'divergence_threshold' = {diverge!r}: with mode "
                f"{self.mode!r} the stopping threshold must be {side} the divergence threshold"
            )


class EarlyStopping(torchloom.Plugin):
    """Stop the fit when a logged value stops improving; see the module docstring and
    ``docs/plugins/early_stopping.md``.

    Args:
        config (`EarlyStoppingConfig`, *optional*): ready-made settings, or pass them as keywords.

    Example:

    .. code-block:: python

        stopper = EarlyStopping(monitor="val/loss", patience=3)
        engine = torchloom.Engine(val_check_interval=100, plugins=[stopper])
        engine.fit(task)
        print(engine.stop_reason, stopper.best, stopper.best_step)

    Attributes:
        best (`float` or ``None``): the best value of ``monitor`` so far (``None`` before the first check).
        best_step (`int` or ``None``): the ``global_step`` of the check that gave ``best``.
        wait (`int`): checks in a row since the last improvement; the fit stops when it reaches ``patience``.
        stopped_step (`int` or ``None``): the ``global_step`` at which this plugin asked the fit to stop, in the
            current or last fit; ``None`` when it did not.
    """

    name = "early_stopping"
    capabilities = frozenset({"outside_sweeps"})  # a throw-away sweep is not stopped by a validated value
    Config = EarlyStoppingConfig

    def __init__(self, config: EarlyStoppingConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        cfg = self.config
        # the logged value: seen or not, its mode, its best so far (warns here if the mode reads wrong)
        self._monitor = torchloom.Monitor(self.name, cfg.monitor, cfg.mode, min_delta=cfg.min_delta)
        self.wait = 0
        self.stopped_step: int | None = None
        # a state loaded outside a fit (a script's load_plugin_state before Engine.fit): the next fit starts from it
        self._next_start: dict[str, Any] | None = None
        self._in_fit = False  # between on_fit_start and on_fit_end
        self._training = False  # before on_train_end: a stop request still stops something
        self._completed = False  # on_train_end fired in this fit
        self._needed = cfg.patience + 1  # checks while training that a stop by patience needs in this fit

    @property
    def best(self) -> float | None:
        return self._monitor.best

    @best.setter
    def best(self, value: float | None) -> None:
        self._monitor.best = value

    @property
    def best_step(self) -> int | None:
        return self._monitor.best_step

    @best_step.setter
    def best_step(self, value: int | None) -> None:
        self._monitor.best_step = value

    # ------------------------------------------------------------------------------------------- hooks

    @torchloom.hookimpl
    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        # Per-fit state from scratch, or from a state loaded outside a fit; a resume's load_state_dict comes after.
        start = self._next_start or {"best": None, "best_step": None, "wait": 0}
        self._monitor.start()
        self.best, self.best_step, self.wait = start["best"], start["best_step"], start["wait"]

    @torchloom.hookimpl
    def on_fit_start(self) -> None:
        self._next_start = None  # used: the next fit starts from scratch unless a state is loaded before it
        self.stopped_step = None
        self._in_fit, self._training, self._completed = True, True, False
        # the first check of a fit without a best is the best; then `patience` checks without improvement
        self._needed = self.config.patience - self.wait + (self.best is None)

    @torchloom.hookimpl
    def on_log(self, metrics: dict[str, float], progress) -> None:
        if not self._in_fit:  # Engine.validate: nothing to stop
            return
        value = self._monitor.observe(metrics, progress.global_step)
        if value is not None:
            if self._training:
                self._monitor.use(progress.global_step)
            reason = self._check(value, progress.global_step)
            if reason is not None and self._training and self.stopped_step is None:
                self.stopped_step = progress.global_step
                torchloom.request_stop(reason)

    @torchloom.hookimpl
    def on_train_end(self) -> None:
        self._training, self._completed = False, True

    @torchloom.hookimpl
    def on_fit_end(self, accelerator) -> None:
        if (
            self._completed
            and accelerator.is_main_process
            and not self._monitor.warn_if_never_logged("it was never checked")
        ):
            self._warn_if_too_few_checks()
        self._in_fit = self._training = self._completed = False

    def _warn_if_too_few_checks(self) -> None:
        """Warn when the fit checked the value too few times while training for patience to ever stop it."""
        cfg, monitor = self.config, self._monitor
        checks = [step for step, _ in monitor.uses]
        if self.stopped_step is not None or len(checks) >= self._needed:
            return
        n, logged = len(checks), monitor.describe_steps(monitor.steps)
        if checks:
            done = f"{n} time{'s' if n != 1 else ''} while training, at {monitor.describe_steps(checks)}"
        else:
            done = f"0 times while training (it was logged only after training, at {logged})"
        torchloom.utils.warn(
            f"early_stopping: monitor {cfg.monitor!r} was checked {done}; with patience {cfg.patience} a stop needs "
            f"{self._needed} checks while training, so patience could never stop this fit. Log {cfg.monitor!r} "
            "more often (engine settings val_check_interval, log_every_n_steps) or lower patience",
        )

    # -------------------------------------------------------------------------------------- the check

    def _check(self, value: float, step: int) -> str | None:
        """Update ``best`` / ``wait`` with one value of ``monitor``; return why to stop, or ``None``."""
        cfg = self.config
        what = f"early_stopping: {cfg.monitor!r} = {value:.6g} at step {step}"
        if cfg.check_finite and not math.isfinite(value):
            return f"{what} is not finite (check_finite); {self._best_text()}"
        if self._monitor.update(value, step):
            self.wait = 0
        else:
            self.wait += 1
        better, worse = ("below", "above") if cfg.mode == "min" else ("above", "below")
        if cfg.stopping_threshold is not None and self._beyond(value, cfg.stopping_threshold, better):
            return f"{what} is {better} stopping_threshold {cfg.stopping_threshold:g}; {self._best_text()}"
        if cfg.divergence_threshold is not None and self._beyond(value, cfg.divergence_threshold, worse):
            return f"{what} is {worse} divergence_threshold {cfg.divergence_threshold:g}; {self._best_text()}"
        if self.wait >= cfg.patience:
            delta = f" by more than min_delta {cfg.min_delta:g}" if cfg.min_delta else ""
            return (
                f"early_stopping: {cfg.monitor!r} did not improve{delta} for {self.wait} checks in a row "
                f"(patience {cfg.patience}, mode {cfg.mode!r}); {self._best_text()}; last {value:.6g} at step {step}"
            )
        return None

    @staticmethod
    def _beyond(value: float, threshold: float, side: str) -> bool:
        return value < threshold if side == "below" else value > threshold

    def _best_text(self) -> str:
        if self.best is None:
            return "no best value yet"
        return f"best {self.best:.6g} at step {self.best_step}"

    # ---------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"best": float | None, "best_step": int | None, "wait": int, "stopped_step": int | None}``:
        plain numbers, as `torchloom.save_plugin_state` takes (an infinite ``best`` is kept exactly)."""
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``best``, ``best_step``, ``wait`` and ``stopped_step``.

        Before a fit (a resume), the next fit keeps them instead of starting afresh: its first check adds to the
        loaded ``wait`` and compares with the loaded ``best``. ``best_step`` and ``stopped_step`` are steps of the
        run that saved the state. During a fit the values apply from the next check.

        Raises:
            PluginError: ``state`` is not such a dict: a missing or unknown key, a value of the wrong type, a
                negative count, a NaN ``best``, or only one of ``best`` / ``best_step``.
        """
        expected = (
            "{'best': float | None, 'best_step': int >= 0 | None, 'wait': int >= 0, 'stopped_step': int >= 0 | None}"
        )
        if not isinstance(state, dict) or set(state) != {"best", "best_step", "wait", "stopped_step"}:
            raise PluginError(f"early_stopping: cannot load state {state!r}; expected {expected}")
        best, best_step, wait, stopped_step = state["best"], state["best_step"], state["wait"], state["stopped_step"]
        problems = []
        if best is not None and (not _is_number(best) or math.isnan(best)):
            problems.append(f"best = {best!r} is not a number (NaN is never a best)")
        for key, value, optional in (
            ("best_step", best_step, True),
            ("wait", wait, False),
            ("stopped_step", stopped_step, True),
        ):
            if not (optional and value is None) and (not _is_int(value) or value < 0):
                problems.append(f"{key} = {value!r} is not an integer >= 0")
        if (best is None) != (best_step is None):
            problems.append(f"best = {best!r} and best_step = {best_step!r}: both are set or both are None")
        if problems:
            raise PluginError(
                f"early_stopping: cannot load state {state!r}: {'; '.join(problems)}; expected {expected}"
            )
        self.best = None if best is None else float(best)
        self.best_step, self.wait, self.stopped_step = best_step, wait, stopped_step
        if not self._in_fit:  # outside a fit, or in a resume's set-up: what the next fit starts from
            self._next_start = {"best": self.best, "best_step": best_step, "wait": wait}
