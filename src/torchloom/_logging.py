"""Logged values of a run: buffered on the device per stage, reduced over the ranks in one collective, kept.

`TaskModule.log` and the ``log`` argument of hooks write into the `RunLog` of the running call (reached through
the run context, `torchloom._context`), so the engine writes nothing onto the user's task. Training and validation
values go to separate buffers: a validation pass reduces only what it logged, and a training window is never split
between two records.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from torchloom._logbuffer import LogBuffer
from torchloom._names import INTERNAL_PREFIX
from torchloom.errors import TaskError

__all__ = ["INTERNAL_PREFIX", "RunLog"]


class RunLog:
    """The logged values of one engine: a training and a validation `LogBuffer`, the records, the latest values.

    Attributes:
        history (`list[dict]`): every reduction of the run: ``step``, ``epoch`` and the reduced names.
        latest (`dict[str, float]`): the latest reduced value of every name.
    """

    def __init__(self) -> None:
        self.train, self.val = LogBuffer(), LogBuffer(zero_weights=True)  # validation: weight 0 counts nothing
        self._buffer = self.train
        self.history: list[dict[str, Any]] = []
        self.latest: dict[str, float] = {}

    def log(
        self, name: str, value: torch.Tensor | float | Any, weight: torch.Tensor | float = 1.0, reduce: str = "mean"
    ) -> None:
        """Add a value to the buffer of the current stage (validation inside `validating`, else training)."""
        self._buffer.log(name, value, weight, reduce)

    def clear(self) -> None:
        """Forget everything: buffers, history and latest values (a new run starts)."""
        self.train.clear()
        self.val.clear()
        self.history.clear()  # in place: Engine.history and Engine.logged_metrics are these objects
        self.latest.clear()

    @contextmanager
    def validating(self) -> Iterator[None]:
        """Send what is logged to the validation buffer."""
        previous, self._buffer = self._buffer, self.val
        try:
            yield
        finally:
            self._buffer = previous

    @contextmanager
    def predicting(self) -> Iterator[None]:
        """Refuse what is logged: a prediction pass reduces and records no logged value (Lightning refuses
        ``self.log`` in ``predict_step`` too), so a value logged there would be dropped without a word."""
        previous, self._buffer = self._buffer, _REFUSING
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

    def report(
        self, buffer: LogBuffer, run: Any, progress: Any, weights: tuple[str, ...] = ()
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Reduce ``buffer`` over the ranks, record the result and send it to ``on_log``; return ``(reported,
        internal)`` values (the summed weights of the ``mean`` names in ``weights`` among the internal ones, see
        `LogBuffer.reduce`).

        Every rank must call this at the same point of the run: it enters one collective whatever this rank
        buffered (on several processes), so a rank that logged nothing still meets the others. The values are
        the same on every rank. Internal names (`INTERNAL_PREFIX`) are returned apart and not recorded.

        Args:
            run: the run (its ``accelerator``, ``agreement`` and ``relay``).
            progress (`Progress`): where the loop is; its ``global_step`` and ``epoch`` go into the record.

        Raises:
            TaskError: the ranks logged different names.
        """
        metrics = buffer.reduce(run.accelerator, run.agreement, weights)
        internal = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(INTERNAL_PREFIX)]}
        if metrics:
            self.latest.update(metrics)
            self.history.append({"step": progress.global_step, "epoch": progress.epoch, **metrics})
            run.relay.call("on_log", metrics=metrics, progress=progress, accelerator=run.accelerator)
        return metrics, internal


class _Refusing:
    """The buffer of a prediction pass: every `log` is a `TaskError`."""

    def log(self, name: str, *args: Any, **kwargs: Any) -> None:
        raise TaskError(
            f"log({name!r}) during predict: a prediction run reduces and records no logged value, so it would be "
            "lost. Return the value from predict_step (it reaches on_predict_batch_end and the predictions), or "
            "log it from validation_step and run validate"
        )


_REFUSING: Any = _Refusing()
