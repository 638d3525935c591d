"""Quick-debug runs (issue 30, item 1): the engine settings ``fast_dev_run``, ``limit_train_batches``,
``limit_val_batches`` and ``overfit_batches``, with Lightning's meanings.

The stop points are counted from the hooks (`torchloom.testing.RecordingPlugin`) and the task's own calls: which
training batches ran in which epoch, how many batches each validation pass (and the sanity pass) ran, the
optimizer steps and ``num_training_steps``. A limited fit resumes exactly (the machinery of tests/test_resume.py),
a ``fast_dev_run`` writes no checkpoint, model, tracker log or ``latest`` link, and on 2 processes every rank stops
at the same batch. Every bad value is one `torchloom.ConfigError` naming the setting, the value and what is valid.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_dataset
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))  # the tasks and helpers of the exact-resume tests

from resume_fit import ShuffleTask, fit, stop_and_resume

from test_resume import assert_resumed_exactly

# TinyTask(n=32, batch_size=4): 8 training batches per epoch; 16 validation samples, 4 validation batches.
TRAIN_BATCHES, VAL_BATCHES = 8, 4


class CountingTask(TinyTask):
    """TinyTask that records the samples of every training and validation batch, and counts ``validation_step``
    calls (the sanity pass calls it without hooks)."""

    def __init__(self, *, shuffle: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shuffle = shuffle
        self.train_x: list[torch.Tensor] = []
        self.val_x: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_x.append(batch[0].detach().clone())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.val_x.append(batch[0].detach().clone())
        return super().validation_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        data = tiny_dataset(self.n, self.in_features, 0, self.dtype)
        return DataLoader(data, batch_size=self.batch_size, shuffle=self.shuffle)


def run(task: TinyTask | None = None, plugins: list[Any] | None = None, **settings: Any) -> tuple[Any, Any, Any]:
    """Fit ``task`` (a `CountingTask`) with a recorder; return the engine, the task and the recorder."""
    task = task if task is not None else CountingTask()
    recorder = RecordingPlugin()
    settings.setdefault("log_every_n_steps", 1)
    settings.setdefault("default_plugins", False)
    engine = torchloom.Engine(plugins=[recorder, *(plugins or [])], **settings)
    engine.fit(task)
    return engine, task, recorder


def train_batches(recorder: RecordingPlugin) -> list[tuple[int, int]]:
    """``(epoch, batch_idx)`` of every training micro-batch, in order."""
    return [(p.epoch, p.batch_idx) for hook, p in recorder.records if hook == "run_train_step"]


def val_passes(recorder: RecordingPlugin) -> list[int]:
    """The batches of every validation pass (the sanity pass fires no hook), in order."""
    passes: list[int] = []
    for hook in recorder.calls:
        if hook == "on_validation_start":
            passes.append(0)
        elif hook == "on_validation_batch_end":
            passes[-1] += 1
    return passes


def step_batches(recorder: RecordingPlugin) -> list[tuple[int, int]]:
    """``(epoch, batch_idx)`` of the micro-batch of every optimizer step."""
    return [(p.epoch, p.batch_idx) for hook, p in recorder.records if hook == "before_optimizer_step"]


def every(epochs: int, batches: int) -> list[tuple[int, int]]:
    return [(e, b) for e in range(epochs) for b in range(batches)]


# ------------------------------------------------------------------------------------- limit_train_batches


@pytest.mark.parametrize(
    ("limit", "per_epoch"),
    [(3, 3), (1, 1), (8, 8), (50, 8), (0.5, 4), (0.4, 3), (0.99, 7), (1.0, 8)],
    ids=["3", "1", "8", "more_than_there_are", "half", "0.4_floored", "0.99_floored", "1.0_is_all"],
)
def test_limit_train_batches_stops_every_epoch_at_the_limit(tmp_path, limit, per_epoch) -> None:
    engine, task, recorder = run(limit_train_batches=limit, max_epochs=2, output_dir=str(tmp_path))
    assert train_batches(recorder) == every(2, per_epoch)
    assert engine.progress.global_step == 2 * per_epoch
    assert task.num_training_steps == 2 * per_epoch  # the schedule length agrees with the limit
    assert val_passes(recorder) == [VAL_BATCHES, VAL_BATCHES]  # validation is not limited by it
    assert len(task.train_x) == 2 * per_epoch


def test_a_limited_epoch_flushes_its_accumulation_window_and_the_schedule_counts_it(tmp_path) -> None:
    # 3 batches per epoch, windows of 2: steps after batches 1 and 2 (a window of 1 at the limit), as at the end
    # of a whole epoch; without that, batch 2's gradient would be added to the next epoch's first window.
    engine, task, recorder = run(
        plugins=[{"grad_accum": {"steps": 2}}], limit_train_batches=3, max_epochs=3, output_dir=str(tmp_path)
    )
    assert step_batches(recorder) == [(e, b) for e in range(3) for b in (1, 2)]
    assert task.num_training_steps == engine.progress.global_step == 6 == 3 * math.ceil(3 / 2)


def test_the_lr_schedule_and_the_progress_total_use_the_limited_length(tmp_path, capsys) -> None:
    class Scheduled(CountingTask):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            total = self.num_training_steps
            return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)

    lrs: list[float] = []

    class LRs(torchloom.Plugin):
        name = "lrs"

        @torchloom.hookimpl
        def before_optimizer_step(self, optimizer) -> None:
            lrs.append(optimizer.param_groups[0]["lr"])

    progress = {"progress": {"terminal": False}}
    _, task, _ = run(Scheduled(), [LRs(), progress], limit_train_batches=2, max_epochs=2, output_dir=str(tmp_path))
    assert task.num_training_steps == 4
    assert lrs == pytest.approx([0.1, 0.075, 0.05, 0.025])  # a linear decay over the 4 steps that ran
    out = capsys.readouterr().out
    assert "step 4/4" in out and "/16" not in out  # the progress total is the limited fit's


@pytest.mark.parametrize(("stop", "k"), [("step", 2), ("step", 3), ("step", 4), ("epoch", 0)])
def test_a_limited_fit_resumes_exactly(tmp_path, stop, k) -> None:
    """ShuffleTask: 5 shuffled batches per epoch, limited to 3; 3 epochs. Step 3 is the limited epoch's last
    batch (saved from on_train_step_end: the epoch's end is still to come)."""
    settings = {"limit_train_batches": 3}
    a = fit(ShuffleTask, tmp_path / "a", **settings)
    assert a.engine.progress.global_step == 9 and a.task.num_training_steps == 9
    where = {"save_at": [k]} if stop == "step" else {"save_epoch_end": [k]}
    b, c = stop_and_resume(ShuffleTask, tmp_path / "bc", **where, **settings)
    assert_resumed_exactly(a, b, c)
    position = json.loads((Path(b.checkpoint) / "manifest.json").read_text())["position"]
    assert position["order"]["batches_per_epoch"] == 3  # the limited epoch, not the loader's 5 batches
    done = 3 if stop == "epoch" else k - 3 * ((k - 1) // 3)  # batches of the epoch it stopped in
    assert position["batches_done"] == done and position["samples_done"] == 2 * done
    assert position["epoch_finished"] == (stop == "epoch")


class Stream(torch.utils.data.IterableDataset):
    """TinyTask's 32 training samples as a stream without a length."""

    def __iter__(self):
        x, y = tiny_dataset(32, 4, 0).tensors
        return iter(zip(x, y, strict=True))


class StreamTask(CountingTask):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=self.batch_size)


def test_a_count_limits_a_stream_without_a_length_and_a_fraction_is_refused(tmp_path) -> None:
    engine, task, recorder = run(StreamTask(), limit_train_batches=3, max_epochs=2, output_dir=str(tmp_path / "a"))
    assert train_batches(recorder) == every(2, 3)
    assert task.num_training_steps == engine.progress.global_step == 6  # without a length: the limit's count
    with pytest.raises(
        torchloom.ConfigError,
        match=r"engine: setting 'limit_train_batches' = 0.5: a fraction of the training batches needs a training "
        r"dataloader with a length \(this one is an iterable dataset without one\); expected an integer number",
    ):
        run(StreamTask(), limit_train_batches=0.5, output_dir=str(tmp_path / "b"))


# --------------------------------------------------------------------------------------- limit_val_batches


@pytest.mark.parametrize(("limit", "batches"), [(1, 1), (3, 3), (0.5, 2), (0.3, 1), (1.0, 4), (9, 4)])
def test_limit_val_batches_limits_every_validation_pass_and_the_sanity_pass(tmp_path, limit, batches) -> None:
    engine, task, recorder = run(
        limit_val_batches=limit, max_epochs=2, val_check_interval=3, num_sanity_val_steps=3, output_dir=str(tmp_path)
    )
    assert train_batches(recorder) == every(2, TRAIN_BATCHES)  # training is not limited by it
    # validations at steps 3, 6, 9, 12, 15 and the final one at 16, each of `batches` batches
    assert val_passes(recorder) == [batches] * 6
    sanity = min(3, batches)
    assert len(task.val_x) == sanity + 6 * batches
    assert engine.validate(task) and val_passes(recorder)[-1] == batches  # a validate call too


# -------------------------------------------------------------------------------------------- fast_dev_run


@pytest.mark.parametrize(("value", "n"), [(True, 1), (1, 1), (3, 3)])
def test_fast_dev_run_runs_n_training_and_validation_batches_in_one_epoch(tmp_path, value, n) -> None:
    engine, task, recorder = run(
        fast_dev_run=value, max_epochs=5, val_check_interval=100, num_sanity_val_steps=2, output_dir=str(tmp_path)
    )
    assert train_batches(recorder) == every(1, n)
    assert engine.progress.global_step == task.num_training_steps == n
    assert val_passes(recorder) == [n]  # one validation, at the end of the one epoch
    assert len(task.val_x) == n  # no sanity pass
    assert engine.validate(task) and val_passes(recorder)[-1] == n


def test_fast_dev_run_writes_no_checkpoint_model_tracker_log_or_latest_link(tmp_path, capsys) -> None:
    plugins = [
        {"checkpoint": {"every_n_steps": 1, "every_n_epochs": 1}},
        {"trackers": {"log_with": ["tensorboard"]}},
        {"progress": {"terminal": False}},
    ]
    engine, _, _ = run(plugins=plugins, fast_dev_run=2, save_model=True, output_dir=str(tmp_path))
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert files == ["version_0", "version_0/config.yaml", "version_0/metrics.jsonl"]  # no summary.json either
    assert engine.accelerator.trackers == []
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fast_dev_run: 2 training and 2 validation batches")
    assert out[-1].startswith("fast_dev_run passed (2 batches): 2 optimizer steps, train/loss ")
    assert "nothing saved" in out[-1] and not any("fit summary" in line for line in out)

    # The same settings without fast_dev_run do write them (the test above is not vacuous).
    engine, _, _ = run(plugins=plugins, save_model=True, output_dir=str(tmp_path / "full"))
    written = {p.name for p in (tmp_path / "full").rglob("*")}
    assert {"checkpoints", "model", "latest", "summary.json"} <= written
    assert any(name.startswith("events.out.tfevents") for name in written)


def test_plugins_learn_of_a_fast_dev_run_from_the_config_setup_receives(tmp_path) -> None:
    seen: list[tuple[bool, int, int, bool]] = []

    class Reader(torchloom.Plugin):
        name = "reader"

        @torchloom.hookimpl
        def setup(self, config) -> None:
            seen.append((config.is_fast_dev_run, config.max_epochs, config.num_sanity_val_steps, config.save_model))

    engine, task, _ = run(
        plugins=[Reader()], fast_dev_run=True, max_epochs=4, save_model=True, output_dir=str(tmp_path)
    )
    engine.validate(task)
    run(plugins=[Reader()], max_epochs=4, output_dir=str(tmp_path / "full"))
    assert seen == [(True, 1, 0, False), (True, 1, 0, False), (False, 4, 2, False)]
    assert engine.config.fast_dev_run is True and engine.config.max_epochs == 4  # the user's settings are kept


# ------------------------------------------------------------------------------------------ overfit_batches


@pytest.mark.parametrize("value", [2, 0.25])
def test_overfit_batches_trains_and_validates_on_the_same_first_batches_every_epoch(tmp_path, value) -> None:
    task = CountingTask(shuffle=True)  # shuffled by the user: overfit_batches trains in dataset order
    engine, task, recorder = run(task, overfit_batches=value, max_epochs=3, output_dir=str(tmp_path))
    assert train_batches(recorder) == every(3, 2)
    assert task.num_training_steps == engine.progress.global_step == 6
    x = tiny_dataset(32, 4, 0).tensors[0]
    first = [x[0:4], x[4:8]]  # the dataset's first two batches
    assert len(task.train_x) == 6
    for got, expected in zip(task.train_x, first * 3, strict=True):
        assert torch.equal(got, expected)
    # every validation runs on those batches, not on the task's validation data
    assert val_passes(recorder) == [2, 2, 2]
    for got, expected in zip(task.val_x, first * 4, strict=True):  # sanity pass (2 batches), then 3 passes
        assert torch.equal(got, expected)
    assert len(task.val_x) == 2 + 6


def test_overfit_batches_needs_a_loader_with_a_batch_size(tmp_path) -> None:
    class BatchSampled(CountingTask):
        def train_dataloader(self) -> DataLoader:
            data = tiny_dataset(self.n, self.in_features, 0, self.dtype)
            return DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, drop_last=False))

    with pytest.raises(
        torchloom.ConfigError, match=r"'overfit_batches' needs a training DataLoader built with batch_size"
    ):
        run(BatchSampled(), overfit_batches=2, output_dir=str(tmp_path))


