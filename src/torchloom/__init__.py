"""torchloom: a Lightning-style training engine over Hugging Face Accelerate; every technique is a plugin.

The public API is what this module exports (the framework's model: `TaskModule`, `Engine`, the hooks, `Plugin`, the
settings, the errors, the checkpoint and memory entry points) and `torchloom.utils` (the helpers a plugin may use);
plugins (built-in or third-party) import nothing else.

Names are imported when first used (PEP 562 module ``__getattr__``, as SciPy and scikit-image load lazily,
scientific-python SPEC 1): ``import torchloom`` alone imports neither torch nor Accelerate, so that
``torchloom --help``, ``--version`` and a plugin module that needs only ``hookimpl`` start fast. ``from
torchloom import Engine`` imports what ``Engine`` needs, as an eager import would.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchloom._lazy import lazy_exports
from torchloom._version import __version__

#: Public name -> the module that defines it.
_EXPORTS = {
    "CheckpointError": "torchloom.errors",
    "ConfigError": "torchloom.errors",
    "DataModule": "torchloom.data",
    "Engine": "torchloom.engine",
    "EngineConfig": "torchloom.config",
    "Plugin": "torchloom.plugins",
    "PluginError": "torchloom.errors",
    "Monitor": "torchloom.monitor",
    "PendingCheckpoint": "torchloom.checkpoint.async_save",
    "PluginInfo": "torchloom.plugins",
    "Progress": "torchloom.progress",
    "Resumed": "torchloom.checkpoint.lineage",
    "RunFileError": "torchloom.errors",
    "StepHooks": "torchloom.step",
    "TaskError": "torchloom.errors",
    "TaskModule": "torchloom.module",
    "TorchloomError": "torchloom.errors",
    "TrainingInterrupted": "torchloom.errors",
    "WindowOutOfMemory": "torchloom.step",
    "build_config": "torchloom.plugins",
    "convert_hf_args": "torchloom.tools.hf_args.convert",
    "delete_checkpoint": "torchloom.checkpoint.store",
    "enable_plugins": "torchloom.plugins",
    "estimate_flops": "torchloom.tools.flops",
    "estimate_memory": "torchloom.tools.memory_plan",
    "estimate_optimizer_memory": "torchloom.tools.optimizer_memory",
    "hookimpl": "torchloom.hookspecs",
    "hookspec": "torchloom.hookspecs",
    "inspect_path": "torchloom.rundir.inspect",
    "installed_plugins": "torchloom.plugins",
    "load_plugin_state": "torchloom.checkpoint.plugin_state",
    "prune_checkpoints": "torchloom.checkpoint.retention",
    "prune_lineage": "torchloom.checkpoint.retention",
    "RankAgreement": "torchloom._agreement",
    "rank_agreement": "torchloom._context",
    "request_stop": "torchloom._context",
    "save_checkpoint": "torchloom._context",
    "save_checkpoint_async": "torchloom._context",
    "save_plugin_state": "torchloom.checkpoint.plugin_state",
}

__all__ = [
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
    "convert_hf_args",
    "delete_checkpoint",
    "enable_plugins",
    "estimate_flops",
    "estimate_memory",
    "estimate_optimizer_memory",
    "hookimpl",
    "hookspec",
    "inspect_path",
    "installed_plugins",
    "load_plugin_state",
    "prune_checkpoints",
    "prune_lineage",
    "rank_agreement",
    "request_stop",
    "save_checkpoint",
    "save_checkpoint_async",
    "save_plugin_state",
]


_lazy_getattr, __dir__ = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "utils":  # the second shelf, imported when first used
        return importlib.import_module("torchloom.utils")
    utils = importlib.import_module("torchloom.utils")
    if name in utils.__all__ and name != "plugins_with":  # a helper's old place, until 0.3
        import warnings

        warnings.warn(
            f"torchloom.{name} moved to torchloom.utils.{name}; the old name stops working in torchloom 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(utils, name)
    return _lazy_getattr(name)


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from torchloom import utils as utils
    from torchloom._agreement import RankAgreement
    from torchloom._context import rank_agreement, request_stop, save_checkpoint, save_checkpoint_async
    from torchloom.checkpoint.async_save import PendingCheckpoint
    from torchloom.checkpoint.lineage import Resumed
    from torchloom.checkpoint.plugin_state import load_plugin_state, save_plugin_state
    from torchloom.checkpoint.retention import prune_checkpoints, prune_lineage
    from torchloom.checkpoint.store import delete_checkpoint
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
    from torchloom.module import TaskModule
    from torchloom.monitor import Monitor
    from torchloom.plugins import Plugin, PluginInfo, build_config, enable_plugins, installed_plugins
    from torchloom.progress import Progress
    from torchloom.rundir.inspect import inspect_path
    from torchloom.step import StepHooks, WindowOutOfMemory
    from torchloom.tools.flops import estimate_flops
    from torchloom.tools.hf_args.convert import convert_hf_args
    from torchloom.tools.memory_plan import estimate_memory
    from torchloom.tools.optimizer_memory import estimate_optimizer_memory
