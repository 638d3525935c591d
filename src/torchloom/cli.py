"""The ``torchloom`` command: ``fit``, ``validate``, ``predict``, ``inspect``, ``plugins`` and ``estimate-memory``.

Configs are parsed with jsonargparse (as LightningCLI does)::

    torchloom fit --config examples/fine_foods.yaml --engine.max_epochs=2 --data.init_args.batch_size=32
    torchloom fit --config examples/fine_foods.yaml --print_config       # the resolved config, then exit
    torchloom plugins [--json] [--config FILE]                           # installed plugins [and call order]
    torchloom predict --config run.yaml --ckpt_path PATH                 # with a checkpoint's or export's weights
    torchloom inspect PATH [--json]                                      # a checkpoint, run directory or export
    torchloom convert-hf-args args.json [-o run.yaml]                    # HF TrainingArguments -> engine + plugins
    torchloom estimate-memory MODEL [--budget 8GiB] [--optimizer adamw,adafactor] [--json]  # training memory

A config has four sections: ``engine`` (`EngineConfig` fields), ``task`` (``class_path`` of a `TaskModule`
subclass + ``init_args``), ``data`` (same for a `DataModule`, optional) and ``plugins``
(``name: {settings}``). Every command that reads a config (``fit``, ``validate``, ``predict``, ``--print_config``,
``plugins --config``) reads it with `_load_run_config`, so all of them accept and reject the same files. The
``plugins`` section is read by this module, not by jsonargparse: ``--plugins.NAME.SETTING=VALUE`` changes one
setting and keeps the others. So is every option that sets one key of a free-form mapping argument of the task or the
data (``--data.init_args.feature_args.f_min=1e-3``, for an argument typed ``dict[str, Any]``): it changes that key and
keeps the others. Both kinds of values are read as the config file reads its values (`_ConfigLoader`: YAML, with
``1e-3`` a float), and both are applied after the config files and the other options. The directory of the
``--config`` file (and the working directory) go on ``sys.path`` *after* the installed packages, so tasks defined
next to it import by module name but a file there cannot shadow a library; a ``class_path`` imports (runs) the module
it names.
    torchloom fit --config run.yaml --resume [PATH]                       # continue from the latest checkpoint

Errors caused by bad input print one line and exit with status 2; no traceback. A fit stopped by SIGTERM or
Ctrl-C after the ``checkpoint`` plugin saved exits with 128 + the signal number (143, 130). ``fit``, ``validate`` and
``predict`` also enable the `DEFAULT_PLUGINS` (the ``progress`` display and summary) unless the config names them;
``--print_config`` and ``plugins --config`` show the config as given, ``config.yaml`` what the run enabled.

The command is a client of torchloom's public API (the names in ``torchloom.__all__``), as a plugin is: it
builds and composes plugins through `torchloom.Engine` (``Engine.hook_order`` for the call order) and lists
them with `torchloom.installed_plugins`; ``tests/test_cli_public_api.py`` checks its imports.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
import types
import typing
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from importlib import metadata
from typing import Any

import pluggy
import yaml

import torchloom
from torchloom import ConfigError, EngineConfig, TorchloomError, TrainingInterrupted

__all__ = ["main"]

RUN_COMMANDS = ("fit", "validate", "predict")
#: Plugins every run command enables, after the config's own, unless the config names them (a config that names one
#: uses its settings, e.g. ``progress: {enabled: false}``) or ``TORCHLOOM_PLUGINS`` does not allow them.
DEFAULT_PLUGINS = ("progress",)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchloom`` console script. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_other_processes(os.environ)
    _put_config_dir_on_path(argv)
    try:
        command = next((a for a in argv if not a.startswith("-")), None)
        # The run commands' parsers import torch (they describe TaskModule / DataModule); the others start without.
        full = command in RUN_COMMANDS or (command == "plugins" and any(a.startswith("--config") for a in argv))
        parser, run_parsers = _build_parser(run_commands=full)
        if command in RUN_COMMANDS:
            argv, plugin_options, print_flags = _take_cli_options(argv, argv.index(command) + 1)
            argv, resume = _take_resume_options(argv, command)
            cfg, _ = _load_run_config(parser, argv, command, plugin_options)
            if print_flags is not None:
                sys.stdout.write(run_parsers[command].dump(cfg[command], **print_flags))
                return 0
            return _run_command(parser, cfg, command, **resume)
        cfg = parser.parse_args(argv)
        if cfg.subcommand == "inspect":
            return _inspect_command(cfg.inspect)
        if cfg.subcommand == "convert-hf-args":
            return _convert_hf_args_command(cfg["convert-hf-args"])
        if cfg.subcommand == "estimate-memory":
            return _estimate_memory_command(cfg["estimate-memory"])
        return _plugins_command(parser, cfg.plugins)
    except TrainingInterrupted as exc:  # a checkpoint was saved: the status tells a scheduler to requeue
        print(f"torchloom: {exc}", file=sys.stderr)
        return exc.exit_code
    except TorchloomError as exc:
        print(f"torchloom: error: {' '.join(str(exc).split())}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:
        print("torchloom: interrupted", file=sys.stderr)
        return 130


def _build_parser(run_commands: bool = True) -> tuple[Any, dict[str, Any]]:
    """The ``torchloom`` parser, and the parser of each run command (for ``--print_config``).

    With ``run_commands`` false the run commands get a parser that only names them (enough for ``--help``,
    ``--version``, ``plugins`` and ``inspect``), which imports neither torch nor the task and data classes.
    """
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="torchloom", description="Train, validate and inspect torchloom runs.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"torchloom {torchloom.__version__}")
    subcommands = parser.add_subcommands(dest="subcommand")
    run_parsers = {}
    for command in RUN_COMMANDS:
        sub = ArgumentParser(description=f"{command} a task (see 'torchloom {command} --help')", allow_abbrev=False)
        if not run_commands:
            subcommands.add_subcommand(command, sub, help=f"{command} a task")
            continue
        sub.add_argument("--config", action=ActionConfigFile, help="YAML config file (may be repeated)")
        sub.add_class_arguments(EngineConfig, "engine", help="Loop settings (torchloom.EngineConfig)")
        # Not required here: `plugins --config` reads a config with no task; a run checks for it itself.
        sub.add_subclass_arguments(
            torchloom.TaskModule, "task", required=False, help="The task: class_path + init_args"
        )
        sub.add_subclass_arguments(
            torchloom.DataModule, "data", required=False, help="The data: class_path + init_args"
        )
        # Read and checked by this module (`_take_cli_options`, `_plugin_section`), not by jsonargparse.
        sub.add_argument(
            "--plugins",
            type=Any,
            default=None,
            help="Plugins to enable, in order: {name: {settings}} or a list of names. "
            "--plugins.NAME.SETTING=VALUE changes one setting (and enables NAME if it is not enabled yet).",
        )
        if command == "predict":
            sub.add_argument(
                "--ckpt_path",
                type=str | None,
                default=None,
                help="Load these weights before predicting: a checkpoint, an exported model (model/), a run "
                "directory (its model/, else its latest checkpoint) or an output_dir (its latest checkpoint).",
            )
        subcommands.add_subcommand(command, sub, help=f"{command} a task")
        run_parsers[command] = sub
    plugins = ArgumentParser(description="List installed plugins (and the call order for a config)")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.add_argument("--config", type=str | None, default=None, help="a run config: show its plugin order")
    subcommands.add_subcommand("plugins", plugins, help="list installed plugins")
    inspect = ArgumentParser(description="Describe a checkpoint, a run directory or an exported model")
    inspect.add_argument("path", type=str, help="a checkpoint, a run directory (version_N) or an exported model")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    subcommands.add_subcommand("inspect", inspect, help="describe a checkpoint, run directory or exported model")
    convert = ArgumentParser(description="Turn a saved HF TrainingArguments JSON into a run config (engine, plugins)")
    convert.add_argument("file", type=str, help="a JSON file written by TrainingArguments.to_json_string()")
    convert.add_argument("-o", "--output", type=str | None, default=None, help="write the YAML here, not to stdout")
    subcommands.add_subcommand("convert-hf-args", convert, help="convert HF TrainingArguments JSON to a run config")
    subcommands.add_subcommand("estimate-memory", _estimate_memory_parser(), help="estimate training memory")
    return parser, run_parsers


def _estimate_memory_parser() -> Any:
    from jsonargparse import ArgumentParser

    sub = ArgumentParser(
        description="Estimate the memory of training MODEL: weights, gradients, optimizer state and activations, "
        "for each optimizer, without and with activation checkpointing (torchloom.estimate_memory; see "
        "docs/memory.md for the method and its limits)"
    )
    sub.add_argument(
        "model",
        type=str,
        help="a local Hugging Face model directory, a transformers config .json or a run config .yaml",
    )
    sub.add_argument("--batch_size", type=int, default=8, help="micro-batch size (samples per forward)")
    sub.add_argument(
        "--seq_len", type=int | None, default=None, help="tokens per sample (default: the model's maximum)"
    )
    sub.add_argument("--precision", type=str, default="fp32", help="fp32, bf16 or fp16 (mixed, fp32 master weights)")
    sub.add_argument(
        "--optimizer", type=str | None, default=None, help="comma-separated optimizer names, e.g. adamw,adafactor"
    )
    sub.add_argument("--grad_checkpoint", type=bool, default=True, help="also estimate with activation checkpointing")
    sub.add_argument(
        "--budget",
        type=str | None,
        default=None,
        help="memory per process, e.g. 8GiB: suggest micro-batch x accumulation",
    )
    sub.add_argument(
        "--effective_batch_size",
        type=int | None,
        default=None,
        help="samples per optimizer step (default: --batch_size)",
    )
    sub.add_argument(
        "--architecture",
        type=str | None,
        default=None,
        help="the transformers class to build, e.g. BertForSequenceClassification",
    )
    sub.add_argument(
        "--fused_attention",
        type=bool,
        default=True,
        help="attention keeps no seq_len^2 matrix (as CUDA's fused kernels)",
    )
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return sub


def _take_cli_options(argv: list[str], start: int) -> tuple[list[str], list[tuple[str, Any]], dict[str, Any] | None]:
    """Take the ``--plugins...`` and ``--print_config`` options of a run command out of ``argv``.

    Returns:
        The remaining arguments (for jsonargparse), the plugin options in order as ``(dotted key, value)`` (key
        ``""`` for ``--plugins`` itself; the value parsed as YAML), and the `dump` flags of ``--print_config``
        (``None`` when not given).

    Raises:
        ConfigError: a plugin option without a value, a value that is not YAML, an unknown ``--print_config`` flag.
    """
    rest, options, print_flags = argv[:start], [], None
    args = iter(argv[start:])
    for arg in args:
        option, has_value, text = arg.partition("=")
        if option == "--print_config":
            print_flags = _print_config_flags(text if has_value else "")
            continue
        if option != "--plugins" and not option.startswith("--plugins."):
            rest.append(arg)
            continue
        key = option.removeprefix("--plugins").removeprefix(".")
        if not has_value:
            following = next(args, None)
            if following is None:
                raise ConfigError(f"{option}: expected a value, e.g. {_option_example(key)}")
            text = following
        if any(not part for part in key.split(".")) and key:
            raise ConfigError(f"{option}: empty name in the option; expected {_option_example(key)}")
        options.append((key, _option_value(option, text)))
    return rest, options, print_flags


def _option_value(option: str, text: str) -> Any:
    """The value of a command-line option that torchloom reads itself, read as the config file reads its values.

    Raises:
        ConfigError: ``text`` is not valid YAML.
    """
    try:
        return yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader
    except _DuplicateKey as dup:
        raise ConfigError(f"{option}: value {text!r} repeats the key {dup.key!r}; keep one") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{option}: value {text!r} is not valid YAML ({problem})") from None


def _take_resume_options(argv: list[str], command: str) -> tuple[list[str], dict[str, Any]]:
    """Take ``--resume [PATH]`` and ``--reset_optimizer`` (``fit`` only) out of ``argv``.

    ``--resume`` alone resumes from the latest checkpoint under the run's ``output_dir``; ``--resume PATH`` (or
    ``--resume=PATH``) from a checkpoint, a run directory or an ``output_dir``.

    Raises:
        ConfigError: either option with a command other than ``fit``, or ``--reset_optimizer`` without ``--resume``.
    """
    rest: list[str] = []
    resume: str | bool | None = None
    reset, i = False, 0
    while i < len(argv):
        option, has_value, text = argv[i].partition("=")
        if option == "--resume":
            if has_value:
                resume = text
            elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                resume, i = argv[i + 1], i + 1
            else:
                resume = True
        elif argv[i] == "--reset_optimizer":
            reset = True
        else:
            rest.append(argv[i])
        i += 1
    if (resume is not None or reset) and command != "fit":
        raise ConfigError(f"--resume and --reset_optimizer apply to 'torchloom fit', not to '{command}'")
    if reset and resume is None:
        raise ConfigError("--reset_optimizer applies to a resumed fit; add --resume [PATH]")
    return rest, ({"resume": resume, "reset_optimizer": reset} if command == "fit" else {})


def _option_example(key: str) -> str:
    if not key:
        return "--plugins='{grad_clip: {max_norm: 1.0}}' or --plugins='[grad_clip]'"
    if "." not in key:
        return f"--plugins.{key}='{{setting: value}}'"
    return f"--plugins.{key}=VALUE"


def _print_config_flags(text: str) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    valid = {"skip_default": "skip_default", "skip_unset": "skip_unset", "skip_null": "skip_unset"}
    for flag in filter(None, text.split(",")):
        if flag not in valid:
            raise ConfigError(f"--print_config={text}: unknown flag {flag!r}; valid flags: skip_default, skip_unset")
        flags[valid[flag]] = True
    return flags


def _load_run_config(
    parser: Any, argv: list[str], command: str, plugin_options: Sequence[tuple[str, Any]]
) -> tuple[Any, Any]:
    """Parse a run command's arguments: the one way every command reads a config.

    Checks each ``--config`` file first (`_read_config_file`), parses with jsonargparse, merges the plugin options
    into the files' ``plugins`` section (a mapping from then on), and checks the engine settings and the plugins
    (imports the plugins the config enables, builds nothing).

    Returns:
        The parsed namespace (``plugins`` replaced by the merged mapping) and the checked `torchloom.Engine`.
    """
    for path in _config_paths(argv):
        _read_config_file(path)
    argv, mapping_options = _take_mapping_options(parser, argv, command)
    cfg = parser.parse_args(argv)
    run = cfg[command]
    _apply_mapping_options(run, mapping_options)
    run.plugins = _merge_plugin_options(_plugin_section(run.plugins, "plugins"), plugin_options)
    return cfg, _checked_engine(run)


#: The sections of a run config that name a class (``class_path`` + ``init_args``), whose free-form mapping
#: arguments take ``--SECTION.init_args.ARGUMENT.KEY=VALUE`` options read by this module.
CLASS_SECTIONS = ("task", "data")


def _take_mapping_options(
    parser: Any, argv: list[str], command: str
) -> tuple[list[str], list[tuple[str, str, list[str], Any]]]:
    """Take the options that set one key of a free-form mapping argument of the task or the data out of ``argv``.

    jsonargparse reads such an option (``--data.init_args.feature_args.f_min=1e-3`` for an argument typed
    ``dict[str, Any]``) otherwise than it reads the same value in a file (``null`` becomes the string ``'None'``,
    quotes are kept, a key under a key becomes a string and replaces its siblings), so this module reads them as
    it reads ``--plugins.NAME.SETTING=VALUE``. Which arguments are free-form mappings is known once the classes
    are: with such options present, ``argv`` without them is parsed once first to find the classes.

    Returns:
        The other arguments, and each mapping option in order as ``(option, section, [argument, key, ...],
        value)``, the value read as the config file reads values (`_option_value`).

    Raises:
        ConfigError: such an option without a value, or with a value that is not YAML.
    """
    start = argv.index(command) + 1 if command in argv else 0
    candidates: list[tuple[int, int, str, str, list[str], str]] = []  # first index, count, option, section, path, text
    i = start
    while i < len(argv):
        option, has_value, text = argv[i].partition("=")
        section, _, rest = option.removeprefix("--").partition(".")
        path = rest.removeprefix("init_args.").split(".")
        count = 1
        mapping_key = len(path) >= 2 and all(path) and path[0] not in ("class_path", "init_args", "dict_kwargs")
        if option.startswith("--") and section in CLASS_SECTIONS and mapping_key:
            if not has_value:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{option}: expected a value, e.g. {option}=VALUE")
                text, count = argv[i + 1], 2
            candidates.append((i, count, option, section, path, text))
        i += count
    if not candidates:
        return argv, []
    taken = {j for first, count, *_ in candidates for j in range(first, first + count)}
    classes = parser.parse_args([a for j, a in enumerate(argv) if j not in taken])[command]
    options, kept = [], set[int]()
    for first, count, option, section, path, text in candidates:
        spec = classes[section]
        cls = _import_class(spec.class_path) if spec is not None and spec.get("class_path") else None
        if cls is not None and _free_form_mapping_argument(cls, path[0]):
            options.append((option, section, path, _option_value(option, text)))
        else:  # another kind of argument (a nested class, a typed mapping): jsonargparse reads it
            kept.update(range(first, first + count))
    return [a for j, a in enumerate(argv) if j not in taken or j in kept], options


def _import_class(class_path: str) -> type | None:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def _free_form_mapping_argument(cls: type, name: str) -> bool:
    """Whether ``cls(name=...)`` takes a free-form mapping: ``dict``, ``dict[str, Any]``, ``Mapping[str, Any]``,
    or a union with one of them (``dict[str, Any] | str | None``); searched up the classes whose ``__init__`` passes
    ``**kwargs`` on, as jsonargparse does."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters
        except (TypeError, ValueError):
            return False
        if name in parameters:
            try:
                hint = typing.get_type_hints(init).get(name)
            except Exception:  # an annotation that does not resolve: jsonargparse reports it
                return False
            return _is_free_form_mapping(hint)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
    return False


