"""The ``grad_checkpoint`` plugin: same gradients as without it (frozen layers, dropout, HF models, DDP with a
block used twice), ``use_reentrant`` kept as configured, clear errors, and a lower activation peak.

Cases C06 and C07 of shared/cases/README.md, run through `torchloom.Engine`.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import tiny_fit
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))  # the tasks shared with the torchrun scripts
from ckpt_tasks import Block, FrozenEmbeddingTask, SharedBlockTask, StepSnapshots

from torchloom_plugins.grad_checkpoint import GradientCheckpointing, checkpoint_use_reentrant

BENCH = Path(__file__).resolve().parents[2] / "bench" / "activation_memory.py"


class ForwardCounter:
    """Counts forward calls of every ``Block.linear`` (a checkpointed block runs it again in backward)."""

    name = "test.forward_counter"

    def __init__(self) -> None:
        self.calls = 0

    @torchloom.hookimpl
    def configure_model(self, model: torch.nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, Block):
                m.linear.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def _c06(tmp_path: Path, plugins: list[Any]) -> tuple[StepSnapshots, ForwardCounter, FrozenEmbeddingTask]:
    snaps, counter, task = StepSnapshots(), ForwardCounter(), FrozenEmbeddingTask()
    tiny_fit([*plugins, snaps, counter], task=task, max_steps=1, output_dir=str(tmp_path))
    return snaps, counter, task


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_c06_frozen_embedding_dropout_same_gradients(tmp_path, use_reentrant):
    """C06: frozen embedding -> checkpointed Block(Linear, Dropout 0.5, Tanh) -> head, float64, one step.

    Every trainable parameter gets a gradient equal (1e-10) to the run without checkpointing, which also
    needs the dropout mask replayed in the recomputation; the block's weights change; the configured
    use_reentrant is the one the wrapper really uses (with use_reentrant=True the plugin makes the block's
    input require grad; without that fix the block's grads are None)."""
    plugin = GradientCheckpointing(modules=["Block"], use_reentrant=use_reentrant)
    ref, ref_count, _ = _c06(tmp_path / "ref", [])
    got, got_count, task = _c06(tmp_path / "ckpt", [plugin])

    assert plugin.checkpointed == ["block"]
    assert checkpoint_use_reentrant(task.model.block) is use_reentrant
    assert (ref_count.calls, got_count.calls) == (1, 2)  # the block really was recomputed in backward
    (ref_grads,), (got_grads,) = ref.grads, got.grads
    assert ref_grads["embed.weight"] is None and got_grads["embed.weight"] is None  # frozen
    for name in ("block.linear.weight", "block.linear.bias", "head.weight", "head.bias"):
        assert got_grads[name] is not None, name
        assert got_grads[name].abs().sum() > 0, name
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=0, atol=1e-10)
    before, after = got.params[0], got.params[1]
    names = [n for n, _ in task.model.named_parameters()]
    block_w = names.index("block.linear.weight")
    assert before[block_w] != after[block_w]  # the step changed the block's weights
    assert got.params == ref.params  # hence the same parameters after the step


def test_hf_model_same_gradients_and_use_reentrant_kept(tmp_path):
    """``modules: hf`` on a tiny GPT-2 (built from a config, offline): every layer is checkpointed with the
    configured use_reentrant, its input embeddings frozen, and the gradients equal the run without (1e-6)."""
    transformers = pytest.importorskip("transformers")

    class TinyLM(torchloom.TaskModule):
        def configure_model(self) -> torch.nn.Module:
            config = transformers.GPT2Config(
                vocab_size=32,
                n_positions=16,
                n_embd=16,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.1,
                embd_pdrop=0.0,
                attn_pdrop=0.1,
                bos_token_id=0,
                eos_token_id=0,
            )
            model = transformers.GPT2LMHeadModel(config)
            model.transformer.wte.weight.requires_grad_(False)  # frozen embeddings (C06's PEFT-like setting)
            return model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1)

        def train_dataloader(self) -> DataLoader:
            ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(ids), batch_size=4)

    results = {}
    for label, plugins in (("ref", []), ("ckpt", [GradientCheckpointing(modules="hf", use_reentrant=True)])):
        snaps, task = StepSnapshots(), TinyLM()
        tiny_fit([*plugins, snaps], task=task, max_steps=1, output_dir=str(tmp_path / label))
        results[label] = (snaps, task)
    (ref, _), (got, task) = results["ref"], results["ckpt"]
    layers = task.model.transformer.h
    assert all(layer.gradient_checkpointing for layer in layers)
    assert [checkpoint_use_reentrant(layer) for layer in layers] == [True, True]
    for name, g in ref.grads[0].items():
        if g is None:
            assert got.grads[0][name] is None, name
            continue
        assert got.grads[0][name] is not None, name
        torch.testing.assert_close(got.grads[0][name], g, rtol=0, atol=1e-6)
    assert ref.grads[0]["transformer.h.0.attn.c_attn.weight"] is not None


