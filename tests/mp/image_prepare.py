"""2-process fit over an image folder: who preprocessed, what each rank loaded, which samples each rank trained on.

argv: out_dir, image folder, cache dir. Each rank writes ``result-<rank>.json``.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

import torchloom
import torchloom.data.image as image_module
from torchloom.data import ImageClassificationData

out, folder, cache = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
calls: list[str] = []
real_preprocess = image_module.preprocess_images


def counting_preprocess(dataset, transform, image_column="image", keep_columns=("labels",), batch_size=256, name=""):
    calls.append(name)
    return real_preprocess(dataset, transform, image_column, keep_columns, batch_size, name)


image_module.preprocess_images = counting_preprocess


class Probe(torchloom.TaskModule):
    """A linear classifier that records the ids (pixel sums) of the samples it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 4))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)

    def training_step(self, batch, batch_idx):
        self.seen += [round(v, 3) for v in batch["pixel_values"].flatten(1).sum(1).tolist()]
        return torch.nn.functional.cross_entropy(self.model(batch["pixel_values"]), batch["labels"])


data = ImageClassificationData(folder, mode="RGB", batch_size=4, shuffle=True, cache_dir=cache)
task = Probe()
engine = torchloom.Engine(max_epochs=1, output_dir=str(out / "run"), seed=0)
engine.fit(task, datamodule=data)
rank = engine._run.accelerator.process_index
pixels, labels = data.train_dataset[:]["pixel_values"], data.train_dataset[:]["labels"]
result = {
    "rank": rank,
    "world_size": engine._run.accelerator.num_processes,
    "preprocess_calls": calls,
    "cache_hit": data.cache_hit,
    "cache_path": str(data.cache_path),
    "label_names": data.label_names,
    "data_sha256": hashlib.sha256(pixels.numpy().tobytes() + labels.numpy().tobytes()).hexdigest(),
    "all_ids": [round(v, 3) for v in pixels.flatten(1).sum(1).tolist()],
    "seen": task.seen,
}
(out / f"result-{rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
