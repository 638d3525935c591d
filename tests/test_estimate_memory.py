"""`torchloom.estimate_memory` and ``torchloom estimate-memory``: the activation estimate (a forward and backward on
fake tensors) against a real torchloom training step measured on the CPU with bench/activation_memory.py's counter;
weights, gradients and optimizer state exact; the micro-batch suggestion; the command's table, JSON and errors."""

from __future__ import annotations

import importlib.util
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.cli import main

ROOT = Path(__file__).resolve().parents[1]

#: The stated tolerance (docs/memory.md): activations within 1 % of the measured step, plus, for a causal LM with
#: checkpointing, up to the attention mask transformers builds for fake tensors (5 bytes per batch x seq x seq).
REL_TOL = 0.01


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("activation_memory", ROOT / "bench" / "activation_memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


def gpt2_config(**overrides: Any) -> transformers.GPT2Config:
    settings = dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**settings, "architectures": ["GPT2LMHeadModel"], **overrides})


def bert_config(**overrides: Any) -> transformers.BertConfig:
    settings = dict(
        vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=128,
    )  # fmt: skip
    return transformers.BertConfig(**{**settings, "architectures": ["BertForMaskedLM"], **overrides})


CONFIGS = {"gpt2": gpt2_config, "bert": bert_config}


class LanguageModelTask(torchloom.TaskModule):
    """A transformers LM from a config, trained on random token ids (labels = inputs) with SGD (no state)."""

    def __init__(self, config: Any, batch_size: int, seq_len: int) -> None:
        super().__init__()
        self.config, self.batch_size, self.seq_len = config, batch_size, seq_len

    def configure_model(self) -> torch.nn.Module:
        return getattr(transformers, self.config.architectures[0])(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.config.vocab_size, (2 * self.batch_size, self.seq_len), generator=g)
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)


class StepProbe:
    """Counts each training step with bench/activation_memory.py's live-tensor counter (a TorchDispatchMode over
    real CPU tensors). Storages alive before the step (parameters, buffers, and the gradients inside an
    accumulation window) are not counted."""

    name = "test.step_probe"

    def __init__(self) -> None:
        self.peaks: list[int] = []

    @torchloom.hookimpl(wrapper=True)
    def run_train_step(self, model: torch.nn.Module):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        existing = [*model.parameters(), *model.buffers(), *grads]
        live = bench._LiveTensors({t.untyped_storage().data_ptr() for t in existing})
        with live:
            outputs = yield
        self.peaks.append(live.peak)
        return outputs


def measure_training_step(config: Any, batch_size: int, seq_len: int, plugins: list[Any], tmp_path: Path) -> list[int]:
    """Peak bytes of the two micro-batches of one optimizer step (gradient accumulation over 2): in the first the
    gradients are created, in the second they exist already."""
    probe = StepProbe()
    engine = torchloom.Engine(
        plugins=[{"grad_accum": {"steps": 2}}, *plugins, probe], max_steps=1, output_dir=str(tmp_path)
    )
    engine.fit(LanguageModelTask(config, batch_size, seq_len))
    assert len(probe.peaks) == 2
    return probe.peaks


@pytest.mark.parametrize(
    ("kind", "checkpointing", "precision", "batch_size", "seq_len"),
    [
        ("gpt2", False, "fp32", 4, 64),
        ("gpt2", True, "fp32", 4, 64),
        ("bert", False, "fp32", 4, 64),
        ("bert", True, "fp32", 4, 64),
        ("gpt2", True, "bf16", 2, 64),
        ("bert", False, "bf16", 8, 32),
    ],
)
def test_activations_are_within_the_stated_tolerance_of_a_measured_step(
    tmp_path, kind, checkpointing, precision, batch_size, seq_len
):
    config = CONFIGS[kind]()  # attention dropout 0.1: the CPU's math attention, so fused_attention=False
    plugins: list[Any] = [{"grad_checkpoint": {}}] if checkpointing else []
    if precision != "fp32":
        plugins.append({"mixed_precision": {"dtype": precision}})
    first, steady = measure_training_step(config, batch_size, seq_len, plugins, tmp_path)

    estimate = torchloom.estimate_memory(
        config, batch_size=batch_size, seq_len=seq_len, precision=precision, optimizers="sgd",
        grad_checkpoint=checkpointing, fused_attention=False,
    )  # fmt: skip
    row = estimate.row("sgd", checkpointing)
    mask = 5 * batch_size * seq_len**2 if kind == "gpt2" and checkpointing else 0
    assert -REL_TOL * steady <= row.activations - steady <= REL_TOL * steady + mask, (row.activations, steady)
    # With no gradients yet (the first micro-batch), gradients + activations still bound the step.
    assert first <= row.activations + row.gradients


