"""Issue 6 on 2 processes: the saved model is the final one after LocalSGD's last average, and a seed repeats a
run (data order and parameters) with new or reused DataLoaders. Each rank writes what it saw."""

import json
import sys
from pathlib import Path

import torch
from lsgd_tasks import TwoGroupTask
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from torchloom.testing import tiny_fit

out = Path(sys.argv[1])
results = {}

# 24 samples in batches of 2 = 12 batches, 6 per rank: 6 optimizer steps; K = 4 averages after step 4, and once
# more at the end of training (on_train_end), which must happen before the model is saved.
task = TwoGroupTask(24)
tiny_fit({"local_sgd": {"sync_every": 4}}, task=task, output_dir=str(out / "lsgd"), save_model=True)
acc = task.accelerator
model = acc.unwrap_model(task.model)
saved = load_file(out / "lsgd" / "latest" / "model" / "model.safetensors")  # fit returned after every rank finished
results["saved_equals_final"] = saved.keys() == model.state_dict().keys() and all(
    torch.equal(saved[k], v) for k, v in model.state_dict().items()
)
results["final_params"] = [p.detach().flatten().tolist() for p in model.parameters()]


class Shuffled(TwoGroupTask):
    """Shuffled data and dropout; records the samples each rank trains on."""

    def __init__(self, loader=None):
        super().__init__(24)
        self.loader, self.seen = loader, []

    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        if self.loader is not None:
            return self.loader
        g = torch.Generator().manual_seed(11)
        dataset = TensorDataset(torch.randn(24, 2, generator=g), torch.randn(24, 1, generator=g))
        return DataLoader(dataset, batch_size=2, shuffle=True)


def seeded(label, loader=None, seed=7):
    task = Shuffled(loader)
    tiny_fit(task=task, output_dir=str(out / label), max_epochs=2, seed=seed)
    params = [p.detach().flatten().tolist() for p in task.accelerator.unwrap_model(task.model).parameters()]
    return {"seen": task.seen, "params": params}


results["new_a"], results["new_b"] = seeded("new_a"), seeded("new_b")
reused = Shuffled().train_dataloader()
results["reused_a"], results["reused_b"] = seeded("reused_a", reused), seeded("reused_b", reused)
results["other_seed"] = seeded("other_seed", seed=8)

results["rank"], results["world_size"] = acc.process_index, acc.num_processes
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
