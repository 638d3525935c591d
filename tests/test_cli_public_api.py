"""The ``torchloom`` command is a client of the public API, as a plugin is (the layer rule of tests/test_layering.py
applied to src/torchloom/cli.py): it imports from torchloom only names in ``torchloom.__all__``, so it composes
plugins through `torchloom.Engine` and never through a private module or a copy of the engine's composition."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_layering import plugin_violations

CLI = Path(__file__).resolve().parents[1] / "src" / "torchloom" / "cli.py"


def test_cli_imports_only_the_public_api():
    assert plugin_violations(CLI.read_text(), "src/torchloom/cli.py") == []


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
