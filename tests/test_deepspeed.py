"""DeepSpeed ZeRO-1 and ZeRO-2 on CPU processes (gloo), through Accelerate, as users ask for it: the ``deepspeed``
plugin or the environment ``accelerate launch --use_deepspeed --zero_stage 2`` sets (issue 41, item 7). Against DDP
on the same data and plugins (grad_accum, grad_clip at 0.5, AdamW); a resume on the same processes is bitwise; the
saved model and ``export`` of a DeepSpeed checkpoint load with plain transformers; LoRA (peft) under ZeRO-2 trains
and resumes; what DeepSpeed would not do (ZeRO-3, offload, clipping by value, token normalisation, 16-bit on CPU, a
partial accumulation window) stops with the reason instead of running otherwise. One launch
(tests/mp/deepspeed_fit.py, about 50 s on 2 CPU cores).

DeepSpeed is an optional test dependency (the tests session installs it with ``DS_BUILD_OPS=0``): without it the
multi-process tests skip, and the error a run gets without it is tested here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchloom
from torchloom.testing import TinyTask
from torchrun_util import MP_DIR, torchrun

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install 'torchloom[deepspeed]')"
)
#: The largest difference from DDP's parameters after 16 steps in float32; measured: ZeRO-1 3.5e-7, ZeRO-2 1.4e-6,
#: LoRA under ZeRO-2 2.0e-7 (the same mean gradient, reduced in another order).
TOLERANCE = 5e-6
ZERO_OPTIMIZER = ["DeepSpeedOptimizerWrapper", "DeepSpeedZeroOptimizer", "AdamW"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every fit of tests/mp/deepspeed_fit.py, by name, as rank 0 saw it (``ranks``: both ranks')."""
    root = tmp_path_factory.mktemp("deepspeed")
    ranks = torchrun("deepspeed_fit.py", root, timeout=400)
    return {**ranks[0], "ranks": ranks, "root": root}


def _largest_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def _checkpoint(result: dict[str, Any], step: int) -> Path:
    return Path(next(p for p in result["checkpoints"] if p.endswith(f"step-{step:08d}")))


@needs_deepspeed
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_zero_runs_deepspeeds_optimizer_on_cpu_processes_and_trains_as_ddp(runs, stage):
    ddp, zero = runs["ddp"], runs[stage]
    assert [r["ddp"]["distributed_type"] for r in runs["ranks"]] == ["MULTI_CPU"] * 2
    # not a silent DDP: Accelerate chose DeepSpeed, whose engine and ZeRO optimizer run the step
    assert [r[stage]["distributed_type"] for r in runs["ranks"]] == ["DEEPSPEED"] * 2
    assert zero["model_type"] == "DeepSpeedEngine" and zero["optimizer_types"] == ZERO_OPTIMIZER
    assert ddp["optimizer_types"] == ["AcceleratedOptimizer", "AdamW"]
    assert runs["ranks"][1][stage]["trainable"] == zero["trainable"]  # every process holds the whole model
    assert zero["global_step"] == ddp["global_step"] == 16
    # grad_clip's max_norm 0.5 is DeepSpeed's gradient_clipping (Accelerate would fill "auto" with 1.0, and none is
    # none): the norms are above 0.5 and mostly above 1, so either other value would leave another model
    assert 0 < _largest_difference(zero["trainable"], ddp["trainable"]) <= TOLERANCE
    for a, b in zip(zero["history"], ddp["history"], strict=True):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6) for k in a)
    norms = [h["grad_norm"] for h in ddp["history"] if "grad_norm" in h]
    assert min(norms) > 0.5 and sum(n > 1.0 for n in norms) > len(norms) / 2


