"""How the ``torchloom`` command reads YAML: the config files and the option values it reads itself.

`ConfigLoader` is YAML's safe loader with jsonargparse's rules for floats and dates, so a value means the same in a
file and on the command line (``tests/test_cli_inputs.py`` checks every kind of value); a key that appears twice in
one mapping is an error.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from torchloom import ConfigError

__all__ = ["ConfigLoader", "DuplicateKey", "option_value", "read_config_file"]


def option_value(option: str, text: str) -> Any:
    """The value of a command-line option that torchloom reads itself, read as the config file reads its values.

    Raises:
        ConfigError: ``text`` is not valid YAML.
    """
    try:
        return yaml.load(text, Loader=ConfigLoader)  # a SafeLoader
    except DuplicateKey as dup:
        raise ConfigError(f"{option}: value {text!r} repeats the key {dup.key!r}; keep one") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{option}: value {text!r} is not valid YAML ({problem})") from None


class ConfigLoader(yaml.SafeLoader):
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
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: PyYAML reports it itself
                    continue
        return super().construct_mapping(node, deep=deep)


def _as_jsonargparse_reads(loader: type[yaml.SafeLoader]) -> None:
    """Give ``loader`` the float and timestamp rules of jsonargparse's YAML loader (see `ConfigLoader`)."""
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
_as_jsonargparse_reads(ConfigLoader)


class DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


def read_config_file(path: str) -> dict[str, Any]:
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
        config = yaml.load(text, Loader=ConfigLoader)  # a SafeLoader
    except DuplicateKey as dup:
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
