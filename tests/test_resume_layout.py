"""Resume into a changed data layout (issue 21, item 1): the position is in samples of the global order.

A checkpoint records how many samples of its epoch's global order were trained, and what defines that order
(the dataset's size, the sampler, the global batch size, the processes). A fit resumed with another batch size
continues with the first sample not yet trained, whenever the samples done are a whole number of new batches;
otherwise, and for another dataset inside an epoch, it is refused with one `torchloom.CheckpointError` naming
the change, and leaves no run directory. At the end of an epoch the data may change freely.

Each scenario: A trains 64 ids in batches of 4 (3 epochs, seeded shuffle), B the same until it saves and stops,
C resumes B's checkpoint with the changed setting. Within an epoch the permutation depends only on the dataset
and the seed, so B's ids then C's ids must be exactly A's ids of that epoch, whatever C's batch size.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import torchloom
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from resume_fit import ShuffleTask, fit

N = 64


def _task(batch_size: int = 4, n: int = N):
    return lambda: ShuffleTask(n=n, batch_size=batch_size, optimizer="sgd")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A: 64 ids, batch 4 (16 steps per epoch), 3 epochs."""
    return fit(_task(), tmp_path_factory.mktemp("a"), val_check_interval=None)


def _epochs(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + N] for i in range(0, len(ids), N)]


