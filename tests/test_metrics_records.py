"""The one reader of a run's metrics.jsonl (torchloom.checkpoint.lineage.read_records), for resuming and for inspect:
what it keeps of a file a killed process left, and the error each caller gets for a file that cannot be read."""

from __future__ import annotations

import math

import pytest

from torchloom.checkpoint.lineage import read_records, read_resumed
from torchloom.errors import ConfigError, RunFileError
from torchloom.rundir.inspect import inspect_path


def test_complete_lines_are_read_a_partial_one_and_non_objects_skipped_non_finite_names_read_back(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [
        '{"step": 1, "epoch": 0, "train/loss": 2.5}',
        "[1, 2]",
        '"text"',
        "",
        '{"step": 2, "epoch": 0, "train/loss": "NaN", "a": "Infinity", "b": "-Infinity", "c": "x"}',
        '{"step": 3, "epo',
    ]
    path.write_text("\n".join(lines), encoding="utf-8")
    first, second = read_records(path)
    assert first == {"step": 1, "epoch": 0, "train/loss": 2.5}
    assert math.isnan(second.pop("train/loss")) and second == {
        "step": 2, "epoch": 0, "a": math.inf, "b": -math.inf, "c": "x"
    }  # fmt: skip
    assert read_records(tmp_path / "missing.jsonl") == []


def test_an_unreadable_file_raises_the_callers_error(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.mkdir()  # exists, cannot be read as a file
    with pytest.raises(RunFileError, match=r"^cannot read '.*metrics\.jsonl': Is a directory$"):
        read_records(path)
    with pytest.raises(ConfigError, match=r"^inspect: cannot read '.*metrics\.jsonl': Is a directory$") as info:
        read_records(path, ConfigError, "inspect: ")
    assert not isinstance(info.value, RunFileError)


def test_resume_and_inspect_each_raise_their_own(tmp_path) -> None:
    run = tmp_path / "version_0"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(RunFileError, match="cannot read"):
        read_resumed(str(run / "checkpoints" / "step-00000002"), {"global_step": 2, "training": {"records": 1}})
    with pytest.raises(ConfigError, match=r"^inspect: cannot read"):
        inspect_path(run)
