"""Retention after failures (issue 39, item 3): ``keep_last`` / ``keep_best`` and the lineage pruning count only
complete checkpoints (those with their manifest), and never delete the newest complete one: not after a failed
synchronous save, a failed background save, a fit that fails after either, a resume after them, nor when a
checkpoint the fit counted is gone (deleted by hand)."""

from __future__ import annotations

import errno
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchloom.checkpoint import async_save as _async_save
from torchloom.checkpoint import store as checkpoint_module
from torchloom.checkpoint.store import list_checkpoints, read_manifest, verify_files
from torchloom.testing import TinyTask
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from resume_fit import ShuffleTask  # 8 optimizer steps per epoch with n=16; AdamW, StepLR


def _left(out: Path) -> list[str]:
    """The complete checkpoints of ``out`` (each verified), as ``version_N/step``."""
    found = list_checkpoints(out)
    for path in found:
        verify_files(path, read_manifest(path))
    return [f"{Path(p).parent.parent.name}/{Path(p).name}" for p in found]


class FailAt(ShuffleTask):
    """ShuffleTask whose ``at``-th micro-batch of the fit raises."""

    def __init__(self, at: int | None) -> None:
        super().__init__(n=16)
        self.at, self.calls = at, 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("the task failed")
        return super().training_step(batch, batch_idx)


class Watch:
    """After every save of the checkpoint plugin (listed before it, its ``*_end`` hooks run after the plugin's):
    at least one complete checkpoint is left once one was written."""

    name = "test.watch"

    def __init__(self, out: Path) -> None:
        self.out, self.seen = out, 0

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        left = list_checkpoints(self.out)
        assert left or not self.seen, f"no complete checkpoint left at step {progress.global_step}"
        self.seen = max(self.seen, len(left))


def _fit(out: Path, at: int | None, async_save: bool, ckpt_path: str | None = None) -> str | None:
    checkpoint = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": 1, "async_save": async_save}
    engine = torchloom.Engine(
        output_dir=str(out),
        max_epochs=2,
        seed=0,
        log_every_n_steps=3,
        default_plugins=False,
        plugins=[Watch(out), {"checkpoint": checkpoint}],
    )
    try:
        engine.fit(FailAt(at), ckpt_path=ckpt_path)
    except (ValueError, torchloom.RunFileError) as exc:
        return type(exc).__name__
    return None


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_failed_saves_and_failed_fits_then_resumes_keep_the_newest_complete_checkpoint(
    tmp_path, monkeypatch, async_save
):
    """Run 0: step 2 saved, the save of step 4 fails (a full disk: in the background thread, or the synchronous
    write), then the fit fails (the task at micro-batch 5, or the failed save itself). Run 1 resumes from step 2:
    step 4 saved, the save of step 6 fails, the task fails (at micro-batch 5, step 7). Run 2 resumes from step 4
    and ends. keep_last: 1 left, at every point, the newest complete checkpoint (the paths pass on the code before
    issue 39 too; they are the failure paths retention runs after)."""
    failing = {"name": "version_0/checkpoints/step-00000004"}

    def full_disk(name: str) -> bool:
        return failing["name"] is not None and name.endswith(failing["name"])

    original_parts, original_publish = _async_save.write_parts, checkpoint_module.publish

    def write_parts(writer: Any) -> None:
        if full_disk(str(writer.tmp).replace(".step", "step").split(".tmp-")[0]):
            raise OSError(errno.ENOSPC, "No space left on device")
        original_parts(writer)

    def publish(tmp: Path, final: Path, *args: Any) -> str | None:
        return "No space left on device" if full_disk(str(final)) else original_publish(tmp, final, *args)

    monkeypatch.setattr(_async_save, "write_parts", write_parts)
    monkeypatch.setattr(checkpoint_module, "publish", publish)
    for run, failing_step in ((0, 4), (1, 6)):
        failing["name"] = f"version_{run}/checkpoints/step-{failing_step:08d}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            failed = _fit(tmp_path, 5, async_save, ckpt_path="auto" if run else None)
        # async: the task fails first (micro-batch 5), then the save in flight fails as the fit ends (a warning);
        # sync: the save itself fails the fit
        assert failed == ("ValueError" if async_save else "RunFileError")
        background = [str(w.message) for w in caught if "and so did the background save" in str(w.message)]
        assert len(background) == async_save and all(failing["name"] in m for m in background)
        assert _left(tmp_path) == ["version_0/step-00000002", "version_1/step-00000004"][: run + 1]
    failing["name"] = None
    assert _fit(tmp_path, None, async_save, ckpt_path="auto") is None
    assert _left(tmp_path) == ["version_2/step-00000016"]


class DeleteByHand:
    """Deletes the checkpoint of optimizer step ``step`` right after it was saved (listed before the checkpoint
    plugin: its ``on_train_step_end`` runs after the plugin's)."""

    name = "test.delete_by_hand"

    def __init__(self, step: int, kill_at: int | None = None) -> None:
        self.step, self.kill_at, self.run_dir = step, kill_at, ""

    @torchloom.hookimpl
    def on_run_start(self, run_dir: str) -> None:
        self.run_dir = run_dir

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        if progress.global_step == self.step:
            torchloom.delete_checkpoint(os.path.join(self.run_dir, "checkpoints", f"step-{self.step:08d}"))
        if progress.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _tiny(out: Path, plugin: DeleteByHand, keep_last: int, ckpt_path: str | None = None) -> None:
    checkpoint = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": keep_last}
    engine = torchloom.Engine(
        output_dir=str(out), max_epochs=2, num_sanity_val_steps=0, default_plugins=False,
        plugins=[plugin, {"checkpoint": checkpoint}],
    )  # fmt: skip
    engine.fit(TinyTask(), ckpt_path=ckpt_path)


def test_keep_last_counts_only_the_checkpoints_still_complete(tmp_path) -> None:
    """keep_last: 2; step 14's checkpoint is deleted by hand: the save of step 16 keeps step 12 with it (two
    complete ones), instead of counting the one gone and leaving one."""
    _tiny(tmp_path, DeleteByHand(14), keep_last=2)
    assert _left(tmp_path) == ["version_0/step-00000012", "version_0/step-00000016"]


def test_a_resumed_fit_never_deletes_the_newest_complete_checkpoint_of_the_training(tmp_path) -> None:
    """keep_last: 1. Stopped by SIGTERM at step 10, resumed; the resumed fit's last checkpoint (step 16) is deleted
    by hand: at the end of training the checkpoint it resumed from (step 10), now the newest complete one of the
    training, stays (the one gone is not counted)."""
    with pytest.raises(torchloom.TrainingInterrupted):
        _tiny(tmp_path, DeleteByHand(0, kill_at=9), keep_last=1)
    assert _left(tmp_path) == ["version_0/step-00000010"]
    _tiny(tmp_path, DeleteByHand(16), keep_last=1, ckpt_path="auto")
    assert _left(tmp_path) == ["version_0/step-00000010"]
