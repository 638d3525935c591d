"""Nothing torchloom loads runs pickled code: no pickle, no torch.load without weights_only=True, in the core and
the built-in plugins (a test over the source, as tests/test_layering.py does for imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SOURCES = sorted([*ROOT.glob("src/torchloom/**/*.py"), *ROOT.glob("plugins/torchloom_plugins/**/*.py")])
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def unsafe_loads(tree: ast.AST) -> list[str]:
    """Imports of pickle-like modules, and calls of ``*.load`` / ``*.loads`` on them or ``torch.load`` without
    ``weights_only=True``, as ``'line: what'``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "torch":
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not safe:
                    found.append(f"{node.lineno}: torch.load without weights_only=True")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_file_loads_pickles(path):
    assert unsafe_loads(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_scan_finds_what_it_looks_for():
    lines = ["import pickle", "import torch", "torch.load('x')", "torch.load('y', weights_only=False)"]
    code = "\n".join([*lines, "torch.load('z', weights_only=True)"])
    assert unsafe_loads(ast.parse(code)) == [
        "1: import pickle",
        "3: torch.load without weights_only=True",
        "4: torch.load without weights_only=True",
    ]
    assert len(SOURCES) > 20  # the scan sees the whole core and every built-in plugin
