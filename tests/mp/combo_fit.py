"""All six technique plugins in one 2-process fit, and the same fit without checkpointing (an exact no-op)."""

import json
import sys
from pathlib import Path

import torch
from combo_tasks import PLUGIN_SETTINGS, ComboTask, final_parameters

from torchloom.testing import tiny_fit

out = Path(sys.argv[1])
results = {}
RUNS = [("all", list(PLUGIN_SETTINGS)), ("no_ckpt", [n for n in PLUGIN_SETTINGS if n != "grad_checkpoint"])]
for label, names in RUNS:
    # 64 samples, micro-batch 4, 2 ranks: 8 micro-batches per rank per epoch, GA 2 -> 4 optimizer steps per epoch.
    engine = tiny_fit(
        {n: PLUGIN_SETTINGS[n] for n in names}, task=ComboTask(n=64), max_epochs=2, output_dir=str(out / label)
    )
    results[label] = {
        "params": final_parameters(engine),
        "global_step": engine.progress.global_step,
        "grad_norms": [r["grad_norm"] for r in engine.history if "grad_norm" in r],
        "lr": [r["lr"] for r in engine.history if "lr" in r],
    }
acc = engine.accelerator
results["rank"], results["world_size"] = acc.process_index, acc.num_processes
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
torch.distributed.barrier()
