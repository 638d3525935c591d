"""torchloom.checkpoint.retention.prune_checkpoints called directly on run directories laid out by hand (manifests in
the checkpoint format, no weights: pruning reads the manifests only): which checkpoints go, in which order, and what is
never touched. Fast, no fit."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from torchloom.checkpoint.lineage import Resumed
from torchloom.checkpoint.retention import prune_checkpoints, prune_lineage
from torchloom.checkpoint.store import FORMAT, MANIFEST, VERSION, list_checkpoints
from torchloom.rundir import atomic as _atomic


def _checkpoint(output_dir: Path, run: int, step: int, **metrics: object) -> Path:
    path = output_dir / f"version_{run}" / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    manifest = {"format": FORMAT, "version": VERSION, "global_step": step, "metrics": metrics}
    (path / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    return path


def _left(output_dir: Path) -> list[str]:
    return [str(Path(p).relative_to(output_dir)) for p in list_checkpoints(output_dir)]


def test_the_oldest_beyond_keep_go_over_the_runs_oldest_first(tmp_path) -> None:
    made = [_checkpoint(tmp_path, run, step) for run in (0, 1, 2) for step in (2, 4)]
    deleted = prune_checkpoints(tmp_path, 3)
    assert deleted == [str(p.resolve()) for p in made[:3]]
    assert _left(tmp_path) == [
        "version_1/checkpoints/step-00000004",
        *(f"version_2/checkpoints/step-0000000{s}" for s in (2, 4)),
    ]
    assert prune_checkpoints(tmp_path, 3) == []  # nothing more to do
    assert prune_checkpoints(tmp_path, 1) == [str(made[3].resolve()), str(made[4].resolve())]


def test_keep_of_exactly_the_number_of_checkpoints_deletes_nothing(tmp_path) -> None:
    for step in (1, 2):
        _checkpoint(tmp_path, 0, step)
    assert prune_checkpoints(tmp_path, 2) == [] and len(_left(tmp_path)) == 2
    assert prune_checkpoints(str(tmp_path), 1) == [str((tmp_path / "version_0/checkpoints/step-00000001").resolve())]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": 0}, "keep=0, keep_best=1, mode='min'"),
        ({"keep": 1, "keep_best": 0}, "keep=1, keep_best=0, mode='min'"),
        ({"keep": 1, "mode": "best"}, "keep=1, keep_best=1, mode='best'"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kwargs, message) -> None:
    _checkpoint(tmp_path, 0, 1)
    with pytest.raises(ValueError, match=f"^prune_checkpoints: {message}$".replace("(", r"\(")):
        prune_checkpoints(tmp_path, **kwargs)
    assert len(_left(tmp_path)) == 1


def test_spared_checkpoints_stay_whatever_their_age(tmp_path) -> None:
    old = _checkpoint(tmp_path, 0, 1)
    middle = _checkpoint(tmp_path, 0, 2)
    _checkpoint(tmp_path, 1, 3)
    relative = os.path.relpath(middle, Path.cwd())
    assert prune_checkpoints(tmp_path, 1, spare=[str(old), relative]) == []
    assert prune_checkpoints(tmp_path, 1, spare=[old]) == [str(middle.resolve())]


@pytest.mark.parametrize(
    ("mode", "keep_best", "kept"),
    [("min", 1, ["s2"]), ("max", 1, ["s3"]), ("min", 2, ["s2", "s5"]), ("max", 2, ["s3", "s5"])],
)
def test_the_best_by_the_monitor_stay_nan_bool_and_missing_never_best_ties_to_the_earlier(
    tmp_path, mode, keep_best, kept
) -> None:
    scores = {1: math.nan, 2: 0.1, 3: 0.9, 4: True, 5: 0.5, 6: 0.5, 7: "x", 8: None}
    for step, value in scores.items():
        _checkpoint(tmp_path, 0, step, **({} if value is None else {"val/loss": value}))
    _checkpoint(tmp_path, 0, 9)  # the newest: kept by keep=1
    prune_checkpoints(tmp_path, 1, monitor="val/loss", mode=mode, keep_best=keep_best)
    names = {f"s{int(p.rsplit('-', 1)[1])}" for p in _left(tmp_path)}
    assert names == {*kept, "s9"}


def test_an_integer_score_counts_and_an_unknown_monitor_keeps_only_the_newest(tmp_path) -> None:
    _checkpoint(tmp_path, 0, 1, score=3)
    _checkpoint(tmp_path, 0, 2, score=2.5)
    _checkpoint(tmp_path, 0, 3, score=4)
    prune_checkpoints(tmp_path, 1, monitor="score", mode="max")
    assert _left(tmp_path) == ["version_0/checkpoints/step-00000003"]  # 4 is the best and the newest
    _checkpoint(tmp_path, 0, 4, score=1)
    prune_checkpoints(tmp_path, 1, monitor="other")
    assert _left(tmp_path) == ["version_0/checkpoints/step-00000004"]


def test_a_run_another_running_process_marked_in_use_keeps_all_its_checkpoints(tmp_path) -> None:
    busy = [_checkpoint(tmp_path, 0, step) for step in (1, 2)]
    free = _checkpoint(tmp_path, 1, 3)
    _checkpoint(tmp_path, 1, 4)
    _atomic.temporary_path(busy[0].parent.parent / "in-use", pid=os.getppid()).touch()  # the parent: still running
    assert prune_checkpoints(tmp_path, 1) == [str(free.resolve())]
    _atomic.mark_in_use(busy[0].parent.parent)  # this process's own mark does not count
    (busy[0].parent.parent / f".in-use.tmp-{os.getppid()}").unlink()
    assert prune_checkpoints(tmp_path, 1) == [str(p.resolve()) for p in busy]


def test_links_and_what_is_not_a_checkpoint_are_left_alone(tmp_path) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    outside = _checkpoint(elsewhere, 0, 1)
    linked_checkpoint = _checkpoint(elsewhere, 0, 2)
    _checkpoint(out, 0, 5)
    (out / "version_1").symlink_to(elsewhere / "version_0", target_is_directory=True)  # a run that is a link
    (out / "version_0" / "checkpoints" / "step-00000003").symlink_to(linked_checkpoint, target_is_directory=True)
    (out / "version_0" / "checkpoints" / "step-00000004").mkdir()  # no manifest: incomplete
    (out / "version_0" / "checkpoints" / ".step-00000006.tmp-1").mkdir()
    assert prune_checkpoints(out, 1) == []
    assert (outside / MANIFEST).is_file() and (linked_checkpoint / MANIFEST).is_file()
    assert (out / "version_0" / "checkpoints" / "step-00000004").is_dir()
    assert prune_checkpoints(tmp_path / "missing", 1) == []


def test_a_runs_checkpoints_folder_that_links_elsewhere_is_left_alone(tmp_path) -> None:
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    outside = [_checkpoint(elsewhere, 0, step) for step in (1, 2)]
    _checkpoint(out, 0, 5)
    (out / "version_1").mkdir()
    (out / "version_1" / "checkpoints").symlink_to(elsewhere / "version_0" / "checkpoints", target_is_directory=True)
    assert prune_checkpoints(out, 1) == []
    assert all((p / MANIFEST).is_file() for p in outside)


def _link(output_dir: Path, run: int, step: int) -> dict[str, object]:
    run_dir = output_dir / f"version_{run}"
    return {
        "run_dir": str(run_dir),
        "checkpoint": str(run_dir / "checkpoints" / f"step-{step:08d}"),
        "global_step": step,
    }


def test_prune_lineage_keeps_the_newest_of_the_whole_training_and_leaves_branches_and_other_runs_alone(tmp_path):
    # Run 0 saved 2, 4, 6 and was resumed from 4 (6 is a branch no run continued); run 1 saved 6, 8 and was
    # resumed from 8; run 2 (a fit of another training) saved 2; run 3 continues run 0 then run 1 and saved 10.
    for run, step in [(0, 2), (0, 4), (0, 6), (1, 6), (1, 8), (2, 2), (3, 10)]:
        _checkpoint(tmp_path, run, step)
    resumed = Resumed("", 8, chain=(_link(tmp_path, 0, 4), _link(tmp_path, 1, 8)))
    newer = [str(tmp_path / "version_3" / "checkpoints" / "step-00000010")]
    assert prune_lineage(resumed, 2, newer, output_dir=tmp_path / "elsewhere") == []  # not that output_dir's runs
    deleted = prune_lineage(resumed, 2, newer, output_dir=tmp_path)
    assert [str(Path(p).relative_to(tmp_path)) for p in deleted] == [
        "version_0/checkpoints/step-00000002",
        "version_0/checkpoints/step-00000004",
        "version_1/checkpoints/step-00000006",
    ]
    assert _left(tmp_path) == [
        "version_0/checkpoints/step-00000006",  # a branch: after the step the next run resumed from
        "version_1/checkpoints/step-00000008",  # the checkpoint resumed from: one of the newest 2 of the training
        "version_2/checkpoints/step-00000002",  # another training's
        "version_3/checkpoints/step-00000010",
    ]
    spare = [str(tmp_path / "version_1" / "checkpoints" / "step-00000008")]
    assert prune_lineage(resumed, 1, newer, spare=spare) == []  # spared: the best, say
    assert [str(Path(p).relative_to(tmp_path)) for p in prune_lineage(resumed, 1, newer)] == [
        "version_1/checkpoints/step-00000008"
    ]
    with pytest.raises(ValueError, match="keep=0"):
        prune_lineage(resumed, 0, newer)
