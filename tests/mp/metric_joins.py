"""Issue 21 items 3, 4 and 5 on N processes; each scenario's values (or the error it raised) per rank.

7 validation samples in batches of 2: on 2 processes the last round holds 3 real samples, so process 1's last
batch is sample 6 plus a copy of sample 0 that Accelerate pads it with (and with 5 samples, process 1's last batch
holds only copies). The predictions are right on every sample but sample 0: accuracy 6/7 (6/8 if the copy counts).

- ``idiom`` (item 5): Lightning's idiom, torchmetrics objects the task holds (an attribute, one in a dict, a
  MetricCollection called as a function) updated in validation_step and logged as objects; and a
  ``gather_for_metrics`` in validation_step, which needs the whole batch on every process.
- ``flattened`` (item 5): an update that the engine cannot cut (one row per token): refused on every rank alike.
- ``two_names`` (item 4): one metric object logged under two names, by the task and by configure_metrics.
- ``bad_target`` / ``bad_shape`` (item 3): a target out of range, or predictions with a wrong class count, only
  in process 1's share: every rank raises the same error.
"""

import json
import sys
from pathlib import Path

import torch
import torchmetrics
from torch.utils.data import DataLoader

import torchloom

LABELS = [1, 0, 1, 1, 0, 0, 1]
SCORES = [0.3, 0.1, 0.8, 0.7, 0.4, 0.2, 0.9]  # above 0.5 exactly where the label is 1, except for sample 0


def rows(n: int = 7) -> list[tuple[torch.Tensor, ...]]:
    """(id, score, label) of the first ``n`` samples."""
    return list(zip(torch.arange(n), torch.tensor(SCORES[:n]), torch.tensor(LABELS[:n])))


class Count(torchmetrics.Metric):
    """The number of samples it was updated with."""

    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.n += target.numel()

    def compute(self):
        return self.n


class Base(torchloom.TaskModule):
    def configure_model(self):
        return torch.nn.Linear(1, 1)


class Idiom(Base):
    def __init__(self):
        super().__init__()
        self.accuracy = torchmetrics.classification.BinaryAccuracy()
        self.held = {"count": Count()}
        self.collection = torchmetrics.MetricCollection(
            {"auroc": torchmetrics.classification.BinaryAUROC(), "f1": torchmetrics.classification.BinaryF1Score()}
        )
        self.gathered = 0

    def validation_step(self, batch, batch_idx):
        ids, scores, labels = batch
        self.accuracy.update(scores, labels)
        self.held["count"](scores, labels)  # forward: update, and this batch's value
        self.collection(scores, labels)
        self.gathered += self.accelerator.gather_for_metrics(ids).numel()  # the whole batch on every rank
        self.log("val/accuracy", self.accuracy)
        self.log("val/count", self.held["count"])
        self.log("val/auroc", self.collection["auroc"])
        self.log("val/f1", self.collection["f1"])
        self.log("val/gathered", float(self.gathered), reduce="max")


class Flattened(Base):
    """Updates a metric with one row per token (3 per sample): rows the engine cannot tell copies among."""

    def __init__(self):
        super().__init__()
        self.accuracy = torchmetrics.classification.BinaryAccuracy()

    def validation_step(self, batch, batch_idx):
        _ids, scores, labels = batch
        self.accuracy.update(scores.repeat_interleave(3), labels.repeat_interleave(3))
        self.log("val/token_accuracy", self.accuracy)


class TwoNames(Base):
    """Logs one metric object under two names; configure_metrics returns one object under two names too."""

    def __init__(self):
        super().__init__()
        self.accuracy = torchmetrics.classification.BinaryAccuracy()
        self.count = Count()

    def validation_step(self, batch, batch_idx):
        _ids, scores, labels = batch
        self.accuracy.update(scores, labels)
        self.log("val/accuracy", self.accuracy)
        self.log("val/accuracy_again", self.accuracy)
        return {"preds": scores, "target": labels}

    def configure_metrics(self):
        return {"count": self.count, "count_again": self.count}


class ThreeClasses(Base):
    """3-class scores from the binary rows; sample 6 (process 1's on 2 processes) breaks the inputs."""

    def __init__(self, fault: str):
        super().__init__()
        self.fault = fault

    def validation_step(self, batch, batch_idx):
        ids, scores, labels = batch
        probs = torch.stack([1 - scores, scores, torch.zeros_like(scores)], dim=1)
        target = labels.clone()
        if self.fault == "target":
            target = torch.where(ids == 6, torch.full_like(labels, 5), labels)
        elif 6 in ids.tolist():
            probs = torch.cat([probs, torch.zeros_like(probs[:, :1])], dim=1)
        return {"preds": probs, "target": target}


THREE = {
    "metrics": {"accuracy": {"task": "multiclass", "num_classes": 3}, "f1": {"task": "multiclass", "num_classes": 3}}
}


def validate(out: Path, name: str, task: torchloom.TaskModule, n: int, plugins=None) -> dict:
    engine = torchloom.Engine(output_dir=str(out / name), plugins=plugins or {})
    try:
        return {"metrics": engine.validate(task, DataLoader(rows(n), batch_size=2))}
    except torchloom.TaskError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # anything else is a failure of the test, reported with the others
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}


SCENARIOS = {
    "idiom": lambda: (Idiom(), 7, None),
    "idiom_5": lambda: (Idiom(), 5, None),  # process 1's last batch is only copies
    "flattened": lambda: (Flattened(), 7, None),
    "two_names": lambda: (TwoNames(), 7, {"eval_metrics": {}}),
    "bad_target": lambda: (ThreeClasses("target"), 7, {"eval_metrics": THREE}),
    "bad_shape": lambda: (ThreeClasses("shape"), 7, {"eval_metrics": THREE}),
}


def scenarios(out: Path, names=None) -> dict:
    """The result of each scenario (all by default) in this process (1 process, or one rank of several)."""
    return {name: validate(out, name, *SCENARIOS[name]()) for name in names or SCENARIOS}


def main() -> None:
    out = Path(sys.argv[1])
    results = scenarios(out, sys.argv[2:])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"result-{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
