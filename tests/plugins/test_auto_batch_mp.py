"""auto_batch on 2 processes (tests/mp/auto_batch_fit.py): an out-of-memory error on rank 1 only in the middle of a
window, on rank 1 only at a forward, on both ranks, in the optimizer step on both; token normalisation with uneven
lengths per rank. Each ends with the parameters (1e-6, float32), the optimizer steps and the learning rates of a
grad_accum run that used the final micro-batch from the start, the same on both ranks; no rank is left in a
collective (the launch would hang and fail). An error in the optimizer step of one rank, which the other has
taken, is one error on both ranks. A resume after a back-off continues with the saved size, bitwise."""

from __future__ import annotations

import sys

import pytest

from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))
from ab_tasks import max_difference

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: case -> (the micro-batch sizes logged at the 8 optimizer steps, the changes as (step, from, to, phases))
EXPECTED = {
    "rank1_mid_window": ([4.0] * 2 + [2.0] * 6, [(3, 4, 2, {"1": "backward"})]),
    "rank1_forward": ([8.0] + [2.0] * 7, [(2, 8, 4, {"1": "forward"}), (2, 4, 2, {"1": "forward"})]),
    "both_forward": (
        [8.0] + [2.0] * 7,
        [(2, 8, 4, {"0": "forward", "1": "forward"}), (2, 4, 2, {"0": "forward", "1": "forward"})],
    ),
    "both_step": ([8.0] + [2.0] * 7, [(2, 8, 4, {"0": "step", "1": "step"}), (2, 4, 2, {"0": "step", "1": "step"})]),
    "tokens_rank1_mid_window": ([4.0] * 2 + [2.0] * 6, [(3, 4, 2, {"1": "backward"})]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("auto_batch_fit.py", tmp_path_factory.mktemp("auto_batch"), timeout=300)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_two_processes_end_as_a_run_with_the_final_micro_batch_from_the_start(results, case):
    micro, changes = EXPECTED[case]
    for rank in results:
        entry = rank[case]
        assert entry["global_step"] == entry["ref_global_step"] == 8
        assert entry["lrs"] == entry["ref_lrs"] and len(entry["lrs"]) == 8
        assert max_difference(entry["params"], entry["ref_params"]) < 1e-6
        assert entry["micro"] == micro
        assert [(c["step"], c["from"], c["to"], c["phases"]) for c in entry["changes"]] == changes
    assert results[0][case]["params"] == results[1][case]["params"]  # DDP's invariant, kept by the redo
    # the error happened where it was injected, and only there
    injected_on = {r["rank"] for r in results if r[case]["raised"]}
    assert injected_on == {int(rank) for _, _, _, phases in changes for rank in phases}


def test_an_error_in_one_ranks_optimizer_step_is_one_error_on_both(results):
    messages = [rank["rank0_step"]["error"] for rank in results]
    assert messages[0] == messages[1]
    assert (
        "out of memory in the optimizer step of step 2 on rank 0 (step), after rank(s) 1 had updated their "
        "parameters: the window cannot be redone exactly" in messages[0]
    )
    assert [rank["rank0_step"]["raised"] for rank in results] == [[[1, "step", 8]], []]


def test_a_resume_after_a_back_off_on_two_processes_is_exact(results):
    for rank in results:
        entry = rank["resume"]
        assert entry["global_steps"] == [8, 8]
        assert entry["resumed_params"] == entry["whole_params"]  # bitwise
        assert entry["resumed_lrs"] == entry["whole_lrs"][4:]
        assert entry["resumed_raised"] == []  # the checkpoint's size, 2, from the first resumed step
        assert entry["resumed_micro"][-4:] == [2.0] * 4
    assert [r["resume"]["whole_raised"] for r in results] == [[], [[1, "backward", 8], [1, "backward", 4]]]