@needs_deepspeed
@pytest.mark.multiprocess
def test_a_zero2_checkpoint_is_deepspeeds_own_inside_torchloom_and_resumes_bitwise(runs):
    zero2 = runs["zero2"]
    for rank in runs["ranks"]:
        resumed = rank["resumed"]
        assert resumed["distributed_type"] == "DEEPSPEED" and resumed["global_step"] == 16
        assert resumed["trainable"] == rank["zero2"]["trainable"]
        assert resumed["history"] == [h for h in rank["zero2"]["history"] if h["step"] > 8]
    step8 = _checkpoint(zero2, 8)
    manifest = json.loads((step8 / "manifest.json").read_text())
    saved = sorted(name for name in manifest["files"] if name.startswith("accelerate/pytorch_model/"))
    assert saved == [  # each process wrote its optimizer partition; the checksums cover them
        "accelerate/pytorch_model/mp_rank_00_model_states.pt",
        "accelerate/pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "accelerate/pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert manifest["distributed_type"] == "DistributedType.DEEPSPEED"


@needs_deepspeed
@pytest.mark.multiprocess
def test_deepspeed_from_the_accelerate_launch_environment_is_the_plugins_zero2(runs):
    """``accelerate launch --use_deepspeed --zero_stage 2`` sets ACCELERATE_USE_DEEPSPEED and the stage."""
    assert [r["env"]["distributed_type"] for r in runs["ranks"]] == ["DEEPSPEED"] * 2
    assert runs["env"]["optimizer_types"] == ZERO_OPTIMIZER
    assert runs["env"]["trainable"] == runs["zero2"]["trainable"]
    assert runs["flags"] == {"ACCELERATE_USE_DEEPSPEED": None, "ACCELERATE_USE_CPU": "1"}  # put back after it
    # --gradient_clipping 0.5 without the grad_clip plugin: DeepSpeed clips as its config says, the same run
    assert runs["env_clip"]["trainable"] == runs["zero2"]["trainable"]
    assert runs["env_clip"]["optimizer_types"] == ZERO_OPTIMIZER
    assert runs["env_clip"]["clipping"] == runs["zero2"]["clipping"] == 0.5


@needs_deepspeed
@pytest.mark.multiprocess
def test_without_grad_clip_deepspeed_does_not_clip(runs):
    """Accelerate fills DeepSpeed's gradient_clipping "auto" with 1.0; torchloom with 0 where no plugin clips."""
    assert runs["noclip"]["distributed_type"] == "DEEPSPEED"
    assert runs["noclip"]["clipping"] == 0.0
    assert runs["noclip"]["trainable"] != runs["zero2"]["trainable"]


@needs_deepspeed
@pytest.mark.multiprocess
def test_the_saved_model_and_the_export_of_a_checkpoint_load_whole_in_plain_transformers(runs, tmp_path):
    import transformers

    sys.path.insert(0, str(MP_DIR))
    from deepspeed_fit import LlamaTask

    trained = {n: torch.tensor(v) for n, v in runs["zero2"]["trainable"].items()}
    exporter = torchloom.Engine(output_dir=str(tmp_path / "exports"), seed=0)  # one process, no DeepSpeed
    exported = exporter.export(LlamaTask(), _checkpoint(runs["zero2"], 16), tmp_path / "exported")
    for folder in (Path(runs["zero2"]["run_dir"]) / "model", Path(exported)):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        loaded = {n: p.detach().double().flatten() for n, p in model.named_parameters()}
        assert loaded.keys() == trained.keys()
        assert all(torch.equal(loaded[n], trained[n]) for n in trained), folder


@needs_deepspeed
@pytest.mark.multiprocess
def test_lora_under_zero2_trains_as_under_ddp_saves_the_adapter_and_resumes_bitwise(runs):
    from safetensors.torch import load_file

    ddp, zero2 = runs["peft_ddp"], runs["peft_zero2"]
    assert zero2["distributed_type"] == "DEEPSPEED" and zero2["optimizer_types"] == ZERO_OPTIMIZER
    assert sorted(zero2["trainable"]) == sorted(ddp["trainable"]) and all("lora_" in n for n in zero2["trainable"])
    assert 0 < _largest_difference(zero2["trainable"], ddp["trainable"]) <= TOLERANCE
    for rank in runs["ranks"]:
        resumed = rank["peft_resumed"]
        assert resumed["trainable"] == rank["peft_zero2"]["trainable"]
        # the step-8 checkpoint is saved before epoch 0's validation: the resumed run validates first
        assert resumed["history"] == [h for h in rank["peft_zero2"]["history"] if h["step"] >= 8][1:]
    model_dir = Path(zero2["run_dir"]) / "model"
    weights = "adapter_model.safetensors"
    adapter, reference = load_file(model_dir / weights), load_file(Path(ddp["run_dir"]) / "model" / weights)
    assert adapter.keys() == reference.keys()
    assert max((adapter[k].double() - reference[k].double()).abs().max().item() for k in adapter) <= TOLERANCE
    assert (model_dir / "merged" / "model.safetensors").is_file()


REFUSALS = {
    "zero3": "ConfigError: DeepSpeed was requested (deepspeed) on 2 CPU processes with ZeRO stage 3: ",
    "offload": "ConfigError: DeepSpeed was requested (deepspeed) on 2 CPU processes with offload_optimizer to 'cpu'",
    "clip_value": "ConfigError: plugin 'grad_clip' under DeepSpeed, which clips the gradients inside its own step "
    "(its gradient_clipping), so this plugin cannot clip them otherwise: setting 'clip_value' = 0.1: ",
    "clip_explicit": "ConfigError: plugin 'grad_clip' under DeepSpeed, which clips the gradients inside its own step "
    "(its gradient_clipping), so this plugin cannot clip them otherwise: max_norm 0.5, but the DeepSpeed config's "
    "gradient_clipping is 1.0; ",
    "tokens": "ConfigError: plugin 'grad_accum': setting 'normalization' = 'tokens' under DeepSpeed: ",
    "bf16": "ConfigError: DeepSpeed was requested (deepspeed) on 2 CPU processes with mixed precision (bf16): ",
    "short_window": "PluginError: grad_accum: a window of 1 micro-batches, fewer than steps=3, ended the epoch under "
    "DeepSpeed",
}


@needs_deepspeed
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_what_deepspeed_would_not_do_stops_with_the_reason(runs, name):
    for rank in runs["ranks"]:
        assert rank[name] is not None and rank[name].startswith(REFUSALS[name]), rank[name]


def test_deepspeed_requested_without_deepspeed_installed_says_how_to_install_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins={"deepspeed": {}})
    with pytest.raises(torchloom.ConfigError, match=r"^plugin 'deepspeed': the deepspeed package is not installed"):
        engine.fit(TinyTask())
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # accelerate launch --use_deepspeed
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1)
    with pytest.raises(torchloom.ConfigError, match=r"DS_BUILD_OPS=0 pip install 'torchloom\[deepspeed\]'") as info:
        engine.fit(TinyTask())
    assert str(info.value).startswith("DeepSpeed was requested (ACCELERATE_USE_DEEPSPEED (accelerate launch)), but")


