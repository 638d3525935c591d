"""Errors a user can cause. Each carries one message that names the thing, the bad value and what is valid.

The CLI prints these as a single line (no traceback); any other exception is a bug or a failure in user
code and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "PluginError",
    "RunFileError",
    "TaskError",
    "TorchloomError",
    "TrainingInterrupted",
]


class TorchloomError(Exception):
    """Base class of errors caused by bad input (a config, a plugin setting, a path)."""


class ConfigError(TorchloomError, ValueError):
    """A setting has a bad value: the message names the setting, the value and what would be valid."""


class PluginError(TorchloomError):
    """A plugin cannot be found, loaded, configured or combined with the other enabled plugins."""


class TaskError(TorchloomError, TypeError, ValueError):
    """A task's step returned something the engine cannot train on (no loss, a loss that is not a scalar
    floating tensor with a gradient). A `TypeError` and a `ValueError` too, for code that catches those."""


class RunFileError(TorchloomError, OSError):
    """A run's files cannot be written: ``output_dir`` is not a writable directory, or the disk is full. The message
    names the path and the operating system's error; files already written are left complete."""


class CheckpointError(TorchloomError):
    """A checkpoint cannot be used: not found, incomplete, altered since it was written, unsafe to load, or
    incompatible with the run (another model shape, optimizer or number of processes). The message says which."""


class TrainingInterrupted(TorchloomError):
    """A fit stopped by a signal (SIGTERM from a scheduler, Ctrl-C) after saving a checkpoint to resume from.

    The ``torchloom`` command exits with `exit_code`, 128 + the signal number (143 for SIGTERM, 130 for SIGINT),
    the status a shell gives a process the signal ended, so that a scheduler can requeue the job.

    Args:
        signal_number (`int`): the signal received.
        checkpoint (`str` or ``None``): the checkpoint saved before stopping; ``None`` when none could be (the state
            was not finite under ``nonfinite_loss`` ``"skip"`` / ``"ignore"``).
        global_step (`int`): the optimizer steps completed, all saved.

    Attributes:
        signal_number (`int`): the signal received.
        checkpoint (`str` or ``None``): the checkpoint saved before stopping.
        global_step (`int`): the optimizer steps completed, all saved.
        exit_code (`int`): 128 + ``signal_number``, the command's exit status.
    """

    def __init__(self, signal_number: int, checkpoint: str | None, global_step: int) -> None:
        import signal

        self.signal_number, self.checkpoint, self.global_step = signal_number, checkpoint, global_step
        self.exit_code = 128 + signal_number
        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = f"signal {signal_number}"
        if checkpoint is None:
            super().__init__(
                f"interrupted by {name} after optimizer step {global_step}; no checkpoint was saved, its state is not "
                "finite: fit again with --resume from an earlier checkpoint (--resume auto takes the latest)"
            )
            return
        super().__init__(
            f"interrupted by {name} after optimizer step {global_step}; the checkpoint {checkpoint!r} holds "
            "everything to continue: fit again with --resume (or ckpt_path=...)"
        )
