"""torchloom.checkpoint.lineage called directly, without a fit: the ``training`` record a checkpoint keeps, the
`Resumed` read back from a hand-written run directory (records counted or, for an older checkpoint, by step), what is
written for the next run and the chain read back. Fast."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from torchloom.checkpoint.lineage import CARRIED_OVER, Resumed, read_chain, read_resumed, training_record, write_resumed
from torchloom.errors import RunFileError


def _run(tmp_path, records: list[dict]) -> str:
    run = tmp_path / "version_0"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(run / "checkpoints" / "step-00000004")


def test_a_first_runs_training_record_is_its_own_part() -> None:
    assert training_record(None, 3, 48, 1.5, 2.0) == {
        "records": 3, "samples": 48, "train_time_s": 1.5, "wall_time_s": 2.0, "resumed_from": []
    }  # fmt: skip
    assert training_record(None, 0, None, 0.0, 0.0)["samples"] is None


def test_a_resumed_runs_training_record_adds_the_earlier_runs() -> None:
    chain = ({"run_dir": "a", "checkpoint": "a/checkpoints/x", "global_step": 4},)
    before = Resumed("c", 4, chain, ({"step": 1},) * 2, samples=32, train_time_s=1.0, wall_time_s=3.0)
    assert training_record(before, 3, 16, 0.5, 0.25) == {
        "records": 5, "samples": 48, "train_time_s": 1.5, "wall_time_s": 3.25, "resumed_from": list(chain)
    }  # fmt: skip
    unknown = Resumed("c", 4, chain, samples=None)
    assert training_record(unknown, 1, 16, 0.0, 0.0)["samples"] is None


def test_read_resumed_takes_the_counted_records_marks_them_and_carries_the_totals(tmp_path) -> None:
    records = [
        {"step": 2, "epoch": 0, "train/loss": 1.0},
        {"epoch": 0, "step": 4, "val/loss": "NaN"},
        {"step": 4, "epoch": 1, "train/loss": 0.5},  # logged after the checkpoint at its own step
    ]
    checkpoint = _run(tmp_path, records)
    training = {"records": 2, "samples": 40, "train_time_s": 2, "wall_time_s": 5, "resumed_from": [{"run_dir": "z"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = read_resumed(checkpoint, {"global_step": 4, "training": training})
    run_dir = str(tmp_path / "version_0")
    assert resumed.checkpoint == checkpoint and resumed.global_step == 4
    assert resumed.chain == ({"run_dir": "z"}, {"run_dir": run_dir, "checkpoint": checkpoint, "global_step": 4})
    first, second = resumed.records
    assert first == {"step": 2, "epoch": 0, CARRIED_OVER: run_dir, "train/loss": 1.0}
    assert list(second) == ["step", "epoch", CARRIED_OVER, "val/loss"] and math.isnan(second["val/loss"])
    assert (resumed.samples, resumed.train_time_s, resumed.wall_time_s) == (40, 2.0, 5.0)
    assert isinstance(resumed.train_time_s, float) and isinstance(resumed.wall_time_s, float)
    assert resumed.logged()[0] == (2, 0, {"train/loss": 1.0})


def test_an_older_checkpoint_without_a_count_takes_the_records_up_to_its_step(tmp_path) -> None:
    records = [{"step": 2, "epoch": 0, "a": 1}, {"step": 4, "epoch": 0, "a": 2}, {"step": 5, "epoch": 0, "a": 3}]
    resumed = read_resumed(_run(tmp_path, [*records, {"epoch": 0, "no_step": 1}]), {"global_step": 4})
    assert [r["a"] for r in resumed.records] == [1, 2]
    assert (resumed.samples, resumed.train_time_s, resumed.wall_time_s) == (None, 0.0, 0.0)
    assert resumed.chain[-1]["global_step"] == 4
    assert read_resumed(_run(tmp_path / "b", records), {}).global_step == 0
    assert read_resumed(_run(tmp_path / "c", records), {"training": {"samples": "many"}}).samples is None


def test_fewer_records_than_counted_warn_only_when_asked(tmp_path) -> None:
    checkpoint = _run(tmp_path, [{"step": 1, "epoch": 0, "a": 1}])
    manifest = {"global_step": 4, "training": {"records": 3}}
    with pytest.warns(UserWarning, match=r"its run's metrics\.jsonl holds 1 of the 3 records written up to it"):
        assert len(read_resumed(checkpoint, manifest).records) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_resumed(checkpoint, manifest, warn=False)
    outside = tmp_path / "moved"
    outside.mkdir()
    with pytest.warns(UserWarning, match=r"it is not in a run directory .* so none of the 3 records"):
        resumed = read_resumed(str(outside), manifest)
    assert resumed.records == () and resumed.chain == ({"run_dir": None, "checkpoint": str(outside), "global_step": 4},)


def test_write_resumed_then_read_chain(tmp_path) -> None:
    chain = ({"run_dir": "a", "checkpoint": "a/c", "global_step": 4},)
    records = ({"step": 1, "epoch": 0, CARRIED_OVER: "a", "loss": math.inf}, {"step": 2, "epoch": 0, "x": 1})
    write_resumed(str(tmp_path), Resumed("a/c", 4, chain, records, samples=8, train_time_s=1.0, wall_time_s=2.0))
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"step": 1, "epoch": 0, "carried_over_from": "a", "loss": "Infinity"}\n{"step": 2, "epoch": 0, "x": 1}\n'
    )
    lineage = json.loads((tmp_path / "resumed_from.json").read_text())
    assert lineage == {
        "checkpoint": "a/c",
        "global_step": 4,
        "chain": list(chain),
        "carried_over": {"records": 2, "samples": 8, "train_time_s": 1.0, "wall_time_s": 2.0},
    }
    assert read_chain(tmp_path) == list(chain)
    with pytest.raises(RunFileError, match=r"^cannot write '.*metrics\.jsonl': No such file or directory$"):
        write_resumed(str(tmp_path / "missing"), Resumed("x", 0))


@pytest.mark.parametrize("text", [None, "{not json", '["a"]', '{"chain": "x"}', '{"other": 1}'])
def test_read_chain_is_none_for_a_run_that_did_not_resume_or_an_unreadable_file(tmp_path, text) -> None:
    if text is not None:
        (tmp_path / "resumed_from.json").write_text(text, encoding="utf-8")
    assert read_chain(tmp_path) is None


def test_read_chain_keeps_only_the_mappings_of_the_chain(tmp_path) -> None:
    (tmp_path / "resumed_from.json").write_text('{"chain": [{"run_dir": "a"}, 3, "x"]}', encoding="utf-8")
    assert read_chain(str(tmp_path)) == [{"run_dir": "a"}]


def test_the_warning_of_a_fit_resumed_outside_a_run_directory_points_at_the_caller_of_fit(tmp_path) -> None:
    import shutil
    import sys
    from pathlib import Path

    import torchloom
    from torchrun_util import MP_DIR

    if "mutants" in Path(torchloom.__file__).parts:  # nox -s mutation: its trampolines add frames to every stack
        pytest.skip("a warning's stacklevel cannot be checked through mutmut's trampolines")
    sys.path.insert(0, str(MP_DIR))
    try:
        import resume_fit
    finally:
        sys.path.remove(str(MP_DIR))
    first = resume_fit.fit(resume_fit.ShuffleTask, tmp_path / "b", save_at=[7])
    moved = shutil.copytree(first.checkpoint, tmp_path / "moved")
    with pytest.warns(UserWarning, match="none of the 4 records") as caught:
        resume_fit.fit(resume_fit.ShuffleTask, tmp_path / "c", ckpt_path=str(moved))
    (warning,) = [w for w in caught if "none of the 4 records" in str(w.message)]
    assert warning.filename == resume_fit.__file__  # the line that called Engine.fit
