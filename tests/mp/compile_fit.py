"""The six technique plugins in one 2-process fit (DDP, LocalSGD averaging every 2 steps), with and without the
``compile`` plugin (``aot_eager``): the compiled model sits inside DDP."""

import json
import sys
from pathlib import Path

import torch
from combo_tasks import PLUGIN_SETTINGS, ComboTask, final_parameters

from torchloom.testing import tiny_fit
from torchloom_plugins.compile import compile_counters

out = Path(sys.argv[1])
results = {}
for label, extra in [("eager", {}), ("compiled", {"compile": {"backend": "aot_eager"}})]:
    graphs_before = compile_counters()[0]
    engine = tiny_fit({**PLUGIN_SETTINGS, **extra}, task=ComboTask(n=64), max_epochs=1, output_dir=str(out / label))
    results[label] = {
        "params": final_parameters(engine),
        "global_step": engine.progress.global_step,
        "graphs": compile_counters()[0] - graphs_before,
        "recompiles": [r["compile/recompiles"] for r in engine.history if "compile/recompiles" in r],
    }
acc = engine.accelerator
results["rank"], results["world_size"] = acc.process_index, acc.num_processes
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
torch.distributed.barrier()
