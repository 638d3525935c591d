"""The profiler plugin on 2 processes: by default only the main process writes a trace; with all_ranks every one."""

import json
import sys
from pathlib import Path

import torch

from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.profiler import Profiler

out = Path(sys.argv[1])
results = {}
for label, settings in (("main", {}), ("all", {"all_ranks": True})):
    profiler, task = Profiler(wait=1, warmup=1, active=1, **settings), TinyTask()
    tiny_fit([profiler], task=task, max_epochs=1, output_dir=str(out / label))  # 4 optimizer steps per process
    results[label] = sorted(Path(p).name for p in profiler.written if p.endswith(".json"))
    results["steps"] = profiler.steps

rank = task.accelerator.process_index
(out / f"result-{rank}.json").write_text(json.dumps(results))
torch.distributed.barrier()
