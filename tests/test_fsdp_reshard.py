"""Checkpoints resumed in another layout (issue 41, items 3, 4 and 11): an FSDP2 checkpoint of 2 processes on 1
process and as DDP, a 1-process and a DDP checkpoint as FSDP2 on 2 processes, through torch.distributed.checkpoint;
each continues the uninterrupted run's sample order exactly and its numbers within reduction order. A sharded
checkpoint is exported (and the end of an FSDP2 fit saves its model) as a transformers folder that plain
transformers loads in a fresh process, equal to the gathered weights; another model is refused at start-up, naming
the parameter.

One launch of 2 processes runs F (FSDP2), D (DDP) and the resumes on 2 processes, one after another in each process
(before, any fit after an FSDP2 fit in the same process failed in Accelerate's prepare: ``AcceleratorState`` has no
``is_fsdp2``); the 1-process fits run in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from fsdp_reshard import IndexedTask, fit

pytestmark = pytest.mark.multiprocess

#: The largest difference of any parameter after 16 optimizer steps between a run resumed at step 4 on another
#: layout and the uninterrupted run (docs/plugins/checkpoint.md): the same samples, another reduction order.
#: Measured: 1.2e-7 for 1 -> FSDP2, DDP -> FSDP2 and FSDP2 -> DDP, 2.4e-7 for FSDP2 (2 processes, shards or
#: FULL_STATE_DICT files) -> 1 process.
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reshard")
    single = fit(out / "single", "single")
    step4 = next(p for p in single["checkpoints"] if p.endswith("step-00000004"))
    ranks = torchrun("fsdp_reshard.py", out / "launch", step4, nproc=2, timeout=900)
    fsdp_step4 = next(p for p in ranks[0]["fsdp"]["checkpoints"] if p.endswith("step-00000004"))
    full_step4 = next(p for p in ranks[0]["fsdp_full"]["checkpoints"] if p.endswith("step-00000004"))
    results = {
        "single": single,
        "fsdp_full_to_single": fit(out / "fsdp_full_to_single", "single", full_step4),
        "ranks": ranks,
        "fsdp_to_single": fit(out / "fsdp_to_single", "single", fsdp_step4),
        "other_model_single": fit(out / "other_single", "single", fsdp_step4, intermediate_size=48),
        "out": out,
    }
    return results


def _largest_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for n in a for x, y in zip(a[n], b[n], strict=True))


def _global(result: dict[str, Any], ranks: list[dict[str, Any]] | None = None) -> list[int]:
    """The rows trained in the global order: each micro-batch's rank 0 rows, then rank 1's."""
    if ranks is None:
        return [i for batch in result["trained"] for i in batch]
    return [i for batches in zip(*(r["trained"] for r in ranks), strict=True) for b in batches for i in b]


def _of(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in ranks]


def test_resumes_in_another_layout_continue_the_same_samples_within_reduction_order(runs) -> None:
    ranks, single = runs["ranks"], runs["single"]
    fsdp, ddp = _of(ranks, "fsdp"), _of(ranks, "ddp")
    assert [r["distributed_type"] for r in fsdp] == ["FSDP"] * 2 and ddp[0]["distributed_type"] == "MULTI_CPU"
    order = _global(single)
    assert len(order) == 2 * 64 and _global(fsdp[0], fsdp) == _global(ddp[0], ddp) == order
    done = 4 * 2 * 4  # step 4: 4 optimizer steps of 2 micro-batches of 4 rows
    cases = {  # resumed run: the uninterrupted run it continues
        "single_to_fsdp": (_of(ranks, "single_to_fsdp"), single),
        "ddp_to_fsdp": (_of(ranks, "ddp_to_fsdp"), ddp[0]),
        "fsdp_to_ddp": (_of(ranks, "fsdp_to_ddp"), fsdp[0]),
        "fsdp_to_single": (None, fsdp[0]),
        "fsdp_full_to_single": (None, fsdp[0]),  # FULL_STATE_DICT files (refused before as "sharded")
    }
    differences = {}
    for name, (resumed_ranks, uninterrupted) in cases.items():
        resumed = runs[name] if resumed_ranks is None else resumed_ranks[0]
        assert "error" not in resumed, resumed.get("error")
        assert resumed["global_step"] == 16
        assert _global(resumed, resumed_ranks) == order[done:], name  # the rest of the global order, exactly
        assert [h["step"] for h in resumed["history"]] == [h["step"] for h in uninterrupted["history"] if h["step"] > 4]
        differences[name] = _largest_difference(resumed["params"], uninterrupted["params"])
    print("largest parameter difference after 16 steps:", differences)
    assert all(d <= TOLERANCE for d in differences.values()), differences
    assert _of(ranks, "single_to_fsdp")[0]["distributed_type"] == "FSDP"
    assert _of(ranks, "fsdp_to_ddp")[0]["distributed_type"] == "MULTI_CPU"
    assert runs["fsdp_to_single"]["distributed_type"] == "NO"
    full = Path(_of(ranks, "fsdp_full")[0]["checkpoints"][0]) / "accelerate"
    assert (full / "pytorch_model_fsdp.bin").is_file() and not (full / "pytorch_model_fsdp_0").exists()


def test_a_sharded_checkpoint_resumed_with_another_model_names_the_parameter(runs) -> None:
    refusals = [r["other_model"] for r in runs["ranks"]] + [runs["other_model_single"]]
    assert all(refused["steps_trained"] == 0 for refused in refusals)  # at start-up
    for error in [refused["error"] for refused in refusals]:
        assert error.startswith("cannot resume from checkpoint: the model's parameters differ ("), error
        assert "model.layers.0.mlp.down_proj.weight: saved [32, 64], now [32, 48]" in error, error


def test_an_asynchronous_save_under_fsdp_is_refused_at_start_up(runs) -> None:
    for rank in runs["ranks"]:
        refused = rank["async_save"]
        assert refused["error"].startswith("setting 'async_save' = true: a run with FSDP saves its"), refused
        assert refused["steps_trained"] == 0


def test_a_sharded_checkpoint_exports_a_model_transformers_loads(runs, tmp_path) -> None:
    import torchloom

    fsdp = runs["ranks"][0]["fsdp"]
    last = fsdp["checkpoints"][-1]
    assert last.endswith("step-00000016")
    assert (Path(last) / "accelerate" / "pytorch_model_fsdp_0" / "__1_0.distcp").is_file()  # shards
    engine = torchloom.Engine(output_dir=str(tmp_path / "runs"), seed=0, default_plugins=False)
    exported = engine.export(IndexedTask(1), last, tmp_path / "exported")
    saved = Path(fsdp["run_dir"]) / "model"  # the end of the FSDP2 fit (save_model)
    script = textwrap.dedent(
        """
        import json, sys, transformers
        out = {}
        for path in sys.argv[1:]:
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
            out[path] = {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}
        print(json.dumps(out))
        """
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script, exported, str(saved)],
        capture_output=True,
        text=True,
        check=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    params = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert params[exported] == fsdp["params"]  # the gathered weights, exactly
    assert params[str(saved)] == fsdp["params"]