# ------------------------------------------------------------------------------------------------ bad values

VALID_LIMIT = r"expected null \(every batch\), an integer >= 1 \(batches\) or a float in \(0, 1\] \(a fraction\)"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fast_dev_run": 0}, r"engine: setting 'fast_dev_run' = 0; expected false, true \(1 batch\) or a number"),
        ({"fast_dev_run": -2}, r"engine: setting 'fast_dev_run' = -2; expected false, true"),
        ({"fast_dev_run": 0.5}, r"engine: setting 'fast_dev_run' = 0.5 \(float\); expected bool \| int"),
        ({"limit_train_batches": 0}, r"engine: setting 'limit_train_batches' = 0; " + VALID_LIMIT),
        ({"limit_train_batches": -3}, r"engine: setting 'limit_train_batches' = -3; " + VALID_LIMIT),
        ({"limit_train_batches": 1.5}, r"engine: setting 'limit_train_batches' = 1.5; " + VALID_LIMIT),
        ({"limit_train_batches": 0.0}, r"engine: setting 'limit_train_batches' = 0.0; " + VALID_LIMIT),
        ({"limit_train_batches": float("nan")}, r"engine: setting 'limit_train_batches' = nan; " + VALID_LIMIT),
        ({"limit_train_batches": "all"}, r"engine: setting 'limit_train_batches' = 'all' \(str\); expected int"),
        ({"limit_train_batches": True}, r"engine: setting 'limit_train_batches' = True \(bool\); expected int"),
        ({"limit_val_batches": 0}, r"engine: setting 'limit_val_batches' = 0; " + VALID_LIMIT),
        ({"limit_val_batches": 2.0}, r"engine: setting 'limit_val_batches' = 2.0; " + VALID_LIMIT),
        ({"overfit_batches": 0}, r"engine: setting 'overfit_batches' = 0; " + VALID_LIMIT),
        ({"overfit_batches": -0.5}, r"engine: setting 'overfit_batches' = -0.5; " + VALID_LIMIT),
        (
            {"fast_dev_run": True, "max_steps": 10},
            r"engine: setting 'max_steps' = 10 cannot be combined with fast_dev_run = True, which sets the batches "
            r"itself; expected max_steps null with fast_dev_run, or fast_dev_run false",
        ),
        ({"fast_dev_run": 2, "limit_train_batches": 3}, r"'limit_train_batches' = 3 cannot be combined with fast_dev"),
        ({"fast_dev_run": 2, "limit_val_batches": 0.5}, r"'limit_val_batches' = 0.5 cannot be combined with fast_dev"),
        ({"fast_dev_run": 1, "overfit_batches": 1}, r"'overfit_batches' = 1 cannot be combined with fast_dev_run = 1"),
        (
            {"overfit_batches": 2, "limit_val_batches": 1},
            r"engine: setting 'limit_val_batches' = 1 cannot be combined with overfit_batches = 2",
        ),
        (
            {"overfit_batches": 2, "limit_train_batches": 4},
            r"'limit_train_batches' = 4 cannot be combined with overfit",
        ),
    ],
    ids=lambda v: json.dumps(v, default=str) if isinstance(v, dict) else None,
)
def test_a_bad_value_is_one_config_error_naming_the_setting(settings, message) -> None:
    with pytest.raises(torchloom.ConfigError, match=message):
        torchloom.Engine(**settings)
    with pytest.raises(torchloom.ConfigError, match=message):  # the config class itself checks alike
        torchloom.EngineConfig(**settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"limit_train_batches": 0.1},
            r"engine: setting 'limit_train_batches' = 0.1 of the 8 training batches per process is no batch; "
            r"expected a fraction >= 0.125 \(one batch\) or an integer number of batches",
        ),
        ({"overfit_batches": 0.05}, r"engine: setting 'overfit_batches' = 0.05 of the 8 training batches"),
        ({"limit_val_batches": 0.2}, r"engine: setting 'limit_val_batches' = 0.2 of the 4 validation batches"),
    ],
)
def test_a_fraction_that_leaves_no_batch_is_refused_before_training(tmp_path, settings, message) -> None:
    task = CountingTask()
    with pytest.raises(torchloom.ConfigError, match=message):
        run(task, output_dir=str(tmp_path), **settings)
    assert task.train_x == [] and not os.listdir(tmp_path)  # nothing trained, no run directory left


