"""Mid-epoch resume of data that draws from the global random generators (issue 29, item 3).

`AugmentTask`'s dataset adds noise drawn from torch's, numpy's and Python's global generators in ``__getitem__``
(random augmentation), and its model draws dropout masks from torch's between two fetches. Accelerate fetches one
batch ahead, so a checkpoint keeps the states right before the fetch of the batch after it, and a resume restores
them in its sampler (`torchloom._fetch_states`). B stopped at any step and resumed (C) is A, the uninterrupted run,
bitwise: every step's parameters, the history, the final state (`test_resume.assert_resumed_exactly`).

Before this change every mid-epoch stop below drifted from its first resumed step (the resumed batches were
augmented with other numbers): the final parameters were off by 0.154, 0.061, 0.039, 0.014 and 0.008 (stops at
steps 1, 3, 4, 6 and 8); only the end-of-epoch checkpoint was exact.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

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
