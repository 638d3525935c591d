"""C17 on 2 processes: LocalSGD (K=2) with two parameter groups, without and with gradient accumulation, plain
DDP for comparison, and a resume that restores the step counter. Each rank writes its snapshots."""

import json
import sys
from pathlib import Path

import torch
from lsgd_tasks import LocalSGDProbe, TwoGroupTask

from torchloom.testing import tiny_fit
from torchloom_plugins.local_sgd import LocalSGDPlugin

out = Path(sys.argv[1])
results = {}


def run(label, plugins, probe, task, **settings):
    engine = tiny_fit([*plugins, probe], task=task, output_dir=str(out / label), **settings)
    lsgd = next((p for p in plugins if isinstance(p, LocalSGDPlugin)), None)
    results[label] = {
        "pre": probe.pre,
        "post": probe.post,
        "grad_allreduces": probe.grad_allreduces,
        "global_step": engine.progress.global_step,
        "micro_steps": engine.progress.micro_step,
        "num_averages": None if lsgd is None else lsgd.num_averages,
        "num_steps": None if lsgd is None else lsgd.num_steps,
    }
    return task


# 24 samples in batches of 2 = 12 batches, 6 per rank: 6 optimizer steps.
task = run("lsgd", [LocalSGDPlugin(sync_every=2)], LocalSGDProbe(), TwoGroupTask(24))
# GA 2: 48 samples = 24 batches, 12 micro-batches per rank, still 6 optimizer steps.
run("lsgd_ga", [LocalSGDPlugin(sync_every=2), {"grad_accum": {"steps": 2}}], LocalSGDProbe(), TwoGroupTask(48))
run("ddp", [], LocalSGDProbe(), TwoGroupTask(24))
# Resume: 3 steps with K=4 and save (torchloom.save_plugin_state, main process); then a new plugin loads the
# counter (3) on every process (torchloom.load_plugin_state, during its fit): it averages after 1 more step.
ckpt = str(out / "ckpt")
first, second = LocalSGDPlugin(sync_every=4), LocalSGDPlugin(sync_every=4)
run("resume_a", [first], LocalSGDProbe(save_to=ckpt, stateful=[first]), TwoGroupTask(24), max_steps=3)
run("resume_b", [second], LocalSGDProbe(load_from=ckpt, stateful=[second]), TwoGroupTask(24), max_steps=2)
results["ckpt_files"] = sorted(p.name for p in Path(ckpt).iterdir())

acc = task.accelerator
results["rank"], results["world_size"] = acc.process_index, acc.num_processes
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
torch.distributed.barrier()
