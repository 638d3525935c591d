"""A resume inside an epoch skips the batches already trained by the sampler's indices (`skip_batches`): the same
batches follow as after Accelerate's ``skip_first_batches``, no skipped sample is read, and no skipped batch is
built (where the batches are a plain ``BatchSampler``, on one process)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from torchloom.checkpoint.fetch_states import _IndexSkipBatchSampler, skip_batches


class Counted(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads += 1
        return i


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("skip", [1, 7, 249, 250])
def test_skipping_by_index_gives_the_batches_accelerate_gives_and_reads_no_skipped_sample(drop_last, skip):
    accelerator = Accelerator(cpu=True)
    data = Counted(1001)  # 250 batches of 4 and one of 1
    loader = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True, drop_last=drop_last))
    loader.set_epoch(3)
    torch.manual_seed(0)
    expected = [batch.tolist() for batch in accelerator.skip_first_batches(loader, skip)]
    torch.manual_seed(0)
    data.reads = 0
    skipped = skip_batches(accelerator, loader, skip)
    assert type(skipped.batch_sampler) is _IndexSkipBatchSampler
    got = [batch.tolist() for batch in skipped]
    assert got == expected and len(got) == len(skipped)
    assert data.reads == sum(len(batch) for batch in got)  # only the batches trained on are read


def test_the_batches_skipped_are_never_built(monkeypatch):
    """Accelerate's skipping builds every skipped batch (a list of indices) and drops it; this one does not."""
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(Counted(4000), batch_size=4))
    built = []
    real_iter = torch.utils.data.BatchSampler.__iter__

    def counting(self):
        for batch in real_iter(self):
            built.append(batch)
            yield batch

    monkeypatch.setattr(torch.utils.data.BatchSampler, "__iter__", counting)
    first = next(iter(skip_batches(accelerator, loader, 900)))
    assert first.tolist() == [3600, 3601, 3602, 3603] and built == []