def test_checkpointing_batch_size_and_seq_len_move_the_activations():
    config = gpt2_config()

    def activations(batch_size: int, seq_len: int, checkpointing: bool) -> int:
        est = torchloom.estimate_memory(
            config, batch_size=batch_size, seq_len=seq_len, optimizers="sgd", grad_checkpoint=checkpointing
        )
        return est.row("sgd", checkpointing).activations

    base = activations(4, 64, False)
    assert 1.9 * base < activations(8, 64, False) < 2.1 * base  # linear in the batch
    assert activations(4, 128, False) > 1.9 * base  # at least linear in the sequence
    assert activations(4, 64, True) < 0.6 * base  # checkpointing keeps only the blocks' inputs


def test_weights_and_gradients_are_exact():
    for config in (gpt2_config(), bert_config()):
        model = getattr(transformers, config.architectures[0])(config)  # GPT-2 ties lm_head to wte
        estimate = torchloom.estimate_memory(config, batch_size=2, seq_len=16, grad_checkpoint=False)
        row = estimate.rows[0]
        params = list(model.parameters())
        assert row.weights == sum(p.nbytes for p in params) + sum(b.nbytes for b in model.buffers())
        ids = torch.randint(0, config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        assert row.gradients == sum(p.grad.nbytes for p in params if p.grad is not None)
        assert estimate.parameters == estimate.trainable_parameters == sum(p.numel() for p in params)


def test_the_optimizer_state_is_what_estimate_optimizer_memory_gives():
    config = bert_config()
    model = transformers.BertForMaskedLM(config)
    optimizers = {"adamw": {}, "adafactor": {}, "adamw8bit": {}, "sgd": {"momentum": 0.9}}
    estimate = torchloom.estimate_memory(config, batch_size=2, seq_len=16, optimizers=optimizers, grad_checkpoint=False)
    assert [r.optimizer for r in estimate.rows] == list(optimizers)
    for name, settings in optimizers.items():
        assert estimate.row(name).optimizer_state == torchloom.estimate_optimizer_memory(model, name, **settings) > 0


def test_the_suggestion_fits_the_budget_and_the_next_larger_micro_batch_does_not():
    config = gpt2_config()
    fixed = torchloom.estimate_memory(config, batch_size=1, seq_len=64, grad_checkpoint=False).rows[0]
    budget = fixed.total - fixed.activations + 5 * fixed.activations  # room for about 4-5 samples
    estimate = torchloom.estimate_memory(config, batch_size=2, seq_len=64, budget=budget, effective_batch_size=32)
    for row in estimate.rows:
        s = row.suggestion
        assert s is not None and s.micro_batch_size * s.gradient_accumulation_steps == 32
        at = torchloom.estimate_memory(
            config, batch_size=s.micro_batch_size, seq_len=64, grad_checkpoint=row.grad_checkpoint
        )
        following = torchloom.estimate_memory(
            config, batch_size=2 * s.micro_batch_size, seq_len=64, grad_checkpoint=row.grad_checkpoint
        )  # the next divisor of 32
        assert at.rows[-1].total == s.total <= budget < following.rows[-1].total == s.next_total
    off, on = estimate.rows
    assert off.suggestion.micro_batch_size == 4 and on.suggestion.micro_batch_size > 4  # type: ignore[union-attr]

    tight = torchloom.estimate_memory(config, batch_size=1, seq_len=64, budget=fixed.total - 1, grad_checkpoint=False)
    assert tight.rows[0].suggestion is None and tight.rows[0].micro_batch_1_total == fixed.total
    assert "none (micro-batch 1 needs" in tight.table()


def test_fused_attention_keeps_no_attention_matrix():
    original = torch.nn.functional.scaled_dot_product_attention

    def activations(config: Any, fused: bool) -> int:
        est = torchloom.estimate_memory(config, batch_size=2, seq_len=128, grad_checkpoint=False, fused_attention=fused)
        return est.rows[0].activations

    with_dropout, without = gpt2_config(attn_pdrop=0.1), gpt2_config(attn_pdrop=0.0)
    math_path = activations(with_dropout, False)  # the math path keeps probabilities and dropout masks
    assert activations(with_dropout, True) == activations(without, False) < math_path - 3 * 2 * 4 * 128**2 * 4
    assert torch.nn.functional.scaled_dot_product_attention is original


class ResidualMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(bench.MLPBlock(64) for _ in range(4))
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp_loss(model: torch.nn.Module, batch_size: int, seq_len: int | None) -> torch.Tensor:
    return model(torch.randn(batch_size, 64)).pow(2).mean()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_any_module_with_a_forward_function(checkpointing):
    from torchloom_plugins.grad_checkpoint import checkpoint_modules

    with torch.device("meta"):
        meta_model = ResidualMLP()
    settings = {"modules": ["MLPBlock"]} if checkpointing else False
    est = torchloom.estimate_memory(meta_model, batch_size=256, forward=mlp_loss, grad_checkpoint=settings)
    assert all(p.is_meta for p in meta_model.parameters()) and "forward" not in vars(meta_model.blocks[0])

    model = ResidualMLP()
    if checkpointing:
        checkpoint_modules(model, ["MLPBlock"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(256, 64)
    live = bench._LiveTensors(
        {t.untyped_storage().data_ptr() for t in [*model.parameters(), x] + [p.grad for p in model.parameters()]}
    )
    with live:
        model(x).pow(2).mean().backward()
    # The forward function's own input (256 x 64 float32) counts in the estimate, not in the measurement.
    measured = live.peak + 256 * 64 * 4
    assert abs(est.row("adamw", checkpointing).activations - measured) <= REL_TOL * measured


def test_frozen_parameters_have_no_gradient_and_no_optimizer_state():
    """The first block and the head frozen: gradients and AdamW's state count the trainable parameters only; the
    weights count all of them."""
    model = ResidualMLP()
    for module in (model.blocks[0], model.head):
        module.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    est = torchloom.estimate_memory(model, batch_size=8, forward=mlp_loss, grad_checkpoint=False, optimizers="adamw")
    row = est.rows[0]
    assert est.trainable_parameters == sum(p.numel() for p in trainable) < est.parameters
    assert row.weights == sum(p.nbytes for p in model.parameters())
    assert row.gradients == sum(p.nbytes for p in trainable)
    # exp_avg and exp_avg_sq (float32), and a float32 step per tensor, for the trainable tensors only
    assert row.optimizer_state == 2 * sum(p.nbytes for p in trainable) + 4 * len(trainable)


def test_a_budget_that_a_micro_batch_fits_exactly_suggests_it():
    """The budget is exactly the total at micro-batch 4 (a divisor of 16): 4 is suggested; a byte less gives 2; the
    exact total at micro-batch 1 still suggests 1."""
    model = ResidualMLP()

    def total(batch_size: int) -> int:
        est = torchloom.estimate_memory(model, batch_size=batch_size, forward=mlp_loss, grad_checkpoint=False)
        return est.rows[0].total

    exact = total(4)
    assert total(2) < exact < total(8)
    for budget, micro_batch in ((exact, 4), (exact - 1, 2), (total(8) - 1, 4), (total(8), 8), (total(1), 1)):
        est = torchloom.estimate_memory(
            model, batch_size=1, forward=mlp_loss, grad_checkpoint=False, budget=budget, effective_batch_size=16
        )
        s = est.rows[0].suggestion
        assert s is not None and (s.micro_batch_size, s.gradient_accumulation_steps) == (micro_batch, 16 // micro_batch)
        assert s.total == total(micro_batch) <= budget


# ----------------------------------------------------------------------------------------------- the command


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "gpt2"
    gpt2_config().save_pretrained(path)
    return path


def test_the_command_prints_one_table_of_optimizers_and_settings(model_dir, capsys):
    args = ["--batch_size", "2", "--seq_len", "64", "--optimizer", "adamw,adafactor,adamw8bit", "--budget", "64MiB"]
    assert main(["estimate-memory", str(model_dir), *args, "--effective_batch_size", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("GPT2LMHeadModel: 222,272 parameters") and "micro-batch 2 x 64 tokens" in lines[0]
    assert lines[1].split()[:3] == ["optimizer", "checkpointing", "weights"] and "fits 64 MiB" in lines[1]
    rows = [line.split()[:2] for line in lines[2:8]]
    assert rows == [[o, c] for o in ("adamw", "adafactor", "adamw8bit") for c in ("off", "on")]
    assert lines[8] == "effective batch size 32 = micro-batch x gradient_accumulation_steps"


def test_the_command_prints_json_equal_to_the_python_api(model_dir, capsys):
    assert main(["estimate-memory", str(model_dir), "--batch_size", "2", "--seq_len", "32", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = torchloom.estimate_memory(str(model_dir), batch_size=2, seq_len=32)
    assert printed == json.loads(json.dumps(expected.to_dict()))
    assert printed["rows"][0]["total"] == sum(
        printed["rows"][0][k] for k in ("weights", "gradients", "optimizer_state", "activations")
    )


def test_a_run_config_builds_the_task_model_with_its_checkpoint_settings(tmp_path, capsys):
    (tmp_path / "lm_task.py").write_text(
        textwrap.dedent(
            """
            import torch, transformers, torchloom

            class TinyLM(torchloom.TaskModule):
                def __init__(self, layers: int = 2):
                    super().__init__()
                    self.layers = layers

                def configure_model(self):
                    config = transformers.GPT2Config(vocab_size=500, n_positions=64, n_embd=64, n_layer=self.layers,
                                                     n_head=4, bos_token_id=0, eos_token_id=0)
                    return transformers.GPT2LMHeadModel(config)

                def training_step(self, batch, batch_idx):
                    return self.model(**batch).loss
            """
        )
    )
    run = tmp_path / "run.yaml"
    run.write_text(
        "task: {class_path: lm_task.TinyLM, init_args: {layers: 3}}\n"
        "plugins:\n  grad_checkpoint: {modules: [GPT2Block]}\n"
    )
    assert main(["estimate-memory", str(run), "--batch_size", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    config = transformers.GPT2Config(
        vocab_size=500, n_positions=64, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
    )
    expected = torchloom.estimate_memory(config, batch_size=2, grad_checkpoint={"modules": ["GPT2Block"]})
    assert printed["seq_len"] == 64 and printed["rows"] == json.loads(json.dumps(expected.to_dict()))["rows"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], r"model '.*missing' does not exist; expected a local Hugging Face model directory"),
        (["{empty}"], r"is a directory without config\.json"),
        (["{model}", "--budget", "8GX"], r"budget '8GX' is not a size; expected bytes .* e\.g\. 8GiB"),
        (["{model}", "--budget", "0GiB"], r"budget '0GiB' is not a size > 0"),
        (["{model}", "--optimizer", "adamw8bitt"], r"unknown optimizer 'adamw8bitt'; did you mean 'adamw8bit'\?"),
        (["{model}", "--precision", "fp8"], r"precision 'fp8' is not estimated; valid: fp32"),
        (["{model}", "--seq_len", "4096"], r"seq_len 4096 is longer than GPT2LMHeadModel takes"),
        (["{model}", "--batch_size", "0"], r"batch_size = 0; expected an integer >= 1"),
        (
            ["{model}", "--architecture", "GPT2LMHead"],
            r"not a transformers model class; did you mean 'GPT2LMHeadModel'",
        ),
        (["{model}", "--architecture", "BertModel"], r"'BertModel' takes a BertConfig, not the GPT2Config given"),
        (["{notask}"], r"run config '.*notask\.yaml' has no task"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, model_dir, capsys, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notask.yaml").write_text("engine: {max_steps: 1}\n")
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "model": model_dir}
    paths["notask"] = tmp_path / "notask.yaml"
    argv = ["estimate-memory", *(a.format(**{k: str(v) for k, v in paths.items()}) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchloom: error: ")
    assert re.search(message, err), err
