"""`torchloom tune-lr` on 2 processes: every process runs the command; each writes its exit status (the main
process also what lr_find.json holds)."""

import json
import os
import sys
from pathlib import Path

import torch

from torchloom.cli import main

out = Path(sys.argv[1])
config = out / "lr.yaml"
rank = int(os.environ["RANK"])
if rank == 0:
    config.write_text(f"engine:\n  output_dir: {out / 'runs'}\ntask:\n  class_path: lr_tasks.ScalarRegression\n")
torch.distributed.init_process_group("gloo")  # only to wait for the config; the engine's Accelerator joins it
torch.distributed.barrier()
status = main(["tune-lr", "--config", str(config), "--min_lr", "1e-4", "--max_lr", "10", "--num_steps", "60"])
result = {"status": status}
if rank == 0:
    result["summary"] = json.loads((out / "runs" / "tune-lr" / "latest" / "lr_find.json").read_text())
(out / f"result-{rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
