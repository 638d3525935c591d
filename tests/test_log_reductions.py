"""Issue 9: per-name reductions of logged values, torchmetrics objects in log(), and stopping a fit cleanly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics

import torchloom
from torchloom.testing import TinyTask, tiny_fit
from torchrun_util import torchrun


class Logs(TinyTask):
    """Logs the 1-based micro-batch number with every reduction; 8 micro-batches, one per optimizer step."""

    def __init__(self) -> None:
        super().__init__(n=16, batch_size=2)
        self.count = 0

    def training_step(self, batch, batch_idx):
        self.count += 1
        for reduce in ("mean", "sum", "max", "min", "last"):
            self.log(f"k/{reduce}", torch.tensor(float(self.count)), reduce=reduce)
        return super().training_step(batch, batch_idx)


def test_each_reduction_over_a_logging_interval(tmp_path):
    engine = tiny_fit(task=Logs(), output_dir=str(tmp_path), log_every_n_steps=4)
    records = [r for r in engine.history if "k/mean" in r]
    assert [r["step"] for r in records] == [4, 8]
    assert [(r["k/mean"], r["k/sum"], r["k/max"], r["k/min"], r["k/last"]) for r in records] == [
        (2.5, 10.0, 4.0, 1.0, 4.0),
        (6.5, 26.0, 8.0, 5.0, 8.0),
    ]


@pytest.mark.multiprocess
def test_each_reduction_over_two_processes(tmp_path):
    """Rank r logs k + 100 r in its micro-batch k: over steps 1-2 and both ranks, mean (1+2+101+102)/4 = 51.5, sum
    206, max 102, min 1, and last the main process's latest value, 2, on every rank; tensors and floats alike."""
    ranks = torchrun("log_reductions_mp.py", tmp_path, nproc=2, timeout=120)
    assert ranks[0] == ranks[1]
    expected = [(2, 51.5, 206.0, 102.0, 1.0, 2.0), (4, 53.5, 214.0, 104.0, 3.0, 4.0)]
    for kind in ("t", "f"):
        got = [(r["step"], *(r[f"{kind}/{x}"] for x in ("mean", "sum", "max", "min", "last"))) for r in ranks[0]]
        assert got == expected, kind


def test_bf16_values_are_summed_in_float64(tmp_path):
    """1, 1 and 1/256 in bf16: their mean is 0.66796875 exactly. Summed in bf16, 2 + 1/256 rounds to 2 (8 bits of
    mantissa), giving 0.6666...; the buffer folds them in float64."""

    class Bf16Logs(TinyTask):
        def __init__(self) -> None:
            super().__init__(n=12, batch_size=4, validate=False)  # 3 micro-batches
            self.values = iter([1.0, 1.0, 1 / 256])

        def training_step(self, batch, batch_idx):
            self.log("b/mean", torch.tensor(next(self.values), dtype=torch.bfloat16))
            return super().training_step(batch, batch_idx)

    engine = tiny_fit(task=Bf16Logs(), output_dir=str(tmp_path), log_every_n_steps=3)
    assert [r["b/mean"] for r in engine.history if "b/mean" in r] == [0.66796875]


@pytest.mark.parametrize("count", [4, 300])  # 300: past LogBuffer.APPEND_FOLD, so appended values fold mid-interval
@pytest.mark.parametrize("value_kind", ["tensor", "float", "mixed"])
@pytest.mark.parametrize("weight_kind", ["tensor", "float", "mixed", "one"])
def test_a_weighted_mean_is_the_same_for_tensors_and_numbers(count, value_kind, weight_kind):
    """Every path of log(name, value, weight): tensor or Python value, tensor or Python weight (or the default 1),
    mixed within one interval, before and after the appended values fold: the exact weighted mean."""
    from torchloom._agreement import RankAgreement
    from torchloom._logbuffer import LogBuffer

    class OneProcess:
        num_processes, device = 1, torch.device("cpu")

    values = [((i * 7) % 13) / 4 for i in range(count)]  # exact in binary
    weights = [1.0 if weight_kind == "one" else float(1 + i % 3) for i in range(count)]
    buffer = LogBuffer()
    for i, (v, w) in enumerate(zip(values, weights, strict=True)):
        as_tensor = value_kind == "tensor" or (value_kind == "mixed" and i % 2 == 0)
        value: Any = torch.tensor(v, dtype=torch.float32) if as_tensor else v
        if weight_kind == "one":
            buffer.log("x", value)
            continue
        weight_tensor = weight_kind == "tensor" or (weight_kind == "mixed" and i % 3 == 0)
        buffer.log("x", value, weight=torch.tensor(w) if weight_tensor else w)
    expected = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    assert buffer.reduce(OneProcess(), RankAgreement(1))["x"] == expected


