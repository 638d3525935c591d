"""The ``trackers`` plugin on 2 processes: two fits in one launch, each with TensorBoard. Each rank reports its pid
(TensorBoard puts the writer's pid in every event file name), the run directories, the history, and how many
trackers its Accelerator held during the fit."""

import json
import os
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.testing import tiny_fit

out = Path(sys.argv[1])


class TrackerCount:
    name = "tracker_count"

    def __init__(self) -> None:
        self.during_fit: int | None = None

    @torchloom.hookimpl
    def on_fit_start(self, accelerator) -> None:
        self.during_fit = len(accelerator.trackers)


runs = []
for label in ("first", "second"):  # the second fit needs the process group the first one used
    probe = TrackerCount()
    engine = tiny_fit([{"trackers": {}}, probe], output_dir=str(out / label), max_epochs=2)
    runs.append({"run_dir": engine.run_dir, "history": engine.history, "trackers_during_fit": probe.during_fit})

acc = engine.accelerator
result = {"rank": acc.process_index, "world_size": acc.num_processes, "pid": os.getpid(), "runs": runs}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
