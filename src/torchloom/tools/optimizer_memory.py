"""Memory estimates made before training, from a model's parameters alone (no step is run).

`estimate_optimizer_memory` predicts, in bytes, the optimizer state that a plugin builds for a model. The core
knows no optimizer: it asks the installed plugins, through two class attributes that any plugin may define
(the optimizer plugin's page, ``docs/plugins/optimizer.md``, documents them as a reference implementation):

- ``optimizer_names`` (`tuple[str, ...]`): the optimizer names the plugin builds and estimates; the first is
  the plugin's default.
- ``estimate_optimizer_memory(model, name, settings)`` (a classmethod or staticmethod): the bytes of optimizer
  state the plugin would hold for ``model`` with the optimizer ``name`` and the plugin's ``settings`` (a
  mapping, validated by the plugin: a bad one is a `ConfigError`). Called only with a name from
  ``optimizer_names``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchloom._suggest import closest_name
from torchloom.errors import ConfigError, PluginError
from torchloom.plugins import find_plugin, installed_plugins

__all__ = ["estimate_optimizer_memory"]

#: The attributes a plugin defines to answer `estimate_optimizer_memory`.
NAMES_ATTR = "optimizer_names"
ESTIMATE_ATTR = "estimate_optimizer_memory"


def estimate_optimizer_memory(
    model: torch.nn.Module, name: str | None = None, *, plugin: Any = None, **settings: Any
) -> int:
    """Return the bytes of optimizer state that the plugin building optimizer ``name`` will hold for ``model``.

    The plugin that knows ``name`` answers: every installed plugin (as `torchloom.installed_plugins` lists them,
    so ``TORCHLOOM_PLUGINS`` limits them) that defines ``optimizer_names`` and a class-level
    ``estimate_optimizer_memory(model, name, settings)`` is imported and asked (see the module docstring);
    ``plugin`` asks one plugin only. For the built-in optimizer plugin the count is exactly what it logs as
    ``optimizer/state_bytes`` after the first optimizer step; its page lists the formula per optimizer.

    Args:
        model (`torch.nn.Module`): the model, on any device (``meta`` works: nothing is allocated).
        name (`str`, *optional*): an optimizer name that an installed plugin lists in ``optimizer_names``;
            defaults to the first name of the one plugin that estimates.
        plugin (`str | type | object`, *optional*): the plugin to ask, by installed name, or a plugin class or
            object (one that is not installed, e.g. in a test); needed only when two plugins know ``name``.
        **settings: the answering plugin's settings, as its config takes them (e.g. ``weight_decay=0.01``);
            validated by that plugin.

    Returns:
        `int`: bytes. Parameters that never receive a gradient get no state, so a model with such parameters
        uses less than estimated.

    Raises:
        ConfigError: no plugin knows ``name`` (the message lists the names the installed plugins know and
            suggests the closest), two plugins know it and ``plugin`` is not given, or a bad setting.
        PluginError: ``plugin`` names no installed plugin, or the plugin does not estimate optimizer memory,
            or it answers something other than a number of bytes.

    Example:

    .. code-block:: python

        >>> model = torch.nn.Linear(1000, 1000)
        >>> torchloom.estimate_optimizer_memory(model)  # the default optimizer of the plugin that estimates
        8008008
    """
    if plugin is not None:
        candidates = [_estimator(plugin)]
        skipped: list[str] = []
    else:
        candidates, skipped = _installed_estimators()
    if name is None:
        if len(candidates) != 1:
            raise ConfigError(_no_default_message(candidates, skipped))
        name = candidates[0][1][0]
    knowing = [c for c in candidates if name in c[1]]
    if not knowing:
        raise ConfigError(_unknown_name_message(name, candidates, skipped))
    if len(knowing) > 1:
        who = " and ".join(repr(c[0]) for c in knowing)
        raise ConfigError(
            f"estimate_optimizer_memory: optimizer {name!r} is known by plugins {who}; pass plugin=<name> to "
            "choose the one whose optimizer you will enable"
        )
    plugin_name, _, obj = knowing[0]
    try:
        result = getattr(obj, ESTIMATE_ATTR)(model, name, dict(settings))
    except ConfigError as exc:
        raise ConfigError(f"estimate_optimizer_memory({name!r}): {exc}") from None
    if isinstance(result, bool) or not isinstance(result, int) or result < 0:
        raise PluginError(
            f"plugin {plugin_name!r}: {ESTIMATE_ATTR}(model, {name!r}, settings) returned {result!r}; "
            "expected a number of bytes (an int >= 0)"
        )
    return result


Estimator = tuple[str, tuple[str, ...], Any]  # (plugin name, optimizer names, plugin class or object)


def _estimator(plugin: Any) -> Estimator:
    """The estimator of the one plugin the caller named (installed name, class or object)."""
    obj = find_plugin(plugin).load() if isinstance(plugin, str) else plugin
    label = plugin if isinstance(plugin, str) else _label(obj)
    names = _names_of(obj)
    if names is None:
        raise PluginError(
            f"plugin {label!r} does not estimate optimizer memory: it defines no {NAMES_ATTR!r} (a tuple of "
            f"optimizer names) and {ESTIMATE_ATTR}(model, name, settings)"
        )
    return label, names, obj


def _installed_estimators() -> tuple[list[Estimator], list[str]]:
    """Every installed plugin that estimates, in name order; and why others could not be asked."""
    found: list[Estimator] = []
    skipped: list[str] = []
    for plugin_name, registrations in installed_plugins().items():
        if len(registrations) > 1:
            skipped.append(f"{plugin_name!r} (registered by {len(registrations)} distributions)")
            continue
        try:
            obj = registrations[0].load()
        except PluginError:
            skipped.append(f"{plugin_name!r} (failed to import)")
            continue
        names = _names_of(obj)
        if names is not None:
            found.append((plugin_name, names, obj))
    return found, skipped


def _label(obj: Any) -> str:
    return getattr(obj, "name", "") or getattr(obj, "__qualname__", type(obj).__qualname__)


def _names_of(obj: Any) -> tuple[str, ...] | None:
    names = getattr(obj, NAMES_ATTR, None)
    if not callable(getattr(obj, ESTIMATE_ATTR, None)) or isinstance(names, str | Mapping):
        return None
    try:
        names = tuple(names)  # type: ignore[arg-type]
    except TypeError:
        return None
    return names if names and all(isinstance(n, str) for n in names) else None


def _valid_names(candidates: list[Estimator]) -> str:
    return "; ".join(f"{', '.join(names)} (plugin {label!r})" for label, names, _ in candidates)


def _not_asked(skipped: list[str]) -> str:
    return f". Not asked: {', '.join(skipped)}" if skipped else ""


def _unknown_name_message(name: str, candidates: list[Estimator], skipped: list[str]) -> str:
    if not candidates:
        return (
            f"estimate_optimizer_memory: unknown optimizer {name!r}: no installed plugin estimates optimizer "
            f"memory (a plugin does by defining {NAMES_ATTR} and {ESTIMATE_ATTR}){_not_asked(skipped)}"
        )
    known = [n for _, names, _ in candidates for n in names]
    close = closest_name(name, known)
    hint = f"; did you mean {close!r}?" if close else "."
    return f"estimate_optimizer_memory: unknown optimizer {name!r}{hint} Valid: {_valid_names(candidates)}" + (
        _not_asked(skipped)
    )


def _no_default_message(candidates: list[Estimator], skipped: list[str]) -> str:
    if not candidates:
        return (
            "estimate_optimizer_memory: no installed plugin estimates optimizer memory (a plugin does by "
            f"defining {NAMES_ATTR} and {ESTIMATE_ATTR}){_not_asked(skipped)}"
        )
    return (
        "estimate_optimizer_memory: several plugins estimate optimizer memory; name the optimizer. "
        f"Valid: {_valid_names(candidates)}"
    )
