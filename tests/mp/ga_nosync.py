"""2-process fit of TinyTask with grad_accum(steps=4): counts DDP's gradient all-reduces with a comm hook
and records each rank's local gradients on the micro-batches that do not end a window.

Per rank: 32 samples / 2 ranks / batch 2 = 8 micro-batches per epoch, 2 optimizer steps per epoch, 2 epochs.
"""

import json
import sys
from pathlib import Path

import torch
from ga_tasks import GradProbe
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import torchloom
from torchloom.testing import TinyTask, tiny_fit


class AllReduceCounter:
    """Counts DDP gradient all-reduce calls (one per bucket per synchronising backward) and snapshots the
    local gradients after every micro-batch that did not synchronise."""

    name = "test.allreduce_counter"

    def __init__(self) -> None:
        self.state = {"calls": 0}
        self.local_grads: list[list[float]] = []
        self.model = None

    @torchloom.hookimpl
    def on_fit_start(self, model):
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
        self.model = model

        def counting_allreduce(state, bucket):
            state["calls"] += 1
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(self.state, counting_allreduce)

    @torchloom.hookimpl
    def on_train_batch_end(self, accelerator):
        if not accelerator.sync_gradients:
            grads = [g for p in self.model.parameters() for g in p.grad.flatten().tolist()]
            self.local_grads.append(grads)


out = Path(sys.argv[1])
counter, probe = AllReduceCounter(), GradProbe()
engine = tiny_fit(
    [{"grad_accum": {"steps": 4}}, counter, probe],
    task=TinyTask(n=32, batch_size=2, validate=False),
    max_epochs=2,
    output_dir=str(out / "run"),
)
acc = engine._run.accelerator
model = acc.unwrap_model(engine._run.model)
result = {
    "rank": acc.process_index,
    "world_size": acc.num_processes,
    "allreduce_calls": counter.state["calls"],
    "local_grads": counter.local_grads,
    "synced_grads": probe.grads,
    "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
    "global_step": engine.progress.global_step,
    "micro_step": engine.progress.micro_step,
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
