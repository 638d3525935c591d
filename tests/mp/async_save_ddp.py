"""Two ranks fit ShuffleTask under DDP with the ``checkpoint`` plugin saving every 3 steps, synchronously and with
``async_save``; then resume each from its step-3 checkpoint to the end. Each rank reports every file of every
checkpoint (size and SHA-256, from the manifests), the parameters the resumed runs end with, and those of the
uninterrupted run (tests/test_async_save.py)."""

import json
import sys
from pathlib import Path

import torch
from resume_fit import ShuffleTask

import torchloom
from torchloom.checkpoint.store import read_manifest
from torchloom_plugins.checkpoint import Checkpoint

out = Path(sys.argv[1])


def fit(folder: Path, async_save: bool, ckpt_path: str | None = None):
    task = ShuffleTask(n=16)
    plugin = Checkpoint(every_n_steps=3, every_n_epochs=None, keep_last=None, async_save=async_save)
    engine = torchloom.Engine(
        output_dir=str(folder), max_epochs=2, seed=0, log_every_n_steps=3, default_plugins=False, plugins=[plugin]
    )
    engine.fit(task, ckpt_path=ckpt_path)
    model = task.accelerator.unwrap_model(task.model)
    return engine, [p.detach().flatten().tolist() for p in model.parameters()]


result: dict = {"files": {}, "resumed": {}}
for mode in ("sync", "async"):
    engine, params = fit(out / mode, mode == "async")
    checkpoints = Path(engine.run_dir) / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    result["names"] = names
    result["files"][mode] = {name: read_manifest(checkpoints / name)["files"] for name in names}
    result["uninterrupted"] = params
    _, result["resumed"][mode] = fit(out / f"resume-{mode}", mode == "async", str(checkpoints / "step-00000003"))
rank = torch.distributed.get_rank()
(out / f"result-{rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