def _is_free_form_mapping(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_free_form_mapping(arg) for arg in typing.get_args(hint))
    if (origin or hint) not in (dict, Mapping, MutableMapping):
        return False
    args = typing.get_args(hint)
    return not args or args[1] in (Any, object)


def _apply_mapping_options(run: Any, options: Sequence[tuple[str, str, list[str], Any]]) -> None:
    """Set each key that `_take_mapping_options` took, in order, keeping the mapping's other keys."""
    for option, section, (argument, *path), value in options:
        init_args = run[section].init_args
        current = init_args.get(argument)
        if current is not None and not isinstance(current, Mapping):
            raise ConfigError(
                f"{option}: {section}.init_args.{argument} = {current!r} is not a mapping, so it has no key "
                f"{path[0]!r}; set the whole value instead: --{section}.init_args.{argument}='{{{path[0]}: ...}}'"
            )
        mapping = copy.deepcopy(dict(current or {}))
        _set_key(mapping, path, value, option, f"{section}.init_args.{argument}")
        init_args[argument] = mapping


def _config_paths(argv: Sequence[str]) -> list[str]:
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


class _ConfigLoader(yaml.SafeLoader):
    """How torchloom reads a config file and the option values it reads itself: YAML's safe loader with the two
    changes jsonargparse (which reads the files' values) makes to it, so that a value means the same in a file and
    on the command line, and with a key that appears twice in one mapping an error (PyYAML keeps the last).

    The changes: a number in e-notation is a float with or without a dot (``1e-3``, ``1E5``; PyYAML reads them as
    strings), and a date stays a string (``2024-01-01``). ``tests/test_cli_inputs.py`` checks that the command
    line and a file agree on every kind of value.
    """

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: PyYAML reports it itself
                    continue
        return super().construct_mapping(node, deep=deep)


