"""Resume into another batch size on 2 processes (tests/test_resume_layout.py): ``torchrun --nproc_per_node 2
resume_layout.py OUT``. A: 64 ids, batch 4 per process, 3 epochs. B: the same, saved after step 2 (16 samples of
epoch 0). C: B's checkpoint with batch 8 per process. D: B's checkpoint with batch 3 (refused). Each rank
writes ``result-<rank>.json``: its ids in A and in B + C, C's optimizer steps, and D's error message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from resume_fit import ShuffleTask, fit

import torchloom


def main(out: Path) -> None:
    def task(batch_size: int):
        return lambda: ShuffleTask(n=64, batch_size=batch_size, optimizer="sgd")

    settings = {"val_check_interval": None}
    a = fit(task(4), out / "a", **settings)
    b = fit(task(4), out / "bc", save_at=[2], **settings)
    c = fit(task(8), out / "bc", ckpt_path=b.checkpoint, **settings)
    try:
        fit(task(3), out / "bc", ckpt_path=b.checkpoint, **settings)
        refused = None
    except torchloom.CheckpointError as exc:
        refused = str(exc)
    rank = torch.distributed.get_rank()
    result = {
        "a_ids": a.probe.ids,
        "bc_ids": b.probe.ids + c.probe.ids,
        "c_steps": len(c.probe.steps),
        "refused": refused,
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
