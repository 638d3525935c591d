"""The docs are true to the code: the hook reference is current and complete, every built-in plugin has a
page, every relative link resolves, the Python examples compile, and the guides' runnable examples run and
print what the page says they print (datasette's tests/test_docs.py)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import re
import sys
from pathlib import Path
from types import ModuleType

import pluggy
import pytest
import yaml

from torchloom import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Markdown files whose relative links must resolve: every page under docs/, the README, the example plugin's.
LINKED_PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "examples" / "torchloom-ema" / "README.md"])
#: Pages whose ```python blocks must compile and whose ```yaml blocks must parse.
CODE_PAGES = sorted([*DOCS.glob("*.md"), ROOT / "README.md"])
#: Pages whose ```python blocks run, in order, as one session; each ```text block is what they printed since the
#: previous ```text block (numbers compared to 4 significant digits).
RUNNABLE_PAGES = ["index.md", "writing-plugins.md"]
NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)  # [name]: target


def _gen_hooks() -> ModuleType:
    """docs/gen_hooks.py, imported (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("torchloom_docs_gen_hooks", DOCS / "gen_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hook_argnames() -> dict[str, tuple[str, ...]]:
    """hook name -> its arguments, read from the hookspecs the way pluggy reads them."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return {
        name: caller.spec.argnames
        for name, caller in vars(pm.hook).items()
        if isinstance(caller, pluggy.HookCaller) and caller.spec is not None
    }


def _builtin_plugin_names() -> list[str]:
    eps = importlib.metadata.distribution("torchloom").entry_points
    return sorted(ep.name for ep in eps if ep.group == "torchloom.plugins")


def _without_code(text: str) -> str:
    """The Markdown with fenced blocks and inline code removed (links inside code are not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (lower case, punctuation dropped, spaces to hyphens)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _relative_links(page: Path) -> list[str]:
    text = _without_code(page.read_text(encoding="utf-8"))
    links = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in links if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t)]  # skip https:, mailto:


def _blocks(page: Path, *languages: str) -> list[tuple[int, str, str]]:
    """(line, language, code) of the page's fenced blocks in ``languages``, in order."""
    text = page.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start(3)) + 1, m.group(2).lower(), m.group(3))
        for m in FENCE.finditer(text)
        if m.group(2).lower() in languages
    ]


def _python_blocks(page: Path) -> list[tuple[int, str]]:
    return [(line, code) for line, _, code in _blocks(page, "python", "py")]


def _same_output(printed: str, documented: str) -> bool:
    """Equal text, and numbers equal to 4 significant digits (float rounding differs across CPU kernels)."""
    if NUMBER.sub("#", printed).strip() != NUMBER.sub("#", documented).strip():
        return False
    pairs = zip(NUMBER.findall(printed), NUMBER.findall(documented), strict=True)
    return all(float(a) == pytest.approx(float(b), rel=1e-4, abs=1e-12) for a, b in pairs)


# ------------------------------------------------------------------------------------------ hook reference


def test_hook_reference_is_up_to_date(capsys):
    gen_hooks = _gen_hooks()
    status = gen_hooks.main(["--check"])
    assert status == 0, capsys.readouterr().err + " (then commit docs/hooks.md)"


