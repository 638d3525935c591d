"""The built-in plugins use the core's public constants, never a copy of one (a copy drifts when the core changes).

The constants are the ones the core reserves and exports (`torchloom.utils.INTERNAL_PREFIX`,
`torchloom.utils.MODEL_DIR`, `torchloom.utils.SUMMARY_FILE`, `torchloom.Monitor.MODES`); a plugin that spells one out (a
string literal starting with the internal prefix, a path component equal to a run-directory name, a tuple of the monitor
modes) fails here with the place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torchloom

PLUGINS = Path(__file__).resolve().parents[1] / "plugins" / "torchloom_plugins"
PREFIXES = (torchloom.utils.INTERNAL_PREFIX,)
PATH_NAMES = (torchloom.utils.MODEL_DIR, torchloom.utils.SUMMARY_FILE)
PATH_CALLS = {"join", "Path", "PurePath"}


def _docstrings(tree: ast.AST) -> set[int]:
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, owners) and node.body and isinstance(node.body[0], ast.Expr)
    }


def _path_components(tree: ast.AST) -> list[ast.Constant]:
    """String literals used as a path component: an argument of ``os.path.join`` / ``Path``, or after ``/``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in PATH_CALLS:
                found += [a for a in node.args if isinstance(a, ast.Constant)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            found.append(node.right)
    return found


def _copies(path: Path) -> list[str]:
    """Each copy of a core constant in the Python file ``path``, as ``file:line: what``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    copies = []
    for node in ast.walk(tree):
        text = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        if text and any(node.value.startswith(prefix) for prefix in PREFIXES):
            copies.append(f"{path.name}:{node.lineno}: {node.value!r} (use torchloom.utils.INTERNAL_PREFIX)")
        items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else None
        if items and tuple(getattr(e, "value", None) for e in items) == torchloom.Monitor.MODES:
            copies.append(f"{path.name}:{node.lineno}: {torchloom.Monitor.MODES!r} (use torchloom.Monitor.MODES)")
    for node in _path_components(tree):
        if node.value in PATH_NAMES:
            copies.append(f"{path.name}:{node.lineno}: the path component {node.value!r} (use the torchloom constant)")
    return copies


def test_no_builtin_plugin_copies_a_core_constant():
    copies = [copy for path in sorted(PLUGINS.glob("*.py")) for copy in _copies(path)]
    assert not copies, "built-in plugins copy core constants:\n" + "\n".join(copies)


def test_the_check_finds_each_kind_of_copy(tmp_path):
    """So that the check above cannot pass by finding nothing."""
    source = 'import os\nMODES = ("min", "max")\nP = "torchloom/x"\nos.path.join(d, "model")\nd / "summary.json"\n'
    (tmp_path / "bad.py").write_text(source)
    assert len(_copies(tmp_path / "bad.py")) == 4
