"""Issue 6: rank 1's dataloader has twice as many batches as rank 0's. Both ranks must stop with the same clear
error at the start of the epoch (one small all-gather) instead of rank 0 reporting success while rank 1 waits
forever in a gradient all-reduce. Each rank writes the error it got."""

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import TinyTask, tiny_dataset

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
loader = DataLoader(tiny_dataset(8 * (rank + 1)), batch_size=2)  # sharded by Accelerate: 2 vs 4 batches per rank
engine = torchloom.Engine(output_dir=str(out / "run"), save_model=True)
try:
    engine.fit(TinyTask(validate=False), train_dataloader=loader)
    result = {"error": None}
except torchloom.TaskError as exc:
    result = {"error": str(exc)}
result["trained_steps"] = engine.progress.global_step
(out / f"result-{rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
