"""Resume from "the latest checkpoint" when some checkpoints are unusable (issue 39, item 5).

"No checkpoint" and "checkpoints, none usable" are different answers: ``fit(ckpt_path="auto")`` / ``--resume auto``
starts fresh only when the ``output_dir`` has no checkpoint at all; when its latest checkpoint is unusable (a
truncated ``manifest.json``, another format version, no manifest) the fit is refused with a `CheckpointError` that
names each such checkpoint and why, whether or not an older one is usable (as a damaged latest checkpoint fails a
Lightning or HF Trainer resume). ``validate`` / ``predict``'s ``ckpt_path`` ("last", "best", a run directory, an
output_dir) treat them alike, and ``torchloom inspect`` lists them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

import torchloom
from cli_util import run_cli
from torchloom.errors import CheckpointError
from torchloom.testing import TinyTask

#: 32 samples, batch 4: 8 steps an epoch; a checkpoint every 4 steps: step-00000004, step-00000008 per epoch.
PLUGINS = [{"checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": 10, "monitor": "val/loss"}}]


def _engine(out: Path, **settings) -> torchloom.Engine:
    settings = {"max_epochs": 1, "log_every_n_steps": 1, "val_check_interval": 4, **settings}
    return torchloom.Engine(output_dir=str(out), plugins=PLUGINS, default_plugins=False, **settings)


def _checkpoints(out: Path) -> list[Path]:
    engine = _engine(out)
    engine.fit(TinyTask())
    found = sorted((out / "version_0" / "checkpoints").iterdir())
    assert [p.name for p in found] == ["step-00000004", "step-00000008"]
    return found


def _truncate(checkpoint: Path) -> None:
    manifest = checkpoint / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])


TRUNCATED = "cannot read manifest.json: Expecting value: line 3 column"  # JSON cut after 40 characters


def test_auto_refuses_an_output_dir_whose_checkpoints_are_all_unusable_naming_each(tmp_path):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    _truncate(older)
    _truncate(newer)
    engine = _engine(out, max_epochs=2)
    with pytest.raises(CheckpointError) as caught:
        engine.fit(TinyTask(), ckpt_path="auto")
    message = str(caught.value)
    assert message.startswith(f"cannot resume from {str(out)!r}: 2 checkpoints found, none usable ({older}: ")
    assert message.count(TRUNCATED) == 2 and f"; {newer}: {TRUNCATED}" in message
    assert "move them out of checkpoints/ (or delete them)" in message
    assert "or fit without ckpt_path (without --resume) to start a new training" in message
    assert not (out / "version_1").exists()  # nothing ran: no run directory
    # A manifest of another format version, and a checkpoint without one, are unusable alike; named with why
    (older / "manifest.json").write_text(json.dumps({"format": "torchloom.checkpoint", "version": 999}))
    (newer / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as caught:
        _engine(out).fit(TinyTask(), ckpt_path="auto")
    message = str(caught.value)
    assert f"{older}: manifest.json is checkpoint format version 999; this torchloom" in message
    assert f"{newer}: it has no manifest.json" in message


def test_auto_refuses_when_the_latest_is_unusable_and_an_older_one_usable_and_says_which(tmp_path):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    _truncate(newer)
    with pytest.raises(CheckpointError) as caught:
        _engine(out, max_epochs=2).fit(TinyTask(), ckpt_path="auto")
    message = str(caught.value)
    assert message.startswith(
        f"cannot resume from {str(out)!r}: 1 checkpoint newer than the newest usable one ({older}) cannot be used "
        f"({newer}: {TRUNCATED}"
    )
    assert f"move it out of checkpoints/ (or delete it) to use {older}" in message
    assert not (out / "version_1").exists()
    # ckpt_path naming the output_dir (--resume alone) picks the latest alike
    with pytest.raises(CheckpointError, match="1 checkpoint newer than the newest usable one"):
        _engine(out, max_epochs=2).fit(TinyTask(), ckpt_path=out)
    # The older one, named explicitly, resumes
    engine = _engine(out, max_epochs=2)
    engine.fit(TinyTask(), ckpt_path=older)
    assert engine.resumed_from == str(older) and engine.progress.global_step == 16


def test_an_unusable_checkpoint_older_than_a_usable_one_does_not_stop_auto(tmp_path):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    _truncate(older)
    engine = _engine(out, max_epochs=2)
    engine.fit(TinyTask(), ckpt_path="auto")
    assert engine.resumed_from == str(newer) and engine.progress.global_step == 16


def test_auto_over_an_empty_or_checkpointless_output_dir_still_starts_fresh(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    engine = _engine(out)
    engine.fit(TinyTask(), ckpt_path="auto")
    assert engine.resumed_from is None and engine.progress.global_step == 8
    bare = tmp_path / "bare"  # runs without the checkpoint plugin: no checkpoint at all
    torchloom.Engine(output_dir=str(bare), default_plugins=False, max_epochs=1).fit(TinyTask())
    again = torchloom.Engine(output_dir=str(bare), default_plugins=False, max_epochs=1)
    again.fit(TinyTask(), ckpt_path="auto")
    assert again.resumed_from is None and again.progress.global_step == 8


@pytest.mark.parametrize("command", ["validate", "predict"])
def test_validate_and_predict_refuse_a_latest_or_best_pick_over_unusable_checkpoints(tmp_path, command):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    _truncate(newer)
    engine = _engine(out)
    run = getattr(engine, command)
    for path in ("last", out, out / "version_0"):
        with pytest.raises(CheckpointError) as caught:
            run(TinyTask(), ckpt_path=path)
        assert f"1 checkpoint newer than the newest usable one ({older}) cannot be used ({newer}: " in str(caught.value)
        assert str(caught.value).endswith("; or name a checkpoint (ckpt_path PATH)")
    # "best" reads every manifest's value: an unreadable one, old or new, may have been the best
    _truncate(older)
    (newer / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="2 checkpoints found, none usable"):
        run(TinyTask(), ckpt_path="best")


def test_best_is_refused_when_any_checkpoint_is_unusable_last_only_when_a_newer_one_is(tmp_path):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    _truncate(older)
    engine = _engine(out)
    with pytest.raises(CheckpointError) as caught:
        engine.validate(TinyTask(), ckpt_path="best")
    assert "validate: ckpt_path 'best': 1 checkpoint cannot be read, so which is best cannot be told (" in str(
        caught.value
    )
    engine.validate(TinyTask(), ckpt_path="last")
    assert engine.weights_from == ("checkpoint", str(newer))


def test_the_cli_resume_auto_refuses_unusable_checkpoints_and_starts_fresh_on_none(tmp_path):
    out = tmp_path / "out"
    config = {
        "engine": {"max_epochs": 1, "output_dir": str(out)},
        "task": {"class_path": "torchloom.testing.TinyTask"},
        "plugins": {"checkpoint": {"every_n_steps": 4, "every_n_epochs": None}, "progress": {"enabled": False}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    first = run_cli("fit", "--config", "config.yaml", "--resume", "auto", cwd=tmp_path)  # none: starts fresh
    assert first.returncode == 0, first.stderr
    assert "resumed from" not in first.stdout
    older, newer = sorted((out / "version_0" / "checkpoints").iterdir())
    _truncate(newer)
    proc = run_cli("fit", "--config", "config.yaml", "--engine.max_epochs=2", "--resume", "auto", cwd=tmp_path)
    assert proc.returncode != 0
    assert f"1 checkpoint newer than the newest usable one ({older}) cannot be used ({newer}: " in proc.stderr
    assert "--resume PATH" in proc.stderr and not (out / "version_1").exists()
    _truncate(older)
    proc = run_cli("fit", "--config", "config.yaml", "--engine.max_epochs=2", "--resume", "auto", cwd=tmp_path)
    assert proc.returncode != 0 and "2 checkpoints found, none usable" in proc.stderr
    assert not (out / "version_1").exists()


def test_inspect_lists_an_unusable_checkpoint_with_why_and_reads_the_weights_of_the_latest_usable(tmp_path):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    _truncate(newer)
    info = torchloom.inspect_path(out / "version_0")
    assert [(c["path"], c["global_step"], c["unusable"] is None) for c in info["checkpoints"]] == [
        (str(older), 4, True),
        (str(newer), None, False),
    ]
    assert info["checkpoints"][1]["unusable"].startswith(TRUNCATED)
    assert info["weights_from"] == str(older)
    proc = run_cli("inspect", str(out / "version_0"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"{newer}  (UNUSABLE: {TRUNCATED}" in proc.stdout and f"{older}  (step 4, epoch 0)" in proc.stdout


def test_newer_means_a_later_run_or_a_later_step_and_a_name_without_a_step_counts_as_the_newest(tmp_path):
    out = tmp_path / "out"
    older, newer = _checkpoints(out)
    later_run = out / "version_1" / "checkpoints"
    later_run.mkdir(parents=True)
    shutil.copytree(older, later_run / "step-00000004")  # step 4 of a later run: newer than step 8 of version_0
    _truncate(later_run / "step-00000004")
    with pytest.raises(CheckpointError, match=r"1 checkpoint newer than the newest usable one \(.*step-00000008\)"):
        _engine(out, max_epochs=2).fit(TinyTask(), ckpt_path="auto")
    shutil.rmtree(out / "version_1")
    shutil.copytree(older, newer.parent / "my-save")  # a name that tells no step: taken as the newest of its run
    _truncate(newer.parent / "my-save")
    with pytest.raises(CheckpointError, match=r"my-save: cannot read manifest\.json"):
        _engine(out, max_epochs=2).fit(TinyTask(), ckpt_path="auto")
    shutil.rmtree(newer.parent / "my-save")
    (newer.parent / "step-00000008-epoch-end").mkdir()  # the same step's end-of-epoch checkpoint comes after it
    with pytest.raises(CheckpointError, match=r"step-00000008-epoch-end: it has no manifest\.json"):
        _engine(out, max_epochs=2).fit(TinyTask(), ckpt_path="auto")
