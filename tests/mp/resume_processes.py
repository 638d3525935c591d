"""Resume on another number of processes (tests/test_resume_processes.py): ``torchrun --nproc_per_node 2
resume_processes.py OUT CHECKPOINT``. A2: 24 ids, batch 2 per process (global batch 4), 3 epochs, logging every 3
steps. B2: the same, saved after step 4 (16 samples of epoch 0, between two logging steps) and stopped. C2: the
one-process checkpoint CHECKPOINT (global batch 4, saved after step 4) continued on 2 processes. L2: LocalSGD
(K = 3), saved after step 4, between two averages. Each rank writes ``result-<rank>.json``: its ids in A2, B2 and
C2, the histories of A2 and C2, C2's optimizer state at its start and its steps, and B2's and L2's checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from resume_fit import ShuffleTask, fit

SETTINGS = {"val_check_interval": None, "log_every_n_steps": 3}


def task():
    return ShuffleTask(n=24, batch_size=2)


def main(out: Path, checkpoint: str) -> None:
    a = fit(task, out / "a", **SETTINGS)
    b = fit(task, out / "b", save_at=[4], **SETTINGS)
    c = fit(task, out / "c", ckpt_path=checkpoint, **SETTINGS)
    lsgd = fit(task, out / "l", [{"local_sgd": {"sync_every": 3}}], save_at=[4], **SETTINGS)
    rank = torch.distributed.get_rank()
    result = {
        "a_ids": a.probe.ids,
        "b_ids": b.probe.ids,
        "c_ids": c.probe.ids,
        "a_history": [dict(r) for r in a.engine.history],
        "c_history": [dict(r) for r in c.engine.history],
        "c_optimizer": c.probe.optimizer_at_start,
        "c_steps": [s["step"] for s in c.probe.steps],
        "b_checkpoint": b.checkpoint,
        "lsgd_checkpoint": lsgd.checkpoint,
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
