"""The ``compile`` plugin: compiled training matches eager (alone and with grad_accum, grad_checkpoint,
mixed_precision bf16 and local_sgd), saved weights carry no ``_orig_mod.``, recompilations under variable
sequence lengths are counted (and stay at zero with ``dynamic=True``), configuration errors.

Most tests use the ``aot_eager`` backend: Dynamo and AOTAutograd trace forward and backward as with inductor,
without generating kernels (fast); one test compiles with inductor.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import tiny_fit
from torchloom_plugins.compile import Compile, compile_counters, compile_in_place
from torchrun_util import torchrun

TOL = 1e-6  # float32 parameters after a few SGD steps: compiled vs eager (aot_eager runs the same kernels)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x)) + x


class MLPTask(torchloom.TaskModule):
    """A small MLP regression over ``(batch, length, 8)`` inputs; ``lengths`` gives each batch's length."""

    def __init__(self, lengths: tuple[int, ...] = (5,) * 8, seed: int = 0) -> None:
        super().__init__()
        self.lengths, self.seed = lengths, seed

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return torch.nn.Sequential(Block(8), Block(8), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        x = x[0]  # one pre-batched (4, length, 8) tensor per item
        return (self.model(x).squeeze(-1) - x.sum(-1).sin()).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, n, 8, generator=g) for n in self.lengths]
        return DataLoader(_Ragged(xs), batch_size=1, collate_fn=lambda items: (torch.stack([items[0]]),))


class _Ragged(torch.utils.data.Dataset):
    def __init__(self, xs: list[torch.Tensor]) -> None:
        self.xs = xs

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.xs[i]


def _params(engine: torchloom.Engine) -> dict[str, torch.Tensor]:
    model = engine.fitted_task.model  # type: ignore[attr-defined]
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _fit(plugins: dict[str, Any], tmp_path, task: torchloom.TaskModule | None = None, **settings: Any):
    settings.setdefault("output_dir", str(tmp_path))
    task = task if task is not None else MLPTask()
    engine = tiny_fit(plugins, task=task, **settings)
    engine.fitted_task = task  # type: ignore[attr-defined]
    return engine


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=tol, rtol=0), (k, (a[k] - b[k]).abs().max().item())


