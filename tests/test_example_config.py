"""examples/example_config.py: the config the examples' main() read (the YAML next to the script, or one given
first, with dotted.key=value overrides). Fast: no example is run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def read_config():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from example_config import read_config

        yield read_config
    finally:
        sys.path.remove(str(EXAMPLES))


def _script(tmp_path: Path, text: str) -> Path:
    (tmp_path / "demo.yaml").write_text(text, encoding="utf-8")
    return tmp_path / "demo.py"


def test_overrides_set_dotted_keys_creating_mappings_and_read_values_as_yaml(tmp_path, read_config) -> None:
    script = _script(tmp_path, "engine:\n  max_epochs: 1\n  seed: 0\ntask:\n  class_path: demo.Task\n")
    config = read_config(script, ["engine.max_epochs=3", "--task.init_args.lr=0.5", "plugins=[ema]", "x.y.z=false"])
    assert config == {
        "engine": {"max_epochs": 3, "seed": 0},
        "task": {"class_path": "demo.Task", "init_args": {"lr": 0.5}},
        "plugins": ["ema"],
        "x": {"y": {"z": False}},
    }
    assert read_config(script, ["engine.output_dir=runs/a=b"])["engine"]["output_dir"] == "runs/a=b"  # first '='


def test_a_yaml_given_first_replaces_the_scripts_own(tmp_path, read_config) -> None:
    script = _script(tmp_path, "engine: {max_epochs: 1}\n")
    other = tmp_path / "other.yml"
    other.write_text("engine: {max_epochs: 7}\n", encoding="utf-8")
    assert read_config(script, [str(other)]) == {"engine": {"max_epochs": 7}}
    assert read_config(script, [str(other), "engine.seed=2"]) == {"engine": {"max_epochs": 7, "seed": 2}}
    assert read_config(script, []) == {"engine": {"max_epochs": 1}}


def test_an_argument_without_a_value_is_refused_naming_the_script(tmp_path, read_config) -> None:
    script = _script(tmp_path, "engine: {max_epochs: 1}\n")
    with pytest.raises(SystemExit, match=r"^demo\.py: override 'engine\.max_epochs' is not of the form dotted"):
        read_config(script, ["engine.max_epochs"])
