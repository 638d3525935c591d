"""Quick-debug runs on several processes (tests/test_quick_debug.py): ``torchrun --nproc_per_node 2
quick_debug.py OUT``. TinyTask(n=32, batch 4): 8 training batches, so 4 per process, and 4 validation batches, 2
per process. Each scenario is one fit; each rank writes ``result-<rank>.json``: per scenario, the batch index of
every training micro-batch, the optimizer steps, the validation batches of each pass, ``num_training_steps``, and
(``fast_dev_run``) the files under the output directory."""

import json
import os
import sys
from pathlib import Path

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask

SCENARIOS = {
    "fraction": {"limit_train_batches": 0.5, "limit_val_batches": 1, "max_epochs": 2},  # 2 of 4, 1 of 2
    "count": {"limit_train_batches": 3, "max_epochs": 2, "val_check_interval": 2},
    "fast_dev_run": {"fast_dev_run": 2, "max_epochs": 3, "save_model": True},
}


def main(out: Path) -> None:
    results = {}
    for name, settings in SCENARIOS.items():
        recorder = RecordingPlugin()
        plugins = [recorder, "checkpoint"] if name == "fast_dev_run" else [recorder]
        root = out / name
        engine = torchloom.Engine(
            plugins=plugins, default_plugins=False, log_every_n_steps=1, output_dir=str(root), **settings
        )
        task = TinyTask(n=32, batch_size=4)
        engine.fit(task)
        task.accelerator.wait_for_everyone()  # the main process has released the run directory (its in-use mark)
        passes, current = [], 0
        for hook in recorder.calls:
            if hook == "on_validation_start":
                current = 0
            elif hook == "on_validation_batch_end":
                current += 1
            elif hook == "on_validation_end":
                passes.append(current)
        results[name] = {
            "batches": [(p.epoch, p.batch_idx) for h, p in recorder.records if h == "run_train_step"],
            "steps": engine.progress.global_step,
            "val_passes": passes,
            "num_training_steps": task.num_training_steps,
            "files": sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files),
        }
        rank = task.accelerator.process_index
    (out / f"result-{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
