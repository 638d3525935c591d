"""The ``peft`` plugin: its settings errors (one line each, before training), composition (the same results as the
adapter written by hand, alone and with grad_clip, grad_checkpoint, grad_accum, bf16), exact resume of LoRA and 4-bit
QLoRA runs (1 process here, 2 with torchrun), checkpoints that hold the adapter only and refuse another base, rank
or target set, and the export: peft's format loaded by plain peft in a process that cannot import torchloom, the
merged model, ``inspect`` and ``predict`` from the adapter folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")

import torchloom
from torchloom.checkpoint.store import read_manifest
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from peft_fit import LORA, MP_SCENARIOS, HandLoraTask, LoraTask, PredictLoraTask, tiny_llama, token_data
from resume_fit import ShuffleTask, fit, stop_and_resume

from test_resume import assert_resumed_exactly


def _engine(tmp_path: Path, plugins: Any, **settings: Any) -> torchloom.Engine:
    settings = {"max_epochs": 1, "output_dir": str(tmp_path), **settings}
    return torchloom.Engine(plugins=plugins, **settings)


def _model(engine: torchloom.Engine) -> torch.nn.Module:
    return engine.accelerator.unwrap_model(engine._run.model)


def _one_line_config_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("settings", "pattern"),
    [
        ({"method": "lorra"}, r"setting 'method' = 'lorra'; did you mean 'lora'\?.*valid.*\bloha\b.*\blora\b"),
        ({"method": "prompt_tuning"}, r"setting 'method' = 'prompt_tuning'.*valid \(peft tuners injected in place\)"),
        ({"r": 0}, r"setting 'r' = 0; expected an integer >= 1"),
        ({"lora_alpha": 0}, r"setting 'lora_alpha' = 0.*expected a number > 0"),
        ({"lora_dropout": 1.0}, r"setting 'lora_dropout' = 1.0; expected a number in \[0, 1\)"),
        ({"bias": "lora-only"}, r"'bias' = 'lora-only'; did you mean 'lora_only'\? valid: none, all, lora_only"),
        ({"quant_type": "nf5", "load_in_4bit": True}, r"setting 'quant_type' = 'nf5'; did you mean 'nf4'\? valid: nf4"),
        ({"compute_dtype": "bf16"}, r"setting 'compute_dtype' = 'bf16'.*valid: float32, bfloat16, float16"),
        ({"load_in_4bit": True, "load_in_8bit": True}, r"'load_in_4bit' = True and 'load_in_8bit' = True"),
        ({"merge": True, "load_in_4bit": True}, r"setting 'merge' = True with load_in_4bit = True"),
        ({"options": {"use_rslor": True}}, r"'options' key 'use_rslor'.*LoraConfig; did you mean 'use_rslora'\?"),
        ({"target_modules": []}, r"setting 'target_modules' = \[\]"),
        ({"rank": 4}, r"plugin 'peft'.*'rank'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_and_the_valid_values(tmp_path, settings, pattern) -> None:
    with pytest.raises(torchloom.ConfigError, match=pattern) as excinfo:
        _engine(tmp_path, {"peft": settings})
    assert _one_line_config_error(excinfo).startswith("plugin 'peft': ")


class Recorder:
    """Counts the training steps: a set-up error must come before any."""

    name = "test.steps"

    def __init__(self) -> None:
        self.steps = 0

    @torchloom.hookimpl
    def on_train_batch_start(self) -> None:
        self.steps += 1


class NoLinearTask(LoraTask):
    """A model with no nn.Linear: nothing 4-bit could quantise."""

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Conv1d(6, 6, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[1]).square().mean()


@pytest.mark.parametrize(
    ("task", "settings", "pattern"),
    [
        (
            LoraTask,
            {"target_modules": ["qproj", "v_proj"]},
            r"setting 'target_modules' entry 'qproj' matches no module of LlamaForCausalLM; did you mean 'q_proj'\? "
            r"valid: 'all-linear'.*layer names: .*q_proj",
        ),
        (LoraTask, {"target_modules": ["model.layers.7.*"]}, r"entry 'model.layers.7.\*' matches no module"),
        (LoraTask, {"target_modules": r".*\.attn\.q_proj"}, r"entry '.*attn.*' matches no module"),
        (LoraTask, {"modules_to_save": ["lm_haed"]}, r"'modules_to_save' entry 'lm_haed'.*did you mean 'lm_head'\?"),
        (LoraTask, {"merge": True}, r"setting 'merge' = True .* engine setting 'save_model' is false; expected"),
        (
            NoLinearTask,
            {"target_modules": ["1"], "load_in_4bit": True},
            r"setting 'load_in_4bit' = True but Sequential has no torch.nn.Linear layer to quantise.*Conv1d.*"
            r"valid for this model: load_in_4bit: false",
        ),
    ],
)
def test_a_setting_that_does_not_fit_the_model_fails_before_training(tmp_path, task, settings, pattern) -> None:
    recorder = Recorder()
    engine = _engine(tmp_path, [{"peft": settings}, recorder])
    with pytest.raises(torchloom.ConfigError, match=pattern) as excinfo:
        engine.fit(task())
    _one_line_config_error(excinfo)
    assert recorder.steps == 0


# --------------------------------------------------------------------------------------------- composition


def _final(engine: torchloom.Engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _model(engine).named_parameters()}


def test_only_the_adapter_trains_and_the_base_stays_bitwise_the_same(tmp_path) -> None:
    base = {name: p.detach().clone() for name, p in tiny_llama().named_parameters()}
    engine = _engine(tmp_path, {"peft": LORA})
    engine.fit(LoraTask())
    model = _model(engine)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    # 2 layers x (q, v) x (A: 4 x 32, B: out x 4): q_proj 32 -> 32, v_proj 32 -> 16 (2 KV heads of 8)
    assert sum(model.get_parameter(n).numel() for n in trainable) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    for name, p in model.named_parameters():
        original = name.replace(".base_layer", "")
        if name not in trainable:
            assert torch.equal(p, base[original]), f"{name} changed"
    assert any(not torch.equal(model.get_parameter(n), torch.zeros_like(model.get_parameter(n))) for n in trainable)
    # The task's own AdamW over all parameters: state for the adapter only (the base never has a gradient).
    inner = getattr(engine._run.optimizer, "optimizer", engine._run.optimizer)
    with_state = {id(p) for p in inner.state}
    assert with_state == {id(model.get_parameter(n)) for n in trainable}


def test_the_optimizer_plugin_gets_only_the_trainable_parameters(tmp_path) -> None:
    engine = _engine(tmp_path, [{"peft": LORA}, {"optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}}])
    engine.fit(LoraTask())
    model = _model(engine)
    inner = getattr(engine._run.optimizer, "optimizer", engine._run.optimizer)
    in_groups = [p for group in inner.param_groups for p in group["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in in_groups} == {id(p) for p in trainable} and len(in_groups) == len(trainable) == 8


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [{"grad_clip": {"max_norm": 0.05}}],
        [{"grad_checkpoint": {"modules": "hf", "use_reentrant": True}}],
        [{"grad_checkpoint": {"modules": "hf"}}],
        [{"grad_accum": {"steps": 2, "normalization": "tokens"}}],
        [{"mixed_precision": {"dtype": "bf16"}}],
        pytest.param([{"compile": {"backend": "aot_eager"}}], marks=pytest.mark.slow),  # ~15 s of tracing
        [{"local_sgd": {"sync_every": 2}}],
    ],
    ids=["alone", "grad_clip", "checkpoint_reentrant", "checkpoint", "grad_accum", "bf16", "compile", "local_sgd"],
)
def test_the_plugin_gives_the_results_of_the_adapter_written_by_hand(tmp_path, extra) -> None:
    plugin = _engine(tmp_path / "plugin", [{"peft": LORA}, *extra], seed=3)
    hand = _engine(tmp_path / "hand", extra, seed=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "local_sgd: the run has 1 process", UserWarning)  # nothing to average
        plugin.fit(LoraTask())
        hand.fit(HandLoraTask())
    a, b = _final(plugin), _final(hand)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    timings = ("compile/",)  # compile's own counters and times: per process, not results
    assert [{k: v for k, v in r.items() if not k.startswith(timings)} for r in plugin.history] == [
        {k: v for k, v in r.items() if not k.startswith(timings)} for r in hand.history
    ]
    if extra and "grad_clip" in extra[0]:  # the norm is that of the adapter's gradients, and it clipped
        norms = [r["grad_norm"] for r in plugin.history if "grad_norm" in r]
        assert norms and all(n > 0.05 for n in norms)


@pytest.mark.parametrize("modules", ["hf", ["LlamaDecoderLayer"]], ids=["hf", "class"])
def test_reentrant_checkpointing_reaches_the_adapter_behind_frozen_embeddings(tmp_path, modules) -> None:
    """Reentrant checkpointing back-propagates only into inputs that require grad, and the frozen embeddings' output
    does not: every checkpointed layer's adapter must still get a gradient (B starts at zero, so one step with a
    gradient moves it)."""
    settings = [{"peft": LORA}, {"grad_checkpoint": {"modules": modules, "use_reentrant": True}}]
    engine = _engine(tmp_path, settings, max_steps=1)
    engine.fit(LoraTask(lr=1e-1))
    model = _model(engine)
    b_weights = [(n, p) for n, p in model.named_parameters() if ".lora_B." in n]
    assert len(b_weights) == 4
    for name, p in b_weights:
        assert p.abs().sum() > 0, f"{name}: no gradient reached the adapter"


# ------------------------------------------------------------------------------------------------- resume


def qlora_task() -> LoraTask:
    """Hidden size 64: bitsandbytes' CPU inference path (eval mode) needs in_features >= its block size (64); 8 ids
    (4 steps per epoch): 4-bit steps are slower on the CPU."""
    return LoraTask(n=8, hidden=64)


QLORA = {**LORA, "load_in_4bit": True}


@pytest.mark.parametrize(
    ("task", "settings", "stop"),
    [
        (LoraTask, LORA, {"save_at": [5]}),
        (LoraTask, LORA, {"save_epoch_end": [0]}),
        (qlora_task, QLORA, {"save_at": [3]}),
        (qlora_task, QLORA, {"save_epoch_end": [0]}),
    ],
    ids=["lora_step5", "lora_epoch0_end", "qlora_step3", "qlora_epoch0_end"],
)
def test_a_resumed_adapter_run_continues_bitwise(tmp_path, task, settings, stop) -> None:
    """LoRA: 12 ids in batches of 2 (6 steps per epoch, 3 epochs); 4-bit: 8 ids, 2 epochs; dropout on the adapter's
    input, AdamW + StepLR, a validation pass every 4 steps."""
    epochs = 2 if settings.get("load_in_4bit") else 3  # 4-bit steps are slower on the CPU
    a = fit(task, tmp_path / "a", [{"peft": settings}], max_epochs=epochs)
    b, c = stop_and_resume(task, tmp_path / "bc", [{"peft": settings}], max_epochs=epochs, **stop)
    assert_resumed_exactly(a, b, c)
    if settings.get("load_in_4bit"):
        q = _model(c.engine).model.layers[0].self_attn.q_proj.base_layer.weight
        assert q.dtype == torch.uint8 and type(q).__name__ == "Params4bit"


class BatchNormTask(ShuffleTask):
    """A plain torch model (not transformers) whose frozen base has running statistics: Linear -> BatchNorm1d ->
    Dropout -> Linear, with LoRA on both linear layers."""

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(2, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )


def test_a_plain_torch_model_resumes_bitwise_with_its_running_statistics(tmp_path) -> None:
    """The frozen base's BatchNorm statistics change in training: the checkpoint holds them with the adapter."""
    from safetensors.torch import load_file

    settings = [{"peft": {"r": 2, "lora_alpha": 4, "target_modules": ["0", "3"]}}]
    make = lambda: BatchNormTask(n=12)  # noqa: E731
    a = fit(make, tmp_path / "a", settings)
    b, c = stop_and_resume(make, tmp_path / "bc", settings, save_at=[7])
    assert_resumed_exactly(a, b, c)
    stored = load_file(os.path.join(b.checkpoint, "accelerate", "model.safetensors"))
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(stored)
    assert not any(k in stored for k in ("0.base_layer.weight", "1.weight", "3.base_layer.weight"))
    bn = _model(c.engine)[1]
    assert int(bn.num_batches_tracked) == 18 and bn.running_mean.abs().sum() > 0


