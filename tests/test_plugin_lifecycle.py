"""The plugin lifecycle, stated once (``torchloom.hookspecs``, docs/writing-plugins.md) and relied on: ``setup`` resets
per-fit state; on a resume every stateful plugin's ``load_state_dict`` runs once, after ``on_run_start`` and before
``on_fit_start``, which receives ``resumed``; ``before_backward`` receives the model and declares a summed loss on
``hooks.loss_reduction``; no built-in plugin keeps a "was my state just loaded" flag or a magic outputs key."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.hookspecs import hookimpl
from torchloom.testing import RecordingPlugin, TinyTask, tiny_fit
from torchloom_plugins.early_stopping import EarlyStopping

PLUGINS_DIR = Path(__file__).resolve().parents[1] / "plugins" / "torchloom_plugins"


class StatefulRecorder(RecordingPlugin):
    """A `RecordingPlugin` with state: records ``load_state_dict`` among the hooks, and what ``on_fit_start`` got."""

    name = "lifecycle_recorder"

    def __init__(self) -> None:
        super().__init__()
        self.resumed: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        return {"hooks": len(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._record("load_state_dict")

    @hookimpl
    def on_fit_start(self, progress, resumed) -> None:
        self._record("on_fit_start", progress)
        self.resumed.append(resumed)


def _checkpoint_at(engine: torchloom.Engine, step: int) -> str:
    return next(c for c in list_checkpoints(engine.run_dir) if c.endswith(f"step-{step:08d}"))


def test_a_resume_loads_every_plugin_state_after_on_run_start_and_before_on_fit_start(tmp_path):
    checkpoint = {"checkpoint": {"every_n_steps": 4, "keep_last": None}}
    first = StatefulRecorder()
    engine = tiny_fit([first, checkpoint], max_epochs=1, output_dir=str(tmp_path / "a"))
    assert "load_state_dict" not in first.calls and first.resumed == [None]  # a fresh fit loads nothing

    again = StatefulRecorder()
    resumed = tiny_fit([again, checkpoint], max_epochs=1, output_dir=str(tmp_path / "b"))
    again.records.clear()
    resumed.fit(TinyTask(), ckpt_path=_checkpoint_at(engine, 4))
    calls = again.calls
    assert calls[0] == "setup" and calls.count("load_state_dict") == 1
    between = calls[calls.index("on_run_start") + 1 : calls.index("on_fit_start")]
    assert between == ["load_state_dict"]  # after on_run_start, before on_fit_start, and nothing else there
    assert isinstance(again.resumed[-1], torchloom.Resumed)


class ScriptedTask(TinyTask):
    """TinyTask whose validation pass i logs ``values[i]`` as ``val/loss`` (8 optimizer steps per epoch)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values, self.passes = list(values), 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.log("val/loss", self.values[self.passes])
            self.passes += 1


def test_early_stopping_resumed_by_the_engine_stops_where_the_whole_fit_stops_and_a_next_fit_starts_afresh(tmp_path):
    """Checks at steps 2, 4, ... see 1.0, 0.8 (best), 0.9, 0.85, 0.95: patience 3 stops at step 10. Resumed from
    the checkpoint at step 4 (best 0.8, wait 0), the resumed fit sees the checks from step 6 on and stops at 10 too.
    The same plugin object's next fit, without a checkpoint, starts afresh (a leftover best 0.8 would stop it at 6)."""
    values = [1.0, 0.8, 0.9, 0.85, 0.95, 0.7]
    settings = {"val_check_interval": 2, "max_epochs": 3, "num_sanity_val_steps": 0}
    plugins = lambda stopper: [stopper, {"checkpoint": {"every_n_steps": 4, "keep_last": None}}]  # noqa: E731
    whole_stopper = EarlyStopping(patience=3)
    whole = tiny_fit(plugins(whole_stopper), task=ScriptedTask(values), output_dir=str(tmp_path / "w"), **settings)
    assert whole.progress.global_step == 10
    stopper = EarlyStopping(patience=3)
    engine = torchloom.Engine(
        plugins=plugins(stopper), output_dir=str(tmp_path / "r"), log_every_n_steps=1, default_plugins=False, **settings
    )
    engine.fit(ScriptedTask(values[2:]), ckpt_path=_checkpoint_at(whole, 4))
    assert engine.progress.global_step == 10 and engine.stop_reason == whole.stop_reason
    assert (
        stopper.state_dict()
        == whole_stopper.state_dict()
        == {
            "best": 0.8,
            "best_step": 4,
            "wait": 3,
            "stopped_step": 10,
        }
    )
    engine.fit(ScriptedTask(values))
    assert engine.progress.global_step == 10 and stopper.state_dict() == whole_stopper.state_dict()