# ---------------------------------------------------------------------------------------------- 2 processes


@pytest.mark.multiprocess
def test_every_rank_stops_at_the_same_batch_on_two_processes(tmp_path) -> None:
    """8 training batches: 4 per process; 4 validation batches: 2 per process (tests/mp/quick_debug.py)."""
    ranks = torchrun("quick_debug.py", tmp_path, nproc=2, timeout=240)
    assert ranks[0] == ranks[1]  # the same stop points on both ranks
    fraction, count, fast = (ranks[0][name] for name in ("fraction", "count", "fast_dev_run"))
    assert fraction["batches"] == [list(b) for b in every(2, 2)]  # 0.5 of the 4 batches per process, not of 8
    assert fraction["steps"] == fraction["num_training_steps"] == 4
    assert fraction["val_passes"] == [1, 1]
    assert count["batches"] == [list(b) for b in every(2, 3)]
    assert count["steps"] == count["num_training_steps"] == 6
    assert count["val_passes"] == [2, 2, 2]  # at steps 2, 4 and 6: the 2 batches per process
    assert fast["batches"] == [[0, 0], [0, 1]] and fast["steps"] == fast["num_training_steps"] == 2
    assert fast["val_passes"] == [2]
    assert fast["files"] == ["version_0/config.yaml", "version_0/metrics.jsonl"]
