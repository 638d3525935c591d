"""What the run commands (``fit``, ``validate``, ``predict``) share: their config options, the engine, task and data a
parsed config gives (`prepare`), and the lines they print at the end (`report`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

import torchloom
from torchloom import ConfigError, EngineConfig, TorchloomError

__all__ = ["CKPT_PATH_HELP", "add_ckpt_path", "add_run_arguments", "prepare", "report", "weights_lines"]


def add_run_arguments(sub: Any) -> None:
    """The options every run command takes: ``--config``, and the ``engine``, ``task``, ``data`` and ``plugins``
    sections."""
    from jsonargparse import ActionConfigFile

    sub.add_argument("--config", action=ActionConfigFile, help="YAML config file (may be repeated)")
    sub.add_class_arguments(EngineConfig, "engine", help="Loop settings (torchloom.EngineConfig)")
    # Not required here: `plugins --config` reads a config with no task; a run checks for it itself.
    sub.add_subclass_arguments(torchloom.TaskModule, "task", required=False, help="The task: class_path + init_args")
    sub.add_subclass_arguments(torchloom.DataModule, "data", required=False, help="The data: class_path + init_args")
    # Read and checked by torchloom.cli._options (`take_cli_options`) and `plugin_section`, not by jsonargparse.
    sub.add_argument(
        "--plugins",
        type=Any,
        default=None,
        help="Plugins to enable, in order: {name: {settings}} or a list of names. "
        "--plugins.NAME.SETTING=VALUE changes one setting (and enables NAME if it is not enabled yet).",
    )


#: ``--ckpt_path``'s help, ``validate``'s and ``predict``'s alike (``{command}``: the command's verb).
CKPT_PATH_HELP = (
    "Load these weights before {command}: a checkpoint (a directory with manifest.json; its files are checked "
    "against it first), an exported model (model/, or a .safetensors file), a run directory (its model/, else its "
    "latest checkpoint), an output_dir (its latest checkpoint), or 'last' / 'best': the latest checkpoint of the "
    "engine's output_dir, or the one with the best value of the 'checkpoint' plugin's monitor (as Lightning's "
    "ckpt_path='last' / 'best'; a directory named so is ./last). A path that holds none of these, or a checkpoint "
    "whose files do not match its manifest, is an error that names the path and what it may be."
)


def add_ckpt_path(sub: Any, command: str) -> None:
    """``--ckpt_path``: the weights ``validate`` or ``predict`` loads first (`torchloom.Engine.validate`)."""
    sub.add_argument("--ckpt_path", type=str | None, default=None, help=CKPT_PATH_HELP.format(command=command))


def weights_lines(engine: Any, command: str) -> list[str]:
    """``torchloom COMMAND: weights of checkpoint PATH`` (or ``saved model``) when ``--ckpt_path`` loaded some."""
    if engine.weights_from is None:
        return []
    kind, path = engine.weights_from
    return [f"torchloom {command}: weights of {'checkpoint' if kind == 'checkpoint' else 'saved model'} {path}"]


def prepare(parser: Any, cfg: Any, command: str) -> tuple[Any, Any, Any]:
    """The `torchloom.Engine`, the task and the data of a parsed run config, ready to run ``command``.

    The engine's ``run_config`` (written to ``config.yaml``) is the resolved config with every plugin setting
    filled in; the engine also announces the run directory when the run starts.

    Raises:
        ConfigError: the config names no task.
        TorchloomError: what the task's or the data's ``__init__`` raised.
    """
    if cfg[command].task is None:
        raise ConfigError(
            f"{command}: no task; name a TaskModule subclass in the config (task: {{class_path: module.Class}}) "
            "or with --task=module.Class"
        )
    resolved = yaml.safe_load(parser.dump(cfg, skip_unset=False))[command]
    resolved.pop("config", None)
    try:
        objects = parser.instantiate(cfg)[command]
    except Exception as exc:  # jsonargparse wraps what a task's or data's __init__ raised
        cause = _user_error_in(exc)
        if cause is None:
            raise
        raise cause from None
    # The plugins as merged by load_run_config; the Engine adds the default plugins that they do not name.
    engine = torchloom.Engine(objects.engine, plugins=cfg[command].plugins)
    resolved["plugins"] = engine.resolved_plugin_settings()  # with every default filled in
    engine.run_config = resolved
    engine.plugins.append(_RunDirectoryAnnouncer(engine, command))  # the CLI's own: not in config.yaml
    return engine, objects.task, objects.data


def report(
    engine: Any, command: str, metrics: Mapping[str, float], before: Iterable[str] = (), after: Iterable[str] = ()
) -> int:
    """Print, on the main process, where the run's output is (``before`` and ``after`` that line) and its
    metrics; return the exit status, 0."""
    if engine.accelerator is None or engine.accelerator.is_main_process:
        for line in before:
            print(line)
        print(f"torchloom {command}: output in {engine.run_dir}")
        for line in after:
            print(line)
        for name, value in sorted(metrics.items()):
            print(f"  {name} = {value:.6g}")
    return 0


class _RunDirectoryAnnouncer:
    """Prints the run directory once, on the main process, when the run starts (``fit``: before the first step)."""

    name = "torchloom.cli"

    def __init__(self, engine: Any, command: str) -> None:
        self.engine, self.command, self.said = engine, command, False

    def _say(self, accelerator: Any) -> None:
        if not self.said and accelerator.is_main_process:
            print(f"torchloom {self.command}: run directory {self.engine.run_dir}", flush=True)
            if self.command == "fit" and self.engine.resumed_from is not None:
                step = self.engine.progress.global_step
                print(f"torchloom fit: resumed from {self.engine.resumed_from} (step {step})", flush=True)
        self.said = True

    @torchloom.hookimpl
    def on_fit_start(self, accelerator: Any) -> None:
        self._say(accelerator)

    @torchloom.hookimpl
    def on_validation_start(self, accelerator: Any) -> None:
        self._say(accelerator)

    @torchloom.hookimpl
    def on_predict_start(self, accelerator: Any) -> None:
        self._say(accelerator)


def _user_error_in(exc: BaseException) -> TorchloomError | None:
    """The `TorchloomError` at the root of an exception chain, if there is one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TorchloomError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
