"""Issue 21 items 3, 4, 5 and 16 on 2 processes (torchrun, gloo, CPU), each compared with one process on the
same data (run here, in this process):

- 16: a process that holds only Accelerate's padding copies in validation: every metric with a list state
  (AUROC, average precision, Spearman, retrieval MRR, a custom list) syncs and equals one process exactly;
- 5: Lightning's idiom (torchmetrics objects the task holds, updated in validation_step, logged as objects)
  counts each sample once: 6/7, not 6/8; an update the engine cannot cut is refused on every rank alike;
- 4: one metric object logged under two names gives both names its value;
- 3: an invalid input in one process's share is the same `TaskError` on every process.
"""

from __future__ import annotations

import importlib.util

import pytest
from torchmetrics.functional.classification import binary_auroc

from torchrun_util import MP_DIR, torchrun

pytestmark = pytest.mark.multiprocess


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, MP_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JOINS = _script("metric_joins")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The scenarios of tests/mp/metric_joins.py with valid inputs, per rank, on 2 processes (one launch)."""
    names = ["idiom", "idiom_5", "flattened", "two_names"]
    return torchrun("metric_joins.py", tmp_path_factory.mktemp("joins"), *names, nproc=2)


@pytest.fixture(scope="module")
def two_invalid(tmp_path_factory):
    """Its scenarios with invalid inputs (a launch of their own: before the fix, one of them hangs)."""
    names = ["bad_target", "bad_shape"]
    return torchrun("metric_joins.py", tmp_path_factory.mktemp("joins_invalid"), *names, nproc=2, timeout=120)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The same scenarios in this process."""
    return JOINS.scenarios(tmp_path_factory.mktemp("joins_one"))


def test_a_process_holding_only_padding_syncs_every_list_state_metric(tmp_path):
    """Item 16: 32 samples in one batch of 32 on 2 processes; process 1 holds only copies."""
    script = _script("metric_padding_only")
    results = torchrun("metric_padding_only.py", tmp_path, nproc=2)
    expected, _ = script.validate(tmp_path / "one")
    assert len(expected) == 10
    for r in results:
        assert r["metrics"] == expected  # exactly one process's values: rank 0's samples, in the same order
    _, scores, labels, _, _ = zip(*script.rows())
    import torch

    assert expected["val/auroc"] == pytest.approx(binary_auroc(torch.stack(scores), torch.stack(labels)).item())
    assert expected["val/auroc"] == expected["val/binary_auroc"]  # settings and configure_metrics alike
    assert expected["val/rows"] == expected["val/task_seen"] == 32.0  # each sample once, none lost
    assert 0.5 < expected["val/task_mrr"] < 1.0 and 0.5 < expected["val/task_multiclass_auroc"] < 1.0


def test_the_lightning_idiom_counts_each_sample_once(two, one):
    """Item 5: 7 samples, process 1's last batch is sample 6 and a copy of sample 0 (the one wrong prediction)."""
    assert one["idiom"]["metrics"] == {
        "val/accuracy": pytest.approx(6 / 7),
        "val/count": 7.0,
        "val/auroc": pytest.approx(11 / 12),
        "val/f1": pytest.approx(6 / 7),
        "val/gathered": 7.0,  # gather_for_metrics in validation_step: the whole batch reached every rank
    }
    # 5 samples: process 0's last batch is sample 4 and a copy, process 1's only copies (its metrics are not
    # updated there, and their forward gives NaN).
    assert one["idiom_5"]["metrics"] == {
        "val/accuracy": pytest.approx(4 / 5),
        "val/count": 5.0,
        "val/auroc": pytest.approx(5 / 6),
        "val/f1": pytest.approx(4 / 5),
        "val/gathered": 5.0,
    }
    for r in two:
        assert r["idiom"] == one["idiom"]  # 6/7 exactly (6/8 if the copy counted), every value as on 1 process
        assert r["idiom_5"] == one["idiom_5"]


def test_an_update_the_engine_cannot_cut_is_refused_on_every_rank(two, one):
    assert one["flattened"] == {"metrics": {"val/token_accuracy": pytest.approx(6 / 7)}}  # nothing padded
    expected = (
        "validation_step updated self.accuracy (BinaryAccuracy) with tensors of shapes (6,), (6,) on a batch of 2 "
        "samples whose last 1 on this process are copies that Accelerate pads the last batch with; the engine cuts "
        "the copies off tensors whose first dimension is the batch size, and none is: update the metric with one "
        "row per sample (before flattening), or from the outputs in on_validation_batch_end (as the eval_metrics "
        "plugin does) (on process 1)"
    )
    assert [r["flattened"] for r in two] == [{"error": expected}] * 2


def test_one_metric_logged_under_two_names_gives_both_its_value(two, one):
    """Item 4: by the task's self.log, and by configure_metrics returning one object under two names."""
    assert one["two_names"]["metrics"] == {
        "val/accuracy": pytest.approx(6 / 7),
        "val/accuracy_again": pytest.approx(6 / 7),
        "val/count": 7.0,  # updated once per batch, not once per name
        "val/count_again": 7.0,
    }
    for r in two:
        assert r["two_names"] == one["two_names"]


def test_an_invalid_input_in_one_process_share_is_the_same_error_on_every_process(two_invalid, one):
    """Item 3: sample 6 (process 1's) has target 5, or 4 class scores; process 0's inputs are valid."""
    about = "eval_metrics: metric 'val/accuracy' (MulticlassAccuracy; also 'val/f1')"
    target = (
        f"{about}: target (validation_step's outputs['target']) holds 1 invalid value (5) in this validation pass; "
        "expected class indices 0..2 (num_classes=3)"
    )
    assert one["bad_target"] == {"error": target}
    assert [r["bad_target"] for r in two_invalid] == [{"error": target}] * 2  # summed over the processes at the end
    shape = (
        f"{about}: preds (validation_step's outputs['preds']) is a float32 tensor of shape (1, 4), with target of "
        "shape (1,); expected float scores of shape (N, 3) (num_classes=3), or class indices of target's shape (1,)"
    )
    assert one["bad_shape"] == {"error": shape}  # one process: raised at once
    assert [r["bad_shape"] for r in two_invalid] == [{"error": f"{shape} (on process 1)"}] * 2
