"""Resume chains, as a kind (issue 39): the counters of schedules and of a partly finished epoch after TWO resumes
equal the uninterrupted run's, bitwise; and every setting the resume check compares is refused, naming it, when
changed, while the settings documented as changeable across a resume are accepted.

The task is C11's (tests/mp/resume_fit.py): 10 ids in shuffled batches of 2 (5 steps per epoch, 3 epochs: 15
steps), dropout, AdamW + StepLR(2, 0.5), a max and a sum logged every micro-batch, logging every 3 steps and
validating every 4. B saves at step 7 (inside epoch 1, between two logging steps: partial sums in the log
buffer) and dies; C resumes it, saves at step 11 (inside epoch 2, again between logging steps) and dies; D resumes
C's checkpoint and finishes. The plugins whose counters a resume must continue: ``ema`` with a warm-up (its decay
depends on its step count), ``early_stopping`` (its ``wait`` counter, with a patience it never reaches) and
``throughput`` (its totals).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from torch.utils.data import DataLoader

import torchloom
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from resume_fit import Run, ShuffleTask, _plain, fit, id_data, metrics_file, snapshot

PLUGINS = [
    {"ema": {"decay": 0.9, "warmup_power": 0.75}},
    {"early_stopping": {"monitor": "val/loss", "patience": 100, "min_delta": 0.5}},
    {"throughput": {}},
]


def _plugin_states(run: Run) -> dict[str, Any]:
    return {
        p.name: _plain(p.state_dict()) for p in run.engine.plugins if p.name in ("ema", "early_stopping", "throughput")
    }


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Run]:
    a = fit(ShuffleTask, tmp_path_factory.mktemp("a"), PLUGINS)
    out = tmp_path_factory.mktemp("bcd")
    b = fit(ShuffleTask, out, PLUGINS, save_at=[7])
    c = fit(ShuffleTask, out, PLUGINS, save_at=[11], ckpt_path=b.checkpoint)
    d = fit(ShuffleTask, out, PLUGINS, ckpt_path=c.checkpoint)
    assert b.crashed and c.crashed and not a.crashed and not d.crashed
    return {"a": a, "b": b, "c": c, "d": d}


def test_two_resumes_end_bitwise_where_the_uninterrupted_run_ends(chain) -> None:
    a, d = chain["a"], chain["d"]
    assert snapshot(d.engine) == snapshot(a.engine)  # parameters, optimizer, StepLR's counters, the step counters
    assert a.engine._run.scheduler.state_dict()["_step_count"] == 16  # the scheduler stepped once per step (+1)


def test_two_resumes_continue_every_plugins_counters(chain) -> None:
    a, d = chain["a"], chain["d"]
    states = _plugin_states(a)
    assert states["ema"]["steps"] == 15 and states["ema"]["updates"] == 15
    assert states["early_stopping"]["wait"] > 0  # it counted checks without improvement, across the resumes too
    assert states["throughput"]["totals"]["samples"] == 30.0
    assert _plugin_states(d) == states


def test_two_resumes_train_the_same_samples_in_the_same_steps(chain) -> None:
    a, b, c, d = (chain[k] for k in "abcd")
    joined = b.probe.steps[:7] + c.probe.steps[:4] + d.probe.steps
    assert [s["step"] for s in joined] == list(range(1, 16))
    assert joined == a.probe.steps  # counters, LR used, parameters after each step
    assert b.probe.ids[:14] + c.probe.ids[:8] + d.probe.ids == a.probe.ids  # the rest of a partly done epoch


def test_two_resumes_log_the_uninterrupted_runs_records(chain) -> None:
    """The log buffer's partial sums (max and sum since the last logging step) at steps 7 and 11 are continued."""
    a, d = chain["a"], chain["d"]

    def exact(records: list[dict[str, Any]]) -> list[dict[str, Any]]:  # without the marks and the timings
        timed = ("carried_over_from", "throughput/samples_per_s", "throughput/peak_memory_bytes")
        return [{k: v for k, v in r.items() if k not in timed} for r in records]

    assert exact(metrics_file(d.engine)) == exact(metrics_file(a.engine)) == exact(a.engine.history)
    logged = [r["step"] for r in a.engine.history if "train/ids" in r]
    assert 7 not in logged and 11 not in logged and {6, 9} <= set(logged)  # saved between two logging steps


# ----------------------------------------------------------------------------------- settings compared


class SequentialTask(ShuffleTask):
    """C11's task without shuffling: another training sampler."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(id_data(self.n), batch_size=self.batch_size, shuffle=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint at step 7 (epoch 1 after 2 batches: 4 samples of it done), with ``ema`` state."""
    b = fit(ShuffleTask, tmp_path_factory.mktemp("saved"), [{"ema": {}}], save_at=[7])
    return b.checkpoint


REFUSED = [
    ("model", lambda: ShuffleTask(hidden=16), {}, r"the model's parameters differ \(0\.bias: saved \[8\], now \[16\]"),
    ("optimizer", lambda: ShuffleTask(optimizer="sgd+steplr"), {}, r"its optimizer is AdamW, this run's is SGD"),
    ("scheduler", lambda: ShuffleTask(optimizer="sgd"), {"reset_optimizer": True},
     r"it holds a learning-rate scheduler's state and this run has no scheduler"),
    ("stateful plugins", ShuffleTask, {"plugins": []}, r"its stateful plugins are 'ema', this run's are none"),
    ("dataset size", lambda: ShuffleTask(n=12), {}, r"the training dataset's size changed from 10 to 12"),
    ("sampler", SequentialTask, {}, r"the training sampler changed from SeedableRandomSampler to SequentialSampler"),
    ("batch size", lambda: ShuffleTask(batch_size=3), {},
     r"it stopped after 4 samples of epoch 1, which is not a whole number of the new global batches of 3 samples"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "make_task", "settings", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_each_compared_setting_when_changed_is_refused_naming_it(saved, tmp_path, what, make_task, settings, message):
    settings = {"plugins": [{"ema": {}}], **settings}
    with pytest.raises(torchloom.CheckpointError, match=r"cannot resume from checkpoint: .*" + message):
        fit(make_task, tmp_path, settings.pop("plugins"), ckpt_path=saved, **settings)


ACCEPTED = [
    ("batch size dividing the samples done", lambda: ShuffleTask(batch_size=4), {}),
    ("optimizer with reset_optimizer", lambda: ShuffleTask(optimizer="sgd+steplr"), {"reset_optimizer": True}),
    ("max_epochs", ShuffleTask, {"max_epochs": 4}),
    ("logging and validation intervals", ShuffleTask, {"log_every_n_steps": 2, "val_check_interval": 3}),
    ("learning rate", lambda: ShuffleTask(lr=0.01), {}),
    ("plugin settings", ShuffleTask, {"plugins": [{"ema": {"decay": 0.5}}]}),
]


@pytest.mark.parametrize(("what", "make_task", "settings"), ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_each_setting_documented_as_changeable_is_accepted(saved, tmp_path, what, make_task, settings) -> None:
    settings = {"plugins": [{"ema": {}}], **settings}
    run = fit(make_task, tmp_path, settings.pop("plugins"), ckpt_path=saved, **settings)
    assert not run.crashed
    assert run.probe.steps[0]["step"] == 8  # continued after the checkpoint's step 7
