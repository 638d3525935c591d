"""The ``peft`` plugin's LoRA under FSDP2 on 2 CPU processes (issue 41, item 5), against the same run under DDP: it
trains within 1e-6 of DDP; a checkpoint holds the adapter and ``modules_to_save`` only (one file, as on DDP, and the
optimizer's shards) and names the same base (SHA-256 of the unsharded base) as the DDP run's; a resume is bitwise;
the saved adapter (``model/``) and its merged model load with plain peft / transformers and equal DDP's within 1e-6,
and so does ``export --merge`` of the FSDP checkpoint; a 4-bit or 8-bit base under FSDP on CPU stops at start-up.
One launch (tests/mp/fsdp_peft_fit.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")

import torchloom
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from peft_fit import LORA, LoraTask, tiny_llama, token_data

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The DDP fit, the FSDP2 fit, the FSDP2 fit resumed from its step-8 checkpoint, the refused quantised bases
    (each rank's results), and the base model saved apart (``base``)."""
    root = tmp_path_factory.mktemp("fsdp_peft")
    ranks = torchrun("fsdp_peft_fit.py", root, timeout=400)
    tiny_llama().save_pretrained(root / "base")
    return {"ranks": ranks, "base": root / "base", "root": root}


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _checkpoint(result: dict[str, Any], step: int) -> Path:
    return Path(next(p for p in result["checkpoints"] if p.endswith(f"step-{step:08d}")))


def test_lora_under_fsdp_trains_as_under_ddp_with_the_adapter_sharded(runs) -> None:
    ranks = runs["ranks"]
    ddp, fsdp = ranks[0]["ddp"], ranks[0]["fsdp"]
    assert [r["ddp"]["distributed_type"] for r in ranks] == ["MULTI_CPU"] * 2
    assert [r["fsdp"]["distributed_type"] for r in ranks] == ["FSDP"] * 2
    assert fsdp["global_step"] == ddp["global_step"] == 16
    assert sum(r["fsdp"]["local_elements"] for r in ranks) == fsdp["elements"] == ddp["elements"]
    assert ranks[0]["fsdp"]["trainable"] == ranks[1]["fsdp"]["trainable"]  # gathered: the same adapter on both
    trained = {k: torch.tensor(v) for k, v in fsdp["trainable"].items()}
    reference = {k: torch.tensor(v) for k, v in ddp["trainable"].items()}
    assert any("lora_A" in k for k in trained) and any("modules_to_save" in k for k in trained)
    assert _largest_difference(trained, reference) <= TOLERANCE
    for a, b in zip(fsdp["history"], ddp["history"], strict=True):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= TOLERANCE for k in a)


def test_an_fsdp_checkpoint_holds_the_adapter_alone_and_names_the_ddp_runs_base(runs) -> None:
    from safetensors.torch import load_file

    ranks = runs["ranks"]
    fsdp8, ddp8 = _checkpoint(ranks[0]["fsdp"], 8), _checkpoint(ranks[0]["ddp"], 8)
    accelerate = sorted(p.name for p in (fsdp8 / "accelerate").iterdir())
    assert accelerate == ["model.safetensors", "optimizer_0"]  # no shards of the frozen base
    stored, reference = (
        load_file(fsdp8 / "accelerate" / "model.safetensors"),
        load_file(ddp8 / "accelerate" / "model.safetensors"),
    )
    plain = {k.removeprefix("module."): v for k, v in reference.items()}
    assert all(".lora_A.default." in k or ".lora_B.default." in k or ".modules_to_save.default." in k for k in stored)
    assert _largest_difference(stored, plain) <= TOLERANCE
    assert sum(t.numel() for t in stored.values()) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4) + 32 * 32
    fsdp_manifest = json.loads((fsdp8 / "manifest.json").read_text())
    ddp_manifest = json.loads((ddp8 / "manifest.json").read_text())
    assert fsdp_manifest["adapter"] == ddp_manifest["adapter"]  # the same base: class and SHA-256 of its weights
    assert fsdp_manifest["adapter"]["base"]["class"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert fsdp_manifest["distributed_type"] == "DistributedType.FSDP"


def test_an_fsdp_adapter_checkpoint_resumes_bitwise(runs) -> None:
    for result in runs["ranks"]:
        fsdp, resumed = result["fsdp"], result["resumed"]
        assert resumed["distributed_type"] == "FSDP" and resumed["global_step"] == 16
        assert resumed["trainable"] == fsdp["trainable"]  # bitwise
        # the step-8 checkpoint is saved before epoch 0's validation: the resumed run validates first
        assert fsdp["history"][3] == {"step": 8, "epoch": 0, "train/loss": fsdp["history"][3]["train/loss"]}
        assert resumed["history"] == fsdp["history"][4:]


def _logits(model_dir: Path, base: Path, merged: bool) -> torch.Tensor:
    """Plain transformers / peft (no torchloom): the adapter folder onto the base, or the merged folder."""
    import peft
    import transformers

    if merged:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "merged")
        assert not any("lora" in name for name, _ in model.named_parameters())
    else:
        model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), model_dir)
    with torch.no_grad():
        return model.eval()(input_ids=token_data(3, seed=9).tensors[1]).logits


