"""eval_metrics on 1, 2 and 3 processes over 23 samples (uneven: Accelerate pads the last batch with copies on 2
and 3 processes): identical values everywhere, equal to torchmetrics on the whole set in one process; exactly 23
samples counted; a failing compute leaves the metrics usable."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torchmetrics.functional.classification import (
    binary_accuracy,
    binary_auroc,
    binary_average_precision,
    binary_f1_score,
)

from torchrun_util import MP_DIR, torchrun

pytestmark = pytest.mark.multiprocess


def _script():
    spec = importlib.util.spec_from_file_location("eval_metrics_fit", MP_DIR / "eval_metrics_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def expected():
    """torchmetrics' functional metrics over the whole validation set, in this process."""
    script = _script()
    _, scores, labels = (torch.stack(column) for column in zip(*script.scored_data()))
    return {
        "val/accuracy": binary_accuracy(scores, labels).item(),
        "val/auroc": binary_auroc(scores, labels).item(),
        "val/f1": binary_f1_score(scores, labels).item(),
        "val/average_precision": binary_average_precision(scores, labels).item(),
        "val/count": float(script.N),
        "val/fail_once": float(script.N),
    }


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_metrics_over_uneven_shards_equal_one_process_on_the_whole_set(tmp_path, nproc, expected):
    results = torchrun("eval_metrics_fit.py", tmp_path, nproc=nproc)
    assert [r["world_size"] for r in results] == [nproc] * nproc
    # 0.5 would mean a constant scorer, 1.0 a perfect one: the AUROC checked here depends on every sample.
    assert 0.6 < expected["val/auroc"] < 0.95
    for r in results:
        assert r["metrics"].keys() == expected.keys()
        for name, value in expected.items():
            # AUROC / AP over the concatenated shards: the same samples, in another order, as one process.
            assert r["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
        assert r["metrics"]["val/count"] == 23.0  # every sample once: no padding copy, none lost
        assert r["metrics_twice"] == r["metrics"]  # a second validation pass starts from reset metrics
    assert len({tuple(sorted(r["metrics"].items())) for r in results}) == 1  # the same values on every rank

    # The first pass failed in one metric's compute, after torchmetrics had synchronised it: every metric then
    # holds its own process's share again (11 + 12 samples on 2 processes), not the total, and updating it with
    # one more sample per process then computing gives 23 + nproc.
    for r in results:
        assert "metric 'val/fail_once' (FailOnce): compute failed: scripted failure" in r["error"]
        assert not any(r["after_failure"]["synced"].values())
        assert r["after_failure"]["recomputed"] == 23 + nproc
    assert sum(r["after_failure"]["local_n"] for r in results) == 23
