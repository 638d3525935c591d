"""The ema plugin on 2 processes: under DDP (one average, the recurrence over the shared weights) and under
local_sgd (K=3; the processes' weights differ between averagings, and the average is the mean over processes of
each process's own recurrence). Each rank writes its averages, its final weights and the error against the hand
recurrence."""

import json
import sys
from pathlib import Path

import torch
from ema_tasks import Trajectory, expected_average

from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.ema import ExponentialMovingAverage
from torchloom_plugins.local_sgd import LocalSGDPlugin

out = Path(sys.argv[1])
results = {}


def flat(tensors):
    return [float(x) for t in tensors for x in t.detach().double().reshape(-1)]


for label, extra in (("ddp", []), ("lsgd", [LocalSGDPlugin(sync_every=3)])):
    ema, trajectory, task = ExponentialMovingAverage(decay=0.8), Trajectory(), TinyTask()
    # 32 samples over 2 processes in batches of 4: 4 optimizer steps per epoch, 2 epochs.
    tiny_fit([*extra, ema, trajectory], task=task, max_epochs=2, output_dir=str(out / label))
    own = torch.cat([t.reshape(-1) for t in expected_average(trajectory.start, trajectory.after_step, 0.8, 1)])
    gathered = [torch.zeros_like(own) for _ in range(2)]
    torch.distributed.all_gather(gathered, own)
    mean = (gathered[0] + gathered[1]) / 2
    got = torch.cat([t.double().reshape(-1) for t in ema.averaged_parameters])
    last = torch.cat([t.reshape(-1) for t in trajectory.after_step[1]])  # after step 2: no averaging yet (K=3)
    lasts = [torch.zeros_like(last) for _ in range(2)]
    torch.distributed.all_gather(lasts, last)
    results[label] = {
        "shadow": flat(ema.averaged_parameters),
        "final": flat(p for p in task.model.parameters()),
        "max_error": float((got - mean).abs().max()),
        "weights_differed": not torch.equal(lasts[0], lasts[1]),
    }

acc = task.accelerator
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
torch.distributed.barrier()
