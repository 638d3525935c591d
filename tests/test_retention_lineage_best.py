"""``keep_best`` counts the whole training (issue 39, item 2): a fit stopped by a signal and resumed with
``ckpt_path="auto"`` keeps exactly the checkpoints an uninterrupted fit keeps, the best of the earlier run
included: the checkpoints of the runs it continues are ranked by the score each was saved with (its manifest's
value of ``monitor``, else the latest of the records written up to it), together with the fit's own (Lightning's
``ModelCheckpoint`` restores its best scores on a resume alike), by ``keep_last``'s lineage pruning and by
``keep_across_runs``."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask

# TinyTask: 8 optimizer steps per epoch, 2 epochs; a validation every 2 steps, a checkpoint every 2 steps.
SCORES = {"min": [0.5, 0.1, 0.4, 0.3, 0.35, 0.2, 0.6, 0.45], "max": [0.5, 0.9, 0.6, 0.7, 0.65, 0.8, 0.4, 0.55]}


class Scripted(TinyTask):
    """Logs the scripted ``val/score`` of the validation at step 2k (k = 1..8), whichever run validates."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scripted = scores

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.log("val/score", self.scripted[self.engine_step // 2 - 1])

    @property
    def engine_step(self) -> int:
        return self.trainer_progress.global_step


class Step:
    """Keeps the progress for the task (validation_step gets none), and sends SIGTERM to this process at
    optimizer step ``kill_at`` (the checkpoint plugin saves at the next step boundary, then stops the fit)."""

    name = "test.step"

    def __init__(self, task: Scripted, kill_at: int | None = None) -> None:
        self.task, self.kill_at = task, kill_at

    @torchloom.hookimpl
    def on_validation_start(self, progress: Any) -> None:
        self.task.trainer_progress = progress

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        if progress.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(
    out: Path,
    mode: str,
    kill_at: int | None = None,
    ckpt_path: str | None = None,
    scores: list[float] | None = None,
    **settings: Any,
) -> None:
    task = Scripted(scores or SCORES[mode])
    checkpoint = {
        "every_n_steps": 2,
        "every_n_epochs": None,
        "keep_last": 1,
        "monitor": "val/score",
        "mode": mode,
        "keep_best": 1,
        **settings,
    }
    # listed before the checkpoint plugin, its on_train_step_end runs after the plugin's (*_end hooks: reverse)
    engine = torchloom.Engine(
        output_dir=str(out),
        max_epochs=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        default_plugins=False,
        plugins=[Step(task, kill_at), {"checkpoint": checkpoint}],
    )
    engine.fit(task, ckpt_path=ckpt_path)


def _kept(out: Path) -> list[str]:
    return sorted(Path(p).name for p in list_checkpoints(out))


@pytest.mark.parametrize("across", [None, 1, 2], ids=["keep_last", "keep_across_runs=1", "keep_across_runs=2"])
@pytest.mark.parametrize(("mode", "best"), [("min", "step-00000004"), ("max", "step-00000004")])
def test_a_resumed_fit_keeps_the_checkpoints_an_uninterrupted_fit_keeps(tmp_path, mode, best, across) -> None:
    settings = {} if across is None else {"keep_across_runs": across}
    _fit(tmp_path / "whole", mode, **settings)
    assert _kept(tmp_path / "whole") == [best, "step-00000016"]
    with pytest.raises(torchloom.TrainingInterrupted):  # SIGTERM after step 9: saved at step 10, stopped
        _fit(tmp_path / "cut", mode, kill_at=9, **settings)
    assert _kept(tmp_path / "cut") == [best, "step-00000010"]
    _fit(tmp_path / "cut", mode, ckpt_path="auto", **settings)
    assert _kept(tmp_path / "cut") == _kept(tmp_path / "whole")
    assert [str(Path(p).relative_to(tmp_path / "cut")) for p in list_checkpoints(tmp_path / "cut")] == [
        f"version_0/checkpoints/{best}",
        "version_1/checkpoints/step-00000016",
    ]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_later_best_of_the_resumed_fit_replaces_the_earlier_runs_best(tmp_path, mode) -> None:
    """The resumed fit scores better at step 12 than the earlier run's best (step 4): step 4 goes, as in an
    uninterrupted fit; twice resumed, the best is still ranked over the three runs."""
    scores = {"min": [0.5, 0.1, 0.4, 0.3, 0.35, 0.05, 0.6, 0.45], "max": [0.5, 0.9, 0.6, 0.7, 0.65, 0.95, 0.4, 0.55]}
    _fit(tmp_path / "whole", mode, scores=scores[mode])
    assert _kept(tmp_path / "whole") == ["step-00000012", "step-00000016"]
    for kill_at in (5, 13):  # stopped at step 6, resumed, stopped at step 14, resumed
        with pytest.raises(torchloom.TrainingInterrupted):
            _fit(tmp_path / "cut", mode, kill_at=kill_at, ckpt_path="auto", scores=scores[mode])
    _fit(tmp_path / "cut", mode, ckpt_path="auto", scores=scores[mode])
    assert _kept(tmp_path / "cut") == _kept(tmp_path / "whole")


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_checkpoint_saved_before_the_resumed_fit_validated_is_scored_by_the_earlier_runs_value(tmp_path, mode):
    """Validation every 4 steps, a checkpoint every 2, keep_best 2: the uninterrupted fit scores step 10 with the
    value of step 8, the best, and keeps both. Stopped at step 8 and resumed, the resumed fit's step 10 is saved
    before it validates: it is scored with the value carried over (the plugin's latest value, and for the next
    resume the records written up to it, since its manifest has none), and survives two resumes."""
    best, worse = (0.1, 0.9) if mode == "min" else (0.9, 0.1)
    scores = [worse, best, worse, worse, worse, worse]  # validations at steps 4, 8, ..., 24

    def fit(out: Path, kill_at: int | None = None, ckpt_path: str | None = None) -> None:
        task = Scripted([s for s in scores for _ in (0, 1)])  # the value of step 2k: scores[(2k - 1) // 4]
        checkpoint = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": 1, "monitor": "val/score"}
        engine = torchloom.Engine(
            output_dir=str(out),
            max_epochs=3,
            val_check_interval=4,
            num_sanity_val_steps=0,
            default_plugins=False,
            plugins=[Step(task, kill_at), {"checkpoint": {**checkpoint, "mode": mode, "keep_best": 2}}],
        )
        engine.fit(task, ckpt_path=ckpt_path)

    fit(tmp_path / "whole")
    assert _kept(tmp_path / "whole") == ["step-00000008", "step-00000010", "step-00000024"]
    for kill_at in (7, 13):  # saved at step 8, resumed; saved at step 14, resumed
        with pytest.raises(torchloom.TrainingInterrupted):
            fit(tmp_path / "cut", kill_at=kill_at, ckpt_path="auto")
    fit(tmp_path / "cut", ckpt_path="auto")
    assert [str(Path(p).relative_to(tmp_path / "cut")) for p in list_checkpoints(tmp_path / "cut")] == [
        "version_0/checkpoints/step-00000008",
        "version_1/checkpoints/step-00000010",
        "version_2/checkpoints/step-00000024",
    ]
