"""``ckpt_path="best"`` is resolved from the checkpoints' manifests (issue 40, item 8): the core reads no plugin's
settings by name. Each manifest records the ranking the enabled plugins declare (``Plugin.checkpoint_ranking``: the
checkpoint plugin's ``monitor`` and ``mode``) as ``"ranking"``; ``"best"`` picks by the ranking an enabled plugin
declares (as before), else by the one the checkpoints recorded, across resumed runs too. Checkpoints that record none
(a run without a monitor, or written before manifests recorded it) give a clear error naming what is missing."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchloom.testing import TinyTask

# TinyTask: 8 optimizer steps per epoch, 2 epochs; a validation every 2 steps, a checkpoint every 2 steps.
SCORES = [0.5, 0.9, 0.6, 0.7, 0.65, 0.8, 0.4, 0.55]  # step 4 is the best by "max", step 14 by "min" of the kept


class Scripted(TinyTask):
    """Logs the scripted ``val/score`` of the validation at step 2k (k = 1..8), whichever run validates."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.log("val/score", SCORES[self.step // 2 - 1])


class Step:
    """Gives the task the progress, and sends SIGTERM at optimizer step ``kill_at`` (saved at the next boundary)."""

    name = "test.step"

    def __init__(self, task: Scripted, kill_at: int | None = None) -> None:
        self.task, self.kill_at = task, kill_at

    @torchloom.hookimpl
    def on_validation_start(self, progress: Any) -> None:
        self.task.step = progress.global_step

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        if progress.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(out: Path, monitor: str | None, kill_at: int | None = None, ckpt_path: str | None = None) -> None:
    task = Scripted()
    checkpoint = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": 2, "monitor": monitor, "mode": "max"}
    engine = torchloom.Engine(
        output_dir=str(out),
        max_epochs=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        default_plugins=False,
        plugins=[Step(task, kill_at), {"checkpoint": checkpoint}],
    )
    engine.fit(task, ckpt_path=ckpt_path)


def _best(out: Path, plugins: Any = None) -> str:
    engine = torchloom.Engine(output_dir=str(out), default_plugins=False, plugins=plugins)
    engine.validate(TinyTask(), ckpt_path="best")
    assert engine.weights_from is not None and engine.weights_from[0] == "checkpoint"
    return str(Path(engine.weights_from[1]).relative_to(out))


def _manifests(out: Path) -> list[Path]:
    return sorted(out.glob("version_*/checkpoints/*/manifest.json"))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """A fit monitoring ``val/score`` (max), stopped by SIGTERM after step 9 and resumed to its end."""
    out = tmp_path_factory.mktemp("resumed")
    with pytest.raises(torchloom.TrainingInterrupted):
        _fit(out, "val/score", kill_at=9)
    _fit(out, "val/score", ckpt_path="auto")
    return out


def test_each_manifest_records_the_ranking_the_plugins_declare(resumed) -> None:
    manifests = _manifests(resumed)
    assert {p.parent.parent.parent.name for p in manifests} == {"version_0", "version_1"}
    for path in manifests:
        assert json.loads(path.read_text())["ranking"] == {"monitor": "val/score", "mode": "max"}, path


def test_best_across_resumed_runs_is_the_same_with_or_without_the_checkpoint_plugin(resumed) -> None:
    """The earlier run's step 4 (0.9) is the best of both runs: found by the plugin's monitor, as before, and by the
    monitor the manifests recorded when no enabled plugin declares one (no plugin, or one without a monitor)."""
    expected = "version_0/checkpoints/step-00000004"
    assert _best(resumed, {"checkpoint": {"monitor": "val/score", "mode": "max"}}) == expected
    assert _best(resumed) == expected
    assert _best(resumed, {"checkpoint": {}}) == expected
    # an enabled plugin's ranking still decides (as before): the lowest score of the kept ones is step 14's 0.4
    lowest = _best(resumed, {"checkpoint": {"monitor": "val/score", "mode": "min"}})
    assert lowest == "version_1/checkpoints/step-00000014"


def test_checkpoints_without_a_monitor_give_an_error_naming_what_is_missing(tmp_path) -> None:
    _fit(tmp_path, None)
    for path in _manifests(tmp_path):
        assert json.loads(path.read_text())["ranking"] is None
    with pytest.raises(torchloom.ConfigError) as info:
        _best(tmp_path)
    message = str(info.value)
    assert message.startswith("validate: ckpt_path 'best' is the checkpoint with the best value of the 'checkpoint'")
    assert f"nor does any checkpoint of the output_dir {str(tmp_path)!r} record the monitor it was ranked by" in message
    assert "name 'last' or a path" in message


def test_checkpoints_written_before_manifests_recorded_a_ranking_still_resolve(tmp_path) -> None:
    """A manifest without ``ranking`` (the format before it) loads, and resolves ``"best"`` by the plugin's monitor
    as before; without one, the error says the checkpoints record none."""
    _fit(tmp_path, "val/score")
    for path in _manifests(tmp_path):
        manifest = json.loads(path.read_text())
        del manifest["ranking"]
        path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    best = _best(tmp_path, {"checkpoint": {"monitor": "val/score", "mode": "max"}})
    assert best == "version_0/checkpoints/step-00000004"
    with pytest.raises(torchloom.ConfigError, match="nor does any checkpoint of the output_dir"):
        _best(tmp_path)
