"""Issue 7 on 2 processes: a value only the main process logs during validation (a clear error on both ranks,
not a hang), a plugin that replaces the training step keeps grad_clip and local_sgd working, and on_log sees the
same values on every rank. Each rank writes what it saw."""

import json
import sys
from pathlib import Path

import torch
from lsgd_tasks import TwoGroupTask

import torchloom
from torchloom.testing import TinyTask, tiny_fit

out = Path(sys.argv[1])
results = {}


class MainOnlyValidationLog(TinyTask):
    """Only the main process logs during validation; rank 1 logs nothing at all there (it used to skip the
    reduction that rank 0 waited in: a hang)."""

    def validation_step(self, batch, batch_idx):
        if self.accelerator.is_main_process:
            self.log("val/main_only", 1.0)


try:
    tiny_fit(task=MainOnlyValidationLog(n=16, batch_size=4), output_dir=str(out / "main_only"))
    results["main_only_error"] = None
except torchloom.TaskError as exc:
    results["main_only_error"] = str(exc)


class ReplacingStep(torchloom.Plugin):
    """Replaces the default step (as a SAM or GAN step does) and fires the step hooks through ``hooks``."""

    name = "test_replacing_step"

    def __init__(self):
        super().__init__()
        self.steps = 0

    @torchloom.hookimpl
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks):
        outputs = {"loss": task.training_step(batch, progress.batch_idx)}
        hooks.before_backward(outputs, accelerator, progress)
        accelerator.backward(outputs["loss"])
        hooks.before_optimizer_step(model, optimizer, accelerator, progress)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        hooks.after_optimizer_step(model, optimizer, scheduler, accelerator, progress)
        self.steps += 1
        return {"loss": outputs["loss"].detach()}


class GradNormProbe(torchloom.Plugin):
    """Records the gradient norm right before the optimizer step (after grad_clip, listed before it)."""

    name = "test_grad_norm_probe"

    def __init__(self):
        super().__init__()
        self.norms, self.logged = [], []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    @torchloom.hookimpl
    def on_log(self, metrics):
        self.logged.append(dict(metrics))


step, probe = ReplacingStep(), GradNormProbe()
plugins = [step, {"grad_clip": {"max_norm": 0.01}}, {"local_sgd": {"sync_every": 2}}, probe]
engine = tiny_fit(plugins, task=(task := TwoGroupTask(16)), output_dir=str(out / "replaced"))
lsgd = engine.plugins[2]
results["replaced"] = {
    "steps": step.steps,
    "norms": probe.norms,
    "grad_norm_logged": [h.get("grad_norm") for h in engine.history],
    "num_averages": lsgd.num_averages,
    "params": [p.detach().flatten().tolist() for p in task.accelerator.unwrap_model(task.model).parameters()],
    "on_log": probe.logged,
}
acc = task.accelerator
results["rank"] = acc.process_index
(out / f"result-{acc.process_index}.json").write_text(json.dumps(results))