@pytest.mark.parametrize("hook", sorted(_hook_argnames()))
def test_every_hook_is_documented_with_its_exact_signature(hook):
    signature = f"{hook}({', '.join(_hook_argnames()[hook])})"
    headings = re.findall(r"^#+ `([^`]+)`\s*$", (DOCS / "hooks.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert signature in headings, f"docs/hooks.md has no heading `{signature}`; run python docs/gen_hooks.py"


def test_the_hook_reference_documents_no_hook_that_does_not_exist():
    text = (DOCS / "hooks.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^### `(\w+)\(", text, re.MULTILINE))
    assert documented == set(_hook_argnames())


# ---------------------------------------------------------------------------------------- plugin pages


def test_the_torchloom_distribution_registers_builtin_plugins():
    assert _builtin_plugin_names(), "no torchloom.plugins entry points in the installed torchloom metadata"


@pytest.mark.parametrize("name", _builtin_plugin_names())
def test_every_builtin_plugin_has_a_page_linked_from_the_index(name):
    page = DOCS / "plugins" / f"{name}.md"
    assert page.is_file(), f"built-in plugin {name!r} has no page {page.relative_to(ROOT)}"
    index = DOCS / "plugins" / "index.md"
    targets = {t.split("#")[0] for t in _relative_links(index)}
    assert f"{name}.md" in targets, f"docs/plugins/index.md does not link {name}.md"


@pytest.mark.parametrize("name", _builtin_plugin_names())
def test_the_plugin_index_lists_the_hooks_each_plugin_implements(name):
    (ep,) = [ep for ep in importlib.metadata.distribution("torchloom").entry_points if ep.name == name]
    plugin = ep.load()
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    implemented = {attr for attr in dir(plugin) if getattr(getattr(plugin, attr, None), marker, None) is not None}
    index = (DOCS / "plugins" / "index.md").read_text(encoding="utf-8")
    rows = [line for line in index.splitlines() if line.startswith(f"| [`{name}`]")]
    assert len(rows) == 1, f"docs/plugins/index.md has no table row for {name!r}"
    documented = set(re.findall(r"`(\w+)`", rows[0].rsplit("|", 2)[-2]))
    assert documented == implemented, (
        f"{name}: the index lists {sorted(documented)}, the plugin implements {sorted(implemented)}"
    )


def test_every_plugin_page_is_linked_from_the_index():
    targets = {t.split("#")[0] for t in _relative_links(DOCS / "plugins" / "index.md")}
    pages = {p.name for p in (DOCS / "plugins").glob("*.md") if p.name != "index.md"}
    assert pages <= targets, f"not linked from docs/plugins/index.md: {sorted(pages - targets)}"


# ------------------------------------------------------------------------------------------ stable surface


def test_the_stable_surface_lists_exactly_the_public_api():
    import torchloom
    import torchloom.testing

    text = (DOCS / "writing-plugins.md").read_text(encoding="utf-8")
    section = text[text.index("## The stable surface") :]
    exported = section[
        section.index("**The names exported by `torchloom`**") : section.index("**`torchloom.testing`**")
    ]
    testing = section[section.index("**`torchloom.testing`**") : section.index("**The hooks**")]
    assert set(re.findall(r"`(\w+)`", exported)) - {"torchloom", "__all__"} == set(torchloom.__all__)
    assert set(re.findall(r"`(\w+)`", testing)) - {"torchloom"} == set(torchloom.testing.__all__)


# ----------------------------------------------------------------------------------------------- links


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page):
    assert page.is_file(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_anchor_rule_matches_github(tmp_path):
    # GitHub lower-cases a heading, drops punctuation (backticks, parentheses, commas), turns spaces into
    # hyphens and numbers repeated headings.
    page = tmp_path / "page.md"
    page.write_text("# User guide\n## `configure_model(model, task)`\n## Enabling plugins\n## Enabling plugins\n")
    assert _anchors(page) == {"user-guide", "configure_modelmodel-task", "enabling-plugins", "enabling-plugins-1"}


# ----------------------------------------------------------------------------------------- code blocks


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_code_blocks_compile(page):
    if not page.is_file():
        pytest.fail(f"{page.relative_to(ROOT)} is missing")
    for line, code in _python_blocks(page):
        try:
            compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")
        except SyntaxError as exc:
            pytest.fail(f"{page.relative_to(ROOT)}, the python block at line {line}: {exc}")


@pytest.mark.parametrize("name", ["writing-plugins.md", "user-guide.md", "index.md", "loop.md"])
def test_the_guides_exist(name):
    page = DOCS / name
    assert page.is_file(), f"docs/{name} is missing"
    if name in ("writing-plugins.md", "user-guide.md"):
        assert _python_blocks(page), f"docs/{name} has no ```python block"


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_blocks_parse(page):
    for line, _, code in _blocks(page, "yaml", "yml"):
        try:
            yaml.safe_load(code)
        except yaml.YAMLError as exc:
            pytest.fail(f"{page.relative_to(ROOT)}, the yaml block at line {line}: {exc}")


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")  # DetectAnomaly's own
@pytest.mark.parametrize("name", RUNNABLE_PAGES)
def test_guide_examples_run_and_print_what_the_page_shows(name, tmp_path, monkeypatch):
    page = DOCS / name
    monkeypatch.chdir(tmp_path)  # the examples write under runs/
    module = ModuleType(f"torchloom_docs_{page.stem.replace('-', '_')}")  # dataclasses look classes up here
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    printed = io.StringIO()
    for line, language, code in _blocks(page, "python", "text"):
        where = f"docs/{name}, the {language} block at line {line}"
        if language == "text":
            assert _same_output(printed.getvalue(), code), (
                f"{where} shows:\n{code}\nbut the examples before it printed:\n{printed.getvalue()}"
            )
            printed = io.StringIO()
            continue
        with contextlib.redirect_stdout(printed):
            exec(compile(code, where, "exec"), namespace)
    # Test functions that the page defines (as a plugin author would write them) must pass too.
    for test_name, function in list(namespace.items()):
        if test_name.startswith("test_") and callable(function):
            function(tmp_path / test_name)
