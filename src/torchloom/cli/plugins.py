"""``torchloom plugins [--json] [--config FILE]``: the installed plugins, or the plugins a config enables and the
order in which their hooks run."""

from __future__ import annotations

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
