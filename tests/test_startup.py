"""Start-up: ``import torchloom``, ``torchloom --help`` / ``--version`` and a plugin module's
``from torchloom import hookimpl, Plugin`` import neither torch nor Accelerate (they take about a second to
import); every public name still resolves. Times are measured by bench/, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import torchloom

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in ("torch", "accelerate", "transformers") if m in sys.modules)))
"""


def _heavy_modules_after(body: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body)], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "body",
    [
        "import torchloom",
        "from torchloom import hookimpl, Plugin, ConfigError, build_config, installed_plugins, __version__",
        "from torchloom.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "from torchloom.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass",
        "from torchloom.cli import main\ntry:\n    main(['inspect', '--help'])\nexcept SystemExit:\n    pass",
    ],
    ids=["import", "plugin-names", "help", "version", "inspect-help"],
)
def test_light_entry_points_import_no_torch(body):
    assert _heavy_modules_after(body) == []


def test_a_run_command_and_the_engine_do_import_torch():  # the probe sees an import when there is one
    assert "torch" in _heavy_modules_after("from torchloom import Engine")
    assert "torch" in _heavy_modules_after(
        "from torchloom.cli import main\ntry:\n    main(['fit', '--help'])\nexcept SystemExit:\n    pass"
    )


def test_every_public_name_resolves_and_is_listed():
    for name in torchloom.__all__:
        assert getattr(torchloom, name) is not None
    assert set(torchloom.__all__) <= set(dir(torchloom))
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        torchloom.Engin  # noqa: B018


def test_the_lazy_table_and_all_list_the_same_names():
    assert set(torchloom.__all__) == {*torchloom._EXPORTS, "__version__"}
