"""torchloom: a Lightning-style training engine over Hugging Face Accelerate; every technique is a plugin.

The public API is exactly what this module exports; plugins (built-in or third-party) import nothing else.
"""

from torchloom._inspect import inspect_path
from torchloom._logging import request_stop
from torchloom._memory_plan import estimate_memory
from torchloom.checkpoint import delete_checkpoint, save_checkpoint
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
from torchloom.plugins import Plugin, PluginInfo, build_config, enable_plugins, installed_plugins
from torchloom.progress import Progress
from torchloom.state import load_plugin_state, save_plugin_state
from torchloom.step import StepHooks

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataModule",
    "Engine",
    "EngineConfig",
    "Plugin",
    "PluginError",
    "PluginInfo",
    "Progress",
    "RunFileError",
    "StepHooks",
    "TaskError",
    "TaskModule",
    "TorchloomError",
    "TrainingInterrupted",
    "__version__",
    "build_config",
    "delete_checkpoint",
    "enable_plugins",
    "estimate_memory",
    "estimate_optimizer_memory",
    "hookimpl",
    "hookspec",
    "inspect_path",
    "installed_plugins",
    "load_plugin_state",
    "request_stop",
    "save_checkpoint",
    "save_plugin_state",
]
