"""torchloom: a Lightning-style training engine over Hugging Face Accelerate; every technique is a plugin.

The public API is exactly what this module exports; plugins (built-in or third-party) import nothing else.

Names are imported when first used (PEP 562 module ``__getattr__``, as SciPy and scikit-image load lazily,
scientific-python SPEC 1): ``import torchloom`` alone imports neither torch nor Accelerate, so that
``torchloom --help``, ``--version`` and a plugin module that needs only ``hookimpl`` start fast. ``from
torchloom import Engine`` imports what ``Engine`` needs, as an eager import would.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchloom._version import __version__

#: Public name -> the module that defines it.
_EXPORTS = {
    "CheckpointError": "torchloom.errors",
    "ConfigError": "torchloom.errors",
    "DataModule": "torchloom.data",
    "Engine": "torchloom.engine",
    "EngineConfig": "torchloom.config",
    "INTERNAL_PREFIX": "torchloom._names",
    "Plugin": "torchloom.plugins",
    "PluginError": "torchloom.errors",
    "MODEL_DIR": "torchloom._layout",
    "Monitor": "torchloom.monitor",
    "PendingCheckpoint": "torchloom._async_save",
    "PluginInfo": "torchloom.plugins",
    "Progress": "torchloom.progress",
    "Resumed": "torchloom._lineage",
    "RunFileError": "torchloom.errors",
    "SUMMARY_FILE": "torchloom._layout",
    "StepHooks": "torchloom.step",
    "TaskError": "torchloom.errors",
    "TaskModule": "torchloom.module",
    "TorchloomError": "torchloom.errors",
    "TrainingInterrupted": "torchloom.errors",
    "WindowOutOfMemory": "torchloom.step",
    "build_config": "torchloom.plugins",
    "closest_name": "torchloom._suggest",
    "convert_hf_args": "torchloom._hf_args",
    "count_parameters": "torchloom._sizes",
    "delete_checkpoint": "torchloom.checkpoint",
    "enable_plugins": "torchloom.plugins",
    "estimate_flops": "torchloom._flops",
    "estimate_memory": "torchloom._memory_plan",
    "estimate_optimizer_memory": "torchloom.memory",
    "format_bytes": "torchloom._bytes",
    "hookimpl": "torchloom.hookspecs",
    "hookspec": "torchloom.hookspecs",
    "inspect_path": "torchloom._inspect",
    "installed_plugins": "torchloom.plugins",
    "is_out_of_memory": "torchloom.step",
    "is_terminal": "torchloom._output",
    "json_dumps": "torchloom._strict_json",
    "optimizer_state_bytes": "torchloom._sizes",
    "load_plugin_state": "torchloom.state",
    "prune_checkpoints": "torchloom._retention",
    "prune_lineage": "torchloom._retention",
    "quiet_libraries": "torchloom._output",
    "RankAgreement": "torchloom._agreement",
    "rank_agreement": "torchloom._context",
    "request_stop": "torchloom._context",
    "save_checkpoint": "torchloom._context",
    "save_checkpoint_async": "torchloom._context",
    "save_plugin_state": "torchloom.state",
    "warn": "torchloom._warn",
    "write_atomically": "torchloom._atomic",
}

__all__ = [
    "INTERNAL_PREFIX",
    "MODEL_DIR",
    "SUMMARY_FILE",
    "CheckpointError",
    "ConfigError",
    "DataModule",
    "Engine",
    "EngineConfig",
    "Monitor",
    "PendingCheckpoint",
    "Plugin",
    "PluginError",
    "PluginInfo",
    "Progress",
    "RankAgreement",
    "Resumed",
    "RunFileError",
    "StepHooks",
    "TaskError",
    "TaskModule",
    "TorchloomError",
    "TrainingInterrupted",
    "WindowOutOfMemory",
    "__version__",
    "build_config",
    "closest_name",
    "convert_hf_args",
    "count_parameters",
    "delete_checkpoint",
    "enable_plugins",
    "estimate_flops",
    "estimate_memory",
    "estimate_optimizer_memory",
    "format_bytes",
    "hookimpl",
    "hookspec",
    "inspect_path",
    "installed_plugins",
    "is_out_of_memory",
    "is_terminal",
    "json_dumps",
    "load_plugin_state",
    "optimizer_state_bytes",
    "prune_checkpoints",
    "prune_lineage",
    "quiet_libraries",
    "rank_agreement",
    "request_stop",
    "save_checkpoint",
    "save_checkpoint_async",
    "save_plugin_state",
    "warn",
    "write_atomically",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchloom' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from torchloom._agreement import RankAgreement
    from torchloom._async_save import PendingCheckpoint
    from torchloom._atomic import write_atomically
    from torchloom._bytes import format_bytes
    from torchloom._context import rank_agreement, request_stop, save_checkpoint, save_checkpoint_async
    from torchloom._flops import estimate_flops
    from torchloom._hf_args import convert_hf_args
    from torchloom._inspect import inspect_path
    from torchloom._layout import MODEL_DIR, SUMMARY_FILE
    from torchloom._lineage import Resumed
    from torchloom._memory_plan import estimate_memory
    from torchloom._names import INTERNAL_PREFIX
    from torchloom._output import is_terminal, quiet_libraries
    from torchloom._retention import prune_checkpoints, prune_lineage
    from torchloom._strict_json import json_dumps
    from torchloom._suggest import closest_name
    from torchloom._warn import warn
    from torchloom.checkpoint import delete_checkpoint
    from torchloom.config import EngineConfig
    from torchloom.data import DataModule
    from torchloom.engine import Engine
    from torchloom.errors import (
        CheckpointError,
        ConfigError,
        PluginError,
        RunFileError,
        TaskError,
        TorchloomError,
        TrainingInterrupted,
    )
    from torchloom.hookspecs import hookimpl, hookspec
    from torchloom.memory import estimate_optimizer_memory
    from torchloom.module import TaskModule
    from torchloom.monitor import Monitor
    from torchloom.plugins import Plugin, PluginInfo, build_config, enable_plugins, installed_plugins
    from torchloom.progress import Progress
    from torchloom.state import load_plugin_state, save_plugin_state
    from torchloom.step import StepHooks, WindowOutOfMemory, is_out_of_memory
