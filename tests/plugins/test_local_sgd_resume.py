"""LocalSGD and DiLoCo stopped between two averages and resumed on 2 processes: bitwise the uninterrupted run
(issue 29, item 2).

Between two averages the processes' parameters and optimizer states differ, so the checkpoint holds each process's
own (``engine/process_<rank>/replica.*``, `torchloom.checkpoint.replicas`) and each process resumes from its own. The
scenarios (`resume_fit.MID_INTERVAL_SCENARIOS`: K = 2 and K = 3, AdamW and SGD with momentum, DiLoCo with Nesterov,
and K = 3 on data augmented with the global random generators, stopped after the first batch of an epoch)
run A uninterrupted, B stopped right after a checkpoint at a step that is not a multiple of K, and C resumed from
it; B + C is A on every rank: sample order, every step's parameters, the logged history and the final parameters,
optimizer state and scheduler, compared exactly (`test_resume.assert_resumed_exactly`).

Before this change (the main process's model and optimizer loaded by every process) the same scenarios drifted
from the first step after the resume: final parameters off by 0.021 (K = 2, stop at 5), 0.096 and 0.085 (K = 3,
stops at 4 and 5) and 0.081 (DiLoCo, K = 3, stop at 5), on both ranks.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import torchloom
from torchloom.checkpoint.store import read_manifest, verify_files
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from resume_fit import MID_INTERVAL_SCENARIOS, ShuffleTask, fit

from test_resume import assert_resumed_exactly

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("lsgd_resume")
    return torchrun("resume_fit.py", out, *MID_INTERVAL_SCENARIOS, nproc=2, timeout=400)


@pytest.mark.parametrize("name", list(MID_INTERVAL_SCENARIOS))
def test_resume_between_two_averages_is_bitwise_on_every_rank(ranks, name) -> None:
    spec = MID_INTERVAL_SCENARIOS[name]
    sync_every = spec["plugins"][0]["local_sgd"]["sync_every"]
    for i, stop in enumerate(spec["stops"]):
        recs = [r[name][i] for r in ranks]
        step = stop["save_at"][0]
        assert step % sync_every != 0, "not between two averages"
        # The ranks differ at the checkpoint, in parameters and optimizer state: one rank's copy loaded by both
        # (what a resume did before) cannot continue both.
        at_save = [rec["a_steps"][step - 1] for rec in recs]
        assert at_save[0]["step"] == step and at_save[0]["params"] != at_save[1]["params"]
        assert recs[0]["a"]["optimizer_state"] != recs[1]["a"]["optimizer_state"]
        for rank, rec in enumerate(recs):
            try:
                assert_resumed_exactly(rec)
            except AssertionError as exc:
                raise AssertionError(f"{name} {stop}, rank {rank}: {exc}") from None
        assert recs[0]["c"]["params"] == recs[1]["c"]["params"], "the final average left the ranks apart"


def test_the_checkpoint_lists_and_checks_each_process_s_copy(ranks, tmp_path) -> None:
    checkpoint = ranks[0]["lsgd_k2"][0]["checkpoint"]
    files = read_manifest(checkpoint)["files"]
    for rank in (0, 1):
        assert {f"engine/process_{rank}/replica.json", f"engine/process_{rank}/replica.safetensors"} <= files.keys()
    state = json.loads((Path(checkpoint) / "engine/process_1/replica.json").read_text())["state"]
    assert sorted(state) == ["optimizer", "parameters", "scaler"] and sorted(state["parameters"]) == [
        "0.bias",
        "0.weight",
        "2.bias",
        "2.weight",
    ]
    altered = Path(shutil.copytree(checkpoint, tmp_path / "altered"))
    path = altered / "engine/process_1/replica.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(torchloom.CheckpointError, match=r"engine/process_1/replica\.safetensors changed"):
        verify_files(altered, read_manifest(altered))


def test_a_resume_on_another_number_of_processes_is_refused_naming_both(ranks, tmp_path) -> None:
    checkpoint = ranks[0]["lsgd_k2"][0]["checkpoint"]
    with pytest.raises(
        torchloom.CheckpointError,
        match=r"written by 2 process\(es\) and this run has 1, and each process saved its own parameters and optimizer "
        r"state \(process_0, process_1: .*LocalSGD or DiLoCo between two averages\)",
    ):
        fit(lambda: ShuffleTask(n=16), tmp_path, [{"local_sgd": {"sync_every": 2}}], ckpt_path=checkpoint)
