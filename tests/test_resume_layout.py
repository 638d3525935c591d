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
from typing import Any

import pytest

import torchloom
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from resume_fit import ShuffleTask, fit

from torchloom.checkpoint.data_position import DataOrder, data_order, layout_problems, position, resume_point

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


# ------------------------------------------------------------------------------------- the rule, unit by unit


def _order(**changes: Any) -> DataOrder:
    settings = {
        "dataset_length": 64,
        "total_batch_size": 4,
        "batches_per_epoch": 16,
        "world_size": 1,
        "sampler": "SeedableRandomSampler",
        "sampler_seed": 0,
    }
    return DataOrder(**{**settings, **changes})


def test_data_order_of_a_plain_dataloader_and_of_odd_ones():
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

    data = list(range(10))
    assert data_order(DataLoader(data, batch_size=4), world_size=2) == DataOrder(
        dataset_length=10, total_batch_size=8, batches_per_epoch=3, world_size=2, sampler="SequentialSampler",
        sampler_seed=None,
    )  # fmt: skip

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(data)

    streamed = data_order(DataLoader(Stream(), batch_size=4), world_size=1)
    assert (streamed.dataset_length, streamed.batches_per_epoch, streamed.total_batch_size) == (None, None, 4)

    class Pairs(BatchSampler):  # batches of no fixed size
        def __init__(self):
            super().__init__(SequentialSampler(data), batch_size=1, drop_last=False)
            self.batch_size = None  # type: ignore[assignment]

        def __iter__(self):
            yield from ([0, 1], [2], [3, 4, 5])

        def __len__(self):
            return 3

    custom = data_order(DataLoader(data, batch_sampler=Pairs()), world_size=1)
    assert (custom.total_batch_size, custom.batches_per_epoch, custom.dataset_length) == (None, 3, 10)

    class Seeded(SequentialSampler):
        initial_seed = "not a seed"

    assert data_order(DataLoader(data, sampler=Seeded(data)), world_size=1).sampler_seed is None


@pytest.mark.parametrize(
    ("batches", "finished", "expected"),
    [(6, False, 24), (16, False, 64), (17, True, 64), (0, False, 0)],  # 17 x 4 > 64: a last, smaller batch
)
def test_the_position_counts_samples_capped_at_the_dataset(batches, finished, expected):
    recorded = position(2, batches, finished, _order())
    assert (recorded["samples_done"], recorded["batches_done"], recorded["epoch"]) == (expected, batches, 2)
    assert recorded["epoch_finished"] is finished and recorded["order"]["dataset_length"] == 64
    assert position(0, 5, False, _order(total_batch_size=None))["samples_done"] is None
    assert position(0, 5, False, _order(dataset_length=None))["samples_done"] == 20  # a stream: no cap


def test_resume_points_and_refusals_for_each_kind_of_position():
    mid = position(0, 6, False, _order())  # 24 samples
    assert layout_problems(mid, _order()) == [] and resume_point(mid, _order()) == (0, 6)
    assert resume_point(mid, _order(total_batch_size=8, batches_per_epoch=8)) == (0, 3)
    assert resume_point(mid, _order(total_batch_size=3, batches_per_epoch=22)) == (0, 8)
    # the end of an epoch: the next one, whatever the data now (also with drop_last: fewer samples than the dataset)
    for finished in (position(0, 16, True, _order()), position(0, 15, True, _order(dataset_length=62))):
        for now in (_order(), _order(dataset_length=10, batches_per_epoch=3), _order(sampler="SequentialSampler")):
            assert layout_problems(finished, now) == [] and resume_point(finished, now) == (1, 0)
    # every sample trained, the epoch's end still to come: all of its new batches are skipped
    done = position(0, 16, False, _order())
    assert layout_problems(done, _order(dataset_length=128, batches_per_epoch=32)) == []
    assert resume_point(done, _order(total_batch_size=2, batches_per_epoch=32)) == (0, 32)
    # batches of no fixed size: the same batches, counted as batches
    counted = position(1, 5, False, _order(total_batch_size=None, batches_per_epoch=9))
    assert counted["samples_done"] is None
    assert layout_problems(counted, _order(total_batch_size=None, batches_per_epoch=9)) == []
    assert resume_point(counted, _order(total_batch_size=None, batches_per_epoch=9)) == (1, 5)


def test_each_refusal_says_what_changed_exactly():
    mid = position(3, 6, False, _order())
    (both,) = layout_problems(mid, _order(dataset_length=32, sampler="SequentialSampler"))
    assert both == (
        "it stopped after 24 samples of epoch 3, and the training dataset's size changed from 64 to 32 and the "
        "training sampler changed from SeedableRandomSampler to SequentialSampler, so the rest of that epoch's order "
        "is another one (samples would be skipped or trained twice); resume with the same training data, or from a "
        "checkpoint at the end of an epoch"
    )
    (divide,) = layout_problems(mid, _order(total_batch_size=16, batches_per_epoch=8, world_size=2))
    assert divide == (
        "it stopped after 24 samples of epoch 3, which is not a whole number of the new global batches of 16 samples "
        "(batch size 8 x 2 process(es); it was 4), so the next batch would skip or repeat samples; resume with a "
        "global batch size that divides 24, or from a checkpoint at the end of an epoch"
    )
    no_size = (
        "it stopped after {done} of epoch 3, and the batches changed (global batch size {a} -> {b}, batches per "
        "epoch {c} -> {d}) with a batch sampler of no fixed size, so the samples done cannot be counted in the new "
        "batches; resume with the same batches, or from a checkpoint at the end of an epoch"
    )
    assert layout_problems(mid, _order(total_batch_size=None, batches_per_epoch=9)) == [
        no_size.format(done="24 samples", a=4, b=None, c=16, d=9)
    ]
    counted = position(3, 5, False, _order(total_batch_size=None, batches_per_epoch=9))
    assert layout_problems(counted, _order(total_batch_size=None, batches_per_epoch=10)) == [
        no_size.format(done="5 batches", a=None, b=None, c=9, d=10)
    ]


def test_an_epoch_end_checkpoint_with_drop_last_resumes_at_the_next_epoch(tmp_path):
    """62 samples in batches of 4 with drop_last: an epoch is 15 batches, 60 samples, and the epoch-end checkpoint
    records 60 of 62; the resumed fit starts the next epoch (the epoch's end, its validation, is not run twice)."""

    class DropLast(ShuffleTask):
        def train_dataloader(self):
            from resume_fit import id_data
            from torch.utils.data import DataLoader

            return DataLoader(id_data(62), batch_size=4, shuffle=True, drop_last=True)

    a = fit(lambda: DropLast(optimizer="sgd"), tmp_path / "a", val_check_interval=None)
    b = fit(lambda: DropLast(optimizer="sgd"), tmp_path / "bc", save_epoch_end=[0], val_check_interval=None)
    c = fit(lambda: DropLast(optimizer="sgd"), tmp_path / "bc", ckpt_path=b.checkpoint, val_check_interval=None)
    assert json.loads((Path(b.checkpoint) / "manifest.json").read_text())["position"]["samples_done"] == 60
    assert b.probe.ids + c.probe.ids == a.probe.ids
    assert [s["epoch"] for s in c.probe.steps] == [1] * 15 + [2] * 15
    validations = [r["step"] for r in c.engine.history if "val/loss" in r]
    assert validations == [30, 45]  # epochs 1 and 2 only