def test_a_4bit_base_trains_the_same_after_an_evaluation_pass() -> None:
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel at the first forward in eval mode and keeps
    it so, and backward through that kernel has no autograd formula: the plugin turns the repacking off, so the
    gradients after a validation pass are those before it, and the frozen base keeps its bytes."""
    from torchloom_plugins.peft import PeftPluginConfig, apply_adapter

    model = tiny_llama(hidden=64)
    apply_adapter(model, PeftPluginConfig(**{**QLORA, "lora_dropout": 0.0}))
    tokens = token_data(2).tensors[1]
    adapter = [p for p in model.parameters() if p.requires_grad]

    def grads() -> list[torch.Tensor]:
        model.train()
        model.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        return [p.grad.clone() for p in adapter]

    torch.nn.init.normal_(adapter[1])  # a B != 0: the gradient of A depends on what flows through the base
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    before = grads()
    model.eval()
    with torch.no_grad():
        model(input_ids=tokens)
    after = grads()
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base.items())


def _checkpoint(tmp_path: Path, settings: dict[str, Any], task: Any = LoraTask) -> str:
    return fit(task, tmp_path / "saved", [{"peft": settings}], save_at=[3]).checkpoint


@pytest.mark.parametrize(("task", "settings", "hidden"), [(LoraTask, LORA, 32), (qlora_task, QLORA, 64)])
def test_a_checkpoint_holds_the_adapter_and_records_it(tmp_path, task, settings, hidden) -> None:
    from safetensors.torch import load_file

    ckpt = _checkpoint(tmp_path, settings, task)
    stored = load_file(os.path.join(ckpt, "accelerate", "model.safetensors"))
    assert stored and all(".lora_A.default." in k or ".lora_B.default." in k for k in stored)
    kv = hidden // 2  # 2 of 4 heads
    assert len(stored) == 8 and sum(t.numel() for t in stored.values()) == 2 * 4 * (3 * hidden + kv)
    adapter = read_manifest(ckpt)["adapter"]
    assert adapter["method"] == "lora" and (adapter["r"], adapter["lora_alpha"]) == (4, 8)
    assert adapter["targets"] == [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]
    assert adapter["quantization"] == ("4bit" if settings.get("load_in_4bit") else None)
    assert adapter["base"]["class"].endswith("LlamaForCausalLM") and len(adapter["base"]["sha256"]) == 64


@pytest.mark.parametrize(
    ("settings", "task", "pattern"),
    [
        ({**LORA, "r": 8}, LoraTask, r"another adapter rank r: saved 4, now 8"),
        (
            {**LORA, "target_modules": ["q_proj", "k_proj"]},
            LoraTask,
            r"another set of target modules: only in the checkpoint: \['model.layers.0.self_attn.v_proj'.*"
            r"only in this run: \['model.layers.0.self_attn.k_proj'",
        ),
        (LORA, lambda: LoraTask(base_seed=1), r"another base model \(.*LlamaForCausalLM\): its frozen weights differ"),
        ({**LORA, "load_in_8bit": True}, LoraTask, r"another base quantization: saved None, now 8bit"),
    ],
    ids=["rank", "targets", "base", "quantization"],
)
def test_resuming_onto_another_adapter_or_base_is_one_checkpoint_error_naming_it(
    tmp_path, settings, task, pattern
) -> None:
    ckpt = _checkpoint(tmp_path, LORA)
    with pytest.raises(torchloom.CheckpointError, match=pattern) as excinfo:
        fit(task, tmp_path / "resumed", [{"peft": settings}], ckpt_path=ckpt)
    message = str(excinfo.value)
    assert message.startswith("cannot resume from checkpoint: ") and "\n" not in message
    assert "parameters differ" not in message  # the cause, not the parameter shapes that follow from it


def test_resuming_an_adapter_checkpoint_without_the_plugin_is_refused(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path, LORA)
    with pytest.raises(torchloom.CheckpointError, match=r"the checkpoint holds an adapter and this run's model"):
        fit(LoraTask, tmp_path / "resumed", [], ckpt_path=ckpt)


@pytest.mark.multiprocess
def test_two_processes_resume_adapter_runs_exactly(tmp_path) -> None:
    """LoRA (mid-epoch, an epoch-end checkpoint) and 4-bit QLoRA, DDP on 2 processes: each rank's B + C is its A;
    and the plugin's LoRA run equals, bitwise on each rank, the same run with the adapter written by hand."""
    ranks = torchrun("peft_fit.py", tmp_path, nproc=2, timeout=400)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    for name, spec in MP_SCENARIOS.items():
        for i, stop in enumerate(spec["stops"]):
            recs = [r[name][i] for r in ranks]
            for rank, rec in enumerate(recs):
                try:
                    assert_resumed_exactly(rec)
                except AssertionError as exc:
                    raise AssertionError(f"{name} {stop}, rank {rank}: {exc}") from None
            assert recs[0]["c"]["params"] == recs[1]["c"]["params"], f"{name} {stop}: the ranks differ"
            assert not set(recs[0]["a_ids"][:2]) & set(recs[1]["a_ids"][:2]), f"{name}: not data-parallel"
    for rank, result in enumerate(ranks):  # DDP: the plugin's run is bitwise the one with the adapter by hand
        by_hand = result["by_hand"]
        assert by_hand["plugin_ids"] == by_hand["hand_ids"], f"rank {rank}: other samples"
        assert by_hand["plugin"] == by_hand["hand"], f"rank {rank}: the parameters or optimizer states differ"
        assert by_hand["plugin_history"] == by_hand["hand_history"], f"rank {rank}: the logged values differ"
    assert ranks[0]["by_hand"]["plugin"] == ranks[1]["by_hand"]["plugin"]


