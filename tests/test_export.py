"""From a checkpoint to a model (issue 29, item 4): ``torchloom export CHECKPOINT OUT`` and `Engine.export` write the
folder a fit with ``save_model: true`` would have written had it ended at the checkpoint: ``model.safetensors`` for a
plain module, an ordinary transformers folder for a transformers model, the adapter in peft's format (``--merge``:
and the merged model) for an adapter checkpoint, each with its model card; a checkpoint whose files do not match its
manifest is refused, with one line naming it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import torchloom
from cli_util import run_cli
from torchloom.checkpoint.store import list_checkpoints
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

TASK = """
import torch
from torchloom.testing import TinyTask


class Regression(TinyTask):
    pass
"""


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A 2-epoch fit of a plain module through the command, with its model saved and every checkpoint kept."""
    root = tmp_path_factory.mktemp("project")
    (root / "regression.py").write_text(TASK)
    config = {
        "engine": {"max_epochs": 2, "output_dir": "runs", "save_model": True},
        "task": {"class_path": "regression.Regression"},
        "plugins": {"checkpoint": {"every_n_steps": 4, "keep_last": None}},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("fit", "--config", "run.yaml", cwd=root)
    assert done.returncode == 0, done.stderr
    return root


def test_export_writes_the_checkpoints_weights_as_safetensors_with_the_model_card(project, tmp_path) -> None:
    checkpoints = list_checkpoints(project / "runs" / "version_0")
    last = checkpoints[-1]  # the end of the fit: what model/ holds
    done = run_cli("export", last, str(tmp_path / "out"), cwd=project)
    assert done.returncode == 0, done.stderr
    assert f"torchloom export: model of checkpoint {last} in {tmp_path / 'out'}" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "torchloom_model.json"]
    fit_model = load_file(str(project / "runs" / "version_0" / "model" / "model.safetensors"))
    assert _same(load_file(str(tmp_path / "out" / "model.safetensors")), fit_model)
    card = json.loads((tmp_path / "out" / "torchloom_model.json").read_text())
    assert card["exported_from"] == last and card["global_step"] == 16
    assert card["config"]["task"]["class_path"] == "regression.Regression"
    # An earlier checkpoint: its own weights, those of accelerate/model.safetensors.
    first = checkpoints[0]
    assert run_cli("export", first, "early", cwd=project).returncode == 0
    assert _same(
        load_file(str(project / "early" / "model.safetensors")),
        load_file(str(Path(first) / "accelerate" / "model.safetensors")),
    )
    assert json.loads((project / "early" / "torchloom_model.json").read_text())["global_step"] == 4


def test_export_refuses_a_checkpoint_that_does_not_verify_and_bad_paths_in_one_line(project, tmp_path) -> None:
    checkpoint = tmp_path / "version_0" / "checkpoints" / "step-00000004"
    shutil.copytree(project / "runs" / "version_0" / "checkpoints" / "step-00000004", checkpoint)
    shutil.copy(project / "runs" / "version_0" / "config.yaml", tmp_path / "version_0" / "config.yaml")
    with open(checkpoint / "accelerate" / "model.safetensors", "ab") as f:
        f.write(b"x")
    cases = [
        ((str(checkpoint), "out"), "accelerate/model.safetensors changed since the checkpoint was written"),
        (("nowhere", "out"), "export: checkpoint 'nowhere': no such file or directory; expected a checkpoint"),
        (("runs/version_0", "out"), "export: 'runs/version_0' is not a checkpoint: it has no manifest.json"),
        ((list_checkpoints(project / "runs")[0], "runs"), "export: OUT 'runs' exists; expected a new (or empty)"),
        ((list_checkpoints(project / "runs")[0], "out", "--merge"), "export: --merge merges an adapter into its base"),
        ((list_checkpoints(project / "runs")[0], "out", "--config", "no.yaml"), "export: --config 'no.yaml': no such"),
    ]
    for args, message in cases:
        done = run_cli("export", *args, cwd=project)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
        assert not (project / "out").exists()