def test_pattern_selects_by_qualified_name(tmp_path):
    """A name pattern checkpoints the matching modules (outermost only), keeps parameter names."""

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Block(4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class StackTask(torchloom.TaskModule):
        def configure_model(self):
            return Stack()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.model(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(
                TensorDataset(torch.randn(4, 4, generator=torch.Generator().manual_seed(0))), batch_size=4
            )

    names_before = [n for n, _ in Stack().named_parameters()]
    plugin = GradientCheckpointing(modules=["layers.*"])
    task = StackTask()
    tiny_fit([plugin], task=task, max_steps=1, output_dir=str(tmp_path))
    assert plugin.checkpointed == ["layers.0", "layers.1", "layers.2"]  # not also layers.0.linear
    assert [n for n, _ in task.model.named_parameters()] == names_before
    assert checkpoint_use_reentrant(task.model.layers[1]) is False
    assert checkpoint_use_reentrant(task.model.layers[1].linear) is None


def test_pattern_matching_nothing_is_a_config_error(tmp_path):
    with pytest.raises(torchloom.ConfigError, match=r"'Blok'.*matches no submodule.*Block"):
        tiny_fit(
            [GradientCheckpointing(modules=["Blok"])], task=FrozenEmbeddingTask(), max_steps=1, output_dir=str(tmp_path)
        )


def test_hf_on_a_plain_module_is_a_config_error(tmp_path):
    with pytest.raises(torchloom.ConfigError, match=r"'hf'.*no transformers model"):
        tiny_fit({"grad_checkpoint": {}}, task=FrozenEmbeddingTask(), max_steps=1, output_dir=str(tmp_path))


def test_bad_settings_are_config_errors():
    with pytest.raises(torchloom.ConfigError, match="modules"):
        torchloom.enable_plugins({"grad_checkpoint": {"modules": []}})
    with pytest.raises(torchloom.ConfigError, match="use_reentrant"):
        torchloom.enable_plugins({"grad_checkpoint": {"use_reentrant": "no"}})


def test_eval_and_no_grad_are_not_checkpointed():
    """Outside training (eval mode or no_grad) the wrapped forward runs as is, with the same output."""
    from torchloom_plugins.grad_checkpoint import checkpoint_modules

    torch.manual_seed(0)
    block = Block(4)
    x = torch.randn(2, 4)
    expected = block(x)
    checkpoint_modules(block, ["Block"])
    calls = []
    block.linear.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    block.eval()
    out = block(x)
    out.sum().backward()
    assert len(calls) == 2  # no recomputation in either


@pytest.mark.multiprocess
def test_c07_ddp_block_used_twice(tmp_path):
    """C07: 2 processes (gloo), a checkpointed block applied twice, 3 SGD steps of 2 samples per rank: no
    "marked ready twice"; after every step the parameters are bitwise equal on both ranks and equal (1e-6) to
    one process without checkpointing on the 4-sample global batch."""
    ranks = torchrun("ckpt_ddp.py", tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["checkpointed"] == ["block"]
    assert ranks[0]["params"] == ranks[1]["params"]  # bitwise, after every step
    assert len(ranks[0]["params"]) == 4  # initial + 3 steps

    snaps = StepSnapshots()
    tiny_fit([snaps], task=SharedBlockTask(batch_size=4), max_epochs=2, max_steps=3, output_dir=str(tmp_path / "one"))
    assert len(snaps.params) == 4
    for step, (got, ref) in enumerate(zip(ranks[0]["params"], snaps.params)):
        for g, r in zip(got, ref):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(r), rtol=0, atol=1e-6, msg=f"step {step}")
    assert snaps.params[0] != snaps.params[3]  # training moved the parameters


def test_activation_memory_is_lower_with_checkpointing(tmp_path):
    """bench/activation_memory.py, small: checkpointing every block lowers both the activations held for
    backward and the peak of tensor memory allocated during a training step (printed; run with -s)."""
    spec = importlib.util.spec_from_file_location("activation_memory", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.compare("mlp", batch=256, width=64, blocks=6, output_dir=str(tmp_path))
    plain, ckpt = rows
    print(bench.format_rows(rows))
    assert ckpt["loss"] == plain["loss"]  # the same step
    assert ckpt["saved_bytes"] < 0.3 * plain["saved_bytes"]
    assert ckpt["peak_bytes"] < 0.8 * plain["peak_bytes"]


def test_the_settings_class_has_a_name_of_its_own_and_the_old_one_still_imports():
    """It was ``CheckpointConfig``, as the checkpoint plugin's is; the old name imports it with a warning."""
    import torchloom_plugins.grad_checkpoint as module
    from torchloom_plugins.grad_checkpoint import GradientCheckpointingConfig

    assert GradientCheckpointing.Config is GradientCheckpointingConfig and "CheckpointConfig" not in module.__all__
    with pytest.warns(DeprecationWarning, match="now GradientCheckpointingConfig"):
        assert module.CheckpointConfig is GradientCheckpointingConfig


def test_hf_checkpointing_turns_use_cache_off_for_training_only(tmp_path, caplog):
    """As the HF Trainer does, a checkpointed transformers model trains with ``use_cache = False`` (so transformers
    logs no "use_cache=True is incompatible with gradient checkpointing" note); the value is back before the model
    is saved, so its config.json keeps ``use_cache: true``."""
    transformers = pytest.importorskip("transformers")
    import json

    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    assert config.use_cache is True

    class TinyLM(torchloom.TaskModule):
        def configure_model(self) -> torch.nn.Module:
            return transformers.GPT2LMHeadModel(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(self.model.config.use_cache)
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randint(0, 32, (4, 12))), batch_size=2)

    seen: list[bool] = []
    task = TinyLM()
    notes = logging.getLogger("transformers")  # transformers' root logger does not propagate (outside CI)
    notes.addHandler(caplog.handler)
    try:
        plugins = [GradientCheckpointing(modules="hf")]
        tiny_fit(plugins, task=task, max_steps=2, output_dir=str(tmp_path), save_model=True)
    finally:
        notes.removeHandler(caplog.handler)
    assert seen == [False, False]
    assert task.model.config.use_cache is True
    saved = json.loads((tmp_path / "latest" / "model" / "config.json").read_text())
    assert saved["use_cache"] is True
    assert not [r for r in caplog.records if "use_cache" in r.getMessage()]
