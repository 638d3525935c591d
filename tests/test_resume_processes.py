"""A resume on another number of processes (issue 29, item 5): supported where the state allows it, with the data
position re-sharded and exact for the global sample order; refused with one `CheckpointError` otherwise.

24 ids, 3 epochs of 6 global batches of 4 (one process with batches of 4, or two with batches of 2), logging
every 3 steps, a seeded shuffle. Within an epoch the permutation depends only on the dataset and the seed, so
the ids of a global step are the same on 1 and 2 processes (checked first). B stops after step 4 (16 samples,
between the logging steps 3 and 6); C continues B's checkpoint on the other number of processes. Then:

- B's ids and C's ids are the uninterrupted run's, sample for sample, over the 3 epochs (2 -> 1 and 1 -> 2);
- the value logged at step 6 over steps 4-6 (``train/ids``, the sum of the ids trained: exact in float) is the
  uninterrupted run's: the saved processes' partial sums of step 4 are merged, not lost (one process's only) nor
  counted twice (every new process given them);
- C starts from B's optimizer state (AdamW's state, StepLR's learning rate after 4 steps) and goes on at step 5;
- a LocalSGD checkpoint between two averages (each process's own parameters) is refused on one process, in Python
  and as one line of the command, leaving no run directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import torchloom
from cli_util import run_cli
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from resume_fit import ShuffleTask, fit

SETTINGS = {"val_check_interval": None, "log_every_n_steps": 3}
N, STEPS = 24, 18


def _task(batch_size: int):
    return lambda: ShuffleTask(n=N, batch_size=batch_size)


def _global(per_rank: list[list[int]], batch_size: int) -> list[int]:
    """The ids in the global order: each step's batch of rank 0, then rank 1's."""
    steps = len(per_rank[0]) // batch_size
    return [i for k in range(steps) for ids in per_rank for i in ids[k * batch_size : (k + 1) * batch_size]]


def _logged(history: list[dict[str, Any]], name: str) -> dict[int, float]:
    return {r["step"]: r[name] for r in history if name in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("processes")
    a1 = fit(_task(4), out / "a1", **SETTINGS)
    b1 = fit(_task(4), out / "b1", save_at=[4], **SETTINGS)
    ranks = torchrun("resume_processes.py", out, b1.checkpoint, nproc=2, timeout=300)
    c1 = fit(_task(4), out / "c1", ckpt_path=ranks[0]["b_checkpoint"], **SETTINGS)
    return {"a1": a1, "b1": b1, "c1": c1, "ranks": ranks, "out": out}


@pytest.mark.multiprocess
def test_the_global_order_is_the_same_on_one_and_two_processes(runs) -> None:
    a2 = _global([r["a_ids"] for r in runs["ranks"]], 2)
    assert len(a2) == STEPS * 4 and a2 == runs["a1"].probe.ids


@pytest.mark.multiprocess
def test_two_processes_resumed_on_one_continue_at_the_first_untrained_sample(runs, tmp_path) -> None:
    ranks, c1 = runs["ranks"], runs["c1"]
    b2 = _global([r["b_ids"] for r in ranks], 2)
    assert len(b2) == 16 and b2 + c1.probe.ids == runs["a1"].probe.ids  # none skipped, none twice, all 3 epochs
    assert [s["step"] for s in c1.probe.steps] == list(range(5, STEPS + 1))
    assert c1.probe.optimizer_at_start == {"state": 4, "lr": [0.05 * 0.5**2], "class": "AdamW"}  # B's, after 4
    # The samples done must still be a whole number of the new global batches: 16 are not of batches of 3.
    with pytest.raises(torchloom.CheckpointError, match=r"global batches of 3 samples \(batch size 3 x 1 process"):
        fit(_task(3), tmp_path / "c3", ckpt_path=ranks[0]["b_checkpoint"], **SETTINGS)


@pytest.mark.multiprocess
def test_one_process_resumed_on_two_continues_at_the_first_untrained_sample(runs) -> None:
    ranks, b1 = runs["ranks"], runs["b1"]
    c2 = _global([r["c_ids"] for r in ranks], 2)
    assert b1.probe.ids[:16] == b1.probe.ids and b1.probe.ids + c2 == runs["a1"].probe.ids
    assert all(r["c_steps"] == list(range(5, STEPS + 1)) for r in ranks)
    assert all(r["c_optimizer"] == {"state": 4, "lr": [0.05 * 0.5**2], "class": "AdamW"} for r in ranks)
    assert not set(ranks[0]["c_ids"][:2]) & set(ranks[1]["c_ids"][:2])  # data-parallel: each rank its own share


@pytest.mark.multiprocess
def test_the_partial_sums_of_the_interval_are_merged_over_the_saved_processes(runs) -> None:
    """``train/ids`` at step 6 sums the ids of steps 4-6, step 4's from the processes that saved the checkpoint."""
    whole = _logged([dict(r) for r in runs["a1"].engine.history], "train/ids")
    assert _logged(runs["ranks"][0]["a_history"], "train/ids") == whole  # 1 and 2 processes log the same sums
    two_to_one = _logged([dict(r) for r in runs["c1"].engine.history], "train/ids")
    one_to_two = _logged(runs["ranks"][0]["c_history"], "train/ids")
    expected = {step: value for step, value in whole.items() if step > 4}
    assert sorted(expected) == [6, 9, 12, 15, 18]
    assert two_to_one == expected and one_to_two == expected
    assert whole[6] == sum(runs["a1"].probe.ids[12:24])  # steps 4-6: samples 12-23


@pytest.mark.multiprocess
def test_a_local_sgd_checkpoint_between_averages_is_refused_on_another_number_of_processes(runs, tmp_path) -> None:
    checkpoint = runs["ranks"][0]["lsgd_checkpoint"]
    expected = (
        "cannot resume from checkpoint: it was written by 2 process(es) and this run has 1, and each process saved "
        "its own parameters and optimizer state (process_0, process_1: a plugin whose processes' copies of the model "
        "differ, LocalSGD or DiLoCo between two averages), which another number of processes cannot load; resume "
        "with 2 process(es) (torchrun --nproc_per_node 2, or accelerate launch --num_processes 2)"
    )
    with pytest.raises(torchloom.CheckpointError) as refused:
        fit(_task(4), tmp_path / "l1", [{"local_sgd": {"sync_every": 3}}], ckpt_path=checkpoint, **SETTINGS)
    assert str(refused.value) == expected
    # The command: one line, exit status 2, nothing trained (no new run directory left in the LocalSGD run's dir).
    out = Path(checkpoint).parents[2]
    config = (
        f"engine: {{max_epochs: 3, output_dir: {out}, log_every_n_steps: 3, val_check_interval: null}}\n"
        "task: {class_path: resume_fit.ShuffleTask, init_args: {n: 24, batch_size: 4}}\n"
        "plugins: {local_sgd: {sync_every: 3}}\n"
    )
    (tmp_path / "run.yaml").write_text(config)
    before = sorted(p.name for p in out.iterdir())
    done = run_cli("fit", "--config", "run.yaml", "--resume", "auto", cwd=tmp_path, env={"PYTHONPATH": str(MP_DIR)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert sorted(p.name for p in out.iterdir()) == before
