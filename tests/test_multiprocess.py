"""Two CPU processes under torchrun (gloo): data-parallel training equals one process over the same global batches.

Accelerate shards a non-shuffled prepared dataloader by whole batches (``split_batches=False``): with batch
size 4 on 2 processes, global step k uses batch 2k on rank 0 and batch 2k+1 on rank 1, i.e. samples
[8k, 8k+4) and [8k+4, 8k+8). DDP averages the two ranks' mean gradients, which for equal halves is the mean
gradient over the 8 samples: exactly one process with batch size 8. The test checks the sharding too, so
the comparison is over the same samples, not just the same count.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import TinyTask, tiny_dataset
from torchrun_util import torchrun

pytestmark = pytest.mark.multiprocess

EPOCHS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("core_fit")
    return out, torchrun("core_fit.py", out, nproc=2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same fit in this process, with one process and batch size 8."""
    out = tmp_path_factory.mktemp("single")
    task = TinyTask(n=32, batch_size=8)
    engine = torchloom.Engine(max_epochs=EPOCHS, log_every_n_steps=1, output_dir=str(out))
    engine.fit(task)
    model = task.accelerator.unwrap_model(task.model)
    history = list(engine.history)
    uneven = engine.validate(task, DataLoader(tiny_dataset(22, 4, seed=5), batch_size=4))
    return {
        "uneven_val_loss": uneven["val/loss"],
        "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
        "history": history,
        "global_step": engine.progress.global_step,
    }


def test_two_cpu_processes_form_one_data_parallel_group(ranks):
    _, results = ranks
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["distributed_type"] == "DistributedType.MULTI_CPU" for r in results)
    assert [r["global_step"] for r in results] == [EPOCHS * 4] * 2  # 32 samples / global batch 8


def test_dataloader_is_sharded_by_whole_batches(ranks):
    _, results = ranks
    x0 = tiny_dataset(32, 4, 0).tensors[0][:, 0].tolist()
    for r in results:
        rank = r["rank"]
        assert [(s["epoch"], s["batch_idx"]) for s in r["samples"]] == [(e, k) for e in range(EPOCHS) for k in range(4)]
        for s in r["samples"]:
            start = 8 * s["batch_idx"] + 4 * rank
            assert s["x0"] == pytest.approx(x0[start : start + 4], abs=0)


def test_parameters_identical_on_both_ranks(ranks):
    _, (r0, r1) = ranks
    assert r0["params"] == r1["params"]  # bit-identical


def test_parameters_equal_one_process_over_the_same_global_batches(ranks, single):
    _, (r0, _) = ranks
    assert single["global_step"] == r0["global_step"]
    for p2, p1 in zip(r0["params"], single["params"], strict=True):
        torch.testing.assert_close(torch.tensor(p2), torch.tensor(p1), rtol=0, atol=1e-6)
    # the 2-process run really trained: its parameters moved away from the initial ones
    torch.manual_seed(0)
    initial = torch.nn.Linear(4, 1).weight.detach().double().flatten()
    assert not torch.allclose(torch.tensor(r0["params"][0], dtype=torch.float64), initial, atol=1e-2)


def test_logged_values_equal_across_ranks_and_one_process(ranks, single):
    _, (r0, r1) = ranks
    val0 = [(h["step"], h["val/loss"]) for h in r0["history"] if "val/loss" in h]
    val1 = [(h["step"], h["val/loss"]) for h in r1["history"] if "val/loss" in h]
    val_single = [(h["step"], h["val/loss"]) for h in single["history"] if "val/loss" in h]
    assert [s for s, _ in val0] == [4, 8]
    assert val0 == val1  # reduced over ranks: the same number everywhere
    assert [s for s, _ in val_single] == [4, 8]
    assert [v for _, v in val0] == pytest.approx([v for _, v in val_single], rel=1e-6, abs=1e-7)
    # the training loss of each step is the mean over the 8 samples of the global batch, as with one process
    train0 = [h["train/loss"] for h in r0["history"] if "train/loss" in h]
    train_single = [h["train/loss"] for h in single["history"] if "train/loss" in h]
    assert len(train0) == EPOCHS * 4
    assert train0 == pytest.approx(train_single, rel=1e-6, abs=1e-7)