# ------------------------------------------------------------------------------------------------- export


_NO_TORCHLOOM = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torchloom", "torchloom_plugins"):
            raise ImportError(f"{name} must not be imported here")
        return None
sys.meta_path.insert(0, _Refuse())
"""


def _logits_without_torchloom(tmp_path: Path, script: str) -> torch.Tensor:
    from safetensors.torch import load_file

    out = tmp_path / "logits.safetensors"
    code = _NO_TORCHLOOM + textwrap.dedent(script).replace("OUT", repr(str(out)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out))["logits"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """A LoRA fit (with a head trained in full, modules_to_save) saved with merge: true; the base saved apart; the
    adapted model's logits on fixed tokens."""
    root = tmp_path_factory.mktemp("exported")
    settings = {**LORA, "lora_dropout": 0.0, "modules_to_save": ["lm_head"], "merge": True}
    engine = _engine(root / "runs", {"peft": settings}, max_epochs=2, save_model=True)
    engine.fit(LoraTask(lr=5e-2))
    model = _model(engine).eval()
    tokens = token_data(3, seed=9).tensors[1]
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    tiny_llama().save_pretrained(root / "base")
    return {"model_dir": Path(engine.run_dir) / "model", "base": root / "base", "tokens": tokens, "logits": logits}