class MetricTask(TinyTask):
    """Logs a torchmetrics MeanAbsoluteError object updated by hand in validation_step."""

    def __init__(self) -> None:
        super().__init__(n=12, batch_size=4)
        self.mae = torchmetrics.MeanAbsoluteError()
        self.seen: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.model(x)
        self.seen.append((preds - y).abs().flatten())
        self.mae.update(preds, y)
        self.log("val/mae", self.mae)


def test_a_logged_metric_is_computed_over_the_whole_pass_and_reset(tmp_path):
    task = MetricTask()
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, num_sanity_val_steps=1)
    task.seen.clear()
    metrics = engine.validate(task, torch.utils.data.DataLoader(list(zip(*_data())), batch_size=3))
    expected = torch.cat(task.seen).double().mean().item()
    assert metrics["val/mae"] == pytest.approx(expected, rel=1e-6)
    assert task.mae._update_count == 0  # reset after the reduction: the next pass starts empty


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(7, 4, generator=g), torch.randn(7, 1, generator=g)


def test_a_failing_metric_compute_is_one_error_and_leaves_the_metric_usable():
    from torchloom._logbuffer import compute_metric

    metric = torchmetrics.classification.BinaryAUROC()
    with pytest.raises(torchloom.TaskError, match=r"metric 'val/auroc' .*compute failed"):
        compute_metric("val/auroc", metric)  # nothing updated: no samples
    metric.update(torch.tensor([0.1, 0.9, 0.4]), torch.tensor([0, 1, 1]))
    assert compute_metric("val/auroc", metric) == pytest.approx(1.0)
    assert compute_metric("val/auroc", metric) == pytest.approx(1.0)  # compute twice: the same value


class StopAt(TinyTask):
    def __init__(self, at: int) -> None:
        super().__init__(n=16, batch_size=2)
        self.at, self.steps = at, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if self.steps == self.at:
            self.request_stop(f"scripted at micro-batch {self.at}")
        return super().training_step(batch, batch_idx)


def test_a_stop_request_ends_the_fit_at_the_next_check_as_a_success(tmp_path):
    engine = tiny_fit(task=StopAt(5), output_dir=str(tmp_path), max_epochs=3, log_every_n_steps=2, save_model=True)
    assert engine.progress.global_step == 6  # requested during step 5, seen at the logging check after step 6
    assert engine.stop_reason == "scripted at micro-batch 5"
    assert (tmp_path / "version_0" / "model" / "model.safetensors").exists()
    assert engine.logged_metrics["val/loss"] == [r for r in engine.history if "val/loss" in r][-1]["val/loss"]
    assert [r["step"] for r in engine.history if "val/loss" in r][-1] == 6  # the final validation


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stop_requested_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, rank):
    """A per-rank decision would stop one rank and leave the other waiting in its next collective (a hang the
    launcher reports); the request is agreed over the ranks at the logging check after step 6."""
    ranks = torchrun("stop_one_rank.py", tmp_path, str(rank), nproc=2, timeout=120)
    assert [r["step"] for r in ranks] == [6, 6]
    assert [r["reason"] for r in ranks] == [f"rank {rank} asked"] * 2  # the same reason everywhere
    assert ranks[0]["val_loss"] == ranks[1]["val_loss"]  # the final validation ran on both


def test_bad_reductions_are_one_clear_error(tmp_path):
    class Bad(TinyTask):
        def training_step(self, batch, batch_idx):
            self.log("x", 1.0, reduce="median")
            return super().training_step(batch, batch_idx)

    with pytest.raises(torchloom.TaskError, match=r"reduce='median' is not one of mean, sum, max, min, last"):
        tiny_fit(task=Bad(), output_dir=str(tmp_path))
