"""How every command that reads a run config reads it (`load_run_config`): ``fit``, ``validate``, ``predict``,
``--print_config`` and ``plugins --config`` accept and reject the same files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torchloom
from torchloom import ConfigError, EngineConfig, TorchloomError

from ._options import apply_mapping_options, set_key, take_mapping_options
from ._yaml import read_config_file

__all__ = ["checked_engine", "config_paths", "load_run_config", "plugin_section"]


def load_run_config(
    parser: Any, argv: list[str], command: str, plugin_options: Sequence[tuple[str, Any]]
) -> tuple[Any, Any]:
    """Parse a run command's arguments: the one way every command reads a config.

    Checks each ``--config`` file first (`read_config_file`), parses with jsonargparse, merges the plugin options
    into the files' ``plugins`` section (a mapping from then on), and checks the engine settings and the plugins
    (imports the plugins the config enables, builds nothing).

    Returns:
        The parsed namespace (``plugins`` replaced by the merged mapping) and the checked `torchloom.Engine`.
    """
    for path in config_paths(argv):
        read_config_file(path)
    argv, mapping_options = take_mapping_options(parser, argv, command)
    cfg = parser.parse_args(argv)
    run = cfg[command]
    apply_mapping_options(run, mapping_options)
    run.plugins = _merge_plugin_options(plugin_section(run.plugins, "plugins"), plugin_options)
    return cfg, checked_engine(run)


def config_paths(argv: Sequence[str]) -> list[str]:
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def plugin_section(value: Any, where: str) -> dict[str, Any]:
    """The plugins of a ``plugins`` section (or of a ``--plugins`` value) as one ordered mapping name -> settings.

    Accepts every form `torchloom.Engine` accepts from a config: ``{name: settings}``, or a list of names and
    ``{name: settings}`` mappings. Settings must be a mapping or empty (the defaults); whether each setting is
    valid is the plugin's to say (`torchloom.build_config`).

    Raises:
        ConfigError: naming ``where``, the bad value and the forms that are valid.
    """
    valid = "a mapping {name: {settings}} or a list of names, e.g. {grad_clip: {max_norm: 1.0}} or [grad_clip]"
    if value is None:
        return {}
    if isinstance(value, Mapping):
        entries = list(value.items())
    elif isinstance(value, list):
        entries = []
        for entry in value:
            if isinstance(entry, str):
                entries.append((entry, None))
            elif isinstance(entry, Mapping):
                entries.extend(entry.items())
            else:
                raise ConfigError(
                    f"{where}: entry {entry!r} ({type(entry).__name__}) is not a plugin; expected a name or a "
                    "{name: {settings}} mapping"
                )
    elif isinstance(value, str):
        raise ConfigError(f"{where}: got the string {value!r}; expected {valid.replace('[grad_clip]', f'[{value}]')}")
    else:
        raise ConfigError(f"{where}: got {value!r} ({type(value).__name__}); expected {valid}")
    section: dict[str, Any] = {}
    for name, settings in entries:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: {name!r} ({type(name).__name__}) is not a plugin name; expected {valid}")
        if ":" in name:
            raise ConfigError(
                f"{where}: {name!r} is not a plugin name; in YAML a colon needs a space after it: "
                f"{{{name.replace(':', ': ', 1)}}}"
            )
        if name in section:
            raise ConfigError(f"{where}: plugin {name!r} is listed twice; list each plugin once")
        if settings is not None and not isinstance(settings, Mapping):
            raise ConfigError(
                f"{where}: settings of plugin {name!r} = {settings!r} ({type(settings).__name__}); expected a "
                f"mapping {{setting: value}}, or nothing for the defaults ({_valid_settings(name)})"
            )
        section[name] = dict(settings) if settings is not None else None
    return section


def _valid_settings(name: str) -> str:
    """``valid settings: a, b`` of an installed plugin, read from its ``Config``; what is known otherwise."""
    registrations = torchloom.installed_plugins().get(name)
    if not registrations:
        return "see 'torchloom plugins' for the installed plugins"
    try:
        config = getattr(registrations[0].load(), "Config", None)
    except TorchloomError:
        config = None
    if config is None or not dataclasses.is_dataclass(config):
        return f"plugin {name!r} takes no settings"
    fields = [f.name for f in dataclasses.fields(config) if f.init]
    return f"valid settings: {', '.join(fields) or '(none)'}"


def _merge_plugin_options(section: dict[str, Any], options: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Apply the command line's plugin options, in order, to the config's plugins.

    ``--plugins=VALUE`` replaces the whole section; ``--plugins.NAME=SETTINGS`` replaces NAME's settings;
    ``--plugins.NAME.SETTING[.KEY...]=VALUE`` sets one setting and keeps NAME's other settings. A plugin that is
    not enabled yet is appended to the end.
    """
    for key, value in options:
        if not key:
            section = plugin_section(value, "--plugins")
            continue
        name, *path = key.split(".")
        option = f"--plugins.{key}"
        if not path:
            section.update(plugin_section({name: value}, option))
            continue
        settings = section.get(name)
        if settings is None:
            settings = section[name] = {}
        set_key(settings, path, value, option, f"plugins.{name}")
    return section


def checked_engine(run: Any) -> Any:
    """The `torchloom.Engine` of a parsed run config: checks the engine settings, imports and configures the
    enabled plugins and composes them (``hook_order``); builds and runs nothing."""
    engine_settings = run.engine.as_dict() if run.engine is not None else {}
    # The config as given: `--print_config` and `plugins --config` show it without the default plugins.
    engine = torchloom.Engine(EngineConfig(**engine_settings), plugins=run.plugins, default_plugins=False)
    engine.hook_order()
    return engine
