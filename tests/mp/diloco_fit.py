"""DiLoCo (local_sgd with an outer optimizer) on 2 processes: TinyTask (Linear 4->1, MSE, inner SGD lr 0.1), data not
shuffled, so rank r trains on batches r, r + 2, ... (Accelerate's sharding by whole batches). Each scenario records
the initial and final parameters of every rank; a crash right after an outer step and a resume record the final
parameters too."""

import contextlib
import json
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.testing import TinyTask

out = Path(sys.argv[1])
results = {}


class Crash(Exception):
    pass


class Probe:
    """Records the parameters at the start of the fit; optionally saves a checkpoint and crashes at a step."""

    name = "probe"

    def __init__(self, crash_at=None):
        self.crash_at, self.initial, self.checkpoint = crash_at, None, None

    @torchloom.hookimpl
    def on_fit_start(self, model):
        self.initial = [x for p in model.parameters() for x in p.detach().flatten().tolist()]

    @torchloom.hookimpl
    def on_train_step_end(self, progress):
        if progress.global_step == self.crash_at:
            self.checkpoint = torchloom.save_checkpoint()
            raise Crash


def run(label, settings, n=32, grad_accum=None, crash_at=None, ckpt_path=None):
    plugins = {"local_sgd": settings}
    if grad_accum:
        plugins["grad_accum"] = {"steps": grad_accum}
    probe = Probe(crash_at)
    engine = torchloom.Engine(
        plugins=plugins, output_dir=str(out / label), max_epochs=2, log_every_n_steps=1, num_sanity_val_steps=0
    )
    engine.plugins.append(probe)
    task = TinyTask(n=n, batch_size=4, validate=False)
    with contextlib.suppress(Crash):
        engine.fit(task, ckpt_path=ckpt_path)
    model = task.accelerator.unwrap_model(task.model)
    results[label] = {
        "initial": probe.initial,
        "final": [x for p in model.parameters() for x in p.detach().flatten().tolist()],
        "global_step": engine.progress.global_step,
        "checkpoint": probe.checkpoint,
        # the plugin's fp32 global parameters after the fit (DiLoCo; None for plain averaging)
        "outer_params": None
        if (lsgd := next(p for p in engine.plugins if getattr(p, "name", "") == "local_sgd")).outer_params is None
        else [x for g in lsgd.outer_params for x in g.flatten().tolist()],
    }
    return task


nesterov = {"sync_every": 2, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
run("nesterov", nesterov)
run("sgd", {**nesterov, "outer_optimizer": "sgd", "outer_lr": 0.5, "outer_momentum": 0.8})
run("nesterov_ga", nesterov, n=64, grad_accum=2)
run("nesterov_k3", {**nesterov, "sync_every": 3})  # 8 steps: outer steps after 3, 6 and the end of training
run("plain", {"sync_every": 2})
task = run("unit", {"sync_every": 2, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0})
run("cut", nesterov, crash_at=4)
run("resumed", nesterov, ckpt_path=results["cut"]["checkpoint"])

rank = task.accelerator.process_index
(out / f"result-{rank}.json").write_text(json.dumps(results))
torch.distributed.barrier()
