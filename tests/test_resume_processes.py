"""A resume on another number of processes (issue 29, item 5) is refused with one `CheckpointError` that names both
counts and what to run instead. The checkpoint here is a one-process one whose manifest says two processes wrote it
(the manifest is not among the files it lists, so it still verifies): what a 2-process checkpoint resumed on one
process meets, without starting torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchloom
from cli_util import run_cli
from torchloom.checkpoint import list_checkpoints
from torchloom.testing import TinyTask

TASK = """
from torchloom.testing import TinyTask


class Tiny(TinyTask):
    pass
"""


def test_a_checkpoint_of_two_processes_resumed_on_one_is_one_error_naming_both_counts(tmp_path) -> None:
    engine = torchloom.Engine(output_dir=str(tmp_path / "out"), max_epochs=1, plugins=["checkpoint"])
    engine.fit(TinyTask())
    (checkpoint,) = list_checkpoints(tmp_path / "out")
    manifest_path = Path(checkpoint) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["world_size"] = 2
    manifest_path.write_text(json.dumps(manifest))
    expected = (
        "cannot resume from checkpoint: it was written by 2 process(es) and this run has 1: another number of "
        "processes is not supported"
    )
    with pytest.raises(torchloom.CheckpointError, match=expected.replace("(", r"\(").replace(")", r"\)")) as refused:
        torchloom.Engine(output_dir=str(tmp_path / "out"), max_epochs=2, plugins=["checkpoint"]).fit(
            TinyTask(), ckpt_path=checkpoint
        )
    assert "resume with 2 process(es) (torchrun --nproc_per_node 2, or accelerate launch --num_processes 2)" in str(
        refused.value
    )
    # The command: one line, exit status 2, and nothing trained (no new run directory left).
    (tmp_path / "tiny.py").write_text(TASK)
    config = f"engine: {{max_epochs: 2, output_dir: {tmp_path / 'out'}}}\ntask: {{class_path: tiny.Tiny}}\n"
    (tmp_path / "run.yaml").write_text(config + "plugins: {checkpoint: {}}\n")
    done = run_cli("fit", "--config", "run.yaml", "--resume", "auto", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("version_")) == ["version_0"]
