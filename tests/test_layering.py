"""The layer rule, by AST scan: the core never imports the built-in plugins, and plugins use only the public API.

- ``src/torchloom`` never imports ``torchloom_plugins`` (nor names it in ``importlib.import_module``).
- ``plugins/torchloom_plugins`` (and the third-party test distributions in ``tests/fixtures``) import from
  ``torchloom`` only names in ``torchloom.__all__``: no ``torchloom.<submodule>`` imports, no private names,
  and no ``torchloom.<name>`` attribute access outside ``__all__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchloom

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "torchloom"
# The example third-party distribution counts too (its module, not its tests, which use torchloom.testing).
PLUGIN_DIRS = [ROOT / "plugins" / "torchloom_plugins", ROOT / "tests" / "fixtures"]
PLUGIN_FILES = [ROOT / "examples" / "torchloom-ema" / "torchloom_ema.py"]
PUBLIC = frozenset(torchloom.__all__)


def python_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "build" not in p.relative_to(directory).parts)


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import statement and every import_module / __import__ call with a literal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def core_violations(source: str, filename: str = "<core>") -> list[str]:
    """Imports of the built-in plugins package from core code."""
    tree = ast.parse(source, filename)
    return [
        f"{filename}:{line}: imports {module}"
        for line, module in _imported_modules(tree)
        if module == "torchloom_plugins" or module.startswith("torchloom_plugins.")
    ]


def plugin_violations(source: str, filename: str = "<plugin>", public: frozenset[str] = PUBLIC) -> list[str]:
    """Uses of torchloom beyond its public API in plugin code."""
    tree = ast.parse(source, filename)
    problems = []
    aliases = set()  # local names bound to the torchloom package itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torchloom":
                    aliases.add(alias.asname or "torchloom")
                elif alias.name.startswith("torchloom."):
                    problems.append(f"{filename}:{node.lineno}: imports submodule {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("torchloom."):
                problems.append(f"{filename}:{node.lineno}: imports from submodule {node.module}")
            elif node.module == "torchloom":
                for alias in node.names:
                    if alias.name not in public:
                        problems.append(f"{filename}:{node.lineno}: imports {alias.name!r}, not in torchloom.__all__")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            target = node.args[0].value
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if (
                called in ("import_module", "__import__")
                and isinstance(target, str)
                and target.startswith("torchloom.")
            ):
                problems.append(f"{filename}:{node.lineno}: imports submodule {target}")
    for node in ast.walk(tree):
        is_package_attr = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if is_package_attr and node.value.id in aliases and node.attr not in public:
            problems.append(f"{filename}:{node.lineno}: uses torchloom.{node.attr}, not in torchloom.__all__")
    return problems


# ---------------------------------------------------------------------------------- the real tree


def test_public_api_has_no_private_names():
    assert PUBLIC and not [n for n in PUBLIC if n.startswith("_") and n != "__version__"]
    for name in PUBLIC:
        assert hasattr(torchloom, name), f"torchloom.__all__ names {name!r} but torchloom has no such attribute"


def test_core_never_imports_the_builtin_plugins():
    files = python_files(CORE)
    assert CORE / "engine.py" in files
    problems = [v for f in files for v in core_violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == []


def test_plugins_use_only_the_public_api():
    files = [f for d in PLUGIN_DIRS for f in python_files(d)] + PLUGIN_FILES
    assert ROOT / "plugins" / "torchloom_plugins" / "__init__.py" in files
    problems = [v for f in files for v in plugin_violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == []


# ------------------------------------------------------------------------- the scanner can fail


@pytest.mark.parametrize(
    "source",
    [
        "import torchloom_plugins.grad_accum",
        "from torchloom_plugins import grad_clip",
        "from torchloom_plugins.optimizer import OptimizerSwap",
        "def f():\n    import torchloom_plugins",
        "import importlib\nimportlib.import_module('torchloom_plugins.local_sgd')",
    ],
)
def test_core_scan_catches(source):
    assert core_violations(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torchloom.engine",
        "from torchloom.engine import Engine",
        "from torchloom.plugins import HookRelay",
        "from torchloom import _default_step",
        "from torchloom import hookspecs",
        "import torchloom\nx = torchloom.engine.Engine",
        "import torchloom as tl\nx = tl._logbuffer",
        "import importlib\nimportlib.import_module('torchloom.testing')",
        "def f():\n    from torchloom.progress import Progress",
    ],
)
def test_plugin_scan_catches(source):
    assert plugin_violations(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torchloom\n@torchloom.hookimpl\ndef f(): pass",
        "from torchloom import Plugin, hookimpl, Progress",
        "import torchloom as tl\nclass P(tl.Plugin): pass",
        "from . import helpers",
        "import torch\nx = torch.nn.Linear",
    ],
)
def test_plugin_scan_allows_the_public_api(source):
    assert plugin_violations(source) == []
