"""Errors a user can cause. Each carries one message that names the thing, the bad value and what is valid.

The CLI prints these as a single line (no traceback); any other exception is a bug or a failure in user
code and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "PluginError", "RunFileError", "TaskError", "TorchloomError"]


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
