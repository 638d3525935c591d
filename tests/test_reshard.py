"""The rules of a resume on another number of processes (`torchloom.checkpoint.reshard`, issue 29 item 5): which
checkpoints another number of processes can load, which saved process each new one takes its own part from, and the
merge of the interval's partial log sums, which must reduce over the new processes to what the saved ones would have
given. The runs on 1 and 2 processes are in tests/test_resume_processes.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from torchloom.checkpoint.reshard import merged_log_state, reshard_problems, source_rank


def test_which_checkpoints_another_number_of_processes_can_load() -> None:
    plain = {"world_size": 2, "files": {"accelerate/model.safetensors": {}, "engine/process_0/process.json": {}}}
    assert reshard_problems(plain, 1, "whole") == []
    assert reshard_problems(plain, 4, "whole") == []
    assert reshard_problems(plain, 4, "fsdp_sharded") == []  # DDP into FSDP2: loaded through DCP
    assert reshard_problems({**plain, "world_size": 1}, 1, None) == []  # the same number: left to Accelerate
    (deepspeed,) = reshard_problems(plain, 4, None)
    assert deepspeed.startswith("it was written by 2 process(es) (whole-model files) and this run has 4 (another ")
    assert (
        "layout torchloom does not re-shard (DeepSpeed or FSDP1)" in deepspeed and "resume with 2 process" in deepspeed
    )
    sharded = {"world_size": 2, "layout": "fsdp_sharded", "files": {"accelerate/pytorch_model_fsdp_0/.metadata": {}}}
    full = {"world_size": 2, "layout": "fsdp_full", "files": {"accelerate/pytorch_model_fsdp.bin": {}}}
    for checkpoint in (sharded, full):  # FSDP2, either state-dict type, on another count or without FSDP
        assert reshard_problems(checkpoint, 1, "whole") == []
        assert reshard_problems(checkpoint, 4, "fsdp_sharded") == []
        assert reshard_problems(checkpoint, 2, "whole") == []
    unrecorded = {key: value for key, value in sharded.items() if key != "layout"}  # FSDP1, or before "layout"
    (old,) = reshard_problems(unrecorded, 1, "whole")
    assert "(another layout) and this run has 1 (whole-model files)" in old and "written before torchloom" in old
    assert reshard_problems(unrecorded, 2, "fsdp_sharded") == []
    replica = {**plain, "files": {**plain["files"], "engine/process_1/replica.safetensors": {}}}
    (own,) = reshard_problems(replica, 1, "whole")
    assert "(process_1: a plugin whose processes' copies of the model differ" in own
    assert [source_rank(r, 2) for r in range(4)] == [0, 1, 0, 1] and [source_rank(r, 4) for r in range(2)] == [0, 1]


def test_an_fsdp2_full_state_dict_checkpoint_is_not_called_sharded() -> None:
    """Before: every FSDP checkpoint was refused on another number of processes as "sharded over the processes",
    also one whose FULL_STATE_DICT files hold the whole state."""
    full = {"world_size": 2, "layout": "fsdp_full", "files": {"accelerate/pytorch_model_fsdp.bin": {}}}
    assert reshard_problems(full, 1, "whole") == []
    assert reshard_problems(full, 3, "fsdp_full") == []


def _buffer(values: dict[str, Any], weights: dict[str, Any], reductions: dict[str, str]) -> dict[str, Any]:
    return {"values": values, "weights": weights, "reductions": reductions}


REDUCTIONS = {"loss": "mean", "ids": "sum", "top": "max", "low": "min", "lr": "last"}
SAVED = [
    _buffer(
        {"loss": torch.tensor(6.0, dtype=torch.float64), "ids": 10.0, "top": torch.tensor(7.0), "low": 1.0, "lr": 0.1},
        {"loss": 3.0},
        REDUCTIONS,
    ),
    _buffer(
        {"loss": torch.tensor(2.0, dtype=torch.float64), "ids": 5.0, "top": torch.tensor(3.0), "low": -2.0, "lr": 0.2},
        {"loss": torch.tensor(1.0, dtype=torch.float64)},
        REDUCTIONS,
    ),
]


def _combined(states: list[dict[str, Any]]) -> dict[str, float]:
    """What `LogBuffer._reduce_values` computes over the ranks' states, written out."""
    out = {}
    for name, reduce in REDUCTIONS.items():
        values = [float(s["values"][name]) for s in states]
        if reduce == "mean":
            out[name] = sum(values) / sum(float(s["weights"][name]) for s in states)
        else:
            out[name] = {"sum": sum, "max": max, "min": min, "last": lambda v: v[0]}[reduce](values)
    return out


@pytest.mark.parametrize("new_world_size", [1, 2, 3])
def test_the_merged_log_state_reduces_to_what_the_saved_processes_would_have(new_world_size) -> None:
    merged = [merged_log_state(SAVED, rank) for rank in range(new_world_size)]
    assert _combined(merged) == _combined(SAVED) == {"loss": 2.0, "ids": 15.0, "top": 7.0, "low": -2.0, "lr": 0.1}
    for state in merged[1:]:  # the other new processes start the interval empty
        assert state["values"]["top"] == -math.inf and state["values"]["low"] == math.inf
        assert state["values"]["ids"] == 0.0 and state["weights"]["loss"] == 0.0
    assert merged[0]["reductions"] == REDUCTIONS
    first = merged[0]
    assert float(first["values"]["loss"]) == 8.0 and float(first["weights"]["loss"]) == 4.0  # added, not negated
    for name in ("loss", "top"):  # a float32 tensor is folded in float64, the buffer's own dtype
        assert first["values"][name].dtype == torch.float64, name
    assert first["weights"]["loss"].dtype == torch.float64 and first["values"]["ids"] == 15.0


def test_a_refusal_names_every_reason_in_one_line() -> None:
    files = {"engine/process_0/replica.json": {}, "engine/process_1/replica.safetensors": {}}
    (line,) = reshard_problems({"world_size": 2, "files": files}, 3, None)
    assert line == (
        "it was written by 2 process(es) (another layout) and this run has 3 (another layout), and its model and "
        "optimizer are in a layout torchloom does not re-shard (DeepSpeed, FSDP1, or an FSDP checkpoint written "
        "before torchloom recorded its layout) and each process saved its own parameters and optimizer state "
        "(process_0, process_1: a plugin whose processes' copies of the model differ, LocalSGD or DiLoCo between two "
        "averages), which another number of processes cannot load; resume with 2 process(es) (torchrun "
        "--nproc_per_node 2, or accelerate launch --num_processes 2)"
    )
