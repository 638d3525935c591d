"""A training interrupted twice reads as one (issue 24, item 4): each run directory keeps only what its own process
wrote, and the last one is complete.

A trains C11's task (10 ids, batches of 2, 3 epochs: 15 steps) without a stop. B saves at step 7 and dies at step
9; C resumes B's checkpoint, saves at step 11 and dies at step 13; D resumes C's checkpoint and finishes. What B
and C logged after their checkpoints was done again by the next run. D's ``metrics.jsonl`` must be A's, record for
record, with the records up to step 11 marked as carried over from the run that logged them (B's up to 7, C's
from 8 to 11); its TensorBoard log must hold A's curve; its ``summary.json`` must count the
whole training as A's does (the samples once each, the 15 steps, the 3 epochs, every value's last and best) and
D's own part apart; ``resumed_from.json`` and ``torchloom inspect`` name B then C. B's and C's files stay theirs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from resume_fit import DiesAt, Run, ShuffleTask, fit

CARRIED_OVER = "carried_over_from"  # the mark of a carried-over record (docs/runs.md)


def _records(run_dir: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _unmarked(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != CARRIED_OVER} for r in records]


def _summary(run: Run) -> dict[str, Any]:
    return json.loads((Path(run.engine.run_dir) / torchloom.utils.SUMMARY_FILE).read_text())


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Run]:
    """A uninterrupted; B (saves at 7, dies at 9), C (resumes B's 7, saves at 11, dies at 13), D (resumes C's 11):
    one output_dir, trackers on."""
    trackers = {"trackers": {"log_with": ["tensorboard"]}}
    a = fit(ShuffleTask, tmp_path_factory.mktemp("a"), [trackers])
    out = tmp_path_factory.mktemp("bcd")
    b = fit(ShuffleTask, out, [trackers, DiesAt(9)], save_at=[7], crash=False)
    c = fit(ShuffleTask, out, [trackers, DiesAt(13)], save_at=[11], crash=False, ckpt_path=b.checkpoint)
    d = fit(ShuffleTask, out, [trackers], ckpt_path=c.checkpoint)
    assert b.crashed and c.crashed and not d.crashed
    return {"a": a, "b": b, "c": c, "d": d}


def test_the_resumed_runs_metrics_are_the_uninterrupted_runs_with_the_carried_over_ones_marked(chain) -> None:
    a, b, c, d = (chain[k] for k in "abcd")
    whole, last = _records(a.engine.run_dir), _records(d.engine.run_dir)
    assert _unmarked(last) == whole  # every record once, in order: none lost, none twice
    marks = [(r["step"], r.get(CARRIED_OVER)) for r in last]
    b_dir, c_dir = b.engine.run_dir, c.engine.run_dir
    expected = [(s, b_dir if s <= 7 else c_dir if s <= 11 else None) for s, _ in marks]
    assert marks == expected  # carried over up to the checkpoint (step 11), each from the run that logged it
    assert all(r.get(CARRIED_OVER) is None for r in d.engine.history)  # what the engine returns is D's own
    assert [r for r in last if CARRIED_OVER not in r] == [dict(r) for r in d.engine.history]


def test_each_run_directory_keeps_only_what_its_own_process_wrote(chain) -> None:
    a, b, c = chain["a"], chain["b"], chain["c"]
    whole = _records(a.engine.run_dir)
    assert _records(b.engine.run_dir) == [r for r in whole if r["step"] <= 9]  # B: its own, nothing added later
    c_records = _records(c.engine.run_dir)  # C: B's up to 7 (carried), then its own up to its death at 13
    assert _unmarked(c_records) == [r for r in whole if r["step"] <= 13]
    assert [r["step"] for r in c_records if CARRIED_OVER in r] == [r["step"] for r in whole if r["step"] <= 7]
    assert not (Path(b.engine.run_dir) / "resumed_from.json").exists()


def test_records_logged_after_the_checkpoint_at_its_own_step_are_not_carried_over(tmp_path) -> None:
    """B saves at step 5, the last step of epoch 0, and goes on: the epoch's validation logs at step 5 after the save,
    then B dies at step 7. The fit resumed from step 5 validates epoch 0 again: carrying over every record of step
    <= 5 would hold that validation twice, carrying those of step < 5 would lose the training record of step 5."""
    settings = {"val_check_interval": None, "log_every_n_steps": 1}
    checkpoint = [{"checkpoint": {"every_n_steps": 5, "every_n_epochs": None, "keep_last": None}}]
    a = fit(ShuffleTask, tmp_path / "a", checkpoint, **settings)
    b = fit(ShuffleTask, tmp_path / "bc", checkpoint, save_at=[7], **settings)
    step5 = str(Path(b.engine.run_dir) / "checkpoints" / "step-00000005")
    assert [r["step"] for r in _records(b.engine.run_dir)].count(5) == 2  # train/loss before the save, val after
    c = fit(ShuffleTask, tmp_path / "bc", checkpoint, ckpt_path=step5, **settings)
    resumed = _records(c.engine.run_dir)
    assert _unmarked(resumed) == _records(a.engine.run_dir)
    carried = [r for r in resumed if CARRIED_OVER in r]
    assert [(r["step"], "val/loss" in r) for r in carried][-1] == (5, False)  # train/loss of step 5, not its val
    assert len(carried) == len(_records(b.engine.run_dir)) - 3  # val@5, train@6, train@7 were after the save


def test_the_resumed_runs_summary_counts_the_whole_training_and_its_own_part_apart(chain) -> None:
    a, c, d = chain["a"], chain["c"], chain["d"]
    whole, last = _summary(a), _summary(d)
    assert last["metrics"] == whole["metrics"]  # last and best over the whole curve, at the same steps
    assert (
        (last["optimizer_steps"], last["epochs"], last["samples"])
        == (15, 3, 30)
        == (
            whole["optimizer_steps"],
            whole["epochs"],
            whole["samples"],
        )
    )  # each of the 30 samples counted once: B's 14 (to step 7), C's 8 (steps 8 to 11), D's 8 (12 to 15)
    own = last["this_run"]
    assert (own["optimizer_steps"], own["samples"]) == (4, 8)
    assert last["runs"] == 3 and last["resumed_from"] == c.checkpoint
    lineage = json.loads((Path(d.engine.run_dir) / "resumed_from.json").read_text())
    before = lineage["carried_over"]
    assert before["samples"] == 22  # B's 14 and C's 8, up to step 11
    assert before["records"] == len([r for r in _records(a.engine.run_dir) if r["step"] <= 11])
    assert last["train_time_s"] == pytest.approx(before["train_time_s"] + own["train_time_s"])
    assert last["wall_time_s"] == pytest.approx(before["wall_time_s"] + own["wall_time_s"])
    assert before["train_time_s"] > 0 and last["wall_time_s"] > own["wall_time_s"] >= own["train_time_s"] > 0
    assert last["samples_per_s"] == pytest.approx(30 / last["train_time_s"])
    assert own["samples_per_s"] == pytest.approx(8 / own["train_time_s"])


def test_the_chain_of_runs_is_recorded_and_inspect_prints_it_oldest_first(chain, capsys) -> None:
    b, c, d = chain["b"], chain["c"], chain["d"]
    links = [
        {"run_dir": b.engine.run_dir, "checkpoint": b.checkpoint, "global_step": 7},
        {"run_dir": c.engine.run_dir, "checkpoint": c.checkpoint, "global_step": 11},
    ]
    lineage = json.loads((Path(d.engine.run_dir) / "resumed_from.json").read_text())
    assert (lineage["checkpoint"], lineage["global_step"], lineage["chain"]) == (c.checkpoint, 11, links)
    assert torchloom.inspect_path(d.engine.run_dir)["resumed_from"] == links
    assert torchloom.inspect_path(c.engine.run_dir)["resumed_from"] == links[:1]
    assert torchloom.inspect_path(c.checkpoint)["resumed_from"] == links[:1]  # the runs its run continued
    assert torchloom.inspect_path(b.engine.run_dir)["resumed_from"] is None
    from torchloom.cli import main

    capsys.readouterr()
    assert main(["inspect", d.engine.run_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("continues"))
    assert lines[start : start + 2] == [
        f"continues     {b.engine.run_dir} up to step 7 (checkpoint step-00000007)",
        f"              {c.engine.run_dir} up to step 11 (checkpoint step-00000011)",
    ]


def test_the_resumed_runs_tensorboard_log_holds_the_whole_curve_at_its_steps(chain) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(run: Run) -> dict[str, list[tuple[int, float]]]:
        reader = EventAccumulator(str(Path(run.engine.run_dir) / "torchloom"))
        reader.Reload()
        return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}

    whole, last = scalars(chain["a"]), scalars(chain["d"])
    assert last == whole and [s for s, _ in last["val/loss"]] == [4, 8, 12, 15]
    assert [s for s, _ in scalars(chain["b"])["val/loss"]] == [4, 8]  # B's own log is untouched


def test_a_checkpoint_outside_a_run_directory_carries_its_totals_but_no_records(tmp_path) -> None:
    import shutil

    b = fit(ShuffleTask, tmp_path / "b", save_at=[7])
    moved = shutil.copytree(b.checkpoint, tmp_path / "moved")
    # Up to step 7 (logging every 3 steps, validating every 4): train@3, train@4 (before its validation), val@4,
    # train@6.
    with pytest.warns(UserWarning, match="none of the 4 records"):
        c = fit(ShuffleTask, tmp_path / "c", ckpt_path=str(moved))
    assert all(CARRIED_OVER not in r for r in _records(c.engine.run_dir))
    assert _summary(c)["samples"] == 30 and _summary(c)["this_run"]["samples"] == 16
    assert torchloom.inspect_path(c.engine.run_dir)["resumed_from"] == [
        {"run_dir": None, "checkpoint": str(moved), "global_step": 7}
    ]
