"""Issue 21 item 16: 32 validation samples in one batch of 32 on 2 processes, so process 1 holds only Accelerate's
padding copies. Metrics whose state is a list of tensors (binary and multiclass AUROC, average precision,
Spearman, a retrieval MRR, a list of the rows seen) reach the log every way there is: the eval_metrics settings,
`TaskModule.configure_metrics`, and the task's own ``self.log(name, metric)`` (updated in validation_step). Each
rank writes what validate returned; the test compares it with one process on the same data."""

import json
import sys
from pathlib import Path

import torch
import torchmetrics
from torch.utils.data import DataLoader

import torchloom

N = 32
SETTINGS = {
    "metrics": {
        "auroc": {"task": "binary"},
        "average_precision": {"task": "binary"},
        "f1": {"task": "binary"},
        "accuracy": {"task": "binary"},
    }
}


def rows() -> list[tuple[torch.Tensor, ...]]:
    """(id, score, label, 3-class scores, 3-class label) per sample; the scores are partly informative."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (N,), generator=gen)
    scores = (0.4 * labels + 0.6 * torch.rand(N, generator=gen)).float()
    classes = torch.randint(0, 3, (N,), generator=gen)
    probs = (torch.nn.functional.one_hot(classes, 3) + 2 * torch.rand(N, 3, generator=gen)).softmax(-1).float()
    return list(zip(torch.arange(N), scores, labels, probs, classes))


class Rows(torchmetrics.Metric):
    """The number of distinct ids it was updated with (a list state), over all processes."""

    def __init__(self):
        super().__init__()
        self.add_state("ids", default=[], dist_reduce_fx="cat")

    def update(self, preds, target, ids=None):
        self.ids.append(ids if ids is not None else torch.arange(len(target)) + 1000)

    def compute(self):
        ids = torchmetrics.utilities.dim_zero_cat(self.ids)
        return torch.tensor(float(len(torch.unique(ids))))


class PaddingOnly(torchloom.TaskModule):
    def __init__(self):
        super().__init__()
        # The Lightning idiom: metrics the task holds, updated in validation_step and logged as objects.
        self.multiclass_auroc = torchmetrics.classification.MulticlassAUROC(num_classes=3)
        self.spearman = torchmetrics.regression.SpearmanCorrCoef()
        self.mrr = torchmetrics.retrieval.RetrievalMRR()
        self.seen = Rows()

    def configure_model(self):
        return torch.nn.Linear(1, 1)

    def validation_step(self, batch, batch_idx):
        ids, scores, labels, probs, classes = batch
        self.multiclass_auroc.update(probs, classes)
        self.spearman.update(scores, labels.float() + ids.float() / 100)
        self.mrr.update(probs[:, 0], labels.bool(), indexes=ids % 4)
        self.seen.update(scores, labels, ids)
        for name in ("multiclass_auroc", "spearman", "mrr", "seen"):
            self.log(f"val/task_{name}", getattr(self, name))
        return {"preds": scores, "target": labels}

    def configure_metrics(self):
        return {"binary_auroc": torchmetrics.classification.BinaryAUROC(), "rows": Rows()}


def validate(out: Path) -> tuple[dict[str, float], int]:
    engine = torchloom.Engine(output_dir=str(out / "run"), plugins={"eval_metrics": SETTINGS})
    task = PaddingOnly()
    metrics = engine.validate(task, DataLoader(rows(), batch_size=N))
    again = engine.validate(task, DataLoader(rows(), batch_size=N))  # reset in between: the same values again
    assert again == metrics, (again, metrics)
    return metrics, task.accelerator.process_index


def main() -> None:
    out = Path(sys.argv[1])
    metrics, rank = validate(out)
    (out / f"result-{rank}.json").write_text(json.dumps({"metrics": metrics}))


if __name__ == "__main__":
    main()
