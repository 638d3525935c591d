"""Length-grouped sampling on 2 processes (tests/test_data_length_grouped.py): ``torchrun --nproc_per_node 2
length_grouped.py OUT``. 62 ids whose lengths are ``LENGTHS``, batch 4 per process, 2 epochs, engine seed 5 (the
sampler is built with seed 123, which the engine replaces). A: uninterrupted. B: the same, saved after step 3 (24
samples of epoch 0), then stopped. C: B's checkpoint, resumed. D: B's checkpoint with a plain shuffle (refused).
Each rank writes ``result-<rank>.json``: its ids per batch in A and in B + C, and D's error message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from resume_fit import ShuffleTask, fit, id_data
from torch.utils.data import DataLoader

import torchloom
from torchloom.data import LengthGroupedSampler

N, BATCH, SEED = 62, 4, 5
LENGTHS = [(i * 37) % 50 + 1 for i in range(N)]


class Grouped(ShuffleTask):
    def train_dataloader(self) -> DataLoader:
        sampler = LengthGroupedSampler(LENGTHS, BATCH, seed=123)
        return DataLoader(id_data(N), batch_size=BATCH, sampler=sampler)


class BatchIds:
    """The ids of every batch this process trained on, one list per batch."""

    name = "test.batch_ids"

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    @torchloom.hookimpl
    def on_train_batch_start(self, batch) -> None:
        self.batches.append(batch[0].tolist())


def main(out: Path) -> None:
    settings = {"val_check_interval": None, "max_epochs": 2, "seed": SEED}
    grouped = lambda: Grouped(n=N, batch_size=BATCH, optimizer="sgd")  # noqa: E731
    a_ids, bc_ids = BatchIds(), BatchIds()
    a = fit(grouped, out / "a", [a_ids], **settings)
    b = fit(grouped, out / "bc", [bc_ids], save_at=[3], **settings)
    c = fit(grouped, out / "bc", [bc_ids], ckpt_path=b.checkpoint, **settings)
    try:
        fit(lambda: ShuffleTask(n=N, batch_size=BATCH, optimizer="sgd"), out / "bc", ckpt_path=b.checkpoint, **settings)
        refused = None
    except torchloom.CheckpointError as exc:
        refused = str(exc)
    rank = torch.distributed.get_rank()
    result = {
        "a_batches": a_ids.batches,
        "bc_batches": bc_ids.batches,
        "b_crashed": b.crashed,
        "c_first_step": c.probe.steps[0]["batch_idx"],
        "a_params": a.probe.steps[-1]["params"],
        "c_params": c.probe.steps[-1]["params"],
        "refused": refused,
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
