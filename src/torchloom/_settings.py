"""One validation path for settings: the engine's (`EngineConfig`), a plugin's (its ``Config``) and a data module's.

Every bad setting is one `ConfigError` of one shape, ``<owner>: <what>``, where the owner is ``engine``,
``plugin 'grad_clip'`` or a data module's class name:

- an unknown name: ``engine: unknown setting 'max_epoch'; did you mean 'max_epochs'? Valid settings: max_epochs,
  ...`` (the suggestion by `torchloom._suggest.closest_name`, when one is close);
- a value of the wrong type, by the field's annotation: ``plugin 'hello': setting 'times' = 'three' (str);
  expected int`` (an ``int`` is taken for a ``float``, a list for a ``tuple``); a string that a ``Literal`` does not
  allow gets the closest allowed one (``...; expected one of 'mean', 'tokens', 'items'; did you mean 'tokens'?``);
- a value out of range, from the settings class's own checks: ``engine: setting 'max_epochs' = 0; expected a
  positive integer`` (`invalid` builds that message; a check that raises a `ValueError` or `TypeError` with a
  message gets the owner in front of it).

Entry points:

- `build_settings`: a mapping (YAML, CLI, keyword arguments) -> an instance of a settings dataclass, checked in
  that order: names, types, the class's ``__post_init__``. `EngineConfig.from_settings` and
  `torchloom.build_config` are this function.
- `check_fields`: the same type check of an instance's fields, for a dataclass's ``__post_init__``, so that
  constructing the class directly is checked like building it from a mapping (`EngineConfig` does).
- `check_arguments`: the same checks of a constructor's or function's arguments against its signature (for a
  data module, whose settings are its ``__init__`` keyword arguments), with `owner` the class name::

      def __init__(self, *, batch_size: int = 16, max_length: int = 128) -> None:
          check_arguments(type(self).__name__, type(self).__init__, {"batch_size": batch_size, ...})
          if batch_size < 1:
              raise invalid("batch_size", batch_size, "a positive integer", owner=type(self).__name__)
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

from torchloom._suggest import closest_name
from torchloom.errors import ConfigError

__all__ = [
    "build_settings",
    "check_arguments",
    "check_fields",
    "check_value",
    "invalid",
    "unknown_setting",
]


def invalid(name: str, value: Any, expected: str, *, owner: str | None = None, show_type: bool = False) -> ConfigError:
    """The error of one bad value: ``[<owner>: ]setting '<name>' = <value>[ (<type>)]; expected <expected>``."""
    kind = f" ({type(value).__name__})" if show_type else ""
    prefix = f"{owner}: " if owner else ""
    return ConfigError(f"{prefix}setting {name!r} = {value!r}{kind}; expected {expected}")


def unknown_setting(owner: str, name: Any, valid: Sequence[str]) -> ConfigError:
    """The error of an unknown setting name, with the closest valid one when there is one, and all valid ones."""
    close = closest_name(str(name), valid)
    hint = f"; did you mean {close!r}?" if close else "."
    return ConfigError(f"{owner}: unknown setting {name!r}{hint} Valid settings: {', '.join(valid) or '(none)'}")


def check_value(owner: str, name: str, value: Any, annotation: Any) -> Any:
    """``value`` checked against the type ``annotation`` (coerced: an int to a float, a list to a tuple).

    Raises:
        ConfigError: ``<owner>: setting '<name>' = <value> (<type>); expected <annotation>``, with ``; did you mean
            '<choice>'?`` for a string close to one a ``Literal`` allows.
    """
    ok, coerced = _check_type(value, annotation)
    if not ok:
        error = invalid(name, value, _type_name(annotation), owner=owner, show_type=True)
        close = closest_name(value, _choices(annotation)) if isinstance(value, str) else None
        raise ConfigError(f"{error}; did you mean {close!r}?") if close else error
    return coerced


def build_settings(config_cls: type, settings: Mapping[str, Any] | None, owner: str) -> Any:
    """An instance of the settings dataclass ``config_cls`` from ``{field: value}`` (``None``: the defaults).

    Checks, in order: ``settings`` is a mapping; every name is a field (`unknown_setting`); every value has its
    field's type (`check_value`); then the class's own checks (its ``__post_init__``), whose error gets
    ``<owner>: `` in front unless its message starts with it already.

    Raises:
        ConfigError: one message naming the owner, the setting, the bad value and what is valid.
    """
    fields = [f.name for f in dataclasses.fields(config_cls) if f.init]
    if settings is None:
        settings = {}
    if not isinstance(settings, Mapping):
        raise ConfigError(
            f"{owner}: settings {settings!r} ({type(settings).__name__}); expected a mapping "
            f"{{setting: value}}. Valid settings: {', '.join(fields) or '(none)'}"
        )
    hints = typing.get_type_hints(config_cls)
    values = {}
    for key, value in settings.items():
        if key not in fields:
            raise unknown_setting(owner, key, fields)
        values[key] = check_value(owner, key, value, hints.get(key, Any))
    try:
        return config_cls(**values)
    except Exception as exc:  # a settings class may check with assert, or raise anything: one ConfigError
        message = _rejection(exc, config_cls, values)
        raise ConfigError(message if message.startswith(f"{owner}: ") else f"{owner}: {message}") from None


def check_fields(instance: Any, owner: str) -> None:
    """Check (and coerce, in place) every field of the dataclass ``instance`` against its annotation: for a
    ``__post_init__``, so that constructing the class directly is checked as `build_settings` checks.

    Raises:
        ConfigError: as `check_value`.
    """
    hints = typing.get_type_hints(type(instance))
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        coerced = check_value(owner, field.name, value, hints.get(field.name, Any))
        if coerced is not value:
            setattr(instance, field.name, coerced)


def check_arguments(owner: str, function: Callable[..., Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` (name -> value) checked against the parameters of ``function`` (a data module's
    ``__init__``): every name must be a parameter (`unknown_setting`) and every value of its annotated type
    (`check_value`; an unannotated parameter takes anything). Returns the values, coerced.

    Raises:
        ConfigError: as `build_settings`.
    """
    parameters = {
        name: p
        for name, p in inspect.signature(function).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve here: check nothing by type rather than fail
        hints = {}
    checked = {}
    for key, value in arguments.items():
        if key not in parameters:
            raise unknown_setting(owner, key, list(parameters))
        checked[key] = check_value(owner, key, value, hints.get(key, Any))
    return checked


# ------------------------------------------------------------------------------------------------ internals


def _rejection(exc: Exception, config_cls: type, values: Mapping[str, Any]) -> str:
    """What a settings class said when it rejected ``values``: its message when it raised a `ValueError` or
    `TypeError` with one (the documented way), else the exception type and the failing line of the class."""
    message = " ".join(str(exc).split())
    if isinstance(exc, ValueError | TypeError) and message:
        return message
    given = ", ".join(f"{k}={v!r}" for k, v in values.items()) or "the defaults"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.name != "<module>"]
    check = f" at `{frames[-1].line}`" if frames and frames[-1].line else ""
    return (
        f"{config_cls.__qualname__} rejected the settings ({given}): "
        f"{type(exc).__name__}{check}{': ' + message if message else ''}"
    )


def _check_type(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (value matches tp, value coerced: int -> float, list -> tuple)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return True, value
    if origin is Literal:
        return value in args, value
    if origin is Union or origin is types.UnionType:
        for arm in args:
            ok, coerced = _check_type(value, arm)
            if ok:
                return True, coerced
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            return False, value
        item_tp = args[0] if args else Any
        items = []
        for item in value:
            ok, coerced = _check_type(item, item_tp)
            if not ok:
                return False, value
            items.append(coerced)
        return True, tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        return isinstance(value, Mapping), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def _choices(tp: Any) -> list[str]:
    """The strings a ``Literal`` annotation (or a union holding one) allows, for a "did you mean"."""
    if typing.get_origin(tp) is Literal:
        return [a for a in typing.get_args(tp) if isinstance(a, str)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [choice for arm in typing.get_args(tp) for choice in _choices(arm)]
    return []


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")