def _as_jsonargparse_reads(loader: type[yaml.SafeLoader]) -> None:
    """Give ``loader`` the float and timestamp rules of jsonargparse's YAML loader (see `_ConfigLoader`)."""
    loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_FLOAT, _TIMESTAMP)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    loader.add_implicit_resolver(_FLOAT, _FLOAT_PATTERN, list("-+0123456789."))


_FLOAT, _TIMESTAMP = "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"
_FLOAT_PATTERN = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_as_jsonargparse_reads(_ConfigLoader)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


def _read_config_file(path: str) -> dict[str, Any]:
    """Read a config file as YAML, strictly: it must hold a mapping, and no mapping in it may repeat a key.

    Raises:
        ConfigError: a file that cannot be read, is not YAML, is empty, holds no mapping, or repeats a key.
    """
    sections = "a mapping with the sections engine, task, data and plugins"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"config {path!r}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path!r}: not a UTF-8 text file ({exc.reason})") from None
    try:
        config = yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader
    except _DuplicateKey as dup:
        raise ConfigError(
            f"config {path!r}: key {dup.key!r} appears twice (lines {dup.first} and {dup.second}); keep one"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config {path!r} is not valid YAML{where}: {problem}") from None
    if config is None:
        raise ConfigError(f"config {path!r} is empty; expected {sections}")
    if not isinstance(config, dict):
        raise ConfigError(f"config {path!r} holds a {type(config).__name__} ({config!r:.40}); expected {sections}")
    return config


def _plugin_section(value: Any, where: str) -> dict[str, Any]:
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
            section = _plugin_section(value, "--plugins")
            continue
        name, *path = key.split(".")
        option = f"--plugins.{key}"
        if not path:
            section.update(_plugin_section({name: value}, option))
            continue
        settings = section.get(name)
        if settings is None:
            settings = section[name] = {}
        _set_key(settings, path, value, option, f"plugins.{name}")
    return section


def _set_key(mapping: dict[str, Any], path: Sequence[str], value: Any, option: str, where: str) -> None:
    """``mapping[path[0]][path[1]]... = value``, creating the mappings on the way.

    Raises:
        ConfigError: a key on the way holds something other than a mapping (``where`` names ``mapping``).
    """
    for i, part in enumerate(path[:-1]):
        inner = mapping.setdefault(part, {})
        if not isinstance(inner, dict):
            inside = ".".join([where, *path[: i + 1]])
            raise ConfigError(f"{option}: {inside} = {inner!r} is not a mapping, so it has no key {path[i + 1]!r}")
        mapping = inner
    mapping[path[-1]] = value


def _checked_engine(run: Any) -> Any:
    """The `torchloom.Engine` of a parsed run config: checks the engine settings, imports and configures the
    enabled plugins and composes them (``hook_order``); builds and runs nothing."""
    engine_settings = run.engine.as_dict() if run.engine is not None else {}
    engine = torchloom.Engine(EngineConfig(**engine_settings), plugins=run.plugins)
    engine.hook_order()
    return engine


def _run_command(
    parser: Any, cfg: Any, command: str, resume: str | bool | None = None, reset_optimizer: bool = False
) -> int:
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
    plugins = _with_default_plugins(cfg[command].plugins)  # as merged by _load_run_config, + the defaults
    engine = torchloom.Engine(objects.engine, plugins=plugins)
    resolved["plugins"] = engine.resolved_plugin_settings()  # with every default filled in
    engine.run_config = resolved
    engine.plugins.append(_RunDirectoryAnnouncer(engine, command))  # the CLI's own: not in config.yaml
    task, data = objects.task, objects.data
    if command == "fit":
        # --resume alone: the output_dir, whose latest checkpoint fit takes
        ckpt_path = engine.config.output_dir if resume is True else resume if isinstance(resume, str) else None
        metrics = engine.fit(task, datamodule=data, ckpt_path=ckpt_path, reset_optimizer=reset_optimizer)
    elif command == "validate":
        metrics = engine.validate(task, datamodule=data)
    else:
        predictions = engine.predict(task, datamodule=data, ckpt_path=cfg[command].ckpt_path)
        metrics = {"batches": float(len(predictions))}
    if engine.accelerator is None or engine.accelerator.is_main_process:
        if command == "predict" and engine.weights_from is not None:
            kind, path = engine.weights_from
            print(f"torchloom predict: weights of {'checkpoint' if kind == 'checkpoint' else 'saved model'} {path}")
        print(f"torchloom {command}: output in {engine.run_dir}")
        if command == "fit" and engine.stop_reason is not None:
            print(f"  stopped early at step {engine.progress.global_step}: {engine.stop_reason}")
        for name, value in sorted(metrics.items()):
            print(f"  {name} = {value:.6g}")
    return 0


def _with_default_plugins(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run's plugins: the config's, in its order, then each of `DEFAULT_PLUGINS` that the config does not name
    and that is installed and allowed (``TORCHLOOM_PLUGINS``), with its default settings."""
    plugins = dict(section or {})
    installed = torchloom.installed_plugins()
    for name in DEFAULT_PLUGINS:
        if name not in plugins and name in installed:
            plugins[name] = None
    return plugins


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


def _inspect_command(cfg: Any) -> int:
    """``torchloom inspect PATH [--json]``: what `torchloom.inspect_path` finds, as text or one JSON object."""
    info = torchloom.inspect_path(cfg.path)
    if cfg.json:
        print(json.dumps(info, indent=2))
        return 0
    for label, value in _inspection_lines(info):
        print(f"{label:<13} {value}")
    return 0


def _convert_hf_args_command(cfg: Any) -> int:
    """``torchloom convert-hf-args FILE [-o OUT]``: the run config `torchloom.convert_hf_args` makes, on stdout or in
    OUT; on stderr, what was not converted (all of it with ``-o``) and whether the config loads here."""
    conversion = torchloom.convert_hf_args(cfg.file)
    text, problem = conversion.to_yaml(), conversion.check()
    skipped, differ = conversion.not_converted, conversion.differences
    counts = f"{len(skipped)} argument{'s' * (len(skipped) != 1)} not converted, {len(differ)} with a difference"
    if cfg.output is None:
        sys.stdout.write(text)
        print(f"torchloom convert-hf-args: {counts} (listed in the comments at the top)", file=sys.stderr)
    else:
        try:
            with open(cfg.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise ConfigError(f"-o {cfg.output!r}: cannot write it: {exc.strerror or exc}") from None
        print(f"torchloom convert-hf-args: wrote {cfg.output}; {counts}", file=sys.stderr)
        for title, remarks in (("not converted", skipped), ("converted with a difference", differ)):
            for remark in remarks:
                print(f"  {title}: {remark.line()}", file=sys.stderr)
    if problem is not None:
        print(f"torchloom convert-hf-args: warning: the config does not load here: {problem}", file=sys.stderr)
    return 0


def _estimate_memory_command(cfg: Any) -> int:
    """``torchloom estimate-memory MODEL ...``: `torchloom.estimate_memory` as a table or one JSON object."""
    if cfg.model.endswith((".yaml", ".yml")):  # the task's module may sit next to its run config
        _put_config_dir_on_path(["--config", cfg.model])
    optimizers = None if cfg.optimizer is None else [n.strip() for n in cfg.optimizer.split(",")]
    estimate = torchloom.estimate_memory(
        cfg.model,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        precision=cfg.precision,
        optimizers=optimizers,
        grad_checkpoint=cfg.grad_checkpoint,
        budget=cfg.budget,
        effective_batch_size=cfg.effective_batch_size,
        architecture=cfg.architecture,
        fused_attention=cfg.fused_attention,
    )
    print(json.dumps(estimate.to_dict(), indent=2) if cfg.json else estimate.table())
    return 0


def _inspection_lines(info: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The rows of ``torchloom inspect``'s text: ``(label, value)``, an empty label continuing the row above."""
    rows = [(info["kind"], info["path"]), ("model class", info["model_class"] or "n/a")]
    params = info["parameters"]
    total, trainable = params["total"], params["trainable"]
    rows.append(
        (
            "parameters",
            "n/a (no manifest or model card)"
            if total is None
            else f"{total:,} ({'trainable n/a' if trainable is None else f'{trainable:,} trainable'})",
        )
    )
    weights = info["weights"]
    if weights is None:
        rows.append(("weights", "n/a (no safetensors weights)"))
    else:
        where = f" in {info['weights_from']}" if info["kind"] == "run" else ""
        rows.append(("weights", f"{_amounts(weights)}{where}"))
        rows += [(f"  {dtype}", _amounts(row)) for dtype, row in weights["dtypes"].items()]
    if info["global_step"] is not None:
        rows.append(("step", f"{info['global_step']} (epoch {info['epoch']})"))
    plugins = info["plugins"]
    if plugins is None and info["stateful_plugins"] is not None:
        plugins = dict.fromkeys(info["stateful_plugins"])
    names = [f"{name} {json.dumps(settings)}" if settings else name for name, settings in (plugins or {}).items()]
    rows += [("plugins" if i == 0 else "", name) for i, name in enumerate(names or ["(none)"])]
    metrics = [f"{name} = {_number(value)}" for name, value in sorted(info["metrics"].items())]
    rows += [("metrics" if i == 0 else "", line) for i, line in enumerate(metrics or ["(none)"])]
    if info["stateful_plugins"] is not None:
        rows.append(("plugin state", ", ".join(info["stateful_plugins"]) or "(none)"))
    if info["checkpoints"] is not None:
        found = [f"{c['path']}  (step {c['global_step']}, epoch {c['epoch']})" for c in info["checkpoints"]]
        rows += [("checkpoints" if i == 0 else "", line) for i, line in enumerate(found or ["(none)"])]
    if info["kind"] == "run":
        rows.append(("model dir", info["model_dir"] or "(none: the fit saved no model)"))
    if info["size_bytes"] is not None:
        rows.append(("files", f"{_bytes(info['size_bytes'])} in all (optimizer state included)"))
    return rows


def _amounts(row: Mapping[str, int]) -> str:
    return f"{row['tensors']:,} tensors, {row['elements']:,} elements, {_bytes(row['bytes'])}"


def _bytes(size: int) -> str:
    """``1,234,567 bytes (1.23 MB)``; under 1 kB just ``20 bytes``."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size:,} bytes ({size / scale:.3g} {unit})"
    return f"{size:,} bytes"


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _plugins_command(parser: Any, cfg: Any) -> int:
    if cfg.config:
        return _plugin_order(parser, cfg.config, as_json=cfg.json)
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
                row["summary"] = _summary(obj.__doc__)
                row["hooks"] = _implemented_hooks(obj)
            rows.append(row)
    if cfg.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(_no_plugins_listed())
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


def _summary(doc: str | None) -> str:
    """The first paragraph of a docstring as one line of plain text (RST roles and literals unmarked)."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    paragraph = re.sub(r":[\w:.-]+:`~?([^`]*?)`", lambda m: m.group(1).rpartition(".")[2] or m.group(1), paragraph)
    paragraph = re.sub(r"`([^`<]*?)\s*<[^`>]*>`__?", r"\1", paragraph)  # `text <url>`_
    return re.sub(r"``?([^`]+?)``?", r"\1", paragraph)