@needs_deepspeed
def test_deepspeed_on_one_process_stops_at_start_up_and_leaves_no_flag_behind(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins={"deepspeed": {}})
    with pytest.raises(
        torchloom.ConfigError, match=r"^DeepSpeed was requested \(deepspeed\) on 1 CPU process: it needs"
    ):
        engine.fit(TinyTask())
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ
    plain = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1)
    plain.fit(TinyTask())
    assert plain.accelerator.distributed_type.value == "NO"


@needs_deepspeed
@pytest.mark.parametrize(
    ("environment", "plugins", "message"),
    [
        (
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
            {},
            "with gradient_accumulation_steps 4 in its DeepSpeed config, but the run accumulates 1 micro-batch(es) ",
        ),
        (
            {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
            {"grad_accum": {"steps": 2}},
            "with gradient_accumulation_steps 4 in its DeepSpeed config, but the run accumulates 2 micro-batch(es) ",
        ),
    ],
)
def test_a_deepspeed_accumulation_that_the_engine_would_not_follow_stops_at_start_up(
    tmp_path, monkeypatch, environment, plugins, message
):
    """What ``accelerate launch --use_deepspeed --gradient_accumulation_steps 4`` sets: DeepSpeed would accumulate
    otherwise than the run's grad_accum plugin (or none); refused before any process group is needed."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins=plugins)
    with pytest.raises(torchloom.ConfigError) as info:
        engine.fit(TinyTask())
    assert str(info.value).startswith("DeepSpeed was requested (ACCELERATE_USE_DEEPSPEED (accelerate launch))")
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("saved", "now"), [("DEEPSPEED", "MULTI_CPU"), ("MULTI_CPU", "DEEPSPEED"), ("NO", "DEEPSPEED")]
)
def test_a_checkpoint_with_deepspeed_on_one_side_only_is_refused_before_loading(saved, now):
    """DeepSpeed's files are read by DeepSpeed's load_checkpoint, a DDP checkpoint's by Accelerate's load_state
    without DeepSpeed: a resume across the two is refused with the reason (on the same number of processes, where
    the re-sharding rules let it through)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from torchloom.checkpoint.compat import check_compatible

    model = torch.nn.Linear(2, 2)
    manifest = {
        "world_size": 2,
        "distributed_type": f"DistributedType.{saved}",
        "model": {"parameters": {n: list(p.shape) for n, p in model.named_parameters()}},
        "optimizer": {"class": "AdamW"},
    }
    optimizer = torch.optim.AdamW(model.parameters())

    def run(kind: str) -> SimpleNamespace:
        return SimpleNamespace(num_processes=2, distributed_type=DistributedType(kind), unwrap_model=lambda m: m)

    with pytest.raises(torchloom.CheckpointError, match=f"it was written under {saved} and this run is {now}: "):
        check_compatible(manifest, accelerator=run(now), model=model, optimizer=optimizer, reset_optimizer=False)
    assert check_compatible(manifest, accelerator=run(saved), model=model, optimizer=optimizer, reset_optimizer=False)
