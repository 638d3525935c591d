"""The two public shelves (issue 40): ``torchloom`` holds the framework's model, ``torchloom.utils`` the helpers a
plugin may use, and a helper's old place on ``torchloom`` still imports, with a ``DeprecationWarning``, until 0.3.

Also the floor plan's bounds: at most 40 top-level modules in ``src/torchloom``, the role folders, and no module
named for a split by size (``_x_table``, ``_x_result``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import torchloom
import torchloom.utils

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "torchloom"
HELPERS = sorted(
    set(torchloom.utils.__all__) - {"plugins_with", "full_tensor", "local_tensor", "reshard_module", "shard_like"}
)  # new: no old place


def test_the_first_shelf_has_at_most_40_names_and_none_of_the_helpers():
    assert len(torchloom.__all__) <= 40
    assert not set(torchloom.__all__) & set(torchloom.utils.__all__)
    assert not set(dir(torchloom)) & set(torchloom.utils.__all__)  # the old places are not advertised
    assert "utils" in dir(torchloom) or hasattr(torchloom, "utils")


@pytest.mark.parametrize("name", HELPERS)
def test_each_helper_imports_from_its_old_place_with_a_deprecation_warning(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = getattr(torchloom, name)
    assert old is getattr(torchloom.utils, name)
    assert [w.category for w in caught] == [DeprecationWarning]
    message = str(caught[0].message)
    assert f"torchloom.{name} moved to torchloom.utils.{name}" in message and "0.3" in message
    assert caught[0].filename == __file__  # it points at the line that used the old name


def test_the_new_place_warns_nothing_and_an_unknown_name_is_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(torchloom.utils.warn)
        from torchloom.utils import format_bytes, json_dumps

        assert format_bytes(2048) == "2 KiB" and json_dumps({"a": float("nan")}) == '{"a": "NaN"}'
    with pytest.raises(AttributeError, match=r"'torchloom\.utils' has no attribute 'parse_bytes'"):
        torchloom.utils.parse_bytes  # noqa: B018 - a private helper stays off the shelf
    with pytest.raises(AttributeError, match="'torchloom' has no attribute 'nothing'"):
        torchloom.nothing  # noqa: B018


def test_importing_the_shelves_imports_neither_torch_nor_accelerate():
    code = "import sys, torchloom, torchloom.utils; print(sorted({'torch', 'accelerate'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_core_has_at_most_40_top_level_modules_and_its_role_folders():
    modules = sorted(p.name for p in CORE.glob("*.py"))
    assert len(modules) <= 40, modules
    folders = {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()}
    assert {"checkpoint", "rundir", "tools", "data", "cli"} <= folders
    split_by_size = [m for m in modules if m.removesuffix(".py").endswith(("_table", "_tables", "_result"))]
    assert not split_by_size


def test_the_inventory_of_upstream_internals_is_test_data_not_in_the_package():
    assert not list(CORE.rglob("*internals*"))
    assert (ROOT / "tests" / "upstream_internals.py").is_file()


def _floor_plan() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") :]
    block = layout[layout.index("```") + 3 : layout.index("```", layout.index("```") + 3)]
    return block[block.index("src/torchloom/") : block.index("plugins/torchloom_plugins/")]


def test_the_readme_floor_plan_names_every_core_module_and_folder_and_nothing_else():
    plan = _floor_plan()
    named = set(re.findall(r"\b(\w+\.py)\b", plan))
    folders = set(re.findall(r"^\s+(\w+)/", plan, re.MULTILINE))
    top = {p.name for p in CORE.glob("*.py")}
    packages = {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()}
    assert top - named == set(), "README's Layout does not name these top-level modules"
    assert packages - folders == set(), "README's Layout does not name these folders"
    existing = {p.name for p in CORE.rglob("*.py")}
    assert named - existing == set(), "README's Layout names modules that do not exist"
    assert folders - packages == set(), "README's Layout names folders that do not exist"
