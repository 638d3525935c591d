"""Nothing in the core knows a built-in plugin by name (issue 40, item 8), except the default-plugin list
(``src/torchloom/_default_plugins.py``): where the core must know what a plugin does, it asks for a capability the
plugin declares (``Plugin.capabilities``, ``Plugin.checkpoint_ranking``; docs/writing-plugins.md).

The scan reads every module of ``src/torchloom`` (AST) for a string constant equal to the name of a built-in plugin
(read from pyproject.toml's ``[project.entry-points."torchloom.plugins"]``). Docstrings are prose, not lookups; an
f-string's text (an error message that mentions a plugin to the user) is not a constant equal to a name. Five
built-in plugins are named by words the core uses for its own things (a checkpoint, an optimizer, progress, mixed
precision, compile): such a word is a lookup only where it is compared with or used as a plugin's name: in a
comparison, subscript or call (or as a dict key, with its value and the call the dict goes to) that mentions
plugins (`_PLUGIN_WORDS`). The exceptions are listed, each with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "torchloom"

#: Where a plugin's name is the point, not a lookup: path (under src/torchloom) -> why.
ALLOWED = {
    "_default_plugins.py": "the default-plugin list: the one place the core names plugins (issue 40, item 8)",
    "tools/hf_args/fields.py": (
        "the HF-arguments converter translates TrainingArguments into a torchloom run config, whose plugins section "
        "names plugins as a user's config does; it writes names, it looks none up and loads nothing"
    ),
    "tools/hf_args/mapping.py": (
        "TrainingArguments' own field names (its fsdp field) as keys of the fields without an equivalent; the key is "
        "the HF field, not the plugin"
    ),
}
#: Plugin names that are also the core's own words (its checkpoints, optimizer, Progress counter, Accelerate's
#: mixed_precision setting, torch.compile, the deepspeed package): a string constant equal to one of them is a lookup
#: only where it is used with one of these identifiers (`_context`).
_CORE_WORDS = {"checkpoint", "optimizer", "progress", "mixed_precision", "compile", "deepspeed"}
_PLUGIN_WORDS = {"plugin_name", "plugins", "enable_plugins", "find_plugin", "installed_plugins", "plugins_with"}


def builtin_plugin_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["entry-points"]["torchloom.plugins"])


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _mentions_plugins(nodes: list[ast.AST | None]) -> bool:
    for top in nodes:
        for node in ast.walk(top) if top is not None else ():
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name is not None and name in _PLUGIN_WORDS:
                return True
    return False


def _context(node: ast.AST, parents: dict[int, ast.AST]) -> list[ast.AST | None]:
    """Where a constant is used: a dict key's own value and the call the dict is passed to; otherwise the nearest
    comparison, subscript, call or statement that holds it."""
    parent = parents.get(id(node))
    if isinstance(parent, ast.Dict) and any(key is node for key in parent.keys):
        value = parent.values[[key is node for key in parent.keys].index(True)]
        outer = parents.get(id(parent))
        return [value, outer.func if isinstance(outer, ast.Call) else None]
    while parent is not None and not isinstance(parent, ast.Compare | ast.Subscript | ast.Call | ast.stmt):
        parent = parents.get(id(parent))
    return [parent]


def plugin_names_in(path: Path, names: set[str]) -> list[str]:
    """``"<line>: '<name>'"`` for each string constant of ``path`` equal to a name of ``names`` that is a lookup."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings, found = _docstrings(tree), []  # (line, column, name)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names):
            continue
        if id(node) in docstrings:
            continue
        if node.value in _CORE_WORDS and not _mentions_plugins(_context(node, parents)):
            continue
        found.append((node.lineno, node.col_offset, node.value))
    return [f"{line}: {value!r}" for line, _, value in sorted(found)]


def test_the_core_names_no_built_in_plugin_outside_the_default_list():
    names = builtin_plugin_names()
    assert {"checkpoint", "peft", "grad_checkpoint", "progress"} <= names  # the table was read
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative in ALLOWED:
            continue
        hits = plugin_names_in(path, names)
        if hits:
            found[relative] = hits
    assert not found, (
        "the core names built-in plugins (ask a declared capability instead, torchloom.Plugin's capabilities, "
        f"docs/writing-plugins.md): {found}"
    )


def test_the_scan_finds_a_lookup_and_passes_the_core_words_used_for_themselves(tmp_path):
    """The scan's own check: a lookup by a core word is found; the same word as a hook argument's key is not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""peft in a docstring."""\n'
        'first = next(p for p in plugins if plugin_name(p) == "checkpoint")\n'
        'settings = {"peft": {}}\n'
        'relay.call("on_fit_start", optimizer=1, progress=2, begin={"optimizer": opt})\n'
        "message = f\"the {kind} plugin 'peft'\"\n"
        'engine = Engine(plugins=enable_plugins({"checkpoint": {}}), optimizer={"optimizer": 1})\n'
        'spec.get("optimizer"), getattr(optimizer, "optimizer", None), plugins.get("compile")\n',
        encoding="utf-8",
    )
    found = plugin_names_in(sample, builtin_plugin_names())
    assert found == ["2: 'checkpoint'", "3: 'peft'", "6: 'checkpoint'", "7: 'compile'"]


def test_every_allowed_exception_still_exists_and_names_a_plugin():
    names = builtin_plugin_names()
    for relative in ALLOWED:
        path = SRC / relative
        assert path.is_file(), relative
        assert relative == "_default_plugins.py" or plugin_names_in(path, names), f"{relative}: no longer needed"
