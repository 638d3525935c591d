"""The layer rule, by AST scan: the core never imports the built-in plugins, and plugins use only the public API.

- ``src/torchloom`` never imports ``torchloom_plugins`` (nor names it in ``importlib.import_module``).
- ``plugins/torchloom_plugins`` (and the third-party test distributions in ``tests/fixtures``) use only the two
  public shelves: names in ``torchloom.__all__`` and in ``torchloom.utils.__all__``; no other
  ``torchloom.<submodule>`` import, no private names, no ``torchloom.<name>`` (or ``torchloom.utils.<name>``)
  attribute access outside them, and none of the helper names that moved to ``torchloom.utils`` through
  ``torchloom`` (their deprecated old place).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchloom
import torchloom.utils

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "torchloom"
# The example third-party distribution counts too (its module, not its tests, which use torchloom.testing).
PLUGIN_DIRS = [ROOT / "plugins" / "torchloom_plugins", ROOT / "tests" / "fixtures"]
PLUGIN_FILES = [ROOT / "examples" / "torchloom-ema" / "torchloom_ema.py"]
PUBLIC = frozenset(torchloom.__all__)
UTILS = frozenset(torchloom.utils.__all__)


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


def plugin_violations(
    source: str, filename: str = "<plugin>", public: frozenset[str] = PUBLIC, utils: frozenset[str] = UTILS
) -> list[str]:
    """Uses of torchloom beyond its two public shelves in plugin code."""
    tree = ast.parse(source, filename)
    problems = []
    aliases = set()  # local names bound to the torchloom package itself
    shelves = set()  # local names bound to torchloom.utils
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torchloom":
                    aliases.add(alias.asname or "torchloom")
                elif alias.name == "torchloom.utils":  # binds torchloom, or the shelf under its alias
                    (shelves if alias.asname else aliases).add(alias.asname or "torchloom")
                elif alias.name.startswith("torchloom."):
                    problems.append(f"{filename}:{node.lineno}: imports submodule {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torchloom.utils":
                for alias in node.names:
                    if alias.name not in utils:
                        problems.append(f"{filename}:{node.lineno}: imports {alias.name!r}, not in torchloom.utils")
            elif node.module.startswith("torchloom."):
                problems.append(f"{filename}:{node.lineno}: imports from submodule {node.module}")
            elif node.module == "torchloom":
                for alias in node.names:
                    if alias.name == "utils":
                        shelves.add(alias.asname or "utils")
                    elif alias.name not in public:
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
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in aliases and node.attr not in public | {"utils"}:
            problems.append(f"{filename}:{node.lineno}: uses torchloom.{node.attr}, not in torchloom.__all__")
        on_utils = (isinstance(owner, ast.Name) and owner.id in shelves) or (
            isinstance(owner, ast.Attribute)
            and owner.attr == "utils"
            and isinstance(owner.value, ast.Name)
            and owner.value.id in aliases
        )
        if on_utils and node.attr not in utils:
            problems.append(f"{filename}:{node.lineno}: uses torchloom.utils.{node.attr}, not in torchloom.utils")
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
        "import torchloom\nx = torchloom.warn",  # a helper's deprecated old place
        "from torchloom import format_bytes",
        "from torchloom.utils import Engine",
        "import torchloom\nx = torchloom.utils.Engine",
        "import torchloom.utils as u\nx = u._bytes",
        "from torchloom import utils\nx = utils.parse_bytes",
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
        "import torchloom\ntorchloom.utils.warn('x')",
        "from torchloom.utils import json_dumps, warn",
        "import torchloom.utils\ntorchloom.utils.format_bytes(1)",
        "import torchloom.utils as u\nu.format_bytes(1)",
        "from torchloom import utils\nutils.closest_name('a', ['b'])",
    ],
)
def test_plugin_scan_allows_the_public_api(source):
    assert plugin_violations(source) == []


# ------------------------------------------------------------------------------- no import cycle


def module_names(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``src`` (a package is its ``__init__.py``)."""
    names = {}
    for path in python_files(src):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (imports for type checkers only, never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def import_graph(src: Path, top: str = "torchloom") -> dict[str, set[str]]:
    """Which module of the package ``top`` under ``src`` imports which, lazy (function-level) imports included.

    An edge goes to the module an import runs: ``import a.b`` and ``from a import b`` (``b`` a module) to ``a.b``;
    ``from a import name`` (a name defined in ``a``) to ``a``, a package's ``__init__`` included, so a submodule
    that imports ``__version__`` from its package depends on the package. Relative imports and
    ``importlib.import_module("literal")`` count; imports under ``if TYPE_CHECKING:`` do not. A module with a lazy
    table ``_EXPORTS`` (``top``, ``torchloom.utils``, ``torchloom.checkpoint``) imports the modules it names (PEP 562:
    it imports them when a name is first used). That a module's parent packages run before it is not an edge (every
    import of a submodule does that).
    """
    modules = module_names(src)

    def known(name: str) -> str | None:  # the module that runs for ``name``: itself, else its package
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules if name == top or name.startswith(top + ".")}
    for name in graph:
        path = modules[name]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skipped = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str | None] = []
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets += [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else known(base))
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                    targets.append(known(node.args[0].value))
            elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_EXPORTS":
                # a lazy table (PEP 562): the module imports the modules it names when a name is first used
                targets += [known(value.value) for value in node.value.values if isinstance(value, ast.Constant)]
        graph[name] = {t for t in targets if t in graph and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each group of modules that import each other (directly or not), its shortest cycle from its first
    module, ``[a, b, ..., a]``."""

    # Modules that reach each other: those reachable from a module that also reach it back.
    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in graph[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    reach = {name: reachable(name) for name in graph}
    cycles, grouped = [], set()
    for start in sorted(graph):
        if start in grouped or start not in reach[start]:
            continue
        group = {m for m in reach[start] if start in reach[m]}
        grouped |= group
        parent, queue = {start: start}, [start]  # breadth first, inside the group: the shortest way back
        while queue:
            current = queue.pop(0)
            if start in graph[current]:
                path = [current]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                cycles.append([*reversed(path), start])
                break
            for nxt in sorted(graph[current] & group):
                if nxt not in parent:
                    parent[nxt] = current
                    queue.append(nxt)
    return cycles


def test_src_torchloom_has_no_import_cycle():
    graph = import_graph(ROOT / "src")
    assert {"torchloom", "torchloom.engine", "torchloom.cli", "torchloom.data"} <= set(graph)
    assert "torchloom.engine" in graph["torchloom"]  # the lazy table counts
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles (lazy imports included):\n" + "\n".join(" -> ".join(c) for c in cycles)


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        (  # a lazy import back
            {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import f\n", "pkg/b.py": "def f():\n    import pkg.a\n"},
            ["pkg.a", "pkg.b", "pkg.a"],
        ),
        (  # a submodule that imports a name from its package, which re-exports it lazily
            {
                "pkg/__init__.py": '_EXPORTS = {"thing": "pkg.a"}\n__version__ = "1"\n',
                "pkg/a.py": "def f():\n    from pkg import __version__\n",
            },
            ["pkg", "pkg.a", "pkg"],
        ),
        (  # relative imports, three modules round
            {
                "pkg/__init__.py": "",
                "pkg/sub/__init__.py": "from .x import X\n",
                "pkg/sub/x.py": "from ..y import Y\nX = 1\n",
                "pkg/y.py": "import importlib\nY = importlib.import_module('pkg.sub')\n",
            },
            ["pkg.sub", "pkg.sub.x", "pkg.y", "pkg.sub"],
        ),
    ],
    ids=["lazy", "package-name", "relative"],
)
def test_the_cycle_check_finds_cycles(tmp_path: Path, files: dict[str, str], cycle: list[str]) -> None:
    assert import_cycles(import_graph(_write_tree(tmp_path, files), top="pkg")) == [cycle]


def test_the_cycle_check_leaves_out_what_never_runs_and_submodule_imports(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "from pkg import a\nimport pkg.a\n",  # a submodule, not the package: no edge to pkg
    }
    graph = import_graph(_write_tree(tmp_path, files), top="pkg")
    assert graph == {"pkg": set(), "pkg.a": set(), "pkg.b": {"pkg.a"}}
    assert import_cycles(graph) == []


#: DESIGN.md: "no module over about 600 lines except the hook contract file" (small modules, one idea each).
MAX_MODULE_LINES = 620
LONG_BY_DESIGN = {CORE / "hookspecs.py": "the hook contract: every hook's documented signature, in one place"}


def test_no_module_of_the_package_is_over_about_600_lines():
    files = python_files(CORE) + python_files(ROOT / "plugins" / "torchloom_plugins")
    long = {
        str(path.relative_to(ROOT)): lines
        for path in files
        if path not in LONG_BY_DESIGN
        and (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by idea): {long}"
    assert all(path.is_file() for path in LONG_BY_DESIGN)  # an exemption names a file that exists