def test_the_saved_adapter_and_merged_model_load_with_plain_peft_and_equal_ddps(runs) -> None:
    from safetensors.torch import load_file

    ranks, base = runs["ranks"], runs["base"]
    fsdp_dir = Path(ranks[0]["fsdp"]["run_dir"]) / "model"
    ddp_dir = Path(ranks[0]["ddp"]["run_dir"]) / "model"
    names = ["adapter_config.json", "adapter_model.safetensors", "merged", "torchloom_model.json"]
    assert sorted(p.name for p in fsdp_dir.iterdir()) == names
    assert json.loads((fsdp_dir / "adapter_config.json").read_text()) == json.loads(
        (ddp_dir / "adapter_config.json").read_text()
    )
    weights = "adapter_model.safetensors"
    assert _largest_difference(load_file(fsdp_dir / weights), load_file(ddp_dir / weights)) <= TOLERANCE
    merged = "merged/model.safetensors"
    assert _largest_difference(load_file(fsdp_dir / merged), load_file(ddp_dir / merged)) <= TOLERANCE
    card = json.loads((fsdp_dir / "torchloom_model.json").read_text())
    assert card["adapter"]["base"] == json.loads((ddp_dir / "torchloom_model.json").read_text())["adapter"]["base"]
    for merged_folder in (False, True):
        fsdp_logits = _logits(fsdp_dir, base, merged_folder)
        assert (fsdp_logits - _logits(ddp_dir, base, merged_folder)).abs().max().item() <= 1e-5
    with torch.no_grad():  # the adapter moved the logits (a fresh one, B = 0, would give the base's)
        untrained = tiny_llama().eval()(input_ids=token_data(3, seed=9).tensors[1]).logits
    assert (untrained - _logits(fsdp_dir, base, False)).abs().max().item() > 1e-3


def test_export_merge_of_an_fsdp_checkpoint_gives_the_fits_saved_model(runs) -> None:
    from safetensors.torch import load_file

    fsdp = runs["ranks"][0]["fsdp"]
    settings = {**LORA, "modules_to_save": ["lm_head"], "merge": True}  # as `torchloom export --merge` sets it
    exporter = torchloom.Engine(output_dir=str(runs["root"] / "exports"), seed=0, plugins={"peft": settings})
    out = Path(exporter.export(LoraTask(n=32, lr=5e-2), _checkpoint(fsdp, 16), runs["root"] / "exported"))
    saved = Path(fsdp["run_dir"]) / "model"
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        assert _largest_difference(load_file(out / name), load_file(saved / name)) <= TOLERANCE, name


@pytest.mark.parametrize("bits", ["load_in_4bit", "load_in_8bit"])
def test_a_quantised_base_under_fsdp_on_cpu_stops_at_start_up(runs, bits) -> None:
    for result in runs["ranks"]:
        message = result[bits]
        assert message is not None and message.startswith(
            f"ConfigError: plugin 'peft': setting '{bits}' = True under FSDP (plugin 'fsdp') on CPU processes: "
        ), message
        assert "Accelerate leaves them out of the sharding" in message and "\n" not in message
