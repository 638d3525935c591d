"""The ``torchloom`` command: ``fit``, ``validate``, ``predict`` and ``plugins``.

Configs are parsed with jsonargparse (as LightningCLI does)::

    torchloom fit --config examples/fine_foods.yaml --engine.max_epochs=2 --data.init_args.batch_size=32
    torchloom fit --config examples/fine_foods.yaml --print_config       # the resolved config, then exit
    torchloom plugins [--json] [--config FILE]                           # installed plugins [and call order]

A config has four sections: ``engine`` (`EngineConfig` fields), ``task`` (``class_path`` of a `TaskModule`
subclass + ``init_args``), ``data`` (same for a `DataModule`, optional) and ``plugins``
(``name: {settings}``). The directory of the ``--config`` file is put on ``sys.path``, so tasks defined
next to it import by module name.
Errors caused by bad input print one line and exit with status 2; no traceback.

The command is a client of torchloom's public API (the names in ``torchloom.__all__``), as a plugin is: it
builds and composes plugins through `torchloom.Engine` (``Engine.hook_order`` for the call order) and lists
them with `torchloom.installed_plugins`; ``tests/test_cli_public_api.py`` checks its imports.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pluggy
import yaml

import torchloom
from torchloom import DataModule, EngineConfig, TaskModule, TorchloomError

__all__ = ["main"]

RUN_COMMANDS = ("fit", "validate", "predict")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchloom`` console script. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _put_config_dir_on_path(argv)
    try:
        parser = _build_parser()
        cfg = parser.parse_args(argv)
        command = cfg.subcommand
        if command == "plugins":
            return _plugins_command(cfg.plugins)
        return _run_command(parser, cfg, command)
    except TorchloomError as exc:
        print(f"torchloom: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torchloom: interrupted", file=sys.stderr)
        return 130


def _build_parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="torchloom", description="Train, validate and inspect torchloom runs.", allow_abbrev=False
    )
    subcommands = parser.add_subcommands(dest="subcommand")
    for command in RUN_COMMANDS:
        sub = ArgumentParser(description=f"{command} a task (see 'torchloom {command} --help')", allow_abbrev=False)
        sub.add_argument("--config", action=ActionConfigFile, help="YAML config file (may be repeated)")
        sub.add_class_arguments(EngineConfig, "engine", help="Loop settings (torchloom.EngineConfig)")
        sub.add_subclass_arguments(TaskModule, "task", required=True, help="The task: class_path + init_args")
        sub.add_subclass_arguments(DataModule, "data", required=False, help="The data: class_path + init_args")
        sub.add_argument(
            "--plugins",
            type=dict[str, dict[str, Any] | None] | list[str | dict[str, dict[str, Any] | None]] | None,
            default=None,
            help="Plugins to enable, in order: {name: {settings}} or a list of names",
        )
        subcommands.add_subcommand(command, sub, help=f"{command} a task")
    plugins = ArgumentParser(description="List installed plugins (and the call order for a config)")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.add_argument("--config", type=str | None, default=None, help="a run config: show its plugin order")
    subcommands.add_subcommand("plugins", plugins, help="list installed plugins")
    return parser


def _run_command(parser: Any, cfg: Any, command: str) -> int:
    resolved = yaml.safe_load(parser.dump(cfg, skip_unset=False))[command]
    resolved.pop("config", None)
    try:
        objects = parser.instantiate(cfg)[command]
    except Exception as exc:  # jsonargparse wraps what a task's or data's __init__ raised
        cause = _user_error_in(exc)
        if cause is None:
            raise
        raise cause from None
    engine = torchloom.Engine(objects.engine, plugins=objects.plugins)
    resolved["plugins"] = engine.resolved_plugin_settings()  # with every default filled in
    engine.run_config = resolved
    engine.plugins.append(_RunDirectoryAnnouncer(engine, command))  # the CLI's own: not in config.yaml
    task, data = objects.task, objects.data
    if command == "fit":
        metrics = engine.fit(task, datamodule=data)
    elif command == "validate":
        metrics = engine.validate(task, datamodule=data)
    else:
        predictions = engine.predict(task, datamodule=data)
        metrics = {"batches": float(len(predictions))}
    if engine.accelerator is None or engine.accelerator.is_main_process:
        print(f"torchloom {command}: output in {engine.run_dir}")
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


def _plugins_command(cfg: Any) -> int:
    if cfg.config:
        return _plugin_order(cfg.config, as_json=cfg.json)
    rows = []
    for name, registrations in torchloom.installed_plugins().items():
        for info in registrations:
            row: dict[str, Any] = {
                "name": name,
                "distribution": info.distribution,
                "version": info.version,
                "summary": "",
                "hooks": [],
                "status": "ok",
            }
            if len(registrations) > 1:
                others = [r.distribution for r in registrations if r is not info]
                row["status"] = f"conflict: name also registered by {', '.join(others)}"
            try:
                obj = info.load()
            except TorchloomError as exc:
                row["status"] = f"failed to import: {exc.__cause__!r}"
            else:
                row["summary"] = (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else ""
                row["hooks"] = _implemented_hooks(obj)
            rows.append(row)
    if cfg.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no torchloom plugins installed")
    for row in rows:
        print(f"{row['name']}  ({row['distribution']} {row['version']})  [{row['status']}]")
        if row["summary"]:
            print(f"    {row['summary']}")
        if row["hooks"]:
            print(f"    hooks: {', '.join(row['hooks'])}")
    return 0


def _implemented_hooks(obj: Any) -> list[str]:
    """The methods of a plugin (class, object or module) marked with `torchloom.hookimpl`, in the order its
    classes define them (base classes first), read with pluggy's own parser: nothing is called."""
    pm = pluggy.PluginManager(torchloom.hookimpl.project_name)
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    namespaces: list[Mapping[str, Any]] = [vars(k) for k in reversed(classes)]
    if not isinstance(obj, type):  # an object or a module: its own attributes too
        namespaces.append(getattr(obj, "__dict__", {}))
    names = dict.fromkeys(n for namespace in namespaces for n in namespace if not n.startswith("_"))
    return [n for n in names if pm.parse_hookimpl_opts(obj, n) is not None]


def _plugin_order(path: str, as_json: bool) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    except OSError as exc:
        raise TorchloomError(f"plugins --config: cannot read {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise TorchloomError(f"plugins --config: {path!r} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise TorchloomError(f"plugins --config: {path!r} holds a {type(config).__name__}; expected a mapping")
    engine = torchloom.Engine(plugins=config.get("plugins"))  # enables the plugins; builds and runs nothing
    order = engine.hook_order()  # composed as a run composes them
    enabled = list(engine.resolved_plugin_settings())
    if as_json:
        print(json.dumps({"enabled": enabled, "hooks": order}, indent=2))
        return 0
    print("enabled plugins, in order: " + (", ".join(enabled) or "(none)"))
    for name, impls in order.items():
        print(f"  {name}: {' -> '.join(impls)}")
    return 0


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


def _put_config_dir_on_path(argv: list[str]) -> None:
    """Make modules next to the ``--config`` file (and in the working directory) importable."""
    paths = [os.getcwd()]
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(os.path.dirname(os.path.abspath(argv[i + 1])))
        elif arg.startswith("--config="):
            paths.append(os.path.dirname(os.path.abspath(arg.split("=", 1)[1])))
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


if __name__ == "__main__":
    raise SystemExit(main())
