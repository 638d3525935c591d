"""`torchloom.estimate_memory` with the ``peft`` plugin (LoRA, QLoRA): the activations against a real torchloom training
step with the plugin, measured on the CPU with bench/activation_memory.py's counter (LoRA in float32, and a 4-bit NF4
base computing in bfloat16); weights exact against the real quantised model (packed 4-bit data and quantisation
state, int8 rows and scales); gradients and optimizer state exact and the adapter's only; a run config's ``peft``
section and ``--peft``; bad settings as the plugin words them."""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

import pytest
import torch
import transformers

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import torchloom
from test_estimate_memory import REL_TOL, measure_training_step
from torchloom.cli import main
from torchloom_plugins.optimizer import optimizer_state_bytes
from torchloom_plugins.peft import Peft

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
QLORA = {**LORA, "load_in_4bit": True, "quant_type": "nf4", "compute_dtype": "bfloat16"}
QLORA_8BIT = {**LORA, "load_in_8bit": True}


def llama_config(**overrides: Any) -> transformers.LlamaConfig:
    settings = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaConfig(**{**settings, "architectures": ["LlamaForCausalLM"], **overrides})


def adapted(settings: dict[str, Any], config: Any = None) -> torch.nn.Module:
    """A real model with the plugin's adapter (and quantised base) applied, as at run set-up."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config or llama_config())
    Peft(**settings).configure_model(model, accelerator=None)  # as the memory estimate calls it
    return model


def real_tensor_bytes(model: torch.nn.Module) -> int:
    """Every distinct storage the model holds: parameters, buffers, and every tensor inside a bitsandbytes weight's
    attributes (a 4-bit weight's quantisation state, nested states included; an 8-bit weight's scales)."""
    seen: dict[int, int] = {}

    def add(value: Any, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif depth < 3 and hasattr(value, "__dict__") and type(value).__module__.startswith("bitsandbytes"):
            for item in vars(value).values():
                add(item, depth + 1)

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
        for name in ("quant_state", "CB", "SCB"):
            add(getattr(t, name, None))
    return sum(seen.values())


@pytest.mark.parametrize(
    "settings",
    [LORA, QLORA, {**QLORA, "quant_type": "fp4", "double_quant": False, "compute_dtype": "float32"}, QLORA_8BIT],
    ids=["lora", "4bit", "4bit-fp4-single-quant", "8bit"],
)
def test_weights_gradients_and_parameter_counts_are_those_of_the_real_adapted_model(settings):
    model = adapted(settings)
    estimate = torchloom.estimate_memory(llama_config(), batch_size=2, seq_len=16, grad_checkpoint=False, peft=settings)
    row = estimate.rows[0]
    assert row.weights == real_tensor_bytes(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.randint(0, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert row.gradients == sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    assert row.gradients == sum(p.nbytes for p in trainable)
    assert estimate.trainable_parameters == sum(p.numel() for p in trainable)
    plain = transformers.LlamaForCausalLM(llama_config())
    assert estimate.parameters == sum(p.numel() for p in plain.parameters()) + estimate.trainable_parameters
    assert estimate.adapter is not None and estimate.adapter.startswith("lora r=4")


def test_a_4bit_base_counts_its_packed_data_and_quantisation_state():
    """Half a byte per quantised weight, plus per block of 64 a uint8 absmax (double quantisation) and per layer the
    NF4 code (16 float32), the nested absmax (a float32 per 256 blocks), the nested code (a copy of the 256-entry
    float32 map in each layer) and the offset (a float32); the embeddings, norms and output head stay float32 as the
    plugin leaves them."""
    full = torchloom.estimate_memory(llama_config(), batch_size=1, seq_len=8, grad_checkpoint=False, peft=LORA)
    four = torchloom.estimate_memory(llama_config(), batch_size=1, seq_len=8, grad_checkpoint=False, peft=QLORA)
    model = adapted(QLORA)
    import bitsandbytes as bnb

    quantised = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 3 * 7  # q, k, v, o, gate, up, down in each layer; not lm_head
    elements = sum(m.in_features * m.out_features for m in quantised)
    adapters = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    lora_fp32 = sum(p.nbytes for p in adapted(LORA).parameters() if p.requires_grad)
    blocks = [m.in_features * m.out_features // 64 for m in quantised]
    state = sum(blocks) + sum(16 * 4 + 4 * -(-n // 256) + 256 * 4 + 4 for n in blocks)
    base_left = full.rows[0].weights - lora_fp32 - 4 * elements  # what is not quantised: the same in both
    assert four.rows[0].weights == base_left + elements // 2 + state + adapters


@pytest.mark.parametrize(
    ("settings", "batch_size", "seq_len", "checkpointing"),
    [
        (LORA, 4, 64, False),
        (LORA, 4, 64, True),
        (QLORA, 4, 64, False),
        pytest.param(QLORA, 4, 64, True, marks=pytest.mark.slow),  # 5 s on a quiet machine, 10 s under load
        (QLORA_8BIT, 4, 64, False),
    ],
    ids=["lora", "lora-checkpointed", "4bit-nf4-bf16", "4bit-checkpointed", "8bit"],
)
def test_activations_with_an_adapter_are_within_the_stated_tolerance_of_a_measured_step(
    tmp_path, settings, batch_size, seq_len, checkpointing
):
    config = llama_config()
    plugins: list[Any] = [{"peft": settings}] + ([{"grad_checkpoint": {}}] if checkpointing else [])
    first, steady = measure_training_step(config, batch_size, seq_len, plugins, tmp_path)
    estimate = torchloom.estimate_memory(
        config, batch_size=batch_size, seq_len=seq_len, optimizers="sgd", grad_checkpoint=checkpointing,
        fused_attention=False, peft=settings,
    )  # fmt: skip
    row = estimate.row("sgd", checkpointing)
    mask = 5 * batch_size * seq_len**2 if checkpointing else 0  # see test_estimate_memory
    print(f"measured {steady} estimated {row.activations} ({(row.activations - steady) / steady:+.3%})")
    assert -REL_TOL * steady <= row.activations - steady <= REL_TOL * steady + mask, (row.activations, steady)
    assert first <= row.activations + row.gradients


@pytest.mark.parametrize("settings", [LORA, QLORA], ids=["lora", "4bit"])
def test_the_optimizer_state_is_the_adapters_only(settings):
    """AdamW over every parameter of the model (as a task's own optimizer holds them): the frozen base gets no
    gradient and so no state; the estimate is the state after a real step, for the adapter alone."""
    model = adapted(settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    measured = optimizer_state_bytes(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert measured == 2 * sum(p.nbytes for p in trainable) + 4 * len(trainable)
    assert torchloom.estimate_optimizer_memory(model, "adamw") == measured
    estimate = torchloom.estimate_memory(llama_config(), batch_size=2, seq_len=16, grad_checkpoint=False, peft=settings)
    assert estimate.row("adamw").optimizer_state == measured


def test_peft_false_and_a_model_module_leave_the_model_as_it_is():
    config = llama_config()
    plain = torchloom.estimate_memory(config, batch_size=1, seq_len=8, grad_checkpoint=False)
    assert torchloom.estimate_memory(config, batch_size=1, seq_len=8, grad_checkpoint=False, peft=False) == plain
    from_config = torchloom.estimate_memory(config, batch_size=1, seq_len=8, grad_checkpoint=False, peft=QLORA)
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    for model in (meta_model, transformers.LlamaForCausalLM(config)):
        before = {name: (p.device, p.dtype, p.requires_grad) for name, p in model.named_parameters()}
        estimate = torchloom.estimate_memory(model, batch_size=1, seq_len=8, grad_checkpoint=False, peft=QLORA)
        assert estimate == from_config
        assert estimate.trainable_parameters < estimate.parameters == plain.parameters + estimate.trainable_parameters
        assert not hasattr(model, "peft_config") and not hasattr(model, "is_loaded_in_4bit")
        assert {name: (p.device, p.dtype, p.requires_grad) for name, p in model.named_parameters()} == before


TASK = """
import transformers, torchloom

class TinyLlama(torchloom.TaskModule):
    def configure_model(self):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128))

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss
"""


def test_a_run_config_applies_its_peft_plugin_and_the_command_takes_peft(tmp_path, capsys):
    (tmp_path / "llama_task.py").write_text(textwrap.dedent(TASK))
    run = tmp_path / "run.yaml"
    run.write_text(
        "task: {class_path: llama_task.TinyLlama}\n"
        "plugins:\n  - grad_checkpoint\n  - peft: {r: 4, lora_alpha: 8, lora_dropout: 0.1, "
        "target_modules: [q_proj, v_proj], load_in_4bit: true}\n"
    )
    args = ["--batch_size", "2", "--seq_len", "32", "--json"]
    assert main(["estimate-memory", str(run), *args]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = torchloom.estimate_memory(llama_config(), batch_size=2, seq_len=32, peft=QLORA)
    assert printed == json.loads(json.dumps({**expected.to_dict(), "model": "LlamaForCausalLM"}))
    assert printed["adapter"] == "lora r=4, base in 4 bits (nf4)"

    args += ["--grad_checkpoint", "false"]
    assert main(["estimate-memory", str(run), *args, "--peft", "false"]) == 0  # the run config's adapter off
    off = json.loads(capsys.readouterr().out)
    assert off["adapter"] is None and off["trainable_parameters"] == off["parameters"]
    assert main(["estimate-memory", str(run), *args, "--peft", "{r: 8, target_modules: [q_proj]}"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["adapter"] == "lora r=8" and given["rows"][0]["weights"] > printed["rows"][0]["weights"]

    assert (
        main(["estimate-memory", str(run), "--batch_size", "2", "--seq_len", "32", "--grad_checkpoint", "false"]) == 0
    )
    header = capsys.readouterr().out.splitlines()[0]
    assert (
        header.startswith("LlamaForCausalLM: ") and "; adapter lora r=4, base in 4 bits (nf4); micro-batch 2" in header
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"r": 0}, "plugin 'peft': setting 'r' = 0; expected an integer >= 1"),
        (
            {"quant_type": "nf5", "load_in_4bit": True},
            "plugin 'peft': setting 'quant_type' = 'nf5'; did you mean 'nf4'?",
        ),
        ({"rr": 4}, "plugin 'peft': unknown setting 'rr'; did you mean 'r'?"),
        ({"target_modules": ["q_prj"]}, "plugin 'peft': setting 'target_modules' entry 'q_prj' matches no module"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "settings 'load_in_4bit' = True and 'load_in_8bit' = True"),
    ],
    ids=["r", "quant_type", "unknown", "target_modules", "4-and-8-bit"],
)
def test_a_bad_peft_setting_is_the_plugins_one_line_error(tmp_path, capsys, settings, message):
    with pytest.raises(torchloom.ConfigError) as excinfo:
        torchloom.estimate_memory(llama_config(), batch_size=1, seq_len=8, peft=settings)
    assert "\n" not in str(excinfo.value) and message in str(excinfo.value)
    with pytest.raises(torchloom.ConfigError) as from_plugin:  # a run's: when the plugin is enabled, or (a target
        # that matches nothing) in configure_model
        engine = torchloom.Engine(plugins={"peft": settings}, max_steps=1, output_dir=str(tmp_path))
        engine.fit(_LlamaTask(llama_config()))
    assert str(from_plugin.value) == str(excinfo.value)
    config = tmp_path / "llama.json"
    llama_config().to_json_file(config)
    assert main(["estimate-memory", str(config), "--peft", json.dumps(settings)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchloom: error: ") and message in err, err


def test_a_peft_argument_that_is_no_mapping_is_refused():
    with pytest.raises(torchloom.ConfigError, match=re.escape("peft = 'lora'; expected the peft plugin's settings")):
        torchloom.estimate_memory(llama_config(), batch_size=1, seq_len=8, peft="lora")  # type: ignore[arg-type]


class _LlamaTask(torchloom.TaskModule):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def configure_model(self) -> torch.nn.Module:
        return transformers.LlamaForCausalLM(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def train_dataloader(self) -> Any:
        ids = torch.randint(0, self.config.vocab_size, (2, 8))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-3)