def test_only_rank_zero_writes(ranks):
    out, (r0, r1) = ranks
    assert r0["on_log_calls"] == len(r0["history"]) > 0
    assert r1["on_log_calls"] == r0["on_log_calls"] and r1["history"] == r0["history"]  # on_log on every rank
    assert not (out / "run-rank1").exists()  # rank 1 created nothing at all
    lines = (out / "run-rank0" / "version_0" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == r0["history"]  # the fit's records, and only those
    assert (out / "run-rank0" / "version_0" / "config.yaml").exists()
    # the extra validation wrote its record into a run directory of its own, not the fit's file
    (validation,) = [json.loads(line) for line in (out / "run-rank0" / "version_1" / "metrics.jsonl").open()]
    assert validation["val/loss"] == pytest.approx(r0["uneven_val_loss"])


def test_validation_on_an_uneven_set_counts_each_sample_once(ranks, single):
    """22 samples over 2 ranks in batches of 4: the sampler pads the last batch with repeated samples;
    gather_for_metrics drops them, so val/loss equals the 1-process value (the parameters agree to 1e-6)."""
    _, results = ranks
    for r in results:
        assert r["uneven_val_loss"] == pytest.approx(single["uneven_val_loss"], rel=1e-5)


def test_ranks_logging_different_names_get_a_clear_error_not_a_hang(tmp_path):
    results = torchrun("core_lognames.py", tmp_path)
    for r in results:
        assert r["error"] == (
            "every process must log the same names between two logging steps; "
            "got rank 0: ['train/loss']; rank 1: ['only/rank1', 'train/loss']"
        )
        assert r["step"] == 2  # the first logging step


# ------------------------------------------------------------------------------------ issue 6 on 2 processes


@pytest.fixture(scope="module")
def safeguards(tmp_path_factory):
    out = tmp_path_factory.mktemp("safeguards")
    return torchrun("safeguards_fit.py", out, nproc=2)


def test_the_saved_model_is_the_final_model_after_local_sgds_last_average(safeguards):
    r0, r1 = safeguards
    assert r0["saved_equals_final"] and r1["saved_equals_final"]  # bitwise, on both ranks
    assert r0["final_params"] == r1["final_params"]  # the final average happened before the save


def test_a_seed_repeats_a_two_process_run_with_new_or_reused_dataloaders(safeguards):
    for r in safeguards:
        assert r["new_a"] == r["new_b"]  # data order and parameters, bitwise
        assert r["reused_a"] == r["reused_b"]  # the same DataLoader objects passed again
        assert r["reused_a"]["seen"] == r["new_a"]["seen"]
        assert r["other_seed"]["seen"] != r["new_a"]["seen"]
    r0, r1 = safeguards
    assert r0["new_a"]["seen"] != r1["new_a"]["seen"]  # the ranks train on different shards
    assert r0["new_a"]["params"] == r1["new_a"]["params"]


def test_ranks_with_different_numbers_of_batches_stop_with_a_clear_error_not_a_hang(tmp_path):
    results = torchrun("uneven_ranks.py", tmp_path, timeout=120)
    for r in results:
        assert r["error"].startswith("the processes have different numbers of training batches (rank 0: 2, rank 1: 4)")
        assert r["trained_steps"] == 0
    assert not list((tmp_path / "run").glob("*/model"))


# ------------------------------------------------------------------------------------ issue 7 on 2 processes


@pytest.fixture(scope="module")
def seams(tmp_path_factory):
    return torchrun("seams.py", tmp_path_factory.mktemp("seams"), nproc=2)


def test_a_value_only_the_main_process_logs_in_validation_is_a_clear_error_not_a_hang(seams):
    for r in seams:
        assert r["main_only_error"] == (
            "every process must log the same names between two logging steps; got rank 0: ['val/main_only']; rank 1: []"
        )


def test_a_replacing_step_keeps_grad_clip_and_local_sgd_working(seams):
    r0, r1 = (r["replaced"] for r in seams)
    assert r0["steps"] == r1["steps"] == 4  # 16 samples, batch 2, 2 ranks: 4 optimizer steps, all replaced
    assert len(r0["norms"]) == 4 and all(n <= 0.01 * (1 + 1e-5) for n in r0["norms"] + r1["norms"])  # clipped
    assert all(isinstance(v, float) for v in r0["grad_norm_logged"])  # grad_clip logged every step
    assert r0["num_averages"] == r1["num_averages"] == 2  # LocalSGD averaged after steps 2 and 4
    assert r0["params"] == r1["params"]  # and the final average makes the ranks equal


def test_on_log_sees_the_same_values_on_every_rank(seams):
    r0, r1 = (r["replaced"]["on_log"] for r in seams)
    assert len(r0) == 4 and r0 == r1


# ------------------------------------------------------------------------------ issue 9: padding copies (C12)


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_every_evaluation_sample_counts_once_whatever_the_number_of_processes(tmp_path, nproc):
    """C12: 10 samples, batch 3; Accelerate pads the last round with copies of ids 0, 1, ... The outputs hooks
    receive and the predictions hold ids 0..9 exactly once over the ranks; the accuracy is 0.7, not 9/12."""
    results = torchrun("padding_copies.py", tmp_path, nproc=nproc)
    assert sorted(i for r in results for i in r["val_ids"]) == list(range(10))
    assert sorted(i for r in results for i in r["predicted_ids"]) == list(range(10))
    accuracies = {r["accuracy"] for r in results}
    assert len(accuracies) == 1 and accuracies.pop() == pytest.approx(0.7, abs=1e-7)  # float32 0.7; 9/12 = 0.75


def test_a_launch_that_hangs_fails_and_leaves_no_process_behind(tmp_path):
    """The launcher of the multi-process tests: a timeout ends the launcher and both workers (which ignore SIGTERM
    and sit in sessions of their own), and the failure shows what they printed."""
    import os

    import psutil

    with pytest.raises(AssertionError) as info:
        # the 20 s count from when both workers run (a busy machine may take longer than that to start them)
        both = (tmp_path / "pid-0", tmp_path / "pid-1")
        torchrun("hang.py", tmp_path, nproc=2, timeout=20, started=lambda: all(p.exists() for p in both))
    message = str(info.value)
    assert message.startswith("torchrun hang.py hung: still running after 20 s; the launcher and its 2 worker(s)")
    assert "rank 0 is waiting" in message and "rank 1 is waiting" in message
    pids = [int((tmp_path / f"pid-{rank}").read_text()) for rank in (0, 1)]
    assert all(str(pid) in message for pid in pids)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"{pid} still runs"
    assert os.getpid() not in pids


def test_validate_and_predict_of_a_frozen_model_need_no_ddp_wrapper(tmp_path):
    """A model with no trainable parameter validates and predicts on two processes as on one (DDP's constructor
    refused it on both ranks), without a DDP wrapper; the model of the last fit (DDP-wrapped) still validates and
    predicts; a fit of the frozen model stops before DDP with a TaskError naming the cause."""
    import importlib.util

    from torchrun_util import MP_DIR

    spec = importlib.util.spec_from_file_location("frozen_eval", MP_DIR / "frozen_eval.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    single = script.run(tmp_path / "single")
    r0, r1 = torchrun("frozen_eval.py", tmp_path / "two")
    assert single["frozen"]["wrapped"] == r0["frozen"]["wrapped"] == r1["frozen"]["wrapped"] == ["Linear", "Linear"]
    for r in (r0, r1):
        assert r["frozen"]["val_loss"] == pytest.approx(single["frozen"]["val_loss"], rel=1e-6)
        assert r["frozen"]["weights"] == single["frozen"]["weights"]
    assert r0["frozen"]["predictions"] + r1["frozen"]["predictions"] == pytest.approx(
        single["frozen"]["predictions"], rel=1e-6
    )
    assert len(single["frozen"]["predictions"]) == 6

    ddp = "DistributedDataParallel"
    assert r0["fitted"]["after_fit"] == r1["fitted"]["after_fit"] == ddp
    assert r0["fitted"]["wrapped"] == r1["fitted"]["wrapped"] == [ddp, ddp]  # the fit's model, reused
    assert r0["fitted"]["weights"] == r1["fitted"]["weights"]
    assert r0["fitted"]["val_loss"] == pytest.approx(r1["fitted"]["val_loss"], rel=1e-6)
    assert len(r0["fitted"]["predictions"] + r1["fitted"]["predictions"]) == 6

    expected = (
        "fit: the model of FrozenTask.configure_model() (Linear) has nothing to train: all 5 of its parameters "
        "have requires_grad=False; unfreeze what should train (requires_grad_(True)), or evaluate the model with "
        "validate or predict, which need no trainable parameter"
    )
    assert single["frozen_fit_error"] == r0["frozen_fit_error"] == r1["frozen_fit_error"] == expected
    assert not list((tmp_path / "two" / "frozen_fit").glob("version_*"))  # refused before the run started