class ModelSeer:
    """Records the ``model`` and ``hooks.loss_reduction`` that ``before_backward`` receives."""

    name = "test.model_seer"

    def __init__(self) -> None:
        self.seen: list[tuple[Any, str]] = []

    @hookimpl
    def before_backward(self, model, hooks) -> None:
        self.seen.append((model, hooks.loss_reduction))


class StepWithoutModel:
    """A replacement step written before ``before_backward`` took a model: it does not pass one."""

    name = "test.step_without_model"

    @hookimpl
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks):
        outputs = {"loss": task.training_step(batch, progress.batch_idx)}
        hooks.before_backward(outputs, accelerator, progress)
        accelerator.backward(outputs["loss"])
        if accelerator.sync_gradients:
            hooks.optimizer_step(model, optimizer, scheduler, accelerator, progress)
        outputs["loss"] = outputs["loss"].detach()
        return outputs


def test_before_backward_receives_the_prepared_model(tmp_path):
    seer = ModelSeer()
    engine = tiny_fit([seer], max_epochs=1, output_dir=str(tmp_path / "default"))
    assert len(seer.seen) == 8
    assert all(model is engine._run.model and reduction == "mean" for model, reduction in seer.seen)

    seer = ModelSeer()  # a step that does not pass its model: the hook still gets the fit's
    engine = tiny_fit([seer, StepWithoutModel()], max_epochs=1, output_dir=str(tmp_path / "replaced"))
    assert len(seer.seen) == 8 and all(model is engine._run.model for model, _ in seer.seen)


class TokenTask(TinyTask):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"loss": super().training_step(batch, batch_idx), "num_items": torch.tensor(3.0)}


def test_grad_accum_declares_a_summed_loss_on_the_step_contract(tmp_path):
    class After:
        name = "test.after"
        seen: list[str] = []

        @hookimpl
        def before_backward(self, outputs, hooks) -> None:
            self.seen.append(hooks.loss_reduction)
            assert "loss_reduction" not in outputs

    after = After()
    tiny_fit([{"grad_accum": {"steps": 2, "normalization": "tokens"}}, after], task=TokenTask(), max_epochs=1,
             output_dir=str(tmp_path))  # fmt: skip
    assert after.seen == ["sum"] * 8


# ---------------------------------------------------------------------------------------------- the layer


def _plugin_modules() -> list[tuple[str, ast.Module]]:
    return [(p.name, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(PLUGINS_DIR.glob("*.py"))]


def test_no_plugin_uses_a_loss_reduction_key():
    """The summed loss is declared on `StepHooks.loss_reduction`, never passed as an outputs key."""
    found = []
    for name, tree in _plugin_modules():
        for node in ast.walk(tree):
            keys: list[ast.AST] = []
            if isinstance(node, ast.Subscript):
                keys.append(node.slice)
            elif isinstance(node, ast.Dict):
                keys.extend(k for k in node.keys if k is not None)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if node.func.attr in ("get", "pop", "setdefault", "__getitem__", "__setitem__"):
                    keys.append(node.args[0])
            elif isinstance(node, ast.Compare):
                keys.append(node.left)  # "loss_reduction" in outputs
            found += [f"{name}:{k.lineno}" for k in keys if isinstance(k, ast.Constant) and k.value == "loss_reduction"]
    assert found == []


def test_no_plugin_keeps_a_was_my_state_just_loaded_flag():
    """Plugins rely on the stated order (``setup``, then a resume's ``load_state_dict``, then ``on_fit_start``)."""
    flag = re.compile(r"(^|_)(just_)?loaded$", re.IGNORECASE)
    found = []
    for name, tree in _plugin_modules():
        for node in ast.walk(tree):
            ident = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if ident is not None and flag.search(ident):
                found.append(f"{name}:{node.lineno}: {ident}")
    assert found == []
