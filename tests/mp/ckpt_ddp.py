"""C07: 2-process DDP fit of SharedBlockTask (a block used twice) with the block checkpointed; each rank writes
its parameters after every optimizer step."""

import json
import sys
from pathlib import Path

import torch
from ckpt_tasks import SharedBlockTask, StepSnapshots

from torchloom.testing import tiny_fit
from torchloom_plugins.grad_checkpoint import GradientCheckpointing

out = Path(sys.argv[1])
plugin, snaps, task = GradientCheckpointing(modules=["Block"]), StepSnapshots(), SharedBlockTask(batch_size=2)
# 8 samples, 2 per rank per step (global batch 4): 2 steps per epoch, 3 steps in all.
tiny_fit([plugin, snaps], task=task, max_epochs=2, max_steps=3, output_dir=str(out / "run"))
acc = task.accelerator
result = {
    "rank": acc.process_index,
    "world_size": acc.num_processes,
    "checkpointed": plugin.checkpointed,
    "params": snaps.params,
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
