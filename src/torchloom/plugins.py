"""Plugins: discovery by entry point (without importing), enabling by name, settings validation, ordering.

A plugin is a class with a ``name``, a ``Config`` dataclass (its typed settings) and methods marked with
`torchloom.hookimpl`. A distribution makes it installable by name with an entry point::

    [project.entry-points."torchloom.plugins"]
    example_ema = "torchloom_ema:EMA"

Only the plugins a run enables are imported. ``TORCHLOOM_PLUGINS=a,b`` limits which installed plugins may
be enabled or listed at all.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

import pluggy
from pluggy._callers import _multicall  # pluggy's own call loop (wrappers), private: pinned in constraints.txt

from torchloom import hookspecs
from torchloom._settings import build_settings
from torchloom._suggest import closest_name
from torchloom.errors import ConfigError, PluginError

__all__ = [
    "ENTRY_POINT_GROUP",
    "HookCall",
    "HookRelay",
    "Plugin",
    "PluginInfo",
    "build_config",
    "enable_plugins",
    "installed_plugins",
    "plugins_with",
]

ENTRY_POINT_GROUP = "torchloom.plugins"
ALLOW_ENV = "TORCHLOOM_PLUGINS"
TRACE_ENV = "TORCHLOOM_TRACE_HOOKS"
#: A plugin object's attribute naming hooks it implements but does not register, its settings making them no-ops
#: (e.g. ``frozenset({"on_train_step_end"})``): read once, as the plugin is registered.
INACTIVE_HOOKS_ATTR = "inactive_hooks"
#: An exception's attribute naming the plugin whose own code raised it (set by `blame`): the hook relay then does not
#: blame the plugin whose hook only called that code (the ``checkpoint`` plugin saving another plugin's state).
CULPRIT_ATTR = "_torchloom_plugin"

PluginSpec = Mapping[str, Any] | Sequence[Any] | None


@dataclass
class NoConfig:
    """Settings of a plugin that has none."""


class Plugin:
    """Base class of torchloom plugins (optional: any object with ``@hookimpl`` methods and a ``name`` works).

    Class attributes:
        name (`str`): the name users enable the plugin by; must match its entry-point name.
        Config (`type`): a dataclass of the plugin's settings, each field typed, with a default and a
            one-line comment. Validated by `build_config`.
        requires (`tuple[str, ...]`): names of plugins that must be enabled too.
        conflicts (`tuple[str, ...]`): names of plugins that must not be enabled together with this one.
        inactive_hooks (`frozenset[str]`): hooks the plugin implements but that its settings make no-ops: they
            are not registered, so the loop never calls them (set it on the object, in ``__init__``, from the
            settings; e.g. ``grad_accum`` with ``steps: 1``). Read once, when the engine registers the plugin.
        divergent_replicas (`bool`): ``True`` when the processes' parameters and optimizer states may differ at a
            checkpoint (``local_sgd``): each process then saves and resumes its own (``engine/process_<rank>/``).
        capabilities (`frozenset[str]`): what the plugin declares it does (``"activation_checkpointing"``,
            ``"adapter"``, ``"outside_sweeps"``; ``docs/writing-plugins.md`` says what each promises), which the core
            asks for instead of a plugin's name (`plugins_with`).
        checkpoint_ranking (`tuple[str, str]` or ``None``): ``(monitor, mode)`` when the plugin ranks checkpoints by
            a logged value; each manifest records it, and ``ckpt_path="best"`` picks by it.

    Args:
        config (`Config`, *optional*): ready-made settings; otherwise built from ``settings``.
        **settings: settings by field name, validated against ``Config``.

    Raises:
        ConfigError: a setting is unknown or has a bad value.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig
    requires: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[tuple[str, ...]] = ()
    inactive_hooks: frozenset[str] = frozenset()
    divergent_replicas: ClassVar[bool] = False
    capabilities: ClassVar[frozenset[str]] = frozenset()
    checkpoint_ranking: tuple[str, str] | None = None

    def __init__(self, config: Any = None, **settings: Any) -> None:
        if config is not None and settings:
            raise ConfigError(f"plugin {self.name!r}: pass either a Config or settings, not both")
        if config is None:
            config = build_config(type(self), settings)
        elif not isinstance(config, self.Config):
            raise ConfigError(
                f"plugin {self.name!r}: config is a {type(config).__name__}; expected {self.Config.__name__}"
            )
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


