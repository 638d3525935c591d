"""Two ranks evaluate a frozen model (no trainable parameter, as after ``from_pretrained`` for evaluation) with
``Engine.validate`` and ``Engine.predict``; then fit a trainable one and validate / predict with the fitted model
(DDP-wrapped by the fit); then try to fit the frozen one. Each rank reports what it saw
(tests/test_multiprocess.py compares them with one process)."""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import TinyTask, tiny_dataset


class FrozenTask(TinyTask):
    """TinyTask whose model has every parameter frozen (fixed weights from seed 0)."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__(n=20, batch_size=4)  # 10 validation samples: 3 batches, the last one padded on rank 1
        self.frozen = frozen

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = super().configure_model()
        return model.requires_grad_(False) if self.frozen else model

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(tiny_dataset(6, seed=5).tensors[0]), batch_size=4)


def evaluate(engine: torchloom.Engine, task: TinyTask) -> dict:
    metrics = engine.validate(task)
    wrapped_in_validate = type(task.model).__name__
    predictions = engine.predict(task)
    return {
        "wrapped": [wrapped_in_validate, type(task.model).__name__],
        "val_loss": metrics["val/loss"],
        "predictions": torch.cat(predictions).flatten().tolist() if predictions else [],
        "weights": {k: v.tolist() for k, v in task.accelerator.unwrap_model(task.model).state_dict().items()},
    }


def run(out: Path) -> dict:
    frozen = FrozenTask()
    result = {"frozen": evaluate(torchloom.Engine(output_dir=str(out / "frozen")), frozen)}
    fitted, engine = FrozenTask(frozen=False), torchloom.Engine(max_epochs=1, output_dir=str(out / "fit"))
    engine.fit(fitted)
    result["fitted"] = {"after_fit": type(fitted.model).__name__, **evaluate(engine, fitted)}
    try:
        torchloom.Engine(max_epochs=1, output_dir=str(out / "frozen_fit")).fit(FrozenTask())
    except torchloom.TaskError as exc:
        result["frozen_fit_error"] = str(exc)
    else:
        result["frozen_fit_error"] = None
    result["rank"] = fitted.accelerator.process_index
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    result = run(out)
    (out / f"result-{result['rank']}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
