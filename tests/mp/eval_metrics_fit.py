"""eval_metrics on N processes: 23 validation samples (batch 4: the last batch is uneven, and on 2 and 3 processes
Accelerate pads it with copies), a fixed scorer. Every metric's value and the number of samples counted must be
what one process computes on the whole set; a compute that fails on every rank leaves the metrics usable."""

import json
import sys
from pathlib import Path

import torch
import torchmetrics
from torch.utils.data import DataLoader

import torchloom

N, BATCH = 23, 4


def scored_data() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(id, score, label) rows; the score is only partly informative, so AUROC is neither 0.5 nor 1."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (N,), generator=gen)
    scores = (0.35 * labels + 0.65 * torch.rand(N, generator=gen)).float()
    return list(zip(torch.arange(N), scores, labels))


class Count(torchmetrics.Metric):
    """The number of samples it was updated with, summed over processes at compute."""

    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.n += target.numel()

    def compute(self):
        return self.n


class FailOnce(Count):
    """Fails its first compute, after torchmetrics has synchronised its state (the 1.9 trap)."""

    failed = False

    def compute(self):
        if not FailOnce.failed:
            FailOnce.failed = True
            raise ValueError("scripted failure")
        return self.n


class Scorer(torchloom.TaskModule):
    def configure_model(self):
        return torch.nn.Linear(1, 1)

    def validation_step(self, batch, batch_idx):
        _ids, scores, labels = batch
        return {"preds": scores, "target": labels}

    def configure_metrics(self):
        return torchmetrics.MetricCollection({"count": Count(), "fail_once": FailOnce()})


def main() -> None:
    out = Path(sys.argv[1])
    data = scored_data()
    settings = {
        "metrics": {
            "accuracy": {"task": "binary"},
            "auroc": {"task": "binary"},
            "f1": {"task": "binary"},
            "average_precision": {"task": "binary"},
        }
    }
    engine = torchloom.Engine(output_dir=str(out / "run"), plugins={"eval_metrics": settings})
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    task = Scorer()
    try:
        engine.validate(task, DataLoader(data, batch_size=BATCH))
        raise AssertionError("the scripted compute failure did not fail validate")
    except torchloom.TaskError as exc:
        error = str(exc)
    # The failed metric holds this process's own count again (not the synchronised total), so it can be updated and
    # computed: one more sample per process.
    failed = plugin.metrics["val/fail_once"]
    after_failure = {
        "synced": {name: bool(m._is_synced) for name, m in plugin.metrics.items()},
        "local_n": int(failed.n),
    }
    failed.update(torch.zeros(1), torch.zeros(1))
    after_failure["recomputed"] = int(failed.compute())
    again = engine.validate(task, DataLoader(data, batch_size=BATCH))
    twice = engine.validate(task, DataLoader(data, batch_size=BATCH))
    rank = task.accelerator.process_index
    result = {
        "rank": rank,
        "world_size": task.accelerator.num_processes,
        "error": error,
        "after_failure": after_failure,
        "metrics": again,
        "metrics_twice": twice,
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
