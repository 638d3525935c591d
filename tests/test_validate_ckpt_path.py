"""``torchloom validate --ckpt_path`` (Lightning's ``trainer.validate(ckpt_path=...)``) and ``predict``'s, alike:
a checkpoint the ``checkpoint`` plugin wrote, a run directory, an ``output_dir``, or ``last`` / ``best`` among the
checkpoints of the engine's ``output_dir``; a bad path or a checkpoint whose files do not match its manifest is one
error line that names the path and what it may be, and leaves no run directory."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import torchloom
from cli_util import run_cli  # the torchloom command, in this process
from torchloom.checkpoint.store import list_checkpoints, read_manifest
from torchloom.testing import TinyTask

#: TinyTask(n=16, batch_size=4): 4 optimizer steps per epoch; validated and checkpointed every 2 steps, so each
#: checkpoint's manifest records the val/loss of exactly its weights (the validation comes first, at that step).
CONFIG = {
    "engine": {"max_epochs": 2, "log_every_n_steps": 2, "val_check_interval": 2, "output_dir": "runs"},
    "task": {"class_path": "torchloom.testing.TinyTask", "init_args": {"n": 16, "lr": 0.05}},
    "plugins": {"checkpoint": {"every_n_steps": 2, "every_n_epochs": None, "keep_last": None}},
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict[str, Any]:
    """A fit of 8 steps with a checkpoint at steps 2, 4, 6 and 8, each with the val/loss of its own weights."""
    root = tmp_path_factory.mktemp("project")
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    proc = run_cli("fit", "--config", "config.yaml", cwd=root)
    assert proc.returncode == 0, proc.stderr
    checkpoints = [Path(p).relative_to(root) for p in list_checkpoints(root / "runs")]
    scores = {str(c): read_manifest(root / c)["metrics"]["val/loss"] for c in checkpoints}
    assert len(checkpoints) == 4 and len(set(scores.values())) == 4  # four different weights, four values
    return {"root": root, "checkpoints": checkpoints, "scores": scores}


def runs(root: Path) -> set[Path]:
    return set((root / "runs").glob("version_*"))


def validate(root: Path, *args: str) -> tuple[Any, float | None, Path | None]:
    """``torchloom validate --config config.yaml ARGS``: the process, its val/loss, its new run directory."""
    before = runs(root)
    proc = run_cli("validate", "--config", "config.yaml", *args, cwd=root)
    if proc.returncode != 0:
        return proc, None, None
    (run_dir,) = runs(root) - before
    return proc, json.loads((run_dir / "summary.json").read_text())["metrics"]["val/loss"]["last"], run_dir


def test_validate_loads_the_weights_of_the_checkpoint_it_names(project):
    """Each checkpoint's weights give back the val/loss its manifest recorded for them (and not the others')."""
    root = project["root"]
    for checkpoint in project["checkpoints"]:
        proc, loss, run_dir = validate(root, "--ckpt_path", str(checkpoint))
        assert proc.returncode == 0, proc.stderr
        assert loss == pytest.approx(project["scores"][str(checkpoint)], rel=1e-6), checkpoint
        assert f"torchloom validate: weights of checkpoint {checkpoint}" in proc.stdout.splitlines()
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["ckpt_path"] == str(checkpoint)
    _, without, _ = validate(root)  # the task's fresh weights: none of the checkpoints'
    assert all(without != pytest.approx(score, rel=1e-3) for score in project["scores"].values())


def test_last_and_best_are_found_among_the_checkpoints_of_the_output_dir(project):
    """``last``: the latest checkpoint; ``best``: the best by the checkpoint plugin's monitor and mode. With
    ``mode: max`` on val/loss the best is the highest loss, not the latest checkpoint: the two really differ."""
    root, checkpoints, scores = project["root"], project["checkpoints"], project["scores"]
    proc, loss, _ = validate(root, "--ckpt_path", "last")
    assert proc.returncode == 0, proc.stderr
    assert f"torchloom validate: weights of checkpoint {checkpoints[-1]}" in proc.stdout.splitlines()
    assert loss == pytest.approx(scores[str(checkpoints[-1])], rel=1e-6)
    for mode, pick in (("min", min), ("max", max)):
        best = pick(checkpoints, key=lambda c: scores[str(c)])
        monitor = ["--plugins.checkpoint.monitor=val/loss", f"--plugins.checkpoint.mode={mode}"]
        proc, loss, _ = validate(root, "--ckpt_path", "best", *monitor)
        assert proc.returncode == 0, proc.stderr
        assert f"torchloom validate: weights of checkpoint {best}" in proc.stdout.splitlines(), mode
        assert loss == pytest.approx(scores[str(best)], rel=1e-6)
    assert best != checkpoints[-1]  # mode max: the best is not the last


def test_predict_takes_the_same_ckpt_path_and_both_commands_document_it(project):
    root = project["root"]
    before = runs(root)
    proc = run_cli("predict", "--config", "config.yaml", "--ckpt_path", "best", cwd=root)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("torchloom: error: predict: ckpt_path 'best' is the checkpoint with the best value")
    assert runs(root) == before
    for command in ("validate", "predict"):
        help_text = " ".join(run_cli(command, "--help", cwd=root).stdout.split())
        assert "--ckpt_path CKPT_PATH" in help_text
        assert "'last' / 'best'" in help_text and "manifest" in help_text, command


@pytest.mark.parametrize(
    ("ckpt_path", "problem"),
    [
        ("runs/nope", "'runs/nope': no such file or directory; expected a checkpoint (a directory with manifest.json)"),
        ("config.yaml", "'config.yaml' is a file that holds no weights validate reads; expected a checkpoint"),
        ("best", "'best' is the checkpoint with the best value of the 'checkpoint' plugin's monitor, and it has none"),
    ],
)
def test_a_bad_ckpt_path_is_one_error_line_naming_it_and_what_it_may_be(project, ckpt_path, problem):
    root = project["root"]
    before = runs(root)
    proc, _, _ = validate(root, "--ckpt_path", ckpt_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"torchloom: error: validate: ckpt_path {problem}"), proc.stderr
    assert "'last' / 'best'" in proc.stderr  # what it may name
    assert runs(root) == before


@pytest.mark.parametrize("change", ["changed weights", "a planted file", "no manifest"])
def test_a_checkpoint_whose_files_do_not_match_its_manifest_is_refused_before_anything_runs(project, tmp_path, change):
    root = project["root"]
    copy = tmp_path / "step-copy"
    shutil.copytree(root / project["checkpoints"][1], copy)
    weights = copy / "accelerate" / "model.safetensors"
    if change == "changed weights":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF  # one bit pattern of the last tensor changed: the size is the same, the SHA-256 is not
        weights.write_bytes(bytes(data))
    elif change == "a planted file":
        (copy / "accelerate" / "extra.pkl").write_bytes(b"not listed")
    else:
        (copy / "manifest.json").unlink()
    before = runs(root)
    proc, _, _ = validate(root, "--ckpt_path", str(copy))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"torchloom: error: validate: ckpt_path {str(copy)!r}"), proc.stderr
    if change == "no manifest":  # a directory without a manifest: not a checkpoint at all
        assert "is a directory that holds no weights validate reads; expected a checkpoint" in proc.stderr
    else:
        assert "expected a complete checkpoint whose files are those its manifest.json lists" in proc.stderr
    assert runs(root) == before


def test_the_engine_takes_ckpt_path_from_python_too(project):
    """`torchloom.Engine.validate(task, ckpt_path=...)`: the same weights, ``weights_from`` says which."""
    root, checkpoint = project["root"], project["checkpoints"][0]
    engine = torchloom.Engine(output_dir=str(root / "runs"), default_plugins=False)
    metrics = engine.validate(TinyTask(n=16, lr=0.05), ckpt_path=root / checkpoint)
    assert engine.weights_from == ("checkpoint", str(root / checkpoint))
    assert metrics["val/loss"] == pytest.approx(project["scores"][str(checkpoint)], rel=1e-6)
    assert math.isfinite(metrics["val/loss"])


class Predicting(TinyTask):
    """TinyTask that predicts ``model(x)`` on its validation inputs."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(batch[0])

    def predict_dataloader(self) -> Any:
        return self.val_dataloader()


def test_predict_loads_last_from_python_as_validate_does(project):
    """``Engine.predict(task, ckpt_path="last")``: the outputs of the latest checkpoint's weights."""
    from safetensors.torch import load_file

    root, last = project["root"], project["checkpoints"][-1]
    engine = torchloom.Engine(output_dir=str(root / "runs"), default_plugins=False)
    task = Predicting(n=16, lr=0.05)
    outputs = torch.cat(engine.predict(task, ckpt_path="last"))
    assert engine.weights_from == ("checkpoint", str(root / last))
    weights = load_file(str(root / last / "accelerate" / "model.safetensors"))
    inputs = torch.cat([x for x, _ in task.val_dataloader()])
    assert torch.allclose(outputs, torch.nn.functional.linear(inputs, weights["weight"], weights["bias"]))
