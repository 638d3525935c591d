"""A learning-rate scheduler stepped per epoch, every N steps or epochs, or on a monitored logged value.

``configure_optimizers`` may return Lightning's scheduler dict,
``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval": "step" | "epoch", "frequency": n,
"monitor": "val/loss"}}``. A plain scheduler (interval ``step``, frequency 1, no monitor) is stepped by the default
step after every optimizer step, as before, and is not wrapped. Anything else is a `Schedule`, which the engine
steps at three points:

- `Schedule.step`, after every optimizer step (`StepHooks.optimizer_step`): the ``step`` interval, every
  ``frequency``-th optimizer step;
- `Schedule.epoch_end`, after each training epoch's validation and before ``on_train_epoch_end`` (so that an
  epoch-end checkpoint holds the stepped scheduler): the ``epoch`` interval, every ``frequency``-th epoch;
- `Schedule.validation_end`, after each validation pass of a fit: with a ``monitor`` (``ReduceLROnPlateau``, whose
  monitor defaults to ``val/loss``), ``scheduler.step(value)`` at every ``frequency``-th pass, with the value
  reduced over all processes (the same on every process).

Its state (the scheduler's and the count of calls) is what checkpoints save as ``lr_scheduler``, so a resumed fit
steps at the same points as the uninterrupted one.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from torchloom._suggest import closest_name
from torchloom.errors import ConfigError, TaskError

__all__ = ["INTERVALS", "Schedule", "after_epoch", "after_validation", "schedule_from"]

#: The values of a Lightning scheduler dict's ``interval``.
INTERVALS = ("step", "epoch")
#: The keys a Lightning scheduler dict may have.
KEYS = ("scheduler", "interval", "frequency", "monitor")
#: The monitor of a ``ReduceLROnPlateau`` returned without one.
DEFAULT_MONITOR = "val/loss"


class Schedule:
    """A scheduler with when to step it; the rest of the scheduler's API (``get_last_lr``, ``optimizer``) is the
    scheduler's own.

    Attributes:
        scheduler: the scheduler.
        interval (`str`): ``"step"`` or ``"epoch"`` (without a monitor).
        frequency (`int`): step it every this many optimizer steps, epochs or validation passes.
        monitor (`str` or `None`): the logged name whose value ``scheduler.step(value)`` gets at validation.
        count (`int`): the calls counted so far (steps, epochs or validation passes).
    """

    def __init__(self, scheduler: Any, interval: str, frequency: int, monitor: str | None, source: str) -> None:
        self.scheduler, self.interval, self.frequency, self.monitor = scheduler, interval, frequency, monitor
        self.source, self.count = source, 0

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def step(self) -> None:
        """After an optimizer step that was taken: the ``step`` interval."""
        if self.monitor is None and self.interval == "step":
            self._tick()

    def epoch_end(self) -> None:
        """After a training epoch (and its validation): the ``epoch`` interval."""
        if self.monitor is None and self.interval == "epoch":
            self._tick()

    def validation_end(self, metrics: Mapping[str, float]) -> None:
        """After a validation pass of a fit, with the values logged so far (reduced over the processes).

        Raises:
            TaskError: the monitored name is not among them.
        """
        if self.monitor is None:
            return
        if self.monitor not in metrics:
            names = sorted(metrics)
            hint = closest_name(self.monitor, names)
            raise TaskError(
                f"{self.source}: the scheduler monitors {self.monitor!r}, which was not logged by this validation"
                + (f"; did you mean {hint!r}?" if hint else ";")
                + f" Logged names: {', '.join(map(repr, names)) or 'none'}. Log it, or set 'monitor' in the "
                "lr_scheduler dict to one of these"
            )
        self._tick(float(metrics[self.monitor]))

    def _tick(self, *value: float) -> None:
        self.count += 1
        if self.count % self.frequency == 0:
            with warnings.catch_warnings():
                # A fit resumed from the checkpoint of an epoch's last step steps an epoch schedule before this
                # process's first optimizer step: the step the uninterrupted fit took there, not a misordered one.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                self.scheduler.step(*value)

    def state_dict(self) -> dict[str, Any]:
        """``{"scheduler": the scheduler's state_dict(), "count": int}``."""
        return {"scheduler": self.scheduler.state_dict(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.count = int(state["count"])


def schedule_from(scheduler: Any, spec: Mapping[str, Any] | None, source: str) -> Any:
    """The scheduler to step: ``scheduler`` itself when it steps after every optimizer step, else a `Schedule`.

    Args:
        scheduler: the scheduler (already checked to have ``step()``).
        spec: Lightning's dict it came in (``interval``, ``frequency``, ``monitor``), or ``None``.
        source (`str`): who returned it, for the messages.

    Raises:
        ConfigError: an unknown key, an interval other than ``step`` / ``epoch``, a frequency that is not an
            integer >= 1, a monitor that is not a string.
    """
    spec = spec or {}
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown lr_scheduler key {unknown[0]!r}; valid keys: {', '.join(KEYS)}")
    interval, frequency, monitor = spec.get("interval", "step"), spec.get("frequency", 1), spec.get("monitor")
    if interval not in INTERVALS:
        raise ConfigError(f"{source}: lr_scheduler interval {interval!r}; expected one of {', '.join(INTERVALS)}")
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ConfigError(f"{source}: lr_scheduler frequency {frequency!r}; expected an integer >= 1")
    if monitor is not None and not isinstance(monitor, str):
        raise ConfigError(f"{source}: lr_scheduler monitor {monitor!r}; expected a logged name such as 'val/loss'")
    if monitor is None and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        monitor = DEFAULT_MONITOR
    if interval == "step" and frequency == 1 and monitor is None:
        return scheduler
    return Schedule(scheduler, interval, frequency, monitor, source)


def after_validation(scheduler: Any, metrics: Mapping[str, float]) -> None:
    """Step a monitoring `Schedule` after a validation pass of a fit (nothing for another scheduler)."""
    if isinstance(scheduler, Schedule):
        scheduler.validation_end(metrics)


def after_epoch(scheduler: Any) -> None:
    """Step an epoch-interval `Schedule` after a training epoch (nothing for another scheduler)."""
    if isinstance(scheduler, Schedule):
        scheduler.epoch_end()