def _no_plugins_listed() -> str:
    allowed = os.environ.get("TORCHLOOM_PLUGINS")
    if allowed is None:
        return "no torchloom plugins installed"
    names = sorted({ep.name for ep in metadata.entry_points(group="torchloom.plugins")})
    return (
        f"no torchloom plugins listed: TORCHLOOM_PLUGINS={allowed!r} allows none of the installed plugins "
        f"({', '.join(names) or 'none installed'}); unset it to list them all"
    )


def _plugin_order(parser: Any, path: str, as_json: bool) -> int:
    # Read as every command reads it; enables the plugins, builds and runs nothing.
    _, engine = _load_run_config(parser, ["fit", "--config", path], "fit", [])
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
    """Make modules next to the ``--config`` file (and in the working directory) importable, after the installed
    packages: a file there named like a library (``yaml.py``) never replaces it. A config is data; only a
    ``class_path`` (or a plugin the config enables) imports code."""
    paths = [os.getcwd()] + [os.path.dirname(os.path.abspath(p)) for p in _config_paths(argv)]
    for path in paths:
        if path not in sys.path:
            sys.path.append(path)


def _quiet_other_processes(environ: MutableMapping[str, str]) -> bool:
    """On a process other than the main one of a multi-process run (``WORLD_SIZE`` > 1, ``RANK`` != 0), keep
    library chatter to the main process: transformers' and datasets' logging at errors only (their load reports
    print once, from rank 0) and Python warnings off. ``TRANSFORMERS_VERBOSITY``, ``DATASETS_VERBOSITY`` and
    ``-W`` / ``PYTHONWARNINGS`` set by the user win. Returns whether this is such a process."""
    if not _is_other_process(environ):
        return False
    for variable, module in (("TRANSFORMERS_VERBOSITY", "transformers"), ("DATASETS_VERBOSITY", "datasets")):
        if variable in environ:
            continue
        environ[variable] = "error"  # read when the library is first imported
        if module in sys.modules:  # already imported: set it directly
            sys.modules[module].logging.set_verbosity_error()
    if not sys.warnoptions:
        warnings.simplefilter("ignore")
    return True


def _is_other_process(environ: Mapping[str, str]) -> bool:
    """Whether the environment says this is a process other than rank 0 of a run of several processes (set by
    ``torchrun`` and ``accelerate launch``)."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1 and int(environ.get("RANK", "0")) != 0
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