@pytest.mark.slow
def test_an_adapter_checkpoint_exports_the_adapter_and_with_merge_the_merged_transformers_model(tmp_path) -> None:
    pytest.importorskip("peft")
    from peft_fit import LORA, LoraTask

    settings = {**LORA, "lora_dropout": 0.0, "merge": True}
    engine = torchloom.Engine(
        max_epochs=1, output_dir=str(tmp_path / "runs"), save_model=True, plugins={"peft": settings, "checkpoint": {}}
    )
    engine.fit(LoraTask(lr=5e-2))
    (checkpoint,) = list_checkpoints(engine.run_dir)
    exporter = torchloom.Engine(output_dir=str(tmp_path / "runs"), plugins={"peft": settings})
    out = exporter.export(LoraTask(lr=5e-2), checkpoint, tmp_path / "out")
    model = Path(engine.run_dir) / "model"
    names = ["adapter_config.json", "adapter_model.safetensors", "merged", "torchloom_model.json"]
    assert sorted(p.name for p in Path(out).iterdir()) == names
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        assert _same(load_file(str(Path(out) / name)), load_file(str(model / name))), name
    assert (Path(out) / "merged" / "config.json").is_file()  # an ordinary transformers folder
    # Without the peft plugin the checkpoint does not fit: one CheckpointError naming the adapter.
    with pytest.raises(torchloom.CheckpointError, match="the checkpoint holds an adapter"):
        torchloom.Engine(output_dir=str(tmp_path / "runs")).export(LoraTask(), checkpoint, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


class _Watching(torchloom.Plugin):
    """Records what ``setup`` and ``configure_model`` of an export are given."""

    name = "watching"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    @torchloom.hookimpl
    def setup(self, config, stage) -> None:
        self.seen.append(("setup", config.max_epochs, stage))

    @torchloom.hookimpl
    def configure_model(self, model, task) -> None:
        self.seen.append(("configure_model", type(task).__name__))

    @torchloom.hookimpl
    def teardown(self, accelerator, stage) -> None:
        self.seen.append(("teardown", accelerator is not None, stage))


def test_engine_export_into_an_empty_folder_with_the_runs_config_and_the_plugins_told_it_is_predict(
    project, tmp_path
) -> None:
    """`Engine.export` in this process: an existing empty OUT is written, the model card's config is the checkpoint
    run's ``config.yaml`` (not the exporting engine's), and the plugins' ``setup`` sees the engine's config and
    the ``predict`` stage, their ``configure_model`` the task, their ``teardown`` the accelerator and the stage."""
    from torchloom.testing import TinyTask

    last = list_checkpoints(project / "runs" / "version_0")[-1]
    watching = _Watching()
    (tmp_path / "out").mkdir()
    engine = torchloom.Engine(max_epochs=3, output_dir=str(tmp_path / "runs"), plugins=[watching])
    out = engine.export(TinyTask(), last, tmp_path / "out")
    assert out == str(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "torchloom_model.json"]
    card = json.loads((tmp_path / "out" / "torchloom_model.json").read_text())
    assert card["config"]["task"]["class_path"] == "regression.Regression"
    manifest = json.loads((Path(last) / "manifest.json").read_text())
    assert manifest["metrics"] and card["metrics"] == manifest["metrics"] and card["epoch"] == manifest["epoch"] == 1
    assert watching.seen == [("setup", 3, "predict"), ("configure_model", "TinyTask"), ("teardown", True, "predict")]
    # A checkpoint away from its run directory (no config.yaml two levels up): the engine's run_config.
    alone = tmp_path / "copied" / "step"
    shutil.copytree(last, alone)
    engine.export(TinyTask(), alone, tmp_path / "out2")
    assert json.loads((tmp_path / "out2" / "torchloom_model.json").read_text())["config"] == engine.run_config


def test_engine_export_refuses_a_missing_checkpoint_or_a_folder_without_a_manifest_naming_it(project, tmp_path):
    from torchloom.testing import TinyTask

    engine = torchloom.Engine(output_dir=str(tmp_path / "runs"))
    missing = str(tmp_path / "nowhere")
    with pytest.raises(torchloom.ConfigError, match=f"export: checkpoint '{missing}': no such file or directory"):
        engine.export(TinyTask(), missing, tmp_path / "out")
    run_dir = str(project / "runs" / "version_0")
    with pytest.raises(torchloom.CheckpointError, match=f"export: '{run_dir}' is not a checkpoint: it has no manifest"):
        engine.export(TinyTask(), run_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
