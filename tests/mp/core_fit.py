"""2-process data-parallel fit of TinyTask for tests/test_multiprocess.py; writes result-<rank>.json.

Usage (from tests/torchrun_util.py): ``torchrun --nproc_per_node 2 core_fit.py OUT_DIR``.

The launcher sets ACCELERATE_USE_CPU=1; this script removes it before anything imports Accelerate, so that
the processes form one gloo group only because the engine detects a multi-process launch on a CPU-only
machine (without that, Accelerate would run each process as an independent single-process job).

Each rank gets its own output_dir (``OUT_DIR/run-rank<r>``) so that the test can tell which ranks wrote
files: only rank 0 may create one.
"""

import json
import os
import sys
from pathlib import Path

os.environ.pop("ACCELERATE_USE_CPU", None)  # before Accelerate is imported: see the module docstring

import torch

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask


class SampleRecorder:
    """Records the first feature of every sample of every training micro-batch (identifies the samples)."""

    name = "sample_recorder"

    def __init__(self) -> None:
        self.batches = []

    @torchloom.hookimpl
    def on_train_batch_start(self, batch, progress):
        x, _ = batch
        self.batches.append({"epoch": progress.epoch, "batch_idx": progress.batch_idx, "x0": x[:, 0].tolist()})


out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
recorder, samples = RecordingPlugin(), SampleRecorder()
engine = torchloom.Engine(
    plugins=[recorder, samples], max_epochs=2, log_every_n_steps=1, output_dir=str(out / f"run-rank{rank}")
)
# Micro-batch 4 per rank: a global batch of 8 (the prepared dataloader shards the 32 samples).
task = TinyTask(n=32, batch_size=4)
engine.fit(task)
acc = task.accelerator
model = acc.unwrap_model(task.model)
# An uneven validation set: 22 samples in batches of 4 over 2 ranks; the sampler repeats samples to even out
# the last batch and TinyTask's gather_for_metrics must drop them.
from torch.utils.data import DataLoader  # noqa: E402

from torchloom.testing import tiny_dataset  # noqa: E402

history = list(engine.history)  # the fit's records, before the extra validation below adds one
on_log_calls = recorder.calls.count("on_log")
uneven = engine.validate(task, DataLoader(tiny_dataset(22, 4, seed=5), batch_size=4))
result = {
    "uneven_val_loss": uneven["val/loss"],
    "rank": acc.process_index,
    "world_size": acc.num_processes,
    "distributed_type": str(acc.distributed_type),
    "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
    "global_step": engine.progress.global_step,
    "history": history,
    "on_log_calls": on_log_calls,
    "samples": samples.batches,
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
