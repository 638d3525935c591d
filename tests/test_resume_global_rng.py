"""Mid-epoch resume of data that draws from the global random generators (issue 29, item 3).

`AugmentTask`'s dataset adds noise drawn from torch's, numpy's and Python's global generators in ``__getitem__``
(random augmentation), and its model draws dropout masks from torch's between two fetches. Accelerate fetches one
batch ahead, so a checkpoint keeps the states right before the fetch of the batch after it, and a resume restores
them in its sampler (`torchloom.checkpoint.fetch_states`). B stopped at any step and resumed (C) is A, the uninterrupted
run, bitwise: every step's parameters, the history, the final state (`test_resume.assert_resumed_exactly`).

Before this change every mid-epoch stop below drifted from its first resumed step (the resumed batches were
augmented with other numbers): the final parameters were off by 0.154, 0.061, 0.039, 0.014 and 0.008 (stops at
steps 1, 3, 4, 6 and 8); only the end-of-epoch checkpoint was exact.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, IterableDataset

from torchloom.checkpoint.fetch_states import Watch, resume_source
from torchloom.checkpoint.random_states import random_states
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from resume_fit import AugmentTask, ShuffleTask, fit, id_data, stop_and_resume

from test_resume import assert_resumed_exactly


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Any:
    return fit(AugmentTask, tmp_path_factory.mktemp("augment_a"))


@pytest.mark.parametrize(
    "stop",
    [
        {"save_at": [1]},  # after the first batch of epoch 0: the loader's first call fetched batches 0 and 1
        {"save_at": [3]},  # mid-epoch 0
        {"save_at": [4]},  # before the epoch's last batch
        {"save_at": [6]},  # after the first batch of epoch 1
        {"save_at": [8]},  # mid-epoch 1
        {"save_epoch_end": [0]},
    ],
    ids=lambda stop: "_".join(f"{k}{v[0]}" for k, v in stop.items()),
)
def test_mid_epoch_resume_of_data_drawing_from_the_global_generators_is_bitwise(uninterrupted, stop, tmp_path):
    b, c = stop_and_resume(AugmentTask, tmp_path, **stop)
    assert_resumed_exactly(uninterrupted, b, c)


@pytest.mark.parametrize("draw", ["torch", "numpy", "python"])
def test_each_global_generator_alone_and_a_resume_of_a_resumed_fit(draw, tmp_path) -> None:
    """One generator at a time (Python's and numpy's states are kept only once the data moved them), without a
    DataLoader generator (the loader's start draws from torch's too), and C saved again and resumed by D."""
    make = lambda: AugmentTask(draw=draw, generator=False)  # noqa: E731
    a = fit(make, tmp_path / "a")
    b, c = stop_and_resume(make, tmp_path / "bc", save_at=[3])
    assert_resumed_exactly(a, b, c)
    c2 = fit(make, tmp_path / "bc", ckpt_path=b.checkpoint, save_at=[7])
    d = fit(make, tmp_path / "bc", ckpt_path=c2.checkpoint)
    assert c2.crashed and not d.crashed
    assert [s["params"] for s in b.probe.steps + c2.probe.steps + d.probe.steps] == [s["params"] for s in a.probe.steps]


class WorkerTask(ShuffleTask):
    """`ShuffleTask` whose loader fetches in a worker process: the sampler restores the states in the main process
    while it prefetches, and the model's dropout must still draw what the uninterrupted run drew."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        return DataLoader(id_data(self.n), batch_size=self.batch_size, shuffle=True, generator=generator, num_workers=1)


def test_a_loader_with_a_worker_process_still_resumes_exactly(tmp_path) -> None:
    a = fit(WorkerTask, tmp_path / "a", max_epochs=1)
    b, c = stop_and_resume(WorkerTask, tmp_path / "bc", save_at=[3], max_epochs=1)
    assert_resumed_exactly(a, b, c)


def _reseed_numpy() -> None:
    np.random.seed(7)  # numpy's position as after seed(3), its keys not


#: what the loader's first call draws from
DRAWS = {"none": lambda: None, "python": random.random, "numpy": np.random.random, "numpy_reseeded": _reseed_numpy}


@pytest.mark.parametrize("draw", list(DRAWS))
def test_the_watch_keeps_python_s_and_numpy_s_states_only_once_the_loader_s_first_call_moved_them(draw) -> None:
    """`Watch` alone: torch's state always; Python's and numpy's from the epoch's first call on only where that call
    drew from them (numpy reseeded: the same position, other keys); a resumed epoch's `continued` takes the parts
    its checkpoint kept, and what it keeps is never "before the loader started" (``first``)."""
    assert Watch().state_dict() is None  # nothing watched yet: a checkpoint keeps no look-ahead states
    unstarted = Watch()
    unstarted.after_first()  # no before_first: nothing to compare
    assert not unstarted.full

    np.random.seed(3)
    watch = Watch()
    watch.before_first()
    assert watch.state_dict()["first"] is True and sorted(watch.state_dict()["states"]) == ["numpy", "python", "torch"]
    DRAWS[draw]()
    watch.after_first()
    assert watch.full is (draw != "none")
    watch.before_next()
    kept = ["numpy", "python", "torch"] if draw != "none" else ["torch"]
    assert watch.state_dict()["first"] is False and sorted(watch.state_dict()["states"]) == kept

    resumed = Watch(full=draw != "none")
    resumed.continued(random_states())
    assert resumed.state_dict()["first"] is False and sorted(resumed.state_dict()["states"]) == kept


@pytest.mark.parametrize("skip", [1, 3])
def test_a_resume_without_look_ahead_states_skips_the_trained_batches_by_index(skip) -> None:
    """A checkpoint that kept no look-ahead states (``fetch_random_states`` missing or None, as one saved before
    the first batch of a resumed epoch): the loader skips ``skip`` batches, none is fetched again, nothing restores."""
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    source, again, restoring = resume_source(accelerator, loader, skip, None, random_states())
    assert again == 0 and restoring is None
    assert [batch.tolist() for batch in source] == [[2 * i, 2 * i + 1] for i in range(skip, 5)]


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_a_loader_that_cannot_skip_by_index_skips_without_fetching_a_batch_again() -> None:
    """An iterable dataset (no batch sampler to wrap): the look-ahead states cannot be restored batch by batch, and
    the batches after the skipped ones are all trained (none is taken for one fetched again)."""
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(_Stream(), batch_size=2))
    fetch = {"states": {"torch": torch.get_rng_state()}, "first": False}
    source, again, restoring = resume_source(accelerator, loader, 2, fetch, random_states())
    assert again == 0 and restoring is None
    assert [batch.tolist() for batch in source] == [[4, 5], [6, 7], [8, 9]]
