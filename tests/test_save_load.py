"""Saving and reloading a trained model: what `TaskModule.save_model` writes, `TaskModule.load_model` (any module)
and ``from_pretrained`` (transformers models) read back, with tied (shared) weights kept tied, in one file or in
shards, and with only the main process writing when several processes train."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom

VOCAB, DIM, SEQ = 16, 8, 6


class TiedLM(torch.nn.Module):
    """A tiny language model whose output projection is its input embedding (``lm_head.weight is embed.weight``)."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        if extra:
            self.extra = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))


def token_data(n: int = 32, batch_size: int = 8) -> DataLoader:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=batch_size)


class TiedTask(torchloom.TaskModule):
    """Next-token prediction with `TiedLM` (or a model from ``build``); saves in shards if ``max_shard_size``."""

    def __init__(self, build: Any = TiedLM, max_shard_size: int | None = None) -> None:
        super().__init__()
        self.build, self.max_shard_size = build, max_shard_size

    def configure_model(self) -> torch.nn.Module:
        return self.build()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        out = self.model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.5)

    def save_model(self, directory: Any) -> None:
        if self.max_shard_size is None:
            super().save_model(directory)
        else:
            super().save_model(directory, max_shard_size=self.max_shard_size)


def fit_and_save(task: TiedTask, out: Path) -> dict[str, torch.Tensor]:
    """Fit ``task`` with ``save_model=True``; return the trained weights (cloned, on the CPU)."""
    engine = torchloom.Engine(max_epochs=2, output_dir=str(out), save_model=True, log_every_n_steps=1)
    engine.fit(task, train_dataloader=token_data())
    trained = task.accelerator.unwrap_model(task.model).state_dict()
    return {k: v.detach().cpu().clone() for k, v in trained.items()}


