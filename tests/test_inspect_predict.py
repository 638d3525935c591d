"""The end of a fit's export, and what reads it back: the model card next to the saved model, plain transformers
loading the export without torchloom, tied weights kept, ``torchloom.inspect_path`` / ``torchloom inspect`` on a
checkpoint, a run directory and an exported model, and ``predict`` with a checkpoint's or an export's weights."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from cli_util import run_cli  # the torchloom command, in this process
from torchloom.checkpoint.store import list_checkpoints, read_manifest
from torchloom.testing import TinyTask, tiny_dataset, tiny_fit

CARD = "torchloom_model.json"


class SaveAt:
    """Saves a checkpoint after optimizer step ``step`` (``path``: where)."""

    name = "save_at"

    def __init__(self, step: int = 2) -> None:
        self.step, self.path = step, None

    @torchloom.hookimpl
    def on_train_step_end(self, progress):
        if progress.global_step == self.step:
            self.path = torchloom.save_checkpoint()


class FrozenBiasTask(TinyTask):
    """TinyTask (``Linear(4, 1)``: 5 parameters) with its bias frozen: 4 trainable; predicts ``model(x)``."""

    def configure_model(self) -> torch.nn.Module:
        model = super().configure_model()
        model.bias.requires_grad_(False)
        return model

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def predict_data(n: int = 6, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(tiny_dataset(n, seed=5).tensors[0]), batch_size=batch_size)


def linear_outputs(weights: dict[str, torch.Tensor], batch_size: int = 4) -> torch.Tensor:
    """What ``Linear(4, 1)`` with ``weights`` returns on `predict_data`, batch by batch."""
    return torch.cat(
        [torch.nn.functional.linear(x, weights["weight"], weights["bias"]) for (x,) in predict_data(batch_size=4)]
    )


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def header_totals(files: list[Path]) -> dict[str, dict[str, int]]:
    """Per dtype: tensors, elements and bytes (numel * element_size), read with safetensors' own reader."""
    totals: dict[str, dict[str, int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensor = f.get_tensor(key)
                row = totals.setdefault(
                    str(tensor.dtype).removeprefix("torch."), dict.fromkeys(("tensors", "elements", "bytes"), 0)
                )
                row["tensors"] += 1
                row["elements"] += tensor.numel()
                row["bytes"] += tensor.numel() * tensor.element_size()
    return totals


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> dict[str, Any]:
    """One fit (2 epochs of 8 steps, grad_clip with a setting, a checkpoint at step 2, the model saved)."""
    out = tmp_path_factory.mktemp("fit") / "run"
    save_at, task = SaveAt(), FrozenBiasTask()
    engine = tiny_fit(
        [{"grad_clip": {"max_norm": 5.0}}, save_at], task=task, output_dir=str(out), save_model=True, max_epochs=2
    )
    run_dir = Path(engine.run_dir)
    final = {k: v.detach().clone() for k, v in task.accelerator.unwrap_model(task.model).state_dict().items()}
    return {"engine": engine, "run_dir": run_dir, "checkpoint": Path(save_at.path), "final": final, "out": out}


# ----------------------------------------------------------------------------------------------- the card


def test_the_model_card_records_the_config_plugins_final_metrics_step_model_and_versions(fitted):
    engine, run_dir = fitted["engine"], fitted["run_dir"]
    card = json.loads((run_dir / "model" / CARD).read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert card["config"] == config  # the resolved run config, as config.yaml holds it
    assert (
        card["plugins"]
        == config["plugins"]
        == {"grad_clip": {"max_norm": 5.0, "norm_type": 2.0, "clip_value": None}, "save_at": None}
    )
    assert card["metrics"] == engine.logged_metrics  # what fit returned
    assert set(card["metrics"]) == {"train/loss", "val/loss", "grad_norm"}
    assert (card["global_step"], card["epoch"]) == (engine.progress.global_step, engine.progress.epoch) == (16, 1)
    model = card["model"]
    assert model["class"] == "torch.nn.modules.linear.Linear"
    assert (model["parameters"], model["trainable_parameters"]) == (5, 4)  # the bias is frozen
    assert model["parameter_dtypes"] == {"float32": 5}
    assert card["libraries"]["torchloom"] == torchloom.__version__
    for name in ("torch", "accelerate", "safetensors", "huggingface_hub"):
        assert card["libraries"][name] == metadata.version(name)
    assert not list((run_dir / "model").glob(".*"))  # written through a temporary file, renamed into place


def test_saving_the_model_again_removes_the_card_that_described_the_old_weights(tmp_path):
    task = TinyTask()
    tiny_fit(task=task, output_dir=str(tmp_path), save_model=True, max_epochs=1)
    directory = tmp_path / "version_0" / "model"
    assert (directory / CARD).is_file()
    task.save_model(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors"]


class Tied(torch.nn.Module):
    """Two attributes that hold one Parameter: ``out.weight is embed.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.embed(ids))))


class TiedTask(torchloom.TaskModule):
    def configure_model(self) -> torch.nn.Module:
        return Tied()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return torch.nn.functional.cross_entropy(self.model(ids[:, :-1]).reshape(-1, 10), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(0, 10, (16, 5), generator=torch.Generator().manual_seed(0))), 4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(10).reshape(2, 5)), 2)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def test_a_plain_module_with_tied_weights_exports_them_once_and_reloads_them_tied(tmp_path):
    save_at, task = SaveAt(step=3), TiedTask()
    engine = tiny_fit([save_at], task=task, output_dir=str(tmp_path / "run"), save_model=True, max_epochs=2)
    model = task.accelerator.unwrap_model(task.model)
    directory = Path(engine.run_dir) / "model"
    stored = load_file(str(directory / "model.safetensors"))
    assert len(stored) == 3  # embed/out weight once, mid.weight, mid.bias
    unique = sum(p.numel() for p in model.parameters())  # 40 + 16 + 4: the shared Parameter once
    assert unique == 60 and sum(v.numel() for v in model.state_dict().values()) == 100

    reloaded = torchloom.TaskModule.load_model(Tied(), directory)
    assert reloaded.out.weight is reloaded.embed.weight
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name

    card = json.loads((directory / CARD).read_text())
    assert card["model"]["parameters"] == card["model"]["trainable_parameters"] == unique
    info = torchloom.inspect_path(directory)
    assert info["parameters"] == {"total": unique, "trainable": unique}
    assert info["weights"]["elements"] == unique  # no buffers: the file holds exactly the parameters, the tie once
    assert info["weights"]["bytes"] == unique * 4

    # predict from the checkpoint (Accelerate stores the tie once too): the tie survives the load
    checkpoint_weights = load_file(str(Path(save_at.path) / "accelerate" / "model.safetensors"))
    assert len(checkpoint_weights) == 3
    target = TiedTask()
    predictions = torchloom.Engine(output_dir=str(tmp_path / "predict")).predict(target, ckpt_path=save_at.path)
    loaded = target.accelerator.unwrap_model(target.model)
    assert loaded.out.weight is loaded.embed.weight
    expected = Tied()
    expected.load_state_dict(checkpoint_weights, strict=False)  # embed.weight fills out.weight too (one Parameter)
    with torch.no_grad():
        assert torch.equal(torch.cat(predictions), expected(torch.arange(10).reshape(2, 5)))


# ------------------------------------------------------------------------------------ transformers export

TINY_BERT = {
    "vocab_size": 30,
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "max_position_embeddings": 16,
    "num_labels": 3,
}


class BertTask(torchloom.TaskModule):
    def configure_model(self) -> torch.nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(**TINY_BERT))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 30, (12, 7), generator=g)
        labels = torch.randint(0, 3, (12,), generator=g)
        rows = [
            {"input_ids": ids[i], "attention_mask": torch.ones(7, dtype=torch.long), "labels": labels[i]}
            for i in range(12)
        ]
        return DataLoader(rows, batch_size=4)


LOAD_WITHOUT_TORCHLOOM = r"""
import importlib.abc, json, sys

class NoTorchloom(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchloom" or name.startswith(("torchloom.", "torchloom_")):
            raise ImportError(f"{name} is hidden in this process")
        return None

sys.meta_path.insert(0, NoTorchloom())
try:
    import torchloom
except ImportError:
    torchloom_importable = False
else:
    torchloom_importable = True

import torch
from transformers import AutoModelForSequenceClassification

model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
print(json.dumps({
    "torchloom_importable": torchloom_importable,
    "torchloom_modules": sorted(m for m in sys.modules if m.startswith("torchloom")),
    "class": type(model).__name__,
    "logits": logits.tolist(),
}))
"""


def test_a_transformers_export_loads_with_plain_transformers_where_torchloom_cannot_be_imported(tmp_path):
    task = BertTask()
    engine = tiny_fit(task=task, output_dir=str(tmp_path / "run"), save_model=True, max_epochs=2)
    directory = Path(engine.run_dir) / "model"
    assert (directory / "config.json").is_file() and (directory / CARD).is_file()
    model = task.accelerator.unwrap_model(task.model).eval()
    ids = torch.randint(1, 30, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_TORCHLOOM, str(directory), json.dumps(ids.tolist())],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["torchloom_importable"] is False and loaded["torchloom_modules"] == []
    assert loaded["class"] == "BertForSequenceClassification"
    torch.testing.assert_close(torch.tensor(loaded["logits"]), expected, rtol=0, atol=1e-6)

    info = torchloom.inspect_path(directory)
    assert info["kind"] == "model"
    assert info["model_class"] == "transformers.models.bert.modeling_bert.BertForSequenceClassification"
    total = sum(p.numel() for p in model.parameters())
    assert info["parameters"] == {"total": total, "trainable": total}
    assert info["weights"]["dtypes"] == header_totals([directory / "model.safetensors"])
    assert info["global_step"] == engine.progress.global_step == 6

    # saved by transformers without a card: the class from config.json, the parameter count unknown
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    info = torchloom.inspect_path(bare)
    assert info["model_class"] == "BertForSequenceClassification"
    assert info["parameters"] == {"total": None, "trainable": None}
    assert info["weights"]["dtypes"] == header_totals([bare / "model.safetensors"])


# ------------------------------------------------------------------------------------------------ inspect


def test_inspect_a_checkpoint_reads_its_manifest_and_weights_header(fitted):
    checkpoint = fitted["checkpoint"]
    info = torchloom.inspect_path(checkpoint)
    manifest = read_manifest(checkpoint)
    weights = load_file(str(checkpoint / "accelerate" / "model.safetensors"))
    assert info["kind"] == "checkpoint" and info["path"] == str(checkpoint)
    assert info["model_class"] == "torch.nn.modules.linear.Linear"
    assert (
        info["parameters"]
        == {"total": sum(v.numel() for v in weights.values()), "trainable": 4}
        == {"total": 5, "trainable": 4}
    )
    assert info["weights"]["files"] == ["accelerate/model.safetensors"]
    assert info["weights"]["bytes"] == sum(v.numel() * v.element_size() for v in weights.values()) == 20
    assert info["weights"]["dtypes"] == header_totals([checkpoint / "accelerate" / "model.safetensors"])
    assert (info["global_step"], info["epoch"]) == (2, 0)
    assert info["metrics"] == manifest["metrics"] and set(info["metrics"]) == {"train/loss", "grad_norm"}
    assert info["plugins"] == {"grad_clip": {"max_norm": 5.0, "norm_type": 2.0, "clip_value": None}, "save_at": None}
    assert info["stateful_plugins"] == []
    assert info["size_bytes"] == sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())


def test_inspect_a_run_directory_lists_its_checkpoints_and_final_values(fitted):
    engine, run_dir = fitted["engine"], fitted["run_dir"]
    info = torchloom.inspect_path(run_dir)
    assert info["kind"] == "run"
    assert [c["path"] for c in info["checkpoints"]] == list_checkpoints(run_dir) == [str(fitted["checkpoint"])]
    assert [(c["global_step"], c["epoch"]) for c in info["checkpoints"]] == [(2, 0)]
    assert info["model_dir"] == info["weights_from"] == str(run_dir / "model")
    assert info["metrics"] == engine.logged_metrics  # the latest value of each name in metrics.jsonl
    assert (info["global_step"], info["epoch"]) == (16, 1)
    assert info["parameters"] == {"total": 5, "trainable": 4}
    assert info["plugins"] == yaml.safe_load((run_dir / "config.yaml").read_text())["plugins"]


def test_inspect_one_safetensors_file_and_the_errors(fitted, tmp_path):
    file = fitted["run_dir"] / "model" / "model.safetensors"
    info = torchloom.inspect_path(file)
    assert info["kind"] == "model" and info["parameters"] == {"total": None, "trainable": None}
    assert info["weights"]["elements"] == 5 and info["weights"]["files"] == ["model.safetensors"]
    with pytest.raises(torchloom.ConfigError, match="no such file or directory"):
        torchloom.inspect_path(tmp_path / "missing")
    with pytest.raises(torchloom.ConfigError, match=r"it holds runs \(version_0\): inspect one"):
        torchloom.inspect_path(fitted["out"])
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(file.read_bytes()[:-4])
    with pytest.raises(torchloom.ConfigError, match="is truncated"):
        torchloom.inspect_path(truncated)


# ------------------------------------------------------------------------------------------------ predict


def test_predict_with_a_checkpoint_an_export_a_run_directory_or_an_output_dir(fitted, tmp_path):
    checkpoint, run_dir = fitted["checkpoint"], fitted["run_dir"]
    at_step_2 = load_file(str(checkpoint / "accelerate" / "model.safetensors"))
    final = fitted["final"]
    assert not torch.equal(at_step_2["weight"], final["weight"])
    cases = [
        (checkpoint, "checkpoint", checkpoint, at_step_2),
        (run_dir / "model", "model", run_dir / "model", final),
        (run_dir, "model", run_dir / "model", final),  # a run directory: its saved model, the final weights
        (fitted["out"], "checkpoint", checkpoint, at_step_2),  # an output_dir: its latest checkpoint
    ]
    for i, (path, kind, loaded, weights) in enumerate(cases):
        engine = torchloom.Engine(output_dir=str(tmp_path / "predict"))
        predictions = engine.predict(FrozenBiasTask(), predict_data(), ckpt_path=path)
        assert engine.weights_from == (kind, str(loaded)), path
        expected = linear_outputs(weights)
        torch.testing.assert_close(torch.cat(predictions), expected, rtol=0, atol=0)
        rows = jsonl(Path(engine.run_dir) / "predictions.jsonl")
        assert [row["prediction"] for row in rows] == expected.tolist()
        assert Path(engine.run_dir).name == f"version_{i}"


def test_predict_refuses_a_changed_checkpoint_or_weights_that_do_not_fit_and_leaves_no_run_dir(fitted, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(fitted["checkpoint"], copy)
    (copy / "accelerate" / "custom_checkpoint_0.pkl").write_bytes(b"planted")
    out = tmp_path / "predict"
    with pytest.raises(torchloom.CheckpointError, match="holds files its manifest does not list"):
        torchloom.Engine(output_dir=str(out)).predict(FrozenBiasTask(), predict_data(), ckpt_path=copy)
    (copy / "accelerate" / "custom_checkpoint_0.pkl").unlink()
    with pytest.raises(torchloom.CheckpointError, match=r"do not fit Linear: .*size mismatch for weight"):
        torchloom.Engine(output_dir=str(out)).predict(FrozenBiasTask(in_features=3), predict_data(), ckpt_path=copy)
    with pytest.raises(torchloom.ConfigError, match="cannot be loaded into Linear"):
        torchloom.Engine(output_dir=str(out)).predict(
            FrozenBiasTask(in_features=3), predict_data(), ckpt_path=fitted["run_dir"] / "model"
        )
    with pytest.raises(torchloom.ConfigError, match="no such file or directory"):
        torchloom.Engine(output_dir=str(out)).predict(FrozenBiasTask(), predict_data(), ckpt_path=tmp_path / "nope")
    assert not list(out.glob("version_*"))  # a failed load removes the predict's run directory


def test_predict_reads_checkpoint_weights_saved_with_a_wrapper_prefix(fitted, tmp_path):
    """Keys under ``module.`` (a DDP wrapper's state_dict) load into the plain model."""
    copy = tmp_path / "ckpt"
    shutil.copytree(fitted["checkpoint"], copy)
    file = copy / "accelerate" / "model.safetensors"
    weights = load_file(str(file))
    save_file({f"module.{k}": v for k, v in weights.items()}, str(file), metadata={"format": "pt"})
    manifest = json.loads((copy / "manifest.json").read_text())
    data = file.read_bytes()
    manifest["files"]["accelerate/model.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    predictions = torchloom.Engine(output_dir=str(tmp_path / "p")).predict(
        FrozenBiasTask(), predict_data(), ckpt_path=copy
    )
    torch.testing.assert_close(torch.cat(predictions), linear_outputs(weights), rtol=0, atol=0)


# --------------------------------------------------------------------- a wrong path or a damaged weights file


def damaged(good: bytes, kind: str) -> bytes:
    """``good`` (a safetensors file) made into a file that is not one, or a damaged one, of ``kind``."""
    (length,) = struct.unpack("<Q", good[:8])
    header = good[8 : 8 + length]
    return {
        "text": b"hello, these are not weights\n",
        "json": json.dumps({"weight": [[1.0, 2.0, 3.0, 4.0]], "bias": [0.0]}).encode(),
        "pickle": b"\x80\x04\x95" + bytes(40),
        "short": b"\x01\x02",
        "bad json": good[:9] + b"x" + good[10:],
        "bad entry": good[:8] + header.replace(b'"dtype"', b'"dtyp_"') + good[8 + length :],
        "header cut": good[: 8 + length // 2],
        "data cut": good[:-4],
    }[kind]


#: kind -> what the message says (a regular expression).
DAMAGE = {
    "text": r"is not a safetensors file: it starts with b'hello, these are', not with a header length and a JSON "
    r"header \(a safetensors file is an 8-byte header length, a JSON header \(\{\.\.\.\}\), then the tensor data\)",
    "json": r"is not a safetensors file: it starts with b'\{\"weight\": \[\[1\.0', not with a header length",
    "pickle": r"is not a safetensors file: it starts with b'\\x80\\x04\\x95\\x00",
    "short": r"is not a safetensors file: it holds 2 bytes, too few for a header",
    "bad json": r"has a damaged safetensors header: its \d+-byte JSON header does not parse \(Expecting .* at byte 9\)",
    "bad entry": r"has a damaged safetensors header: tensor '(weight|bias)' is \{.*\}; expected \{\"dtype\": \.\.\.",
    "header cut": r"is truncated or its header is damaged: the header length says \d+ bytes, but the file holds \d+",
    "data cut": r"is truncated: its tensors end at byte \d+, the file at \d+",
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_weights_file_is_named_with_what_is_wrong_by_every_reader(fitted, tmp_path, kind):
    """inspect, predict and TaskModule.load_model read the header first: a file that is no safetensors is told so
    (not "its header claims 8031924123371070824 bytes", nor the loader's advice to unpickle it with safe=False)."""
    good = (fitted["run_dir"] / "model" / "model.safetensors").read_bytes()
    file = tmp_path / "model" / "model.safetensors"
    file.parent.mkdir()
    file.write_bytes(damaged(good, kind))
    for path in (file, file.parent):
        shown = re.escape(repr(str(file)))
        with pytest.raises(torchloom.ConfigError, match=f"^{shown} {DAMAGE[kind]}") as raised:
            torchloom.inspect_path(path)
        messages = [str(raised.value)]
        with pytest.raises(torchloom.ConfigError, match=f"^{shown} {DAMAGE[kind]}") as raised:
            torchloom.TaskModule.load_model(torch.nn.Linear(4, 1), path)
        messages.append(str(raised.value))
        predict = f"^predict: ckpt_path {re.escape(repr(str(path)))}: {shown} {DAMAGE[kind]}"
        with pytest.raises(torchloom.ConfigError, match=predict) as raised:
            torchloom.Engine(output_dir=str(tmp_path / "p")).predict(FrozenBiasTask(), predict_data(), ckpt_path=path)
        messages.append(str(raised.value))
        for message in messages:
            assert "claims" not in message and "safe=False" not in message and "pickle" not in message, message
    assert not (tmp_path / "p").exists()


def test_each_command_says_what_its_path_should_be(fitted, tmp_path):
    """predict's ckpt_path, fit's resume and inspect each name themselves and what the path may be; predict never
    says "cannot resume" nor advises the checkpoint plugin, fit says why weights alone do not resume."""
    notes, empty, missing = tmp_path / "notes.txt", tmp_path / "empty", tmp_path / "missing"
    notes.write_text("not weights\n")
    empty.mkdir()
    weights = (
        "expected a checkpoint (a directory with manifest.json), an exported model (a directory with "
        "model.safetensors or model.safetensors.index.json, or one .safetensors file, or an adapter folder with "
        "adapter_config.json and adapter_model.safetensors), a run directory (version_N, with model/ or checkpoints/), "
        "an output_dir whose runs have a checkpoint, or 'last' / 'best' (the latest / the best-scoring checkpoint of "
        "the engine's output_dir)"
    )
    for path, problem in [
        (notes, " is a file that holds no weights predict reads"),
        (empty, " is a directory that holds no weights predict reads"),
        (missing, ": no such file or directory"),
    ]:
        with pytest.raises(torchloom.TorchloomError) as raised:
            torchloom.Engine(output_dir=str(tmp_path / "p")).predict(FrozenBiasTask(), predict_data(), ckpt_path=path)
        assert str(raised.value) == f"predict: ckpt_path {str(path)!r}{problem}; {weights}"
    checkpoints = (
        "expected a checkpoint (a directory with manifest.json, as <run_dir>/checkpoints/step-00000040), a run "
        "directory or an output_dir whose runs have one"
    )
    run_dir = tmp_path / "version_0"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    for path, problem in [
        (notes, "it is a file, not a checkpoint directory"),
        (empty, "the directory holds no complete checkpoint, nor runs that have one"),
        (missing, "no such file or directory"),
        (run_dir, "the run directory has no complete checkpoint (the 'checkpoint' plugin writes checkpoints/)"),
    ]:
        with pytest.raises(torchloom.CheckpointError) as raised:
            torchloom.Engine(output_dir=str(tmp_path / "f")).fit(FrozenBiasTask(), ckpt_path=path)
        assert str(raised.value) == f"cannot resume from {str(path)!r}: {problem}; {checkpoints}"
    for path in (fitted["run_dir"] / "model", fitted["run_dir"] / "model" / "model.safetensors"):
        with pytest.raises(torchloom.CheckpointError) as raised:
            torchloom.Engine(output_dir=str(tmp_path / "f")).fit(FrozenBiasTask(), ckpt_path=path)
        assert str(raised.value) == (
            f"cannot resume from {str(path)!r}: it holds weights only (an exported model or a .safetensors file), "
            f"and a resume also needs the optimizer, the counters and the data position; {checkpoints}. To start a "
            "new fit from these weights, load them in configure_model (TaskModule.load_model)"
        )
    with pytest.raises(torchloom.ConfigError, match=r"^inspect: '.*notes\.txt' is not a checkpoint \(manifest"):
        torchloom.inspect_path(notes)
    assert not (tmp_path / "p").exists() and not (tmp_path / "f").exists()


@pytest.mark.multiprocess
def test_predict_on_one_process_from_a_checkpoint_two_ddp_processes_wrote(tmp_path):
    from torchrun_util import torchrun

    ranks = torchrun("predict_ckpt_ddp.py", tmp_path)
    assert [r["wrapped"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert ranks[0]["checkpoint"] == ranks[1]["checkpoint"] and ranks[0]["weights"] == ranks[1]["weights"]
    checkpoint = Path(ranks[0]["checkpoint"])
    assert read_manifest(checkpoint)["world_size"] == 2
    engine = torchloom.Engine(output_dir=str(tmp_path / "predict"))
    predictions = engine.predict(FrozenBiasTask(), predict_data(), ckpt_path=checkpoint)
    trained = {k: torch.tensor(v) for k, v in ranks[0]["weights"].items()}
    torch.testing.assert_close(torch.cat(predictions), linear_outputs(trained), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ the CLI

TASK_MODULE = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchloom.testing import TinyTask, tiny_dataset


class Regression(TinyTask):
    """TinyTask with plain-typed settings and prediction data: 6 samples in batches of 4."""

    def __init__(self, lr: float = 0.1, batch_size: int = 4, n: int = 32):
        super().__init__(n=n, batch_size=batch_size, lr=lr)

    def predict_dataloader(self):
        return DataLoader(TensorDataset(tiny_dataset(6, seed=5).tensors[0]), batch_size=4)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> dict[str, Any]:
    """A project whose ``torchloom fit --engine.save_model=true`` wrote run/version_0 (model, card, summary), and a
    checkpoint at step 2 written from Python into run/version_1 (the same architecture)."""
    root = tmp_path_factory.mktemp("project")
    (root / "regression.py").write_text(TASK_MODULE)
    config = {
        "engine": {"max_epochs": 2, "log_every_n_steps": 2, "output_dir": "run"},
        "task": {"class_path": "regression.Regression", "init_args": {"lr": 0.05}},
        "plugins": {"grad_clip": {"max_norm": 5.0}},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_cli("fit", "--config", "config.yaml", "--engine.save_model=true", cwd=root)
    assert proc.returncode == 0, proc.stderr
    save_at = SaveAt()
    tiny_fit([save_at], output_dir=str(root / "run"), max_epochs=1)
    return {"root": root, "checkpoint": Path(save_at.path).relative_to(root)}


def test_the_inspect_command_describes_a_run_directory_in_text_and_json(project):
    root = project["root"]
    text = run_cli("inspect", "run/version_0", cwd=root)
    assert text.returncode == 0, text.stderr
    summary = json.loads((root / "run" / "version_0" / "summary.json").read_text())
    last = {name: entry["last"] for name, entry in summary["metrics"].items()}
    lines = text.stdout.splitlines()
    assert lines[:5] == [
        "run           run/version_0",
        "model class   torch.nn.modules.linear.Linear",
        "parameters    5 (5 trainable)",
        "weights       2 tensors, 5 elements, 20 bytes in run/version_0/model",
        "  float32     2 tensors, 5 elements, 20 bytes",
    ]
    assert "step          16 (epoch 1)" in lines
    assert 'plugins       grad_clip {"max_norm": 5.0, "norm_type": 2.0, "clip_value": null}' in lines
    assert f"metrics       grad_norm = {last['grad_norm']:.6g}" in lines
    assert "checkpoints   (none)" in lines and "model dir     run/version_0/model" in lines

    proc = run_cli("inspect", "run/version_0", "--json", cwd=root)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info == torchloom.inspect_path(root / "run" / "version_0") | {
        "path": "run/version_0",
        "weights_from": "run/version_0/model",
        "model_dir": "run/version_0/model",
    }
    assert info["metrics"] == last
    assert info["plugins"] == {
        "grad_clip": {"max_norm": 5.0, "norm_type": 2.0, "clip_value": None},
        "progress": info["plugins"]["progress"],
    }
    card = json.loads((root / "run" / "version_0" / "model" / CARD).read_text())
    assert card["config"] == yaml.safe_load((root / "run" / "version_0" / "config.yaml").read_text())
    assert card["config"]["task"]["init_args"] == {"lr": 0.05, "batch_size": 4, "n": 32}


def test_the_inspect_command_describes_a_checkpoint_and_reports_a_bad_path_in_one_line(project):
    root, checkpoint = project["root"], project["checkpoint"]
    proc = run_cli("inspect", str(checkpoint), "--json", cwd=root)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert (info["kind"], info["global_step"], info["epoch"]) == ("checkpoint", 2, 0)
    assert info["parameters"] == {"total": 5, "trainable": 5}
    assert info["weights"]["dtypes"] == {"float32": {"tensors": 2, "elements": 5, "bytes": 20}}
    text = run_cli("inspect", str(checkpoint), cwd=root)
    assert text.returncode == 0, text.stderr
    size = sum(p.stat().st_size for p in (root / checkpoint).rglob("*") if p.is_file())
    assert text.stdout.splitlines()[0] == f"checkpoint    {checkpoint}"
    assert "step          2 (epoch 0)" in text.stdout.splitlines()
    assert "plugin state  (none)" in text.stdout.splitlines()
    assert f"files         {size:,} bytes ({size / 1024:.3g} KiB) in all (optimizer state included)" in text.stdout
    bad = run_cli("inspect", "run", cwd=root)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("torchloom: error: inspect: 'run' is not a checkpoint") and bad.stderr.count("\n") == 1


def test_the_predict_command_uses_a_checkpoint_or_an_exported_model(project):
    root, checkpoint = project["root"], project["checkpoint"]
    for ckpt_path, shown, weights_file in [
        (str(checkpoint), f"weights of checkpoint {checkpoint}", checkpoint / "accelerate" / "model.safetensors"),
        ("run/version_0", "weights of saved model run/version_0/model", Path("run/version_0/model/model.safetensors")),
    ]:
        before = set((root / "run").glob("version_*"))
        proc = run_cli("predict", "--config", "config.yaml", "--ckpt_path", ckpt_path, cwd=root)
        assert proc.returncode == 0, proc.stderr
        (run_dir,) = set((root / "run").glob("version_*")) - before
        assert f"torchloom predict: {shown}" in proc.stdout.splitlines()
        assert "  batches = 2" in proc.stdout.splitlines()
        expected = linear_outputs(load_file(str(root / weights_file)))
        assert [row["prediction"] for row in jsonl(run_dir / "predictions.jsonl")] == expected.tolist()
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["ckpt_path"] == ckpt_path

    before = set((root / "run").glob("version_*"))
    bad = run_cli("predict", "--config", "config.yaml", "--ckpt_path", "run/nope", cwd=root)
    assert bad.returncode == 2
    assert bad.stderr.startswith(
        "torchloom: error: predict: ckpt_path 'run/nope': no such file or directory; expected a "
    )
    assert bad.stderr.count("\n") == 1
    assert set((root / "run").glob("version_*")) == before


def test_a_documented_inspect_output_matches_the_command(project):
    """The ``torchloom inspect`` example of docs/runs.md has the rows the command prints, in that order."""
    guide = (Path(__file__).parents[1] / "docs" / "runs.md").read_text(encoding="utf-8")
    section = guide[guide.index("$ torchloom inspect runs/regression/version_2\n") :]
    shown = section.split("```")[0].splitlines()[1:]
    labels = [line[:13].strip() for line in shown if line[:13].strip()]
    proc = run_cli("inspect", "run/version_0", cwd=project["root"])
    printed = [line[:13].strip() for line in proc.stdout.splitlines() if line[:13].strip()]
    assert labels == printed
