"""The ``torchloom`` command is a client of the public API, as a plugin is (the layer rule of tests/test_layering.py
applied to every module of src/torchloom/cli/): it imports from torchloom only names in ``torchloom.__all__`` (and its
own modules, relatively), so it composes plugins through `torchloom.Engine` and never through a private module or a
copy of the engine's composition."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_layering import plugin_violations

ROOT = Path(__file__).resolve().parents[1]
CLI_MODULES = sorted((ROOT / "src" / "torchloom" / "cli").glob("*.py"))


def test_the_cli_is_a_package_of_modules():
    assert {p.name for p in CLI_MODULES} >= {"__init__.py", "__main__.py", "fit.py", "plugins.py", "inspect.py"}


@pytest.mark.parametrize("path", CLI_MODULES, ids=[p.name for p in CLI_MODULES])
def test_cli_imports_only_the_public_api(path: Path):
    assert plugin_violations(path.read_text(), str(path.relative_to(ROOT))) == []
    # Its own modules, relatively, and nothing above the package that way (``from .. import _memory_plan``).
    above = [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 1]
    assert above == [], f"{path.name}: relative imports from outside torchloom.cli at lines {above}"


@pytest.mark.parametrize(
    "source",
    [
        "from torchloom._default_step import DefaultTrainStep",  # the engine's own plugins: composing by hand
        "from torchloom.plugins import HookRelay, plugin_name",
        "from torchloom import hookspecs",
        "from torchloom.engine import Engine",  # public name, private module path
        "import torchloom\nrelay = torchloom.plugins.HookRelay([])",
    ],
)
def test_the_scan_catches_what_the_cli_used_to_import(source):
    assert plugin_violations(source)