def assert_same_weights(model: torch.nn.Module, trained: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(state[key], value), f"{key} differs after reloading"


# ------------------------------------------------------------------------------------------- plain modules


def test_a_plain_module_with_tied_weights_reloads_with_the_tie_kept(tmp_path):
    trained = fit_and_save(TiedTask(), tmp_path)
    directory = tmp_path / "latest" / "model"
    assert (directory / "model.safetensors").is_file()
    fresh = TiedLM()
    assert not torch.equal(fresh.embed.weight, trained["embed.weight"])  # the load below is what makes them equal

    returned = torchloom.TaskModule.load_model(fresh, directory)

    assert returned is fresh
    assert_same_weights(fresh, trained)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert fresh.lm_head.weight.data_ptr() == fresh.embed.weight.data_ptr()


RUNS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "runs.md"
DOCUMENTED_EXPORT = "runs/regression/version_2/model/model.safetensors"


def documented_reload_without_torchloom() -> str:
    """The block of docs/runs.md that reloads an export without torchloom, less the line that builds its model."""
    blocks = re.findall(r"```python\n(.*?)```", RUNS_PAGE.read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith("# without torchloom")]
    assert DOCUMENTED_EXPORT in block and "torchloom" not in block.replace("# without torchloom", "")
    return "\n".join(line for line in block.splitlines() if not line.startswith("model = "))


def test_the_documented_reload_without_torchloom_is_strict_and_keeps_the_tie(tmp_path):
    """The call docs/runs.md shows runs, as shown, on a save_model export of a plain module with tied weights:
    every key checked, the tie restored (``model.load_state_dict(safetensors.torch.load_file(...))`` fails here on
    the key the file stores once)."""
    trained = fit_and_save(TiedTask(), tmp_path)
    file = tmp_path / "latest" / "model" / "model.safetensors"
    from safetensors.torch import load_file

    assert set(load_file(str(file))) == {"embed.weight", "proj.weight", "proj.bias"}  # the tie stored once
    with pytest.raises(RuntimeError, match="Missing key"):
        TiedLM().load_state_dict(load_file(str(file)))  # why the page shows another call
    namespace: dict[str, Any] = {"model": TiedLM()}
    exec(documented_reload_without_torchloom().replace(DOCUMENTED_EXPORT, str(file)), namespace)
    model = namespace["model"]
    assert_same_weights(model, trained)
    assert model.lm_head.weight is model.embed.weight
    namespace = {"model": TiedLM(extra=True)}  # strict: a key the file lacks is an error
    with pytest.raises(RuntimeError, match="extra"):
        exec(documented_reload_without_torchloom().replace(DOCUMENTED_EXPORT, str(file)), namespace)


def test_the_documented_task_pattern_loads_weights_in_configure_model(tmp_path):
    """The user guide's pattern: a task argument names the saved model; ``configure_model`` loads it."""

    class Reloading(TiedTask):
        def __init__(self, weights: str | None = None) -> None:
            super().__init__()
            self.weights = weights

        def configure_model(self) -> torch.nn.Module:
            model = TiedLM()
            if self.weights:
                self.load_model(model, self.weights)
            return model

    trained = fit_and_save(TiedTask(), tmp_path / "fit")
    for weights in (tmp_path / "fit" / "latest" / "model", tmp_path / "fit" / "latest" / "model" / "model.safetensors"):
        task = Reloading(weights=str(weights))
        torchloom.Engine(output_dir=str(tmp_path / "validate")).validate(task, token_data())
        model = task.accelerator.unwrap_model(task.model)
        assert_same_weights(model, trained)
        assert model.lm_head.weight is model.embed.weight


def test_a_sharded_save_reloads_with_the_tie_kept(tmp_path):
    # 300 bytes: the 512-byte embedding, the 256-byte projection weight and its bias land in separate shards.
    trained = fit_and_save(TiedTask(max_shard_size=300), tmp_path)
    directory = tmp_path / "latest" / "model"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (directory / "model.safetensors").exists()

    fresh = torchloom.TaskModule.load_model(TiedLM(), directory)

    assert_same_weights(fresh, trained)
    assert fresh.lm_head.weight is fresh.embed.weight


def test_saving_again_replaces_the_shards_of_an_earlier_save(tmp_path):
    fit_and_save(TiedTask(max_shard_size=300), tmp_path)  # a sharded save first, in version_0
    task = TiedTask()
    trained = fit_and_save(task, tmp_path)  # the same output_dir: a run directory of its own, one file
    saved = sorted(p.name for p in (tmp_path / "version_1" / "model").iterdir())
    assert saved == ["model.safetensors", "torchloom_model.json"]  # the weights and the model card
    assert (tmp_path / "version_0" / "model" / "model.safetensors.index.json").is_file()  # both runs kept
    directory = tmp_path / "version_0" / "model"
    task.save_model(directory)  # saving into a directory that holds shards replaces them
    assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors"]
    assert_same_weights(torchloom.TaskModule.load_model(TiedLM(), directory), trained)


def test_loading_is_strict_about_keys_that_are_truly_missing_or_unexpected(tmp_path):
    fit_and_save(TiedTask(), tmp_path)
    directory = tmp_path / "latest" / "model"
    with pytest.raises(torchloom.ConfigError, match=r"missing keys \['extra\.bias', 'extra\.weight'\]") as missing:
        torchloom.TaskModule.load_model(TiedLM(extra=True), directory)
    assert str(directory) in str(missing.value)
    assert "lm_head.weight" not in str(missing.value)  # tied to embed.weight, which the file has: not missing

    fit_and_save(TiedTask(build=lambda: TiedLM(extra=True)), tmp_path / "bigger")
    with pytest.raises(torchloom.ConfigError, match=r"unexpected keys \['extra\.bias', 'extra\.weight'\]"):
        torchloom.TaskModule.load_model(TiedLM(), tmp_path / "bigger" / "latest" / "model")


def test_a_shape_mismatch_is_a_config_error_naming_the_directory(tmp_path):
    fit_and_save(TiedTask(), tmp_path)

    class Wider(TiedLM):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(DIM, DIM + 1)

    with pytest.raises(torchloom.ConfigError, match=r"size mismatch for proj\.weight") as error:
        torchloom.TaskModule.load_model(Wider(), tmp_path / "latest" / "model")
    assert str(tmp_path / "latest" / "model") in str(error.value)


@pytest.mark.parametrize("case", ["empty", "absent", "other_files"])
def test_a_directory_without_a_saved_model_is_a_config_error_naming_it(tmp_path, case):
    directory = tmp_path / "model"
    if case != "absent":
        directory.mkdir()
    if case == "other_files":
        (directory / "pytorch_model.bin").write_bytes(b"not loaded: pickles are never loaded")
        (directory / "config.json").write_text("{}")
    with pytest.raises(torchloom.ConfigError, match=r"model\.safetensors") as error:
        torchloom.TaskModule.load_model(TiedLM(), directory)
    assert str(directory) in str(error.value)


# ------------------------------------------------------------------------------------- transformers models


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=1, n_head=2, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("max_shard_size", [None, 1000], ids=["one_file", "sharded"])
def test_a_transformers_model_with_tied_embeddings_reloads_with_the_tie_kept(tmp_path, max_shard_size):
    from transformers import GPT2LMHeadModel

    trained = fit_and_save(TiedTask(build=tiny_gpt2, max_shard_size=max_shard_size), tmp_path)
    directory = tmp_path / "latest" / "model"
    assert (directory / "config.json").is_file()
    sharded = (directory / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size is not None)

    reloaded = GPT2LMHeadModel.from_pretrained(directory)
    assert_same_weights(reloaded, trained)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()

    into = torchloom.TaskModule.load_model(tiny_gpt2(), directory)
    assert_same_weights(into, trained)
    assert into.lm_head.weight is into.transformer.wte.weight


# ------------------------------------------------------------------------------------- several processes

MP_SCRIPT = '''
"""Two ranks fit a tied-weights model and save it in shards; rank 1 records any write under the model dir."""
import builtins
import json
import os
import sys
from pathlib import Path

import safetensors.torch
import torch

import torchloom
from test_save_load import TiedLM, TiedTask, token_data

out = Path(sys.argv[1])
model_dir = out / "run" / "version_0" / "model"
writes = []
rank = int(os.environ["RANK"])

if rank != 0:
    real_open, real_makedirs, real_save_file = builtins.open, os.makedirs, safetensors.torch.save_file

    def under(path):
        return str(model_dir) in os.path.abspath(os.fspath(path))

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and under(file) and any(c in mode for c in "wax+"):
            writes.append(("open", os.fspath(file)))
        return real_open(file, mode, *args, **kwargs)

    def makedirs(name, *args, **kwargs):
        if under(name):
            writes.append(("makedirs", os.fspath(name)))
        return real_makedirs(name, *args, **kwargs)

    def save_file(tensors, filename, *args, **kwargs):
        if under(filename):
            writes.append(("save_file", os.fspath(filename)))
        return real_save_file(tensors, filename, *args, **kwargs)

    builtins.open, os.makedirs, safetensors.torch.save_file = open_, makedirs, save_file

task = TiedTask(max_shard_size=300)
engine = torchloom.Engine(max_epochs=1, output_dir=str(out / "run"), save_model=True)
engine.fit(task, train_dataloader=token_data())
trained = task.accelerator.unwrap_model(task.model).state_dict()

if rank != 0:
    builtins.open, os.makedirs, safetensors.torch.save_file = real_open, real_makedirs, real_save_file

fresh = torchloom.TaskModule.load_model(TiedLM(), model_dir)
result = {
    "rank": rank,
    "writes": writes,
    "equal": all(torch.equal(fresh.state_dict()[k], v.cpu()) for k, v in trained.items()),
    "tied": fresh.lm_head.weight is fresh.embed.weight,
    "shards": sorted(p.name for p in model_dir.iterdir()),
}
(out / f"result-{rank}.json").write_text(json.dumps(result))
'''


@pytest.mark.multiprocess
def test_on_two_processes_only_the_main_process_writes_and_every_rank_reloads(tmp_path, monkeypatch):
    from torchrun_util import torchrun

    script = tmp_path / "save_load_fit.py"
    script.write_text(textwrap.dedent(MP_SCRIPT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    results = torchrun(str(script), tmp_path, nproc=2)  # an absolute path: torchrun_util joins it as is

    assert [r["rank"] for r in results] == [0, 1]
    assert results[1]["writes"] == []
    for r in results:
        assert r["equal"] and r["tied"], r
        assert "model.safetensors.index.json" in r["shards"], r
