"""DiLoCo (``local_sgd`` with ``outer_optimizer``) on 2 processes against a reference computed here by hand: both
workers simulated in one process with plain PyTorch (inner SGD on each worker's shard, then every K optimizer steps
the mean of the workers, the outer gradient Δ = θ_global - mean, and SGD / Nesterov momentum on θ_global). Also:
``outer_lr: 1, outer_momentum: 0`` is plain averaging bitwise, a resume right after an outer step is bitwise, and
bad settings and states are one error each.

Reference: Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105, Algorithm 1; the momentum update of `torch.optim.SGD`.
"""

from __future__ import annotations

import pytest
import torch

import torchloom
from torchloom.testing import tiny_dataset
from torchloom_plugins.local_sgd import LocalSGDPlugin
from torchrun_util import torchrun

STEPS_PER_EPOCH, EPOCHS = 4, 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("diloco_fit.py", tmp_path_factory.mktemp("diloco"), nproc=2)


def reference(initial, *, n, sync_every, outer, lr, mu, grad_accum=1):
    """The final global parameters of 2 simulated workers (TinyTask: Linear(4, 1), MSE, SGD lr 0.1, batch 4)."""
    x, y = tiny_dataset(n, 4, 0).tensors
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, n, 4)]
    shards = [batches[0::2], batches[1::2]]  # Accelerate's sharding of an unshuffled loader by whole batches
    flat = torch.tensor(initial)
    workers = []
    for _ in shards:
        model = torch.nn.Linear(4, 1)
        with torch.no_grad():
            model.weight.copy_(flat[:4].view(1, 4))
            model.bias.copy_(flat[4:])
        workers.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    global_params = [p.detach().clone() for p in workers[0][0].parameters()]
    buffers = None

    def synchronise():
        nonlocal buffers
        with torch.no_grad():
            for i, g in enumerate(global_params):
                averaged = (list(workers[0][0].parameters())[i] + list(workers[1][0].parameters())[i]) / 2
                delta = g - averaged
                if buffers is None or len(buffers) <= i:
                    buffers = (buffers or []) + [delta.clone()]
                else:
                    buffers[i].mul_(mu).add_(delta)
                update = delta + mu * buffers[i] if outer == "nesterov" else buffers[i]
                g.sub_(lr * update)  # θ - lr·u
                for model, _ in workers:
                    list(model.parameters())[i].copy_(g)

    step = 0
    for _ in range(EPOCHS):
        for window in range(STEPS_PER_EPOCH):
            for (model, optimizer), shard in zip(workers, shards):
                for xb, yb in shard[window * grad_accum : (window + 1) * grad_accum]:
                    (torch.nn.functional.mse_loss(model(xb), yb) / grad_accum).backward()
                optimizer.step()
                optimizer.zero_grad()
            step += 1
            if step % sync_every == 0:
                synchronise()
    if step % sync_every:
        synchronise()  # the final average at the end of training, then its outer step
    return [v for g in global_params for v in g.flatten().tolist()]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("label", "settings"),
    [
        ("nesterov", {"n": 32, "sync_every": 2, "outer": "nesterov", "lr": 0.7, "mu": 0.9}),
        ("sgd", {"n": 32, "sync_every": 2, "outer": "sgd", "lr": 0.5, "mu": 0.8}),
        ("nesterov_ga", {"n": 64, "sync_every": 2, "outer": "nesterov", "lr": 0.7, "mu": 0.9, "grad_accum": 2}),
        ("nesterov_k3", {"n": 32, "sync_every": 3, "outer": "nesterov", "lr": 0.7, "mu": 0.9}),
    ],
)
def test_outer_steps_equal_a_reference_computed_by_hand(ranks, label, settings):
    for result in ranks:
        assert result[label]["global_step"] == EPOCHS * STEPS_PER_EPOCH
        expected = reference(result[label]["initial"], **settings)
        assert result[label]["final"] == pytest.approx(expected, abs=1e-6)
    assert ranks[0][label]["final"] == ranks[1][label]["final"]  # the processes end with the global parameters


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", ["nesterov", "nesterov_k3", "nesterov_ga", "sgd"])
def test_after_the_fit_the_global_parameters_are_the_models_on_every_rank(ranks, label):
    """Also when the fit ends between two synchronisations (nesterov_k3: 8 steps, K = 3): the last interval is
    averaged and gets its outer step, so the plugin's global parameters are the model's, the same on both ranks."""
    for result in ranks:
        assert result[label]["outer_params"] == result[label]["final"]
    assert ranks[0][label]["outer_params"] == ranks[1][label]["outer_params"]