@pytest.mark.parametrize(
    ("save_at", "batch_size", "steps_after"),
    [
        (6, 8, (64 - 24) // 8 + 2 * 8),  # 24 samples done = 3 batches of 8
        (6, 3, 14 + 2 * 22),  # 24 samples = 8 batches of 3; 40 left: 13 of 3 and one of 1
        (4, 16, 3 + 2 * 4),  # 16 samples = 1 batch of 16
        (8, 2, 16 + 2 * 32),  # a smaller batch
    ],
    ids=["4to8", "4to3", "4to16", "4to2"],
)
def test_another_batch_size_continues_at_the_first_untrained_sample(
    uninterrupted, tmp_path, save_at, batch_size, steps_after
) -> None:
    b = fit(_task(), tmp_path, save_at=[save_at], val_check_interval=None)
    c = fit(_task(batch_size), tmp_path, ckpt_path=b.checkpoint, val_check_interval=None)
    assert c.engine.resumed_from == b.checkpoint
    a_epochs, bc_epochs = _epochs(uninterrupted.probe.ids), _epochs(b.probe.ids + c.probe.ids)
    assert bc_epochs == a_epochs  # the same samples, in the same order, each epoch: none skipped, none twice
    assert all(sorted(e) == list(range(N)) for e in bc_epochs)
    assert len(c.probe.steps) == steps_after
    assert c.engine.progress.global_step == save_at + steps_after
    first = c.probe.steps[0]
    assert (first["epoch"], first["batch_idx"]) == (0, save_at * 4 // batch_size)  # counted in the new batches


@pytest.mark.parametrize(
    ("save_at", "batch_size", "samples"),
    [(7, 8, 28), (5, 3, 20), (6, 16, 24)],
    ids=["28_by_8", "20_by_3", "24_by_16"],
)
def test_a_batch_size_that_does_not_divide_the_samples_done_is_refused(tmp_path, save_at, batch_size, samples) -> None:
    b = fit(_task(), tmp_path, save_at=[save_at], val_check_interval=None)
    runs_before = sorted(os.listdir(tmp_path))
    with pytest.raises(torchloom.CheckpointError) as info:
        fit(_task(batch_size), tmp_path, ckpt_path=b.checkpoint, val_check_interval=None)
    message = str(info.value)
    assert "\n" not in message
    assert f"it stopped after {samples} samples of epoch 0" in message
    assert f"not a whole number of the new global batches of {batch_size} samples" in message
    assert f"(batch size {batch_size} x 1 process(es); it was 4)" in message
    assert f"resume with a global batch size that divides {samples}" in message
    assert sorted(os.listdir(tmp_path)) == runs_before  # the refused resume left no run directory (item 8)


@pytest.mark.parametrize("n", [32, 30, 65])
def test_another_dataset_inside_an_epoch_is_refused(tmp_path, n) -> None:
    b = fit(_task(), tmp_path, save_at=[6], val_check_interval=None)
    with pytest.raises(torchloom.CheckpointError, match=rf"the training dataset's size changed from 64 to {n}"):
        fit(_task(n=n), tmp_path, ckpt_path=b.checkpoint, val_check_interval=None)


def test_another_sampler_inside_an_epoch_is_refused(tmp_path) -> None:
    class InOrder(ShuffleTask):
        def train_dataloader(self):
            from resume_fit import id_data
            from torch.utils.data import DataLoader

            return DataLoader(id_data(N), batch_size=4, shuffle=False)

    b = fit(_task(), tmp_path, save_at=[6], val_check_interval=None)
    with pytest.raises(
        torchloom.CheckpointError, match=r"the training sampler changed from SeedableRandomSampler to SequentialSampler"
    ):
        fit(lambda: InOrder(n=N, optimizer="sgd"), tmp_path, ckpt_path=b.checkpoint, val_check_interval=None)


@pytest.mark.parametrize(("n", "batch_size"), [(32, 4), (30, 8), (64, 5)])
def test_at_the_end_of_an_epoch_the_data_may_change(uninterrupted, tmp_path, n, batch_size) -> None:
    b = fit(_task(), tmp_path, save_epoch_end=[0], val_check_interval=None)
    c = fit(_task(batch_size, n), tmp_path, ckpt_path=b.checkpoint, val_check_interval=None)
    assert b.probe.ids == uninterrupted.probe.ids[:N]
    epochs = [c.probe.ids[:n], c.probe.ids[n:]]
    assert len(c.probe.ids) == 2 * n and all(sorted(e) == list(range(n)) for e in epochs)
    per_epoch = -(-n // batch_size)
    assert [s["epoch"] for s in c.probe.steps] == [1] * per_epoch + [2] * per_epoch


def test_a_step_checkpoint_after_the_last_batch_finishes_that_epoch(uninterrupted, tmp_path) -> None:
    # Saved at the epoch's last step (64 samples done): the epoch's end still comes, then whole epochs of 8.
    b = fit(_task(), tmp_path, save_at=[16], val_check_interval=None)
    c = fit(_task(8), tmp_path, ckpt_path=b.checkpoint, val_check_interval=None)
    assert b.probe.ids == uninterrupted.probe.ids[:N]
    assert c.probe.ids == uninterrupted.probe.ids[N:]
    assert [s["epoch"] for s in c.probe.steps] == [1] * 8 + [2] * 8


def test_the_manifest_records_the_position_in_samples(tmp_path) -> None:
    b = fit(_task(), tmp_path, save_at=[6], val_check_interval=None)
    position = json.loads((Path(b.checkpoint) / "manifest.json").read_text())["position"]
    assert position == {
        "epoch": 0,
        "batches_done": 6,
        "samples_done": 24,
        "epoch_finished": False,
        "order": {
            "dataset_length": 64,
            "total_batch_size": 4,
            "batches_per_epoch": 16,
            "world_size": 1,
            "sampler": "SeedableRandomSampler",
            "sampler_seed": 0,
        },
    }


@pytest.mark.multiprocess
def test_two_processes_resume_with_another_batch_size(tmp_path) -> None:
    """2 processes, batch 4 (8 samples per step): saved after 16 samples, resumed with batch 8 (16 per step),
    and with batch 3 refused (16 is not a multiple of 6). The two ranks together train each sample of every
    epoch exactly once, in A's global order."""
    ranks = torchrun("resume_layout.py", tmp_path, nproc=2, timeout=300)
    for rank in ranks:
        assert rank["refused"].startswith("cannot resume from checkpoint: it stopped after 16 samples of epoch 0")
        assert "(batch size 3 x 2 process(es); it was 8)" in rank["refused"]
    per_epoch = N // 2  # each rank's share of an epoch
    for epoch in range(3):
        a = sorted(i for r in ranks for i in r["a_ids"][epoch * per_epoch : (epoch + 1) * per_epoch])
        bc = sorted(i for r in ranks for i in r["bc_ids"][epoch * per_epoch : (epoch + 1) * per_epoch])
        assert a == bc == list(range(N)), f"epoch {epoch}"
    assert ranks[0]["c_steps"] == ranks[1]["c_steps"] == (64 - 16) // 16 + 2 * 4
