"""Version checks of on-disk formats, as a kind (issue 39): every file torchloom writes with a format version and
reads back (a checkpoint's ``manifest.json``, a plugin's state ``<name>.json``, the model card
``torchloom_model.json``) refuses a NEWER version with one error naming the file, its version and the version
read; an older supported version loads (plugin state version 1, docs/runs.md); a checkpoint manifest or plugin
state without a version is refused the same way; a model card without format and version (hand-written) is read as
the current one.

Files without a version (``summary.json``, ``resumed_from.json``, ``metrics.jsonl``) are not checked here; the
processed-dataset cache puts its ``cache_format`` in the entry's key, so another format is another entry.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchloom.checkpoint.manifest import FORMAT, VERSION
from torchloom.checkpoint.plugin_state import VERSION as STATE_VERSION
from torchloom.checkpoint.store import read_manifest
from torchloom.rundir.export import CARD_FORMAT, CARD_VERSION
from torchloom.testing import TinyTask, tiny_fit


class SaveAt:
    name = "test.save_at"

    def __init__(self, step: int) -> None:
        self.step, self.path = step, None

    @torchloom.hookimpl
    def on_train_step_end(self, progress) -> None:
        if progress.global_step == self.step:
            self.path = torchloom.save_checkpoint()


class Counter:
    """A stateful plugin whose state holds a float (NaN in the version-1 test)."""

    name = "test.counter"

    def __init__(self) -> None:
        self.value: Any = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[str, str]:
    """(a checkpoint at step 2, the exported model directory) of one tiny fit."""
    out = tmp_path_factory.mktemp("fit")
    saver = SaveAt(2)
    engine = tiny_fit([saver], output_dir=str(out), max_epochs=1, save_model=True)
    assert saver.path is not None
    return saver.path, str(Path(engine.run_dir) / torchloom.utils.MODEL_DIR)


def _copy(src: str, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite(path: Path, **changes: Any) -> None:
    document = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            document.pop(key)
        else:
            document[key] = value
    path.write_text(json.dumps(document))


_DROP = object()


# --------------------------------------------------------------------------------------------- manifest.json


def test_the_written_manifest_has_the_current_format_and_version(fitted) -> None:
    manifest = json.loads((Path(fitted[0]) / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == (FORMAT, VERSION) == ("torchloom.checkpoint", 3)


@pytest.mark.parametrize("version", [VERSION + 1, 1, _DROP, "2"], ids=["newer", "older-unsupported", "missing", "str"])
def test_a_manifest_of_another_version_is_refused_naming_file_version_and_the_one_read(
    fitted, tmp_path, version
) -> None:
    checkpoint = _copy(fitted[0], tmp_path / "step-00000002")
    _rewrite(checkpoint / "manifest.json", version=version)
    shown = None if version is _DROP else version
    expected = (
        rf"{re.escape(repr(str(checkpoint / 'manifest.json')))} is checkpoint format version {re.escape(repr(shown))};"
        rf" this torchloom \(.*\) reads versions 2, {VERSION}$"
    )
    with pytest.raises(torchloom.CheckpointError, match=expected):
        read_manifest(checkpoint)
    # a resume from it is refused with the same message, before anything is loaded
    with pytest.raises(torchloom.CheckpointError, match=rf"format version {re.escape(repr(shown))}"):
        engine = torchloom.Engine(output_dir=str(tmp_path / "resumed"), max_epochs=1, default_plugins=False)
        engine.fit(TinyTask(), ckpt_path=str(checkpoint))
    # and inspect does not describe it as if it were one it reads
    with pytest.raises(torchloom.CheckpointError, match=rf"format version {re.escape(repr(shown))}"):
        torchloom.inspect_path(checkpoint)


def test_a_manifest_of_another_format_is_refused(fitted, tmp_path) -> None:
    checkpoint = _copy(fitted[0], tmp_path / "step-00000002")
    _rewrite(checkpoint / "manifest.json", format="torchloom.checkpoint2")
    with pytest.raises(torchloom.CheckpointError, match=r"manifest.json' is not a torchloom checkpoint manifest"):
        read_manifest(checkpoint)


# ------------------------------------------------------------------------------------------- plugin state


def _saved_state(tmp_path: Path, value: float = 1.5) -> Path:
    plugin = Counter()
    plugin.value = value
    torchloom.save_plugin_state([plugin], tmp_path)
    return tmp_path / f"{Counter.name}.json"


def test_plugin_state_is_written_at_the_current_version_and_loads(tmp_path) -> None:
    path = _saved_state(tmp_path)
    document = json.loads(path.read_text())
    assert (document["format"], document["version"], document["plugin"]) == (
        "torchloom.plugin_state",
        STATE_VERSION,
        Counter.name,
    )
    fresh = Counter()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert fresh.value == 1.5


@pytest.mark.parametrize("version", [STATE_VERSION + 1, 0, _DROP, 2.0], ids=["newer", "zero", "missing", "float"])
def test_plugin_state_of_an_unknown_version_is_refused_naming_file_version_and_the_ones_read(tmp_path, version) -> None:
    path = _saved_state(tmp_path)
    _rewrite(path, version=version)
    fresh = Counter()
    shown = None if version is _DROP else version
    expected = (
        rf"{re.escape(Counter.name)}: {re.escape(repr(str(path)))} holds version {re.escape(repr(shown))} state of "
        rf"plugin '{re.escape(Counter.name)}'; expected version 1 or 2 of '{re.escape(Counter.name)}'"
    )
    with pytest.raises(torchloom.PluginError, match=expected):
        torchloom.load_plugin_state([fresh], tmp_path)
    assert fresh.value == 0.0  # nothing loaded


def test_plugin_state_of_version_1_still_loads_with_its_nan_spelling(tmp_path) -> None:
    """docs/runs.md: version 1 wrote ``{"__float__": "nan"}``, and still loads; version 2 reads ``"NaN"``."""
    path = _saved_state(tmp_path, value=math.nan)
    document = json.loads(path.read_text())
    assert document["state"]["value"] == {"__float__": "NaN"}
    document.update(version=1, state={"value": {"__float__": "nan"}})
    path.write_text(json.dumps(document))
    fresh = Counter()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert math.isnan(fresh.value)


# ------------------------------------------------------------------------------------------------ model card


def test_the_model_card_is_written_at_the_current_version(fitted) -> None:
    card = json.loads((Path(fitted[1]) / "torchloom_model.json").read_text())
    assert (card["format"], card["version"]) == (CARD_FORMAT, CARD_VERSION) == ("torchloom.model_card", 1)
    assert torchloom.inspect_path(fitted[1])["global_step"] == card["global_step"]


@pytest.mark.parametrize(
    ("changes", "shown"),
    [({"version": CARD_VERSION + 1}, "version 2"), ({"version": 0}, "version 0"), ({"version": True}, "version True"),
     ({"format": "other.card"}, "format 'other.card'")],
    ids=["newer", "zero", "bool", "other-format"],
)  # fmt: skip
def test_inspect_refuses_a_model_card_it_does_not_read(fitted, tmp_path, changes, shown) -> None:
    model = _copy(fitted[1], tmp_path / "model")
    _rewrite(model / "torchloom_model.json", **changes)
    expected = (
        rf"inspect: {re.escape(repr(str(model / 'torchloom_model.json')))} is a model card of {re.escape(shown)}; "
        rf"this torchloom \(.*\) reads format '{CARD_FORMAT}' version {CARD_VERSION}"
    )
    with pytest.raises(torchloom.ConfigError, match=expected):
        torchloom.inspect_path(model)


def test_inspect_reads_a_model_card_without_format_and_version_as_the_current_one(fitted, tmp_path) -> None:
    model = _copy(fitted[1], tmp_path / "model")
    _rewrite(model / "torchloom_model.json", format=_DROP, version=_DROP)
    assert torchloom.inspect_path(model)["model_class"] == "torch.nn.modules.linear.Linear"
