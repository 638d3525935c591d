"""The ``local_sgd`` plugin: averaging exactly every K optimizer steps (parameter groups, gradient
accumulation), ranks equal right after each averaging and different between them, no gradient all-reduce,
the step counter carried by checkpoints (`torchloom.save_plugin_state`), and an exact no-op with a warning on
one process.

Case C17 of shared/cases/README.md, run through `torchloom.Engine` (2 CPU processes under torchrun, gloo).
"""

from __future__ import annotations

import sys

import pytest
import torch
from accelerate import Accelerator

import torchloom
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.local_sgd import LocalSGDPlugin
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))  # the task shared with the torchrun script
from lsgd_tasks import LocalSGDProbe, TwoGroupTask

AVERAGED = [False, True, False, True, False, True]  # after optimizer steps 1..6 with K = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("lsgd_fit.py", tmp_path_factory.mktemp("lsgd"), nproc=2)


def _check_averaging(r0: dict, r1: dict, expected: list[bool]) -> None:
    """Right after an averaging the ranks are bitwise equal and equal to the float32 mean of their values just
    before it; after the other steps they differ."""
    assert len(r0["post"]) == len(expected)
    for step, averaged in enumerate(expected, start=1):
        pre0, pre1 = torch.tensor(r0["pre"][step - 1]), torch.tensor(r1["pre"][step - 1])
        post0, post1 = torch.tensor(r0["post"][step - 1]), torch.tensor(r1["post"][step - 1])
        assert not torch.equal(pre0, pre1), f"step {step}: ranks trained on the same data"
        if averaged:
            assert torch.equal(post0, post1), f"step {step}: not averaged"
            assert torch.equal(post0, (pre0 + pre1) / 2), f"step {step}: not the mean"
        else:
            assert not torch.equal(post0, post1), f"step {step}: averaged although not a multiple of K"
            assert torch.equal(post0, pre0) and torch.equal(post1, pre1)


@pytest.mark.multiprocess
def test_c17_average_every_k_steps_with_two_param_groups(ranks):
    """C17: Linear(2, 1), weight in group A (lr 0.1), bias in group B (lr 0.01), K = 2, 6 steps: exactly 3
    averagings, after steps 2, 4 and 6 (not one per group, not one per step)."""
    r0, r1 = ranks[0]["lsgd"], ranks[1]["lsgd"]
    assert ranks[0]["world_size"] == 2
    assert r0["global_step"] == 6 and r0["num_averages"] == r1["num_averages"] == 3
    _check_averaging(r0, r1, AVERAGED)


@pytest.mark.multiprocess
def test_c17_with_gradient_accumulation_counts_optimizer_steps(ranks):
    """C17 with grad_accum steps 2: 12 micro-batches per rank, 6 optimizer steps, still exactly 3 averagings
    at steps 2, 4, 6 (the counter is per optimizer step, never per micro-batch)."""
    r0, r1 = ranks[0]["lsgd_ga"], ranks[1]["lsgd_ga"]
    assert (r0["micro_steps"], r0["global_step"], r0["num_averages"]) == (12, 6, 3)
    _check_averaging(r0, r1, AVERAGED)


@pytest.mark.multiprocess
def test_no_gradient_allreduce_unlike_ddp(ranks):
    """LocalSGD runs inside DDP's no_sync(): no gradient bucket is all-reduced (plain DDP: one per step)."""
    assert ranks[0]["lsgd"]["grad_allreduces"] == ranks[0]["lsgd_ga"]["grad_allreduces"] == 0
    assert ranks[0]["ddp"]["grad_allreduces"] == 6
    assert ranks[0]["ddp"]["post"] == ranks[1]["ddp"]["post"]  # DDP keeps ranks equal every step


@pytest.mark.multiprocess
def test_counter_is_restored_from_a_checkpoint(ranks):
    """K = 4: a run of 3 steps saves its state (num_steps 3, `torchloom.save_plugin_state` on the main process);
    a new plugin that loads it on both processes averages after the first step of the resumed run (count 4), not
    after its fourth. The checkpoint is JSON + safetensors: no pickle."""
    a0, b0, b1 = ranks[0]["resume_a"], ranks[0]["resume_b"], ranks[1]["resume_b"]
    assert (a0["num_steps"], a0["num_averages"]) == (3, 0)
    assert (b0["num_steps"], b0["num_averages"]) == (b1["num_steps"], b1["num_averages"]) == (5, 1)
    _check_averaging(b0, b1, [True, False])
    assert ranks[0]["ckpt_files"] == ["local_sgd.json", "local_sgd.safetensors"]