def test_the_model_folder_is_peft_format_loaded_by_plain_peft_without_torchloom(exported, tmp_path) -> None:
    model_dir = exported["model_dir"]
    names = sorted(os.listdir(model_dir))
    assert names == ["adapter_config.json", "adapter_model.safetensors", "merged", "torchloom_model.json"]
    config = json.loads((model_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["modules_to_save"] == ["lm_head"]
    torch.save(exported["tokens"], tmp_path / "tokens.pt")
    logits = _logits_without_torchloom(
        tmp_path,
        f"""
        import torch, transformers, peft
        from safetensors.torch import save_file
        base = transformers.LlamaForCausalLM.from_pretrained({str(exported["base"])!r})
        model = peft.PeftModel.from_pretrained(base, {str(model_dir)!r}).eval()
        tokens = torch.load({str(tmp_path / "tokens.pt")!r})
        with torch.no_grad():
            save_file({{"logits": model(input_ids=tokens).logits.contiguous()}}, OUT)
        """,
    )
    difference = (logits - exported["logits"]).abs().max().item()
    assert difference <= 1e-6, difference
    # the adapter moved the logits: a fresh adapter (B = 0) would give the base's, and fail the comparison above
    with torch.no_grad():
        base_logits = tiny_llama().eval()(input_ids=exported["tokens"]).logits
    assert (base_logits - exported["logits"]).abs().max() > 1e-3


def test_merge_writes_an_ordinary_transformers_folder_with_the_same_logits(exported, tmp_path) -> None:
    merged = exported["model_dir"] / "merged"
    assert (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()
    torch.save(exported["tokens"], tmp_path / "tokens.pt")
    logits = _logits_without_torchloom(
        tmp_path,
        f"""
        import torch, transformers
        from safetensors.torch import save_file
        model = transformers.AutoModelForCausalLM.from_pretrained({str(merged)!r}).eval()
        assert not any("lora" in name for name, _ in model.named_parameters())
        tokens = torch.load({str(tmp_path / "tokens.pt")!r})
        with torch.no_grad():
            save_file({{"logits": model(input_ids=tokens).logits.contiguous()}}, OUT)
        """,
    )
    difference = (logits - exported["logits"]).abs().max().item()
    assert difference <= 1e-5, difference  # merging rounds W + s B A once in float32 (measured ~1e-7)


def test_inspect_shows_the_adapter_and_the_base_it_needs(exported) -> None:
    info = torchloom.inspect_path(exported["model_dir"])
    adapter = info["adapter"]
    assert adapter["method"] == "lora" and adapter["r"] == 4 and adapter["modules_to_save"] == ["lm_head"]
    assert adapter["targets"] == [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]
    head = 32 * 32  # lm_head, trained in full (its copy: the original stays frozen)
    lora = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert adapter["trainable_parameters"] == lora + head
    assert adapter["total_parameters"] == sum(p.numel() for p in tiny_llama().parameters()) + lora + head
    assert adapter["bytes"] == 4 * (lora + head) == info["weights"]["bytes"]
    assert adapter["base"]["class"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    from cli_util import run_cli

    done = run_cli("inspect", str(exported["model_dir"]), cwd=exported["model_dir"])
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert "lora r=4 lora_alpha=8" in out and "base" in out and f"{lora + head:,} of" in out


@pytest.mark.parametrize("with_plugin", [True, False], ids=["plugin", "no_plugin"])
def test_predict_from_the_adapter_folder_gives_the_trained_model_outputs(exported, tmp_path, with_plugin) -> None:
    settings = {**LORA, "lora_dropout": 0.0, "modules_to_save": ["lm_head"]}
    engine = _engine(tmp_path, [{"peft": settings}] if with_plugin else [])
    (logits,) = engine.predict(PredictLoraTask(), ckpt_path=str(exported["model_dir"]))
    assert torch.equal(exported["tokens"], token_data(3, seed=9).tensors[1])
    assert (logits - exported["logits"]).abs().max().item() <= 1e-6


def test_the_predict_command_reads_an_adapter_folder(exported, tmp_path) -> None:
    import yaml

    from cli_util import run_cli

    config = {
        "engine": {"output_dir": "run"},
        "task": {"class_path": "peft_fit.PredictLoraTask"},
        "plugins": {"peft": {**LORA, "modules_to_save": ["lm_head"]}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("predict", "--config", "config.yaml", "--ckpt_path", str(exported["model_dir"]), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"weights of saved model {exported['model_dir']}" in done.stdout
    (predictions,) = (tmp_path / "run").glob("version_*/predictions.jsonl")
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(rows) == 3
    difference = (torch.tensor([row["prediction"] for row in rows]) - exported["logits"]).abs().max().item()
    assert difference <= 1e-6, difference