# ----------------------------------------------------------------------------------------------- settings


def build_config(plugin_cls: type, settings: Mapping[str, Any] | None) -> Any:
    """Build and validate ``plugin_cls.Config`` from a mapping of settings (from YAML or Python).

    The one settings check of torchloom (`torchloom._settings.build_settings`, which `EngineConfig` uses too):
    unknown names first (with the closest valid one), then each value's type by the field's annotation, then
    the Config's own ``__post_init__`` checks; every failure is one `ConfigError` that starts with
    ``plugin '<name>': ``.

    Args:
        plugin_cls (`type`): a plugin class with a ``Config`` dataclass and a ``name``.
        settings (`Mapping[str, Any]`, *optional*): field name -> value; ``None`` means all defaults.

    Returns:
        An instance of ``plugin_cls.Config``.

    Raises:
        ConfigError: naming the plugin, the setting, the bad value and what is valid (the known fields, the
            expected type, or the message of the Config's ``__post_init__`` check).
    """
    name = getattr(plugin_cls, "name", plugin_cls.__name__)
    config_cls = getattr(plugin_cls, "Config", NoConfig)
    if isinstance(settings, config_cls):
        return settings
    return build_settings(config_cls, settings, owner=f"plugin {name!r}")


# ---------------------------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin, read from entry-point metadata without importing it.

    Attributes:
        name (`str`): the entry-point name, which users enable the plugin by.
        value (`str`): ``"module:attr"``, the object the entry point names.
        distribution (`str`): the distribution that registers it.
        version (`str`): that distribution's version.
    """

    name: str
    value: str
    distribution: str
    version: str

    def load(self) -> Any:
        """Import the plugin's module and return the object the entry point names.

        Raises:
            PluginError: the import failed; the message names the plugin, its distribution and why.
        """
        try:
            obj = metadata.EntryPoint(self.name, self.value, ENTRY_POINT_GROUP).load()
        except Exception as exc:
            raise PluginError(
                f"plugin {self.name!r} (from {self.distribution} {self.version}) failed to import "
                f"{self.value!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return obj


def installed_plugins() -> dict[str, list[PluginInfo]]:
    """List installed plugins from entry-point metadata, importing nothing.

    Returns:
        name -> the registrations of that name, one per distribution (more than one is a conflict that
        `enable_plugins` reports). Names outside ``TORCHLOOM_PLUGINS``, when it is set, are left out.
    """
    allowed = _allow_list()
    found: dict[str, list[PluginInfo]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        dist = ep.dist
        info = PluginInfo(ep.name, ep.value, dist.metadata["Name"] if dist else "?", dist.version if dist else "?")
        registrations = found.setdefault(ep.name, [])
        if all(r.distribution != info.distribution for r in registrations):
            registrations.append(info)
    return dict(sorted(found.items()))


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV)
    if raw is None:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


def find_plugin(name: str, installed: Mapping[str, list[PluginInfo]] | None = None) -> PluginInfo:
    """Return the one installed registration of ``name``.

    Args:
        name (`str`): the entry-point name.
        installed (`Mapping`, *optional*): what `installed_plugins` returned, when the caller already has it
            (enabling several plugins scans the entry points once); else scanned now.

    Raises:
        PluginError: unknown name (lists the installed ones and suggests the closest), a name left out by
            ``TORCHLOOM_PLUGINS``, or a name registered by two distributions (names both).
    """
    installed = installed_plugins() if installed is None else installed
    if name not in installed:
        allowed = _allow_list()
        if allowed is not None:
            everything = sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})
            setting = f"{ALLOW_ENV}={os.environ[ALLOW_ENV]!r}"
            if name in everything:
                none = " (it allows no plugin; unset it to allow all)" if not allowed else ""
                raise PluginError(f"plugin {name!r} is installed but not allowed by {setting}{none}")
            if not installed:
                raise PluginError(
                    f"unknown plugin {name!r}: {setting} allows none of the installed plugins "
                    f"({', '.join(everything) or 'none installed'}); list the plugins to allow in it, or unset it"
                )
        close = closest_name(name, installed)
        hint = f" Did you mean {close!r}?" if close else ""
        raise PluginError(f"unknown plugin {name!r}.{hint} Installed plugins: {', '.join(installed) or '(none)'}")
    registrations = installed[name]
    if len(registrations) > 1:
        who = " and ".join(f"{r.distribution} {r.version} ({r.value})" for r in registrations)
        raise PluginError(f"plugin name {name!r} is registered by two distributions: {who}; uninstall one")
    return registrations[0]


def plugins_with(capability: str, names: Iterable[str] | None = None) -> list[tuple[str, Any]]:
    """The installed plugins that declare ``capability`` (``Plugin.capabilities``), as ``(name, object the entry
    point names)``: among ``names`` when given (those not installed left out), else among all installed ones, each
    imported. One of ``names`` that fails to import raises its `PluginError`; one of all the others is skipped.

    Example: ``torchloom.utils.plugins_with("adapter", ["peft", "grad_clip"])`` is ``[("peft", PeftPlugin)]``.

    Raises:
        PluginError: one of ``names`` is installed but cannot be imported.
    """
    installed = installed_plugins()
    asked = sorted(installed) if names is None else [n for n in dict.fromkeys(names) if n in installed]
    found = []
    for name in asked:
        try:
            obj = find_plugin(name, installed).load()
        except PluginError:
            if names is not None:
                raise
            continue
        if capability in (getattr(obj, "capabilities", None) or ()):
            found.append((name, obj))
    return found


# --------------------------------------------------------------------------------------------- enabling


def enable_plugins(spec: PluginSpec) -> list[Any]:
    """Import, configure and check the plugins a run enables, in the user's order.

    Args:
        spec: ``{"name": {settings} or None, ...}`` (as in YAML), or a list whose items are names, plugin
            instances, or one-entry ``{"name": {settings}}`` mappings; ``None`` enables nothing.

    Returns:
        Plugin instances, in the order given.

    Raises:
        PluginError: unknown or failing plugin, duplicate name, unmet ``requires`` or a ``conflicts`` pair.
        ConfigError: a bad setting.
    """
    valid = "a mapping {name: settings} or a list of names, {name: settings} mappings and plugin objects"
    items: list[tuple[str | None, Any, Any]] = []  # (name, settings, instance)
    if spec is None:
        pass
    elif isinstance(spec, Mapping):
        items = [(str(k), v, None) for k, v in spec.items()]
    elif isinstance(spec, str):
        raise ConfigError(f"plugins: got the string {spec!r}; expected a list of names or a mapping {{name: settings}}")
    elif not isinstance(spec, list | tuple):
        hint = " (a set has no order)" if isinstance(spec, set | frozenset) else ""
        raise ConfigError(f"plugins: got {spec!r}{hint}; expected {valid}")
    else:
        for entry in spec:
            if isinstance(entry, str):
                items.append((entry, None, None))
            elif isinstance(entry, Mapping):  # [{a: {...}, b: {...}}] enables a then b
                items.extend((str(k), v, None) for k, v in entry.items())
            elif isinstance(entry, type):
                raise ConfigError(
                    f"plugins: got the class {entry.__qualname__}; pass an instance, {entry.__qualname__}(...)"
                )
            elif entry is None or isinstance(entry, int | float | bytes | list | tuple | set | frozenset):
                raise ConfigError(f"plugins: entry {entry!r} is not a plugin; expected {valid}")
            else:
                items.append((None, None, entry))
    installed = installed_plugins() if any(inst is None for _, _, inst in items) else {}  # one scan for all names
    plugins = [inst if inst is not None else _instantiate(name, settings, installed) for name, settings, inst in items]
    _check_relations(plugins)
    return plugins


def _instantiate(name: str | None, settings: Any, installed: Mapping[str, list[PluginInfo]]) -> Any:
    assert name is not None
    obj = find_plugin(name, installed).load()
    if not isinstance(obj, type):
        if settings is not None and settings != {}:
            raise ConfigError(
                f"plugin {name!r} is a ready-made object and takes no settings; got {settings!r}: "
                f"enable it with {{{name}: {{}}}} or by name"
            )
        return obj
    declared = getattr(obj, "name", name)
    if declared != name:
        raise PluginError(f"plugin {name!r}: its class {obj.__qualname__} is named {declared!r}")
    return obj(build_config(obj, settings))


def blame(exc: BaseException, plugin: str, operation: str, detail: str = "") -> None:
    """Name ``plugin`` as the one whose ``operation`` raised ``exc`` (a method that is no hook: ``state_dict``,
    ``load_state_dict``), called from another plugin's hook or from the engine: a note
    ``torchloom: raised in <operation> of plugin '<plugin>'<detail>`` on the exception, and `CULPRIT_ATTR`, which
    the hook relay reads so that its own note names the calling hook without blaming its plugin. An exception
    already blamed keeps its first culprit (the innermost)."""
    if getattr(exc, CULPRIT_ATTR, None) is not None:
        return
    with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
        setattr(exc, CULPRIT_ATTR, plugin)
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"torchloom: raised in {operation} of plugin {plugin!r}{detail}")


def plugin_name(plugin: Any) -> str:
    """The name a plugin object is registered under: its ``name`` attribute, else its class name."""
    return getattr(plugin, "name", "") or type(plugin).__name__


def _check_relations(plugins: Iterable[Any]) -> None:
    plugins = list(plugins)
    names = [plugin_name(p) for p in plugins]
    seen = set()
    for n in names:
        if n in seen:
            raise PluginError(f"plugin {n!r} is enabled twice; enable each plugin once")
        seen.add(n)
    for p, n in zip(plugins, names):
        for req in getattr(p, "requires", ()):
            if req not in seen:
                raise PluginError(f"plugin {n!r} requires plugin {req!r}; enable it too")
        for other in getattr(p, "conflicts", ()):
            if other in seen:
                raise PluginError(f"plugins {n!r} and {other!r} cannot be enabled together; enable one of them")


# ------------------------------------------------------------------------------------------- hook relay


def _is_reversed(hook_name: str) -> bool:
    """after_* and *_end hooks (and teardown) run first-in-last-out."""
    return hook_name.startswith("after_") or hook_name.endswith("_end") or hook_name == "teardown"


def _is_wrapper(impl: Any) -> bool:
    return bool(impl.wrapper or impl.hookwrapper)


class HookCall:
    """One hook's implementations (pluggy's ``HookImpl`` objects) in the order they run, for `HookRelay.run`; the
    relay updates it in place when a plugin is registered or unregistered, so a caller may keep it. ``impls`` is
    empty when no plugin implements the hook; ``plain`` when none is a wrapper or takes a keyword argument with a
    default (which only pluggy's ``_multicall`` passes); ``multicall`` is the list as ``_multicall`` takes it (it
    calls from the end)."""

    __slots__ = ("calls", "firstresult", "impls", "multicall", "name", "plain")

    def __init__(self, name: str, firstresult: bool, impls: Sequence[Any] = ()) -> None:
        self.name, self.firstresult = name, firstresult
        self.set(impls)

    def set(self, impls: Sequence[Any]) -> None:
        self.impls = tuple(impls)
        self.calls = tuple((impl.function, tuple(impl.argnames)) for impl in self.impls)  # for the plain loop
        self.plain = not any(_is_wrapper(impl) or getattr(impl, "kwargnames", ()) for impl in self.impls)
        self.multicall = self.impls[::-1]


class HookRelay:
    """Registers enabled plugins with pluggy and calls hooks in the documented order.

    Forward hooks run in the order the plugins were given; ``after_*``, ``*_end`` and ``teardown`` run in
    reverse. One pluggy manager registers and validates the implementations; per hook the relay keeps one list
    of them in the order the hook runs them (`HookCall`), updated whenever a plugin is registered or
    unregistered, and every call goes through `run`. The order is pluggy's: wrappers outside plain
    implementations, ``tryfirst`` before and ``trylast`` after the others; within each group by the plugins'
    order (``trylast`` ones in the opposite order, as pluggy does), each group reversed for a reversed hook.

    Args:
        plugins (`Sequence[object]`): the plugin objects, user's order first, engine defaults last.

    Raises:
        PluginError: an implementation whose name is no hook (``check_pending``), whose arguments are not
            the hook's, or two plugins with one name.
    """

    def __init__(self, plugins: Sequence[Any]) -> None:
        self.plugins: list[Any] = []
        self._pm = _PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._trace = os.environ.get(TRACE_ENV, "") not in ("", "0")
        self._hooks: dict[str, HookCall] = {}  # every hook of the spec, implemented or not
        for plugin in plugins:
            self.register(plugin)  # about 0.1 ms each
        self._rebuild()  # every hook has its list, even with no plugin

    # -------------------------------------------------------------------------------------- registration

    def register(self, plugin: Any) -> None:
        """Register one more plugin, after the others.

        Raises:
            PluginError: as the constructor does.
        """
        try:
            self._pm.register(plugin, name=plugin_name(plugin))
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"plugin {plugin_name(plugin)!r} cannot be registered: {exc}") from None
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self._pm.unregister(plugin)
            raise PluginError(
                f"plugin {plugin_name(exc.plugin)!r}: {exc}; see the hook reference for the valid hook names"
            ) from None
        self.plugins.append(plugin)
        self._rebuild()

    def unregister(self, plugin: Any) -> None:
        """Unregister a registered plugin object: none of its hooks is called afterwards."""
        self._pm.unregister(plugin)
        self.plugins = [p for p in self.plugins if p is not plugin]
        self._rebuild()

    def _rebuild(self) -> None:
        """Recompute every hook's call list from pluggy's registered implementations (in place)."""
        position = {id(plugin): i for i, plugin in enumerate(self.plugins)}
        for name, caller in vars(self._pm.hook).items():
            if name.startswith("_"):
                continue
            forward = -1 if _is_reversed(name) else 1

            def key(impl: Any, forward: int = forward) -> tuple[bool, int, int]:
                direction = -forward if impl.trylast else forward  # pluggy runs trylast ones the other way round
                group = 0 if impl.tryfirst else 2 if impl.trylast else 1
                return not _is_wrapper(impl), group, direction * position[id(impl.plugin)]

            impls = sorted(reversed(caller.get_hookimpls()), key=key)  # stable: pluggy's order within a plugin
            if name not in self._hooks:
                self._hooks[name] = HookCall(name, bool(caller.spec and caller.spec.opts.get("firstresult")))
            self._hooks[name].set(impls)

    # ------------------------------------------------------------------------------------------- calling

    def implemented(self, hook_name: str) -> bool:
        """Whether any plugin implements ``hook_name`` (the engine skips the others on the hot path)."""
        hook = self._hooks.get(hook_name)
        return hook is not None and bool(hook.impls)

    def hook(self, hook_name: str) -> HookCall:
        """The call list of ``hook_name``, kept up to date: for a hot path that calls `run` with it."""
        return self._hooks[hook_name]

    def call(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a hook by keyword. An exception gets a note naming the plugin and hook that raised it.

        Returns what pluggy's hook call would: the results that are not ``None``, in call order, or for a
        ``firstresult`` hook the first one (``None`` if none). A hook no plugin implements returns at once.
        """
        return self.run(self._hooks[hook_name], kwargs)

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call a (set-up time) hook once per implementing plugin; return ``(plugin name, result)`` pairs
        in call order, so that results can be attributed (e.g. in a clash between two plugins)."""
        results = []
        for name, one in self._one_by_one(hook_name):
            result = self.run(one, kwargs, name)
            results.append((name, result if one.firstresult else (result[0] if result else None)))
        return results

    def call_all(self, hook_name: str, **kwargs: Any) -> list[Exception]:
        """Call every implementation of a (clean-up) hook in the documented order, even when some raise.

        Returns:
            The exceptions raised, in call order, each with a note naming the plugin and the hook.
        """
        failures = []
        for name, one in self._one_by_one(hook_name):
            try:
                self.run(one, kwargs, name)
            except Exception as exc:
                failures.append(exc)
        return failures

    def _one_by_one(self, hook_name: str) -> list[tuple[str, HookCall]]:
        """``(plugin name, a call list of that plugin's implementation alone)``, in the order the hook runs them."""
        hook = self._hooks[hook_name]
        return [(impl.plugin_name, HookCall(hook_name, hook.firstresult, (impl,))) for impl in hook.impls]

    def call_cleanup(self, hook_name: str, error: BaseException | None, **kwargs: Any) -> BaseException | None:
        """`call_all` for a clean-up hook; return the error in charge.

        With ``error`` (the run already failed), failures are attached to it as notes and it stays the one
        reported. Otherwise the first failure is returned, with the later ones as notes, for the caller to raise
        once every clean-up hook has run.
        """
        for failure in self.call_all(hook_name, **kwargs):
            if error is None:
                error = failure
            elif hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"torchloom: during clean-up, hook {hook_name!r} also raised {failure!r}")
        return error

    def run(self, hook: HookCall, kwargs: Mapping[str, Any], plugin: str | None = None) -> Any:
        """The one dispatch: call ``hook``'s implementations in its order, as pluggy's ``_multicall`` does.

        Implementations that are all plain are called here, each with the arguments it names (results that are not
        ``None`` collected; the first one returned for a ``firstresult`` hook), which costs about 0.4 µs less per
        call than ``_multicall``; wrapped ones go through ``_multicall`` with the same list. An exception gets a
        note naming ``plugin``, else the implementation it was raised in; one that another plugin's own code raised
        (`blame`: a ``state_dict`` the ``checkpoint`` plugin's hook called) is left to name that plugin, and the
        note names the hook it happened in only. ``TORCHLOOM_TRACE_HOOKS`` prints the call first.
        """
        if self._trace:
            _trace_call(hook)
        try:
            if hook.plain:
                results = []
                for function, argnames in hook.calls:
                    result = function(*[kwargs[name] for name in argnames])
                    if result is not None:
                        if hook.firstresult:
                            return result
                        results.append(result)
                return None if hook.firstresult else results
            return _multicall(hook.name, hook.multicall, kwargs, hook.firstresult)
        except BaseException as exc:
            if self._trace:
                print(f"[torchloom] {hook.name} raised {exc!r}", file=sys.stderr)
            culprit = plugin or _raising_plugin(exc, hook.impls)
            if culprit is not None and isinstance(exc, Exception) and hasattr(exc, "add_note"):
                named = getattr(exc, CULPRIT_ATTR, None)
                if named is None or named == culprit:
                    exc.add_note(f"torchloom: raised in hook {hook.name!r} of plugin {culprit!r}")
                else:  # raised in another plugin's code that this hook called (`blame`): that plugin is named
                    exc.add_note(f"torchloom: while hook {hook.name!r} of plugin {culprit!r} ran")
            raise

    # ------------------------------------------------------------------------------------------ inspection

    def wrappers(self, hook_name: str) -> list[str]:
        """Names of the plugins that wrap ``hook_name`` (``wrapper=True``), outermost first."""
        return [impl.plugin_name for impl in self._hooks[hook_name].impls if _is_wrapper(impl)]

    def call_order(self, hook_name: str) -> list[str]:
        """Names of the plugins implementing ``hook_name``, in the order they run (wrappers first)."""
        return [impl.plugin_name for impl in self._hooks[hook_name].impls]


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager that also leaves out the hooks a plugin object lists in ``inactive_hooks``."""

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        if name in getattr(plugin, INACTIVE_HOOKS_ATTR, ()):
            return None
        return super().parse_hookimpl_opts(plugin, name)


def _raising_plugin(exc: BaseException, impls: Sequence[Any]) -> str | None:
    codes = {impl.function.__code__: impl.plugin_name for impl in impls if hasattr(impl.function, "__code__")}
    culprit = None
    tb = exc.__traceback__
    while tb is not None:  # innermost matching frame wins
        culprit = codes.get(tb.tb_frame.f_code, culprit)
        tb = tb.tb_next
    return culprit


def _trace_call(hook: HookCall) -> None:
    names = ", ".join(impl.plugin_name for impl in hook.impls) or "(no implementations)"
    print(f"[torchloom] {hook.name}: {names}", file=sys.stderr)