PAIRS = {
    "alone": {},
    "grad_accum": {"grad_accum": {"steps": 2}},
    "grad_checkpoint": {"grad_checkpoint": {"modules": ["Block"]}},
    "mixed_precision_bf16": {"mixed_precision": {"dtype": "bf16"}},
    "local_sgd": {"local_sgd": {"sync_every": 2}},  # one process: averaging is the identity
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_compiled_matches_eager(pair, tmp_path):
    others = PAIRS[pair]
    eager = _fit(copy.deepcopy(others), tmp_path / "eager")
    graphs_before, _ = compile_counters()
    compiled = _fit({"compile": {"backend": "aot_eager"}, **copy.deepcopy(others)}, tmp_path / "compiled")
    assert compile_counters()[0] > graphs_before  # the model really was compiled
    _assert_close(_params(compiled), _params(eager), TOL)
    assert compiled.history[-1]["compile/recompiles"] == 0.0
    assert compiled.history[-1]["compile/graph_breaks"] == 0.0  # also through checkpointing and autocast
    assert compiled.history[0]["compile/first_step_seconds"] > 0


def test_inductor_matches_eager_and_saves_plain_keys(tmp_path):
    eager = _fit({}, tmp_path / "eager", save_model=True)
    compiled = _fit({"compile": {}}, tmp_path / "compiled", save_model=True)
    _assert_close(_params(compiled), _params(eager), 1e-5)  # inductor fuses and reorders float32 arithmetic
    files = sorted((tmp_path / "compiled").rglob("*.safetensors"))
    assert files
    for f in files:
        keys = list(load_file(f))
        assert keys and not any("_orig_mod" in k for k in keys), keys
    eager_keys = {k for f in (tmp_path / "eager").rglob("model.safetensors") for k in load_file(f)}
    assert eager_keys == set(keys)


def test_checkpoint_has_no_orig_mod(tmp_path):
    _fit({"compile": {"backend": "aot_eager"}, "checkpoint": {}}, tmp_path, max_steps=2)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for f in files:
        assert not any("_orig_mod" in k for k in load_file(f))


def test_recompiles_counted_under_variable_lengths(tmp_path):
    lengths = (3, 5, 7, 9, 11, 13, 15, 17)
    with pytest.warns(UserWarning, match=r"last reason: .*size mismatch(.|\n)*dynamic: true"):
        engine = _fit(
            {"compile": {"backend": "aot_eager", "dynamic": False, "recompile_warn_threshold": 4}},
            tmp_path / "static",
            task=MLPTask(lengths),
        )
    counts = [h["compile/recompiles"] for h in engine.history if "compile/recompiles" in h]
    assert counts == sorted(counts) and counts[-1] == len(lengths) - 1  # one graph per new length
    dynamic = _fit({"compile": {"backend": "aot_eager", "dynamic": True}}, tmp_path / "dynamic", task=MLPTask(lengths))
    assert {h["compile/recompiles"] for h in dynamic.history if "compile/recompiles" in h} == {0.0}


def test_graph_breaks_counted(tmp_path):
    class Breaking(MLPTask):
        def configure_model(self) -> torch.nn.Module:
            model = super().configure_model()
            model[0].register_forward_hook(lambda m, i, o: print(end=""))  # print: a graph break
            return model

    engine = _fit({"compile": {"backend": "eager"}}, tmp_path, task=Breaking())
    assert engine.history[-1]["compile/graph_breaks"] >= 1


@pytest.mark.parametrize(("threshold", "warns"), [(4, False), (3, True)])
def test_the_recompile_warning_fires_past_the_threshold_not_at_it(tmp_path, threshold, warns):
    """5 lengths: 4 graphs compiled after the first step. Threshold 4 is reached, not passed: no warning."""
    settings = {"backend": "aot_eager", "dynamic": False, "recompile_warn_threshold": threshold}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = _fit({"compile": settings}, tmp_path, task=MLPTask((3, 5, 7, 9, 11)))
    assert engine.history[-1]["compile/recompiles"] == 4
    compile_warnings = [str(w.message) for w in record if str(w.message).startswith("compile:")]
    assert len(compile_warnings) == (1 if warns else 0)
    if warns:
        assert compile_warnings[0].startswith("compile: 4 graphs were recompiled after the first step (threshold 3;")


def test_counts_are_per_fit(tmp_path):
    """Dynamo's counters are per process; the plugin counts from the start of each fit. Two fits of new models over
    lengths 3, 5, 7 each recompile twice (a graph per new length after the first step); a model with a graph break
    reports the breaks of its own fit (Dynamo caches the broken-off frames, so a second one breaks less often)."""

    class Breaking(MLPTask):
        def configure_model(self) -> torch.nn.Module:
            model = super().configure_model()
            model[0].register_forward_hook(lambda m, i, o: print(end=""))  # print: a graph break
            return model

    plugins = {"compile": {"backend": "eager", "dynamic": False, "recompile_warn_threshold": 10}}
    for run in ("a", "b"):
        engine = _fit(plugins, tmp_path / run, task=MLPTask((3, 5, 7)))
        records = [
            (h["compile/recompiles"], h["compile/graph_breaks"]) for h in engine.history if "compile/recompiles" in h
        ]
        assert records == [(0, 0), (1, 0), (2, 0)], run
    for run in ("c", "d"):
        breaks_before = compile_counters()[1]
        engine = _fit(plugins, tmp_path / run, task=Breaking((5, 5, 5)))
        breaks = compile_counters()[1] - breaks_before
        assert breaks > 0 and engine.history[-1]["compile/graph_breaks"] == breaks, run
        assert engine.history[-1]["compile/recompiles"] == 0


def test_compile_in_place_keeps_the_module():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    names = list(model.state_dict())
    compile_in_place(model, backend="eager")
    assert list(model.state_dict()) == names
    assert model(torch.ones(1, 3)).shape == (1, 2)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"backend": "nope"}, "'backend' = 'nope'"),
        ({"mode": "fast"}, "'mode' = 'fast'"),
        ({"mode": "max-autotune", "backend": "eager"}, "needs backend 'inductor'"),
        ({"fullgraph": "yes"}, "'fullgraph'"),
        ({"dynamic": "auto"}, "'dynamic'"),
        ({"recompile_warn_threshold": -1}, "'recompile_warn_threshold' = -1"),
    ],
)
def test_config_errors(settings, match):
    with pytest.raises(torchloom.ConfigError, match=match):
        Compile(**settings)


@pytest.mark.multiprocess
def test_compiled_matches_eager_on_two_processes_with_local_sgd(tmp_path):
    """All six technique plugins under 2-process DDP (LocalSGD every 2 steps, GA 2, bf16, checkpointing,
    clipping, AdamW), with and without compile: the same parameters on both ranks and as eager."""
    ranks = torchrun("compile_fit.py", tmp_path)
    for r in ranks:
        assert r["world_size"] == 2 and r["compiled"]["global_step"] == r["eager"]["global_step"] == 4
        assert r["eager"]["graphs"] == 0 and r["compiled"]["graphs"] > 0  # compiled inside DDP
        assert r["compiled"]["recompiles"] and set(r["compiled"]["recompiles"]) == {0.0}
        for got, want in zip(r["compiled"]["params"], r["eager"]["params"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
    assert ranks[0]["compiled"]["params"] == ranks[1]["compiled"]["params"]  # LocalSGD averaged at step 4
