"""`torchloom.checkpoint.replicas`: each process's own parameters, optimizer state and loss scaler, for checkpoints of
runs whose processes' copies differ (LocalSGD). The 2-process resumes are in tests/plugins/test_local_sgd_resume.py."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

import torchloom
from torchloom.checkpoint.plugin_state import load_plugin_state, save_plugin_state
from torchloom.checkpoint.replicas import divergent, load_replica, replica_state
from torchloom.checkpoint.store import _Named


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _round_trip(state, tmp_path):
    """``state`` written and read back as a checkpoint does it (`torchloom.checkpoint.plugin_state`'s files)."""
    save_plugin_state([_Named("replica", lambda: state, lambda s: None)], tmp_path)
    kept = {}
    load_plugin_state([_Named("replica", dict, lambda s: kept.update(s))], tmp_path)
    return kept


def test_a_replica_round_trips_bitwise_and_reset_optimizer_keeps_the_fresh_state(tmp_path) -> None:
    accelerator = Accelerator(cpu=True)
    source, source_opt = _trained(0)
    saved = _round_trip(replica_state(accelerator, source, source_opt), tmp_path)
    assert sorted(saved["optimizer"]) == ["0", "1", "2", "3"] and saved["scaler"] is None

    model, optimizer = _trained(1)
    load_replica(saved, accelerator, model, optimizer, load_optimizer=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), source.parameters(), strict=True))
    for index, values in source_opt.state_dict()["state"].items():
        loaded = optimizer.state_dict()["state"][index]
        assert all(torch.equal(loaded[k], v) for k, v in values.items())

    fresh_model, fresh_opt = _trained(2)
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in fresh_opt.state_dict()["state"].items()}
    load_replica(saved, accelerator, fresh_model, fresh_opt, load_optimizer=False)
    assert torch.equal(fresh_model[0].weight, source[0].weight)
    after = fresh_opt.state_dict()["state"]
    assert all(torch.equal(after[k][n], t) for k, v in before.items() for n, t in v.items())


def test_a_replica_of_another_model_is_refused(tmp_path) -> None:
    accelerator = Accelerator(cpu=True)
    saved = replica_state(accelerator, *_trained(0))
    other = torch.nn.Linear(3, 1)
    refused = r"process_0/replica\.safetensors holds other parameters than this model's trainable ones; refused$"
    with pytest.raises(torchloom.CheckpointError, match=refused):
        load_replica(saved, accelerator, other, torch.optim.SGD(other.parameters(), lr=0.1), load_optimizer=True)


def test_the_fp16_loss_scaler_is_kept_and_loaded_only_where_the_run_has_one(tmp_path) -> None:
    """An fp16 run's scaler (its scale and growth tracker differ between the processes too) is saved and put back;
    a resume without a scaler (bf16, fp32) ignores a saved one, and a saved ``None`` leaves the scaler as it is."""
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    source, source_opt = _trained(0)
    saved = _round_trip(replica_state(accelerator, source, source_opt), tmp_path)
    assert saved["scaler"]["scale"] == 1024.0 and saved["scaler"]["growth_interval"] == 7

    resumed = Accelerator(cpu=True)
    resumed.scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    model, optimizer = _trained(1)
    load_replica(saved, resumed, model, optimizer, load_optimizer=True)
    assert resumed.scaler.get_scale() == 1024.0 and resumed.scaler.get_growth_interval() == 7

    load_replica({**saved, "scaler": None}, resumed, model, optimizer, load_optimizer=True)
    assert resumed.scaler.get_scale() == 1024.0

    without = Accelerator(cpu=True)
    assert without.scaler is None
    load_replica(saved, without, model, optimizer, load_optimizer=True)  # no scaler to load into: not an error
    assert without.scaler is None and torch.equal(model[0].weight, source[0].weight)


def test_only_a_plugin_that_declares_it_asks_for_replicas() -> None:
    from torchloom_plugins.local_sgd import LocalSGDPlugin

    class Plain(torchloom.Plugin):
        name = "plain"

    assert LocalSGDPlugin.divergent_replicas is True and divergent([Plain(), LocalSGDPlugin()])
    assert not divergent([Plain(), object()])
