"""Every reduction of logged values over 2 processes with rank-dependent values (tests/test_kind_reductions.py):
``torchrun --nproc_per_node 2 kind_reductions_mp.py OUT``.

TinyTask, 32 samples in batches of 4: 4 micro-batches (= optimizer steps) per rank, one epoch, logging every 2
steps, validation (16 samples: 2 batches per rank) at the end, no sanity pass. In training micro-batch k (1-based)
rank r logs ``k + 10 r`` as a weighted mean with weight ``k (1 + r)`` (a tensor and a float weight); in validation
batch j rank r logs ``j + 100 r`` with every reduction and as a mean weighted ``j + 3 r``. Each micro-batch takes
1 s on the ``throughput`` and ``progress`` plugins' clock (injected) on both ranks. Each rank writes its history,
its own training losses and the main process's ``summary.json``."""

import json
import sys
from pathlib import Path

import torch

import torchloom
import torchloom._loop as loop_module
from torchloom.testing import TinyTask
from torchloom_plugins import progress as progress_module
from torchloom_plugins import throughput as throughput_module


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def perf_counter(self) -> float:
        return self.now


clock = Clock()
for module in (loop_module, progress_module, throughput_module):
    module.time = clock


class RankValues(TinyTask):
    def __init__(self) -> None:
        super().__init__(n=32, batch_size=4)
        self.count, self.losses = 0, []

    def training_step(self, batch, batch_idx):
        clock.now += 1.0
        self.count += 1
        rank = self.accelerator.process_index
        value, weight = float(self.count + 10 * rank), float(self.count * (1 + rank))
        self.log("w/tensor", torch.tensor(value), weight=torch.tensor(weight))
        self.log("w/float", value, weight=weight)
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        rank = self.accelerator.process_index
        value = float(batch_idx + 1 + 100 * rank)
        for reduce in ("sum", "max", "min", "last"):
            self.log(f"v/{reduce}", torch.tensor(value), reduce=reduce)
        self.log("v/mean", torch.tensor(value), weight=float(batch_idx + 1 + 3 * rank))
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)


out = Path(sys.argv[1])
task = RankValues()
engine = torchloom.Engine(
    max_epochs=1, log_every_n_steps=2, num_sanity_val_steps=0, output_dir=str(out / "run"),
    plugins=[{"throughput": {}}, {"progress": {}}],
)  # fmt: skip
engine.fit(task)
summary = None
if task.accelerator.is_main_process:
    summary = json.loads((Path(engine.run_dir) / torchloom.utils.SUMMARY_FILE).read_text())
result = {"history": engine.history, "losses": task.losses, "summary": summary}
(out / f"result-{task.accelerator.process_index}.json").write_text(json.dumps(result))
