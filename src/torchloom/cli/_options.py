"""The options of a run command that the ``torchloom`` command reads itself, not jsonargparse.

``--plugins`` / ``--plugins.NAME[.SETTING...]=VALUE`` (`take_cli_options`), ``--print_config[=FLAGS]``, and every
``--task.init_args.ARGUMENT.KEY=VALUE`` / ``--data.init_args.ARGUMENT.KEY=VALUE`` that sets one key of a free-form
mapping argument (`take_mapping_options`). Their values are read as the config file reads its values
(`torchloom.cli._yaml.option_value`).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import types
import typing
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from torchloom import ConfigError

from ._yaml import option_value

__all__ = [
    "CLASS_SECTIONS",
    "apply_mapping_options",
    "option_example",
    "print_config_flags",
    "set_key",
    "take_cli_options",
    "take_mapping_options",
]


def take_cli_options(argv: list[str], start: int) -> tuple[list[str], list[tuple[str, Any]], dict[str, Any] | None]:
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
            print_flags = print_config_flags(text if has_value else "")
            continue
        if option != "--plugins" and not option.startswith("--plugins."):
            rest.append(arg)
            continue
        key = option.removeprefix("--plugins").removeprefix(".")
        if not has_value:
            following = next(args, None)
            if following is None:
                raise ConfigError(f"{option}: expected a value, e.g. {option_example(key)}")
            text = following
        if any(not part for part in key.split(".")) and key:
            raise ConfigError(f"{option}: empty name in the option; expected {option_example(key)}")
        options.append((key, option_value(option, text)))
    return rest, options, print_flags


def option_example(key: str) -> str:
    if not key:
        return "--plugins='{grad_clip: {max_norm: 1.0}}' or --plugins='[grad_clip]'"
    if "." not in key:
        return f"--plugins.{key}='{{setting: value}}'"
    return f"--plugins.{key}=VALUE"


def print_config_flags(text: str) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    valid = {"skip_default": "skip_default", "skip_unset": "skip_unset", "skip_null": "skip_unset"}
    for flag in filter(None, text.split(",")):
        if flag not in valid:
            raise ConfigError(f"--print_config={text}: unknown flag {flag!r}; valid flags: skip_default, skip_unset")
        flags[valid[flag]] = True
    return flags


#: The sections of a run config that name a class (``class_path`` + ``init_args``), whose free-form mapping
#: arguments take ``--SECTION.init_args.ARGUMENT.KEY=VALUE`` options read by this module.
CLASS_SECTIONS = ("task", "data")


def take_mapping_options(
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
        value)``, the value read as the config file reads values (`option_value`).

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
            options.append((option, section, path, option_value(option, text)))
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


def apply_mapping_options(run: Any, options: Sequence[tuple[str, str, list[str], Any]]) -> None:
    """Set each key that `take_mapping_options` took, in order, keeping the mapping's other keys."""
    for option, section, (argument, *path), value in options:
        init_args = run[section].init_args
        current = init_args.get(argument)
        if current is not None and not isinstance(current, Mapping):
            raise ConfigError(
                f"{option}: {section}.init_args.{argument} = {current!r} is not a mapping, so it has no key "
                f"{path[0]!r}; set the whole value instead: --{section}.init_args.{argument}='{{{path[0]}: ...}}'"
            )
        mapping = copy.deepcopy(dict(current or {}))
        set_key(mapping, path, value, option, f"{section}.init_args.{argument}")
        init_args[argument] = mapping


def set_key(mapping: dict[str, Any], path: Sequence[str], value: Any, option: str, where: str) -> None:
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
