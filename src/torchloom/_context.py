"""The run context: what tasks and plugins reach without an argument while a ``fit``, ``validate`` or ``predict``
runs in this thread: logging (`TaskModule.log`), `request_stop`, `save_checkpoint` and `rank_agreement`.

The engine makes one `RunContext` per call and makes it current for the call's duration (one
`contextvars.ContextVar`); the functions here read it. Nothing is written onto the user's task.

- ``log`` buffers into the run's `torchloom._logging.RunLog`;
- `request_stop` records this process's request; the loop agrees on it over the processes at its next check;
- `save_checkpoint` calls the running fit's loop (`torchloom._loop.FitLoop.save_checkpoint`), which writes the
  fit's entries next to the plugins' states with `torchloom.checkpoint.store.write`;
- `rank_agreement` is the run's `torchloom.RankAgreement`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from torchloom._agreement import RankAgreement
    from torchloom._logging import RunLog
    from torchloom.checkpoint.async_save import PendingCheckpoint

__all__ = [
    "RunContext",
    "current",
    "log_to_active_run",
    "rank_agreement",
    "request_stop",
    "save_checkpoint",
    "save_checkpoint_async",
]


@dataclass
class RunContext:
    """What the running call exposes ambiently.

    Attributes:
        log (`RunLog`): the engine's logged values.
        agreement (`RankAgreement`): the run's rank agreement.
        saver (`Callable[[str | None], str | None]`, *optional*): the fit loop's ``save_checkpoint``; ``None`` outside a
            fit.
        async_saver (`Callable[[str | None], PendingCheckpoint | None]`, *optional*): the fit loop's
            ``save_checkpoint_async``; ``None`` outside a fit.
        stop_reason (`str`, *optional*): this process's pending stop request (the first one's reason).
    """

    log: RunLog
    agreement: RankAgreement
    saver: Callable[[str | None], str | None] | None = None
    async_saver: Callable[[str | None], PendingCheckpoint | None] | None = None
    stop_reason: str | None = None


_CURRENT: ContextVar[RunContext | None] = ContextVar("torchloom_run_context", default=None)


@contextlib.contextmanager
def activate(context: RunContext) -> Iterator[RunContext]:
    """Make ``context`` current in this thread for the block (the engine's, around each call)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


def current(what: str) -> RunContext:
    """The current run context.

    Raises:
        RuntimeError: no ``fit`` / ``validate`` / ``predict`` runs in this thread (``what`` names the caller).
    """
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError(f"{what} called outside Engine.fit / validate / predict")
    return context


def log_to_active_run(
    name: str, value: torch.Tensor | float | Any, weight: torch.Tensor | float = 1.0, reduce: str = "mean"
) -> None:
    """Buffer a value in the running call's log (see `TaskModule.log`).

    Raises:
        RuntimeError: no ``fit`` / ``validate`` / ``predict`` is running.
    """
    current(f"log({name!r})").log.log(name, value, weight, reduce)


def request_stop(reason: str) -> None:
    """Ask the running ``fit`` to stop after the current optimizer step (see `TaskModule.request_stop`).

    The request is this process's until the engine's next check, where it is combined over the ranks
    (`torchloom.RankAgreement.first`): every rank stops at the same optimizer step. Checks happen after each
    logging of training values (``log_every_n_steps``), after each validation pass and at the end of each epoch.
    The fit then ends as a success: ``on_train_end``, a final validation if the last step was not validated, the
    model save, ``on_fit_end`` and ``teardown``. `Engine.stop_reason` holds the reason afterwards.

    Args:
        reason (`str`): why, for people: printed by the CLI and kept in `Engine.stop_reason`.

    Raises:
        RuntimeError: no ``fit`` / ``validate`` / ``predict`` is running in this thread.
        TypeError: ``reason`` is not a non-empty string.
    """
    if not isinstance(reason, str) or not reason:
        raise TypeError(f"request_stop(reason): reason must be a non-empty string; got {reason!r}")
    context = current("request_stop()")
    if context.stop_reason is None:  # the first request's reason is kept
        context.stop_reason = reason


def save_checkpoint(directory: str | os.PathLike[str] | None = None) -> str | None:
    """Save the state of the running fit, so that ``fit(..., ckpt_path=...)`` continues it exactly.

    Call it on every process at the same point, from ``on_train_step_end`` (after an optimizer step) or
    ``on_train_epoch_end``: it writes on every process (each its random states) and waits for all of them.
    The `checkpoint` plugin calls it on a schedule; a plugin of your own can too.

    Args:
        directory (`str` or `os.PathLike`, *optional*): where to write; must not exist. Defaults to
            ``<run_dir>/checkpoints/step-<global_step, 8 digits>`` (``...-epoch-end`` from
            ``on_train_epoch_end`` of an epoch that ran to its end). At the end of an epoch cut short (``max_steps``,
            a stop request) whose last step's checkpoint was just saved, that checkpoint is the fit's state
            (nothing was trained since): its path is returned and nothing is written.

    Before anything is written, the model's weights, the optimizer's state and every plugin's state are checked
    finite on every process (one fused flag, one all-reduce: the save syncs anyway). A checkpoint of non-finite
    state is never written: under the engine's ``nonfinite_loss="error"`` the fit stops, otherwise the save is
    skipped with a warning (the first of the fit) and ``None`` is returned.

    Returns:
        `str` or ``None``: the path of the complete checkpoint; ``None`` when non-finite state was skipped.

    Raises:
        RuntimeError: no fit is running in this thread, or it is called outside those two hooks.
        TaskError: the state is not finite (``nonfinite_loss="error"``); the message names the part and the step.
        CheckpointError: ``directory`` already exists.
        PluginError: a plugin's ``state_dict()`` returned something outside the state contract.
        RunFileError: the files cannot be written (the disk is full, ...) on any process; nothing is left under
            the final name, and every process raises.
    """
    saver = current("save_checkpoint()").saver
    if saver is None:
        raise RuntimeError("save_checkpoint() called outside Engine.fit")
    return saver(None if directory is None else os.fspath(directory))


def save_checkpoint_async(directory: str | os.PathLike[str] | None = None) -> PendingCheckpoint | None:
    """Save the state of the running fit as `save_checkpoint` does, written in the background; return at once.

    At the call, on every process, the state (the model, the optimizer, the scheduler, the loss scaler, the
    random states, the data position, every stateful plugin's state) is copied once into host memory (the
    memory cost: one copy of that state); a thread then writes it in the layout of a synchronous save, and
    `torchloom.PendingCheckpoint.result`, called on every process at the same point, writes the manifest and
    renames the checkpoint into place, exactly as a synchronous save does. At most one save is in flight: a
    save (synchronous or not) first waits for the previous one; the end of training waits for it too (a fit
    that fails: on one process it is completed, on several discarded). Until it is complete the checkpoint is a
    temporary directory: a crash leaves the previous checkpoint the latest. One process or DDP only (FSDP and
    DeepSpeed save their shards with collectives: save synchronously).

    Args:
        directory (`str` or `os.PathLike`, *optional*): as for `save_checkpoint`.

    The state is checked finite first, as `save_checkpoint` does, before anything is copied.

    Returns:
        `torchloom.PendingCheckpoint` or ``None``: its ``path`` is where the checkpoint will be; ``result()`` waits
        for it. ``None`` when non-finite state was skipped (``nonfinite_loss`` ``"skip"`` / ``"ignore"``).

    Raises:
        RuntimeError: no fit is running in this thread, or it is called outside ``on_train_step_end`` /
            ``on_train_epoch_end``.
        TaskError: the state is not finite (``nonfinite_loss="error"``).
        CheckpointError: ``directory`` already exists; the run uses FSDP or DeepSpeed.
        PluginError: a plugin's ``state_dict()`` returned something outside the state contract.
        RunFileError: the previous save in flight failed (raised here, on every process).
    """
    saver = current("save_checkpoint_async()").async_saver
    if saver is None:
        raise RuntimeError("save_checkpoint_async() called outside Engine.fit")
    return saver(None if directory is None else os.fspath(directory))


def rank_agreement() -> RankAgreement:
    """The `torchloom.RankAgreement` of the running call: how plugins and tasks make a decision that every process
    takes alike (a stop, a save on a signal), on a CPU process group of the run's own.

    Raises:
        RuntimeError: no ``fit`` / ``validate`` / ``predict`` is running in this thread.
    """
    return current("rank_agreement()").agreement