# -------------------------------------------------------------------------------------------- one process


def test_one_process_warns_and_is_an_exact_noop(tmp_path, monkeypatch):
    """C17, 1 process: a warning, no collective (Accelerator.reduce is never called by the plugin) and
    parameters bitwise identical to the run without LocalSGD, after every step."""
    reduces = []
    real_reduce = Accelerator.reduce

    def counting_reduce(self, *args, **kwargs):
        reduces.append(1)
        return real_reduce(self, *args, **kwargs)

    ref = LocalSGDProbe()
    tiny_fit([ref], task=TwoGroupTask(24), max_epochs=2, output_dir=str(tmp_path / "ref"))
    monkeypatch.setattr(Accelerator, "reduce", counting_reduce)
    plugin, got = LocalSGDPlugin(sync_every=2), LocalSGDProbe()
    with pytest.warns(UserWarning, match=r"local_sgd: the run has 1 process.*does nothing"):
        tiny_fit([plugin, got], task=TwoGroupTask(24), max_epochs=2, output_dir=str(tmp_path / "lsgd"))
    assert len(got.post) == 24
    assert got.post == ref.post  # bitwise
    assert reduces == []
    assert plugin.num_steps == 24 and plugin.num_averages == 0


def test_state_travels_with_save_plugin_state_and_load_plugin_state(tmp_path):
    """save_plugin_state writes the counter as JSON; load_plugin_state in a new run restores it into a new plugin
    instance (here loaded before that plugin's on_fit_start: the probe is listed first)."""
    ckpt = str(tmp_path / "ckpt")
    first = LocalSGDPlugin(sync_every=3)
    with pytest.warns(UserWarning):
        tiny_fit([first, LocalSGDProbe(save_to=ckpt, stateful=[first])], max_steps=5, output_dir=str(tmp_path / "a"))
    assert first.state_dict() == {"num_steps": 5}
    second = LocalSGDPlugin(sync_every=3)
    with pytest.warns(UserWarning):
        tiny_fit(
            [LocalSGDProbe(load_from=ckpt, stateful=[second]), second], max_steps=2, output_dir=str(tmp_path / "b")
        )
    assert second.num_steps == 7


def test_state_round_trips_exactly(tmp_path):
    """The state after a load is the state before the save, of the same type (a plain int)."""
    plugin = LocalSGDPlugin(sync_every=2)
    plugin.load_state_dict({"num_steps": 2**40 + 3})
    assert torchloom.save_plugin_state([plugin], tmp_path) == ["local_sgd"]
    fresh = LocalSGDPlugin(sync_every=2)
    assert torchloom.load_plugin_state([fresh], tmp_path) == ["local_sgd"]
    assert fresh.state_dict() == {"num_steps": 2**40 + 3} and type(fresh.state_dict()["num_steps"]) is int


def test_load_state_dict_validates_and_applies_to_a_running_counter(tmp_path):
    plugin = LocalSGDPlugin(sync_every=2)
    plugin.load_state_dict({"num_steps": 4})
    assert plugin.num_steps == 4 and plugin.state_dict() == {"num_steps": 4}
    with pytest.raises(torchloom.PluginError, match=r"local_sgd: cannot load state .*num_steps"):
        plugin.load_state_dict({"steps": 4})
    with pytest.raises(torchloom.PluginError):
        plugin.load_state_dict({"num_steps": -1})


def test_bad_sync_every_is_a_config_error():
    with pytest.raises(torchloom.ConfigError, match=r"'sync_every' = 0.*>= 1"):
        torchloom.enable_plugins({"local_sgd": {"sync_every": 0}})
    with pytest.raises(torchloom.ConfigError, match="sync_every"):
        torchloom.enable_plugins({"local_sgd": {"sync_every": 2.5}})


def test_context_is_closed_after_an_exception(tmp_path):
    """A failing fit still runs teardown; the plugin drops its context without the final average."""

    class Boom(TinyTask):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    plugin = LocalSGDPlugin(sync_every=2)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="boom"):
        tiny_fit([plugin], task=Boom(), output_dir=str(tmp_path))
    assert plugin.num_steps == 2 and plugin._stack is None
