"""``torchloom plugins [--json] [--check] [--config FILE]``: the installed plugins, or the plugins a config enables
and the order in which their hooks run.

The listing imports no plugin: each one's summary (the first paragraph of its class docstring) and hooks (the
methods decorated with ``hookimpl``) are read from its module's source with `ast` (`read_plugin_source`), so the
command starts in a fraction of a second, without torch. A plugin that cannot be read so (not a class defined in
that file, a base class from another module) is imported. ``--check`` imports every plugin: each one's status is
then ``ok`` or ``failed to import`` with the reason, and its hooks are pluggy's reading of the imported class."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import pluggy

import torchloom
from torchloom import TorchloomError

from ._config import load_run_config

__all__ = ["HELP", "parser", "run"]

HELP = "list installed plugins"


def parser() -> Any:
    from jsonargparse import ArgumentParser

    sub = ArgumentParser(description="List installed plugins (and the call order for a config)")
    sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sub.add_argument(
        "--check", action="store_true", help="import every plugin: show whether it imports (slower: imports torch)"
    )
    sub.add_argument("--config", type=str | None, default=None, help="a run config: show its plugin order")
    return sub


def run(parser: Any, cfg: Any) -> int:
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
                "status": "not imported",
            }
            read = None if cfg.check else read_plugin_source(info.value)
            if read is not None:
                row["summary"], row["hooks"] = read
            else:
                try:
                    obj = info.load()
                except TorchloomError as exc:
                    row["status"] = f"failed to import: {exc.__cause__!r}"
                else:
                    row["summary"], row["hooks"], row["status"] = _summary(obj.__doc__), _implemented_hooks(obj), "ok"
            if len(registrations) > 1:
                others = [r.distribution for r in registrations if r is not info]
                row["status"] = f"conflict: name also registered by {', '.join(others)}"
            rows.append(row)
    if cfg.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(_no_plugins_listed())
    for row in rows:
        status = "" if row["status"] == "not imported" else f"  [{row['status']}]"
        print(f"{row['name']}  ({row['distribution']} {row['version']}){status}")
        if row["summary"]:
            print(f"    {row['summary']}")
        if row["hooks"]:
            print(f"    hooks: {', '.join(row['hooks'])}")
    return 0


def read_plugin_source(value: str) -> tuple[str, list[str]] | None:
    """``(summary, hooks)`` of the plugin class an entry point names (``"module:Class"``), read from the module's
    source with `ast`: nothing is imported but the module's parent packages (`importlib.util.find_spec`).

    The summary is the first paragraph of the class docstring (`_summary`); the hooks are the methods decorated with
    ``hookimpl`` (``@torchloom.hookimpl``, ``@hookimpl``, ``@hookimpl(...)``: a decorator named ``hookimpl``), in
    the order the class and its bases define them (bases first), as pluggy's reading of the imported class lists
    them. ``None`` when the source cannot be read so: the module has no source file, the name is not a class
    defined in it, or a base class other than ``Plugin`` / ``object`` comes from another module.
    """
    module, _, attr = value.partition(":")
    try:
        spec = importlib.util.find_spec(module.strip())
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py") or not attr or "." in attr.strip():
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=origin)
    except (OSError, SyntaxError, ValueError):
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    chain = _class_chain(attr.strip(), classes, set())
    if chain is None:
        return None
    hooks = [
        item.name
        for cls in chain
        for item in cls.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        and not item.name.startswith("_")
        and any(_is_hookimpl(decorator) for decorator in item.decorator_list)
    ]
    return _summary(ast.get_docstring(chain[-1])), list(dict.fromkeys(hooks))


def _class_chain(name: str, classes: Mapping[str, ast.ClassDef], seen: set[str]) -> list[ast.ClassDef] | None:
    """The class ``name`` after its bases of the same module, base first; ``None`` for a base read elsewhere."""
    node = classes.get(name)
    if node is None or name in seen:
        return None
    seen.add(name)
    chain: list[ast.ClassDef] = []
    for base in node.bases:
        base_name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else None
        if base_name in ("Plugin", "object") and (isinstance(base, ast.Name) or _is_torchloom(base)):
            continue
        if not isinstance(base, ast.Name):
            return None
        inherited = _class_chain(base.id, classes, seen)
        if inherited is None:
            return None
        chain.extend(inherited)
    return [*chain, node]


def _is_torchloom(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torchloom"


def _is_hookimpl(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "hookimpl") or (
        isinstance(target, ast.Attribute) and target.attr == "hookimpl"
    )


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
    _, engine = load_run_config(parser, ["fit", "--config", path], "fit", [])
    order = engine.hook_order()  # composed as a run composes them
    enabled = list(engine.resolved_plugin_settings())
    if as_json:
        print(json.dumps({"enabled": enabled, "hooks": order}, indent=2))
        return 0
    print("enabled plugins, in order: " + (", ".join(enabled) or "(none)"))
    for name, impls in order.items():
        print(f"  {name}: {' -> '.join(impls)}")
    return 0