@pytest.mark.multiprocess
def test_outer_lr_one_without_momentum_is_plain_averaging_bitwise(ranks):
    for result in ranks:
        assert result["unit"]["final"] == result["plain"]["final"]
        assert result["unit"]["final"] != result["nesterov"]["final"]  # the outer step does something otherwise


@pytest.mark.multiprocess
def test_a_resume_right_after_an_outer_step_is_bitwise(ranks):
    for result in ranks:
        assert result["cut"]["global_step"] == 4 and result["cut"]["checkpoint"].endswith("step-00000004")
        assert result["resumed"]["final"] == result["nesterov"]["final"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"outer_optimizer": "adam"},
            r"'outer_optimizer' = 'adam': expected null \(plain averaging\) or one of sgd, nesterov",
        ),
        ({"outer_optimizer": "sgd", "outer_lr": 0.0}, r"'outer_lr' = 0.0: expected a number > 0"),
        ({"outer_optimizer": "sgd", "outer_momentum": 1.0}, r"'outer_momentum' = 1.0: expected a number in \[0, 1\)"),
    ],
)
def test_bad_outer_settings_are_config_errors(settings, message):
    with pytest.raises(torchloom.ConfigError, match=message):
        LocalSGDPlugin(**settings)


def test_outer_state_round_trips_and_must_match_the_setting(tmp_path):
    plugin = LocalSGDPlugin(outer_optimizer="nesterov")
    state = {"num_steps": 6, "outer_steps": 3, "outer_params": [torch.ones(2, 2)], "outer_buffers": [torch.zeros(2, 2)]}
    plugin.load_state_dict(state)
    torchloom.save_plugin_state([plugin], tmp_path)
    again = LocalSGDPlugin(outer_optimizer="nesterov")
    torchloom.load_plugin_state([again], tmp_path)
    saved = again.state_dict()
    assert saved["num_steps"] == 6 and saved["outer_steps"] == 3
    assert torch.equal(saved["outer_params"][0], torch.ones(2, 2))
    with pytest.raises(
        torchloom.PluginError, match=r"saved with an outer optimizer \(DiLoCo\), but outer_optimizer is None"
    ):
        LocalSGDPlugin().load_state_dict(state)
    with pytest.raises(torchloom.PluginError, match="saved with plain averaging, but outer_optimizer is 'sgd'"):
        LocalSGDPlugin(outer_optimizer="sgd").load_state_dict({"num_steps": 2})


def test_the_memory_estimate_counts_the_fp32_global_parameters_and_momentum():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)  # 23 parameters
    assert LocalSGDPlugin.estimate_state_bytes(model, {"outer_optimizer": "nesterov"}) == 23 * 2 * 4
    assert LocalSGDPlugin.estimate_state_bytes(model, {"sync_every": 4}) == 0
    plugin = LocalSGDPlugin(outer_optimizer="sgd")
    plugin.load_state_dict(
        {"num_steps": 0, "outer_steps": 0, "outer_params": [torch.zeros(23)], "outer_buffers": [torch.zeros(23)]}
    )
    held = sum(t.numel() * t.element_size() for t in [*plugin.outer_params, *plugin.outer_buffers])
    assert held == LocalSGDPlugin.estimate_state_bytes(model, {"outer_optimizer": "sgd"})
