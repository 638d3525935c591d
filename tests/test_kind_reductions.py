"""Two-process reductions, as a kind (issue 39): every logged value's reduction over ranks with rank-dependent
values and weights, so that max-vs-sum, mean-vs-weighted-mean and one-rank-vs-all mistakes fail. One torchrun
launch (tests/mp/kind_reductions_mp.py); tests/test_log_reductions.py covers the unweighted training reductions.

Expected values by construction: in training micro-batch k (1-based) rank r logs ``k + 10 r`` weighted
``k (1 + r)``; in validation batch j rank r logs ``j + 100 r`` (weight ``j + 3 r`` for the mean); each
micro-batch takes 1 s on the injected clock of both ranks; 4 samples per micro-batch.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from torchrun_util import torchrun

RANKS, STEPS, BATCH, LOG_EVERY = 2, 4, 4, 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return torchrun("kind_reductions_mp.py", Path(tmp_path_factory.mktemp("reductions")), nproc=RANKS, timeout=180)


def _interval_records(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["history"] if "w/tensor" in r]


@pytest.mark.multiprocess
def test_every_rank_gets_the_same_reduced_records(ranks) -> None:
    assert ranks[0]["history"] == ranks[1]["history"]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # the ranks trained on other samples: a real reduction


@pytest.mark.multiprocess
def test_a_weighted_mean_over_ranks_weighs_every_value_by_its_own_weight(ranks) -> None:
    records = _interval_records(ranks[0])
    assert [r["step"] for r in records] == [2, 4]
    for record, ks in zip(records, ([1, 2], [3, 4])):
        pairs = [(Fraction(k + 10 * r), Fraction(k * (1 + r))) for r in range(RANKS) for k in ks]
        weighted = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
        assert record["w/tensor"] == record["w/float"] == pytest.approx(float(weighted), rel=1e-15)
        assert float(weighted) != pytest.approx(float(sum(v for v, _ in pairs) / len(pairs)), rel=1e-6)


@pytest.mark.multiprocess
def test_the_training_loss_is_the_mean_over_every_micro_batch_of_every_rank(ranks) -> None:
    records = [r for r in ranks[0]["history"] if "train/loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for i, record in enumerate(records):
        losses = [ranks[r]["losses"][k] for r in range(RANKS) for k in range(i * LOG_EVERY, (i + 1) * LOG_EVERY)]
        assert record["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
        assert record["train/loss"] != pytest.approx(sum(losses[:LOG_EVERY]) / LOG_EVERY, rel=1e-9)  # not rank 0's


@pytest.mark.multiprocess
def test_validation_values_reduce_over_ranks_by_their_reduction(ranks) -> None:
    (record,) = [r for r in ranks[0]["history"] if "v/sum" in r]
    values = [j + 100 * r for r in range(RANKS) for j in (1, 2)]  # 1, 2, 101, 102
    weights = [j + 3 * r for r in range(RANKS) for j in (1, 2)]  # 1, 2, 4, 5
    assert (record["v/sum"], record["v/max"], record["v/min"], record["v/last"]) == (206.0, 102.0, 1.0, 2.0)
    expected = Fraction(sum(v * w for v, w in zip(values, weights)), sum(weights))  # 919 / 12
    assert record["v/mean"] == pytest.approx(float(expected), rel=1e-15)


@pytest.mark.multiprocess
def test_counts_and_rates_are_over_all_processes(ranks) -> None:
    """throughput: an interval's samples are both ranks' (2 steps x 4 x 2 = 16), its rate those over the interval's
    2 s (8 /s: not one rank's 4, not the mean of the ranks' 4); the progress summary likewise."""
    records = [r for r in ranks[0]["history"] if "throughput/samples" in r]
    assert [(r["throughput/samples"], r["throughput/samples_per_s"]) for r in records] == [(16.0, 8.0), (16.0, 8.0)]
    summary = ranks[0]["summary"]
    assert (summary["samples"], summary["optimizer_steps"]) == (RANKS * STEPS * BATCH, STEPS)
    assert (summary["train_time_s"], summary["samples_per_s"], summary["steps_per_s"]) == (4.0, 8.0, 1.0)
