"""2-process fit over an audio folder: who decoded, what each rank loaded, which clips each rank trained on.

argv: out_dir, audio folder, cache dir. Each rank writes ``result-<rank>.json``.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

import torchloom
import torchloom.data.audio as audio_module
from torchloom.data import AudioClassificationData

out, folder, cache = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
calls: list[str] = []
real_extract = audio_module.extract_features


def counting_extract(*args, **kwargs):
    calls.append(kwargs.get("name", ""))
    return real_extract(*args, **kwargs)


audio_module.extract_features = counting_extract


class Probe(torchloom.TaskModule):
    """A linear classifier that records the ids (feature sums) of the clips it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(40 * 101, 3))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)

    def training_step(self, batch, batch_idx):
        self.seen += [round(v, 1) for v in batch["input_features"].double().flatten(1).sum(1).tolist()]
        return torch.nn.functional.cross_entropy(self.model(batch["input_features"]), batch["labels"])


data = AudioClassificationData(folder, batch_size=4, shuffle=True, cache_dir=cache)
task = Probe()
engine = torchloom.Engine(max_epochs=1, output_dir=str(out / "run"), seed=0)
engine.fit(task, datamodule=data)
rank = engine._run.accelerator.process_index
features, labels = data.train_dataset[:]["input_features"], data.train_dataset[:]["labels"]
result = {
    "rank": rank,
    "world_size": engine._run.accelerator.num_processes,
    "extract_calls": calls,
    "cache_hit": data.cache_hit,
    "cache_path": str(data.cache_path),
    "label_names": data.label_names,
    "data_sha256": hashlib.sha256(features.numpy().tobytes() + labels.numpy().tobytes()).hexdigest(),
    "all_ids": [round(v, 1) for v in features.double().flatten(1).sum(1).tolist()],
    "seen": task.seen,
}
(out / f"result-{rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
