"""A checkpoint written by an earlier torchloom still loads, and resumes bitwise (issue 40: the core moved into
folders, and a moved module must not change the format: the manifest's format name once followed a module path).

``tests/data/checkpoint_format_2`` holds the run directory of a 6-step fit written by torchloom at commit b738e6a
(format version 2; its ``make.py`` says how) with its checkpoint at step 3, and the model that run ended with. The
current code resumes it and must end with that model to the bit, logging the same losses at steps 4 to 6 as the old
run's ``metrics.jsonl``; a manifest with its format name changed is refused.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchloom
from torchloom.checkpoint.manifest import FORMAT, READABLE, VERSION
from torchloom.testing import TinyTask

DATA = Path(__file__).resolve().parent / "data" / "checkpoint_format_2"
sys.path.insert(0, str(DATA))
from make import CHECKPOINT, SETTINGS  # noqa: E402

CHECKPOINT_DIR = Path("version_0") / "checkpoints" / "step-00000003"


def _copy(tmp_path: Path) -> Path:
    """The stored run directory, copied. Its checkpoint has no ``plugins/`` folder: the old code wrote an empty one
    (the run has no stateful plugin), which git does not keep; a load needs none then."""
    shutil.copytree(DATA / "version_0", tmp_path / "version_0")
    assert not (tmp_path / CHECKPOINT_DIR / "plugins").exists()
    return tmp_path / CHECKPOINT_DIR


def test_the_format_has_not_changed_under_the_stored_checkpoint():
    manifest = json.loads((DATA / CHECKPOINT_DIR / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == ("torchloom.checkpoint", 2)
    assert FORMAT == "torchloom.checkpoint" and 2 in READABLE and VERSION == 3  # version 3: XXH3-128 checksums
    assert all("sha256" in entry and "xxh3_128" not in entry for entry in manifest["files"].values())


def test_a_checkpoint_of_the_earlier_code_resumes_to_the_same_model_bitwise(tmp_path):
    checkpoint = _copy(tmp_path)
    engine = torchloom.Engine(
        plugins=[{"checkpoint": CHECKPOINT}], default_plugins=False, output_dir=str(tmp_path), **SETTINGS
    )
    task = TinyTask(n=32, batch_size=4)
    engine.fit(task, ckpt_path=str(checkpoint))
    old = [json.loads(line) for line in (DATA / "version_0" / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["train/loss"]) for r in old if "train/loss" in r and r["step"] > 3]
    assert [(r["step"], r["train/loss"]) for r in engine.history if "train/loss" in r] == losses
    assert [r["step"] for r in old if "val/loss" in r] == [6] and engine.history[-1] == {**old[-1]}
    expected = load_file(DATA / "final_model.safetensors")
    got = {name: p.detach() for name, p in task.model.named_parameters()}
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_manifest_of_another_format_name_is_refused(tmp_path):
    checkpoint = _copy(tmp_path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "format": "torchloom.checkpoint.store"}))
    engine = torchloom.Engine(plugins=[{"checkpoint": CHECKPOINT}], default_plugins=False, **SETTINGS)
    with pytest.raises(torchloom.CheckpointError, match="is not a torchloom checkpoint manifest"):
        engine.fit(TinyTask(n=32, batch_size=4), ckpt_path=str(checkpoint))


def test_a_flipped_byte_in_a_version_2_checkpoint_is_caught_by_its_sha256(tmp_path):
    checkpoint = _copy(tmp_path)
    weights = checkpoint / "accelerate" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    engine = torchloom.Engine(plugins=[{"checkpoint": CHECKPOINT}], default_plugins=False, **SETTINGS)
    with pytest.raises(torchloom.CheckpointError, match=r"model.safetensors changed .* \(size or sha256 differs"):
        engine.fit(TinyTask(n=32, batch_size=4), ckpt_path=str(checkpoint))
