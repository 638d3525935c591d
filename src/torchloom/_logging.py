"""Logged values of a run: buffered on the device per stage, reduced over the ranks in one collective, kept.

`TaskModule.log` and the ``log`` argument of hooks write into the run that is active in this thread (a
`contextvars.ContextVar`), so the engine writes nothing onto the user's task. Training and validation values
go to separate buffers: a validation pass reduces only what it logged, and a training window is never split
between two records.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from torchloom._logbuffer import LogBuffer
from torchloom._names import INTERNAL_PREFIX

__all__ = ["INTERNAL_PREFIX", "RunLog", "active_run_log", "log_to_active_run", "request_stop"]


_ACTIVE: ContextVar[RunLog | None] = ContextVar("torchloom_active_run_log", default=None)


def active_run_log() -> RunLog | None:
    """The run log active in this thread (its ``latest`` values and ``history``), ``None`` outside a run."""
    return _ACTIVE.get()


def log_to_active_run(
    name: str, value: torch.Tensor | float | Any, weight: torch.Tensor | float = 1.0, reduce: str = "mean"
) -> None:
    """Buffer a value in the run active in this thread (see `TaskModule.log`).

    Raises:
        RuntimeError: no ``fit`` / ``validate`` / ``predict`` is running.
    """
    run_log = _ACTIVE.get()
    if run_log is None:
        raise RuntimeError(f"log({name!r}) called outside Engine.fit / validate / predict")
    run_log.log(name, value, weight, reduce)


def request_stop(reason: str) -> None:
    """Ask the running ``fit`` to stop after the current optimizer step (see `TaskModule.request_stop`).

    The request is this process's until the engine's next check, where it is combined over the ranks: every
    rank stops at the same optimizer step. Checks happen after each logging of training values
    (``log_every_n_steps``), after each validation pass and at the end of each epoch. The fit then ends as a
    success: ``on_train_end``, a final validation if the last step was not validated, the model save,
    ``on_fit_end`` and ``teardown``. `Engine.stop_reason` holds the reason afterwards.

    Args:
        reason (`str`): why, for people: printed by the CLI and kept in `Engine.stop_reason`.

    Raises:
        RuntimeError: no ``fit`` / ``validate`` / ``predict`` is running in this thread.
        TypeError: ``reason`` is not a non-empty string.
    """
    if not isinstance(reason, str) or not reason:
        raise TypeError(f"request_stop(reason): reason must be a non-empty string; got {reason!r}")
    run_log = _ACTIVE.get()
    if run_log is None:
        raise RuntimeError("request_stop() called outside Engine.fit / validate / predict")
    if run_log.stop_reason is None:  # the first request's reason is kept
        run_log.stop_reason = reason


class RunLog:
    """The logged values of one engine: a training and a validation `LogBuffer`, the records, the latest values.

    Attributes:
        history (`list[dict]`): every reduction of the run: ``step``, ``epoch`` and the reduced names.
        latest (`dict[str, float]`): the latest reduced value of every name.
    """

    def __init__(self) -> None:
        self.train, self.val = LogBuffer(), LogBuffer()
        self._buffer = self.train
        self.history: list[dict[str, Any]] = []
        self.latest: dict[str, float] = {}
        #: The reason of this process's pending stop request (`request_stop`), ``None`` without one.
        self.stop_reason: str | None = None

    def log(
        self, name: str, value: torch.Tensor | float | Any, weight: torch.Tensor | float = 1.0, reduce: str = "mean"
    ) -> None:
        """Add a value to the buffer of the current stage (validation inside `validating`, else training)."""
        self._buffer.log(name, value, weight, reduce)

    def clear(self) -> None:
        """Forget everything: buffers, history, latest values and a stop request (a new run starts)."""
        self.train.clear()
        self.val.clear()
        self.history.clear()  # in place: Engine.history and Engine.logged_metrics are these objects
        self.latest.clear()
        self.stop_reason = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make this the run that `log_to_active_run` (and so `TaskModule.log`) writes into."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def validating(self) -> Iterator[None]:
        """Send what is logged to the validation buffer."""
        previous, self._buffer = self._buffer, self.val
        try:
            yield
        finally:
            self._buffer = previous

    @contextmanager
    def discarding(self) -> Iterator[None]:
        """Check what is logged (types, shapes) and drop it: the sanity pass. A torchmetrics object logged here
        is reset afterwards, so what it saw during the pass is not counted later."""
        previous, self._buffer = self._buffer, LogBuffer()
        try:
            yield
        finally:
            self._buffer.reset_metrics()
            self._buffer = previous

    def reduce(
        self, buffer: LogBuffer, accelerator: Any, step: int, epoch: int, weights: tuple[str, ...] = ()
    ) -> tuple[dict[str, float], dict]:
        """Reduce ``buffer`` over the ranks and record the result; return ``(reported, internal)`` values (the
        summed weights of the ``mean`` names in ``weights`` among the internal ones, see `LogBuffer.reduce`).

        Every rank must call this at the same point of the run: it enters one collective whatever this rank
        buffered (on several processes), so a rank that logged nothing still meets the others. The values are
        the same on every rank. Internal names (`INTERNAL_PREFIX`) are returned apart and not recorded.

        Raises:
            TaskError: the ranks logged different names.
        """
        metrics = buffer.reduce(accelerator, weights)
        internal = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(INTERNAL_PREFIX)]}
        if metrics:
            self.latest.update(metrics)
            self.history.append({"step": step, "epoch": epoch, **metrics})
        return metrics, internal
