"""FSDP2 on CPU processes (gloo), through Accelerate, as users configure it: the ``fsdp`` plugin or the environment
``accelerate launch`` sets from an Accelerate config. Against DDP on the same data and plugins (grad_accum with
token normalisation, grad_clip, AdamW, checkpoints); a resume on the same processes is bitwise; a request that
cannot take effect stops at start-up instead of running DDP (issue 41, item 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchloom.testing import TinyTask
from torchrun_util import torchrun

pytestmark = pytest.mark.multiprocess

#: What accelerate launch sets from a config with distributed_type FSDP, fsdp_version 2 (accelerate/utils/launch.py).
ACCELERATE_FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The DDP and FSDP2 fits (2 processes each), and the FSDP2 fit resumed from its step-8 checkpoint."""
    root = tmp_path_factory.mktemp("fsdp")
    results = {mode: torchrun("fsdp_fit.py", root / mode, mode, "-") for mode in ("ddp", "fsdp")}
    middle = next(p for p in results["fsdp"][0]["checkpoints"] if p.endswith("step-00000008"))
    results["resumed"] = torchrun("fsdp_fit.py", root / "resumed", "fsdp", middle)
    return results


def _largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def test_the_fsdp_plugin_shards_on_cpu_processes_and_trains_as_ddp(runs):
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    assert [r["distributed_type"] for r in ddp] == ["MULTI_CPU"] * 2
    assert [r["distributed_type"] for r in fsdp] == ["FSDP"] * 2
    assert fsdp[0]["params"] == fsdp[1]["params"]  # gathered from the shards: the same model on both
    assert fsdp[0]["global_step"] == ddp[0]["global_step"] == 16
    assert _largest_difference(fsdp[0]["params"], ddp[0]["params"]) <= 1e-6
    assert _largest_difference(fsdp[0]["params"], ddp[0]["params"]) > 0  # another reduction order, not DDP itself
    for a, b in zip(fsdp[0]["history"], ddp[0]["history"], strict=True):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6) for k in a)


def test_each_process_holds_its_shard_and_the_sizes_say_both(runs):
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    elements = fsdp[0]["elements"]
    assert elements == ddp[0]["elements"] == ddp[0]["local_elements"] == 21_664
    assert sum(r["local_elements"] for r in fsdp) == elements
    assert all(r["local_elements"] < 0.6 * elements for r in fsdp)
    whole = ddp[0]["optimizer_bytes"]
    assert [r["optimizer_bytes"] for r in fsdp] == [whole, whole]  # the whole state, as a checkpoint holds it
    assert ddp[0]["optimizer_process_bytes"] == whole
    # Each process holds its shard of AdamW's moments, and the whole of each parameter's step count (a 4-byte
    # scalar tensor, not sharded)
    assert sum(r["optimizer_process_bytes"] for r in fsdp) == whole + 4 * fsdp[0]["tensors"]
    assert all(r["optimizer_process_bytes"] < 0.6 * whole for r in fsdp)


def test_the_summary_gives_the_whole_size_and_what_the_main_process_holds(runs):
    """The line docs/plugins/fsdp.md shows."""
    summary = json.loads((Path(runs["fsdp"][0]["run_dir"]) / "summary.json").read_text())
    assert summary["parameters"] == {"total": 21_664, "trainable": 21_664, "bytes": 86_656, "process_bytes": 43_328}
    assert (summary["optimizer_state_bytes"], summary["optimizer_state_process_bytes"]) == (173_396, 86_740)
    line = "parameters 21,664 (21,664 trainable), 84.6 KiB (42.3 KiB on this process); optimizer state 169 KiB"
    assert line in (Path(__file__).parents[1] / "docs" / "plugins" / "fsdp.md").read_text()


def test_a_sharded_checkpoint_resumes_bitwise_on_the_same_processes(runs):
    fsdp, resumed = runs["fsdp"], runs["resumed"]
    assert [r["distributed_type"] for r in resumed] == ["FSDP"] * 2
    assert resumed[0]["params"] == fsdp[0]["params"]
    assert resumed[0]["history"] == [h for h in fsdp[0]["history"] if h["step"] > 8]
    step8 = Path(next(p for p in fsdp[0]["checkpoints"] if p.endswith("step-00000008")))
    shards = sorted(p.name for p in (step8 / "accelerate" / "pytorch_model_fsdp_0").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each process wrote its own shards


def test_fsdp_from_an_accelerate_config_runs_fsdp2(tmp_path, monkeypatch):
    for key, value in ACCELERATE_FSDP_ENV.items():
        monkeypatch.setenv(key, value)
    results = torchrun("fsdp_fit.py", tmp_path, "fsdp_env", "-")
    assert [r["distributed_type"] for r in results] == ["FSDP"] * 2
    assert all(r["local_elements"] < 0.6 * r["elements"] for r in results)


def test_fsdp1_on_cpu_processes_stops_at_start_up_instead_of_running_ddp(tmp_path):
    """(DeepSpeed on CPU processes runs since issue 41, item 7: tests/test_deepspeed.py, with what it refuses.)"""
    message = "FSDP1 was requested (fsdp) on 2 CPU processes: torch's FullyShardedDataParallel (FSDP1) needs"
    results = torchrun("fsdp_refused.py", tmp_path, "fsdp1")
    for result in results:
        assert result["error"] is not None and result["error"].startswith(message), result["error"]
        assert "silently be plain data parallelism (DDP)" in result["error"]
        assert result["flags"]["ACCELERATE_USE_FSDP"] is None  # the run's flag is not left behind


def test_fsdp_on_one_process_stops_at_start_up_and_leaves_no_flag_behind(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins={"fsdp": {}})
    with pytest.raises(torchloom.ConfigError, match=r"^FSDP2 was requested \(fsdp\), but Accelerate chose NO on 1 "):
        engine.fit(TinyTask())
    assert "ACCELERATE_USE_FSDP" not in os.environ
    plain = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1)
    plain.fit(TinyTask())
    assert plain.accelerator.distributed_type.value == "NO"
