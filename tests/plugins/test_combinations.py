"""Every pair of technique plugins fits together; all six fit together on two processes.

Checkpointing and (on one process) LocalSGD must not change the arithmetic, so a fit with them equals the fit
without them; the other plugins define the reference.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mp"))

from combo_tasks import EXACT_NO_OPS_ON_ONE_PROCESS, PLUGIN_SETTINGS, ComboTask, final_parameters

from torchloom.testing import tiny_fit
from torchrun_util import torchrun

PAIRS = list(itertools.combinations(PLUGIN_SETTINGS, 2))


def fit(names, tmp_path: Path, label: str):
    return tiny_fit(
        {n: PLUGIN_SETTINGS[n] for n in names}, task=ComboTask(), max_epochs=1, output_dir=str(tmp_path / label)
    )


@pytest.mark.filterwarnings("ignore:local_sgd")
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_every_pair_fits_together_with_exact_no_ops(pair, tmp_path):
    engine = fit(pair, tmp_path, "pair")
    steps_per_epoch = 8 // (2 if "grad_accum" in pair else 1)
    assert engine.progress.global_step == steps_per_epoch
    losses = [r["train/loss"] for r in engine.history if "train/loss" in r]
    assert len(losses) == steps_per_epoch and all(torch.isfinite(torch.tensor(losses)))
    if "grad_clip" in pair:
        assert len([r for r in engine.history if "grad_norm" in r]) == steps_per_epoch
    reference_names = [n for n in pair if n not in EXACT_NO_OPS_ON_ONE_PROCESS]
    if len(reference_names) < len(pair):
        reference = fit(reference_names, tmp_path, "reference")
        for got, want in zip(final_parameters(engine), final_parameters(reference)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
    initial = [p.detach().double().flatten().tolist() for p in ComboTask().configure_model().parameters()]
    assert final_parameters(engine) != initial  # it trained


@pytest.mark.multiprocess
def test_all_six_plugins_on_two_processes(tmp_path):
    ranks = torchrun("combo_fit.py", tmp_path)
    for r in ranks:
        assert r["world_size"] == 2
        assert r["all"]["global_step"] == 8  # 2 epochs x 8 micro-batches per rank / GA 2
        assert len(r["all"]["grad_norms"]) == 8 and all(n > 0 for n in r["all"]["grad_norms"])
        # linear schedule with one warm-up step over the 8 optimizer steps: lr 1e-2 at step 1, 0 at the end
        assert r["all"]["lr"][0] == pytest.approx(1e-2 * 1 / 1) or r["all"]["lr"][0] == pytest.approx(0.0)
    # LocalSGD averages every 2 steps and 8 is a multiple: the ranks end bitwise equal.
    assert ranks[0]["all"]["params"] == ranks[1]["all"]["params"]
    # Checkpointing changes nothing, also with bf16 autocast, clipping, accumulation and LocalSGD together.
    for got, want in zip(ranks[0]["all"]["params"], ranks[0]["no_ckpt"]["params"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
