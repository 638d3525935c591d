"""tests/test_safety_net.py on 2 processes: the step count of a drop_last dataloader, a LocalSGD fit that raised
on every rank (no final average), and token normalisation of a bf16 loss under DDP. Each rank writes
result-<rank>.json."""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import TinyTask, tiny_dataset, tiny_fit

out = Path(sys.argv[1])
results = {}


class DropLastTask(TinyTask):
    """11 samples in batches of 2 with drop_last: 5 batches, so 2 per rank on 2 processes."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tiny_dataset(11), batch_size=2, drop_last=True)


task = DropLastTask(validate=False)
engine = tiny_fit(None, task=task, output_dir=str(out / "drop_last"))
results["drop_last"] = {"num_training_steps": task.num_training_steps, "global_step": engine.progress.global_step}


class FailingTask(TinyTask):
    """Trains on this rank's shard (LocalSGD: no gradient all-reduce), then raises on every rank at batch 3."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            raise RuntimeError("planned failure")
        return super().training_step(batch, batch_idx)


task = FailingTask(n=32, batch_size=2, validate=False)
try:
    tiny_fit({"local_sgd": {"sync_every": 100}}, task=task, output_dir=str(out / "lsgd"))
except RuntimeError as exc:
    error = str(exc)
else:
    error = None
results["lsgd_failed"] = {
    "error": error,
    "params": [p.detach().flatten().tolist() for p in task.model.parameters()],
}


class Bf16TokenTask(torchloom.TaskModule):
    """One parameter w = 1; rank r's bf16 loss is (r + 1) * w with 257 items on rank 0 and 3 on rank 1: the
    exact mean over the 260 items has the gradient (257 * 1 + 3 * 2) / 260."""

    def configure_model(self):
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        return model

    def training_step(self, batch, batch_idx):
        rank = self.accelerator.process_index
        (x,) = batch  # ones: the forward (through DDP, which then all-reduces in backward) returns w
        return {"loss": (rank + 1) * self.model(x).to(torch.bfloat16).sum(), "num_items": (257, 3)[rank]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=1.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.ones(2, 1)), batch_size=1)


class GradProbe:
    name = "safety_net.grad_probe"

    def __init__(self) -> None:
        self.grads = []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model):
        self.grads.append(next(model.parameters()).grad.item())


probe = GradProbe()
tiny_fit([{"grad_accum": {"normalization": "tokens"}}, probe], task=Bf16TokenTask(), output_dir=str(out / "bf16"))
results["bf16_tokens"] = {"grads": probe.grads}

acc = task.accelerator
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
torch.distributed.barrier()
