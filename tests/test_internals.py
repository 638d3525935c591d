"""The list of library internals torchloom relies on (`upstream_internals.INTERNALS`, test data) holds on the installed
versions, and names every private access in ``src/`` and ``plugins/``.

- `test_every_internal_resolves`: one test per entry; an upgrade that removes or changes one fails there, with
  what torchloom uses it for and where.
- `test_every_private_access_is_listed`: a private name reached in the code (an import from a private module of
  one of the libraries, ``obj._name`` on anything but torchloom's own objects, ``getattr(obj, "_name")``, a string
  such as ``"_orig_mod."``) must be an entry's mark in that module: the list cannot fall behind. (An attribute
  name that torchloom defines on its own objects too is taken as its own.)
- `test_every_listed_use_is_still_there`: each entry's mark (or its accessor) still appears in each module it
  names: the list cannot keep a use that is gone.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from upstream_internals import INTERNALS, LIBRARIES, Internal, resolve

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"torchloom": ROOT / "src" / "torchloom", "torchloom_plugins": ROOT / "plugins" / "torchloom_plugins"}
#: Private-looking strings and attributes that are no library's internal: name -> why.
NOT_LIBRARY_INTERNALS = {
    "_stage": "data/causal_lm.py: torchloom's own attribute of the data module (the stage it prepares)",
    "_torchloom_plugin": "plugins.py: torchloom's own marker attribute on a plugin class",
    "_time": "profiler.py: the suffix of torch.profiler's sort keys (cpu_time, self_cpu_time_total): public names",
    "_time_total": "profiler.py: the suffix of torch.profiler's public sort keys",
    "_memory_usage": "profiler.py: the suffix of torch.profiler's public sort keys (cpu_memory_usage)",
    "_end": "plugins.py: the suffix of the *_end hook names",
    "_kwargs": "_hf_args.py: the suffix of TrainingArguments fields such as gradient_checkpointing_kwargs",
    "_fields": "_padding.py: a namedtuple's fields (documented in the standard library)",
    "_torchloom_checkpoint": "grad_checkpoint.py: the plugin's own attribute on the modules it checkpoints",
    "_torchloom_base_sha256": "_adapter.py: the core's own cache of an adapted model's base hash (in its __dict__)",
    "_per_s": "throughput.py: the suffix of its logged rates (samples_per_s, tokens_per_s)",
}
PRIVATE_STRING = re.compile(r"_[a-z][A-Za-z0-9_]*\.?")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _files() -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every module of torchloom and of the built-in plugins."""
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            yield ".".join((package, *parts)), path


def _owned() -> set[str]:
    """The private names torchloom defines itself: functions, classes, module and class attributes, and the
    attributes its objects set on ``self`` / ``cls``."""
    owned: set[str] = set()
    for _, path in _files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                owned.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    owned.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                owned.add(node.id)
    return {name for name in owned if _private(name)}


def private_accesses(source: str, owned: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of every private name that ``source`` reaches of something it does not own."""
    tree = ast.parse(source)
    bodies = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, bodies) and node.body and isinstance(node.body[0], ast.Expr)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            for part in [*node.module.split("."), *(alias.name for alias in node.names)]:
                if _private(part):
                    yield node.lineno, part
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    yield from ((node.lineno, part) for part in alias.name.split(".") if _private(part))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if (isinstance(base, ast.Name) and base.id in LIBRARIES) or node.attr not in owned:
                yield node.lineno, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            yield node.lineno, node.args[1].value
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and PRIVATE_STRING.fullmatch(node.value)
        ):
            yield node.lineno, node.value.rstrip(".")


def _listed(module: str, name: str) -> bool:
    return any(
        name in entry.marks and any(module == where or module.startswith(f"{where}.") for where in entry.where)
        for entry in INTERNALS
    )


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("entry", INTERNALS, ids=[entry.path for entry in INTERNALS])
def test_every_internal_resolves(entry: Internal):
    try:
        resolve(entry)
    except LookupError as exc:
        try:
            version = importlib.metadata.version(entry.library)
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed)"
        accessor = f" (through {entry.accessor})" if entry.accessor else ""
        pytest.fail(
            f"{entry.path}: {exc} in the installed {entry.library} {version}. torchloom relies on it {entry.why}, "
            f"in {', '.join(entry.where)}{accessor}: "
            "adapt those places and this entry of tests/upstream_internals.py",
            pytrace=False,
        )


def test_every_private_access_is_listed():
    owned = _owned()
    unlisted = []
    for module, path in _files():
        for line, name in private_accesses(path.read_text(encoding="utf-8"), owned):
            if name not in NOT_LIBRARY_INTERNALS and not _listed(module, name):
                unlisted.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not unlisted, (
        "private names of libraries used but not in tests/upstream_internals.py (add an entry: the dotted path, "
        "what torchloom uses it for, the module), or a name of torchloom's own to NOT_LIBRARY_INTERNALS:\n"
        + "\n".join(unlisted)
    )


def test_every_listed_use_is_still_there():
    sources: dict[str, str] = {}
    for module, path in _files():
        sources[module] = path.read_text(encoding="utf-8")
    stale = []
    for entry in INTERNALS:
        marks = (*entry.marks, *([entry.accessor] if entry.accessor else []))
        for where in entry.where:
            texts = [text for module, text in sources.items() if module == where or module.startswith(f"{where}.")]
            if not texts:
                stale.append(f"{entry.path}: no module {where}")
            elif not any(mark in text for mark in marks for text in texts):
                stale.append(f"{entry.path}: {where} no longer mentions {' or '.join(map(repr, marks))}")
    assert not stale, "entries of tests/upstream_internals.py whose use is gone:\n" + "\n".join(stale)


def test_every_accessor_exists_and_every_entry_is_unique():
    import importlib

    for entry in (e for e in INTERNALS if e.accessor):
        modules = [importlib.import_module(where) for where in entry.where]
        assert any(callable(getattr(module, entry.accessor, None)) for module in modules), entry.path
    assert len({e.path for e in INTERNALS}) == len(INTERNALS)
    assert all(e.library in LIBRARIES for e in INTERNALS)


def test_the_scan_finds_each_kind_of_private_access():
    source = (
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_flatten\n"
        "from accelerate.state import _private_helper\n"
        "x = metric._secret\n"
        "y = getattr(metric, '_hidden', None)\n"
        "z = key.removeprefix('_orig_mod.')\n"
        "def f(self):\n    return self._mine\n"
    )
    found = {name for _, name in private_accesses(source, owned=set())}
    assert found == {"_dynamo", "_pytree", "_private_helper", "_secret", "_hidden", "_orig_mod"}
