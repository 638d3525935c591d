"""C12 on N processes: 10 evaluation samples (ids 0..9), batch 3, a predictor right on ids 0..6. The outputs
that on_validation_batch_end receives, the predictions, and a torchmetrics accuracy fed from the outputs count
every id exactly once, whatever N."""

import json
import sys
from pathlib import Path

import torch
import torchmetrics
from torch.utils.data import DataLoader

import torchloom


class Fixed(torchloom.TaskModule):
    def configure_model(self):
        return torch.nn.Linear(1, 1)

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        preds = torch.where(ids < 7, labels, labels + 1)
        return {"ids": ids, "preds": preds, "target": labels}

    def predict_step(self, batch, batch_idx):
        return {"ids": batch[0]}


class Counter:
    def __init__(self):
        self.ids, self.acc = [], None

    @torchloom.hookimpl
    def on_validation_start(self, accelerator):
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro").to(accelerator.device)

    @torchloom.hookimpl
    def on_validation_batch_end(self, outputs):
        self.ids += outputs["ids"].tolist()
        self.acc.update(outputs["preds"], outputs["target"])

    @torchloom.hookimpl
    def on_validation_end(self, log):
        log("val/accuracy", self.acc)


out = Path(sys.argv[1])
ids = torch.arange(10)
data = list(zip(ids, ids % 3))
counter = Counter()
engine = torchloom.Engine(output_dir=str(out / "run"), plugins=[counter])
task = Fixed()
metrics = engine.validate(task, DataLoader(data, batch_size=3))
predictions = engine.predict(task, DataLoader(data, batch_size=3))
rank = task.accelerator.process_index
result = {
    "val_ids": counter.ids,
    "accuracy": metrics["val/accuracy"],
    "predicted_ids": [i for p in predictions for i in p["ids"].tolist()],
}
(out / f"result-{rank}.json").write_text(json.dumps(result))
