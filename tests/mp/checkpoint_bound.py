"""keep_across_runs on 2 processes: a fit saves every 2 steps (4 steps per epoch, 2 epochs), then a fit resumed from
its first checkpoint with keep_across_runs: 1. Each rank writes what its checkpoint plugin still holds as saved and
what is left on disk, as paths relative to the output_dir."""

import json
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask, tiny_fit

out = Path(sys.argv[1])
run = out / "run"
settings = {"every_n_steps": 2, "keep_last": None}
first = tiny_fit({"checkpoint": settings}, output_dir=str(run), max_epochs=2)
start = str(Path(first.run_dir) / "checkpoints" / "step-00000002")
bounded = {"checkpoint": {**settings, "keep_last": 2, "keep_across_runs": 1}}
resumed = torchloom.Engine(plugins=bounded, default_plugins=False, output_dir=str(run), max_epochs=2)
resumed.fit(TinyTask(), ckpt_path=start)
plugin = resumed.plugins[0]


def relative(path: str) -> str:
    return str(Path(path).resolve().relative_to(run.resolve()))


acc = resumed.accelerator
result = {
    "rank": acc.process_index,
    "first": relative(first.run_dir),
    "resumed": relative(resumed.run_dir),
    "saved": [relative(p) for p in plugin.saved],
    "listed": [relative(p) for p in list_checkpoints(run)],
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
