"""The auto_batch plugin on one process: the back-off at forward, backward and the optimizer step gives the
parameters, optimizer steps and learning rates of a grad_accum run that used the final micro-batch from the start
(1e-6, float32), for a plain mean and for token normalisation with uneven lengths; the bounds (max_retries, a
micro-batch of 1); the checks of the combination; the size through a checkpoint; and a broken discard fails.

The out-of-memory errors are injected (`ab_tasks.Fault`: the real `torch.OutOfMemoryError`, above a number of rows).
The 2-process halves are in test_auto_batch_mp.py.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torchloom
from torchloom_plugins.auto_batch import AutoBatch, batch_rows, smaller_micro_batch, split_batch

MP_DIR = Path(__file__).resolve().parents[1] / "mp"
sys.path.insert(0, str(MP_DIR))  # the tasks shared with the torchrun scripts
from ab_tasks import Fault, Regression, TokenLM, fit, max_difference  # noqa: E402


def _micro_sizes(engine) -> list[float]:
    return [record["train/micro_batch_size"] for record in engine.history if "train/micro_batch_size" in record]


def _fit_quiet(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fit(*args, **kwargs)


# ------------------------------------------------------------------------------------------ functional core


def test_smaller_micro_batch_is_the_largest_divisor_at_most_half():
    assert [smaller_micro_batch(12, m) for m in (12, 6, 3, 1)] == [6, 3, 1, None]
    assert [smaller_micro_batch(8, m) for m in (8, 4, 2, 1)] == [4, 2, 1, None]
    assert smaller_micro_batch(7, 7) == 1  # a prime batch: straight to 1
    assert smaller_micro_batch(12, 5) == 2


def test_split_batch_cuts_tensors_with_the_batch_rows_and_keeps_the_rest_whole():
    ids, mask, scale = torch.arange(10).view(5, 2), torch.ones(5, 2), torch.tensor(2.0)
    batch = {"input_ids": ids, "attention_mask": mask, "scale": scale, "other": torch.zeros(3), "name": "x"}
    pieces = split_batch(batch, 5, 2)
    assert [batch_rows(p) for p in pieces] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces]), ids)
    assert all(p["scale"] is scale and p["name"] == "x" and p["other"].shape == (3,) for p in pieces)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    tuples = split_batch((x, y), 6, 3)
    assert [type(t) for t in tuples] == [tuple, tuple] and torch.equal(tuples[1][0], x[3:])
    assert batch_rows("text") is None and batch_rows([torch.tensor(1.0), torch.zeros(4, 2)]) == 4


def test_is_out_of_memory_knows_the_allocators_errors():
    assert torchloom.utils.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert torchloom.utils.is_out_of_memory(MemoryError())
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried")
    assert torchloom.utils.is_out_of_memory(cpu)
    assert not torchloom.utils.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not torchloom.utils.is_out_of_memory(ValueError("CUDA out of memory."))


def test_settings_are_checked():
    for bad in ({"micro_batch_size": 0}, {"max_retries": -1}, {"effective_batch_size": True}):
        with pytest.raises(torchloom.ConfigError, match=next(iter(bad))):
            AutoBatch(**bad)


# ------------------------------------------------------------------------- exact back-off, one process


@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_back_off_equals_a_run_with_the_final_micro_batch_from_the_start(tmp_path, phase):
    """Batch 8, whole batch first; from the second optimizer step on, more than 2 rows run out of memory at
    ``phase``: 8 -> 4 -> 2 at step 2. The reference is grad_accum(steps=4) over batches of 2 from the start."""
    fault = Fault(phase=phase, ranks=(0,), above=2, from_step=1)
    engine, probe = _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {}}], str(tmp_path / "auto"))
    ref_engine, ref = fit(Regression(2), [{"grad_accum": {"steps": 4}}], str(tmp_path / "ref"))
    assert fault.raised == [(1, phase, 8), (1, phase, 4)]  # two back-offs, both at the second step
    assert engine.progress.global_step == ref_engine.progress.global_step == 16
    assert probe.lrs == ref.lrs and len(probe.lrs) == 16
    assert max_difference(probe.params, ref.params) < 1e-6
    assert _micro_sizes(engine) == [8.0] + [2.0] * 15
    plugin = next(p for p in engine.plugins if p.name == "auto_batch")
    assert [(c["step"], c["from"], c["to"], c["phases"]) for c in plugin.changes] == [
        (2, 8, 4, {0: phase}),
        (2, 4, 2, {0: phase}),
    ]


def test_the_cpu_allocators_own_error_is_backed_off_from(tmp_path):
    """No injected exception: the forward asks the CPU allocator for 2**47 bytes per row above 2 rows, and its
    ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory`` is what the plugin recovers from."""
    fault = Fault(phase="cpu allocator", above=2, from_step=1)
    engine, probe = _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {}}], str(tmp_path / "auto"))
    _, ref = fit(Regression(2), [{"grad_accum": {"steps": 4}}], str(tmp_path / "ref"))
    assert fault.raised == [(1, "cpu allocator", 8), (1, "cpu allocator", 4)]
    assert max_difference(probe.params, ref.params) < 1e-6 and probe.lrs == ref.lrs
    assert _micro_sizes(engine) == [8.0] + [2.0] * 15


def test_clipping_sees_the_whole_batchs_gradient_once_per_step(tmp_path):
    """grad_clip (a small max_norm: every step clips) runs once per optimizer step on the averaged gradient of all
    the pieces, after a back-off too: the clipped updates and the logged norms are the reference's."""
    fault = Fault(phase="backward", above=2, from_step=2)
    clip = {"grad_clip": {"max_norm": 0.05}}
    engine, probe = _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {}}, clip], str(tmp_path / "auto"))
    ref_engine, ref = fit(Regression(2), [{"grad_accum": {"steps": 4}}, clip], str(tmp_path / "ref"))
    norms = [r["grad_norm"] for r in engine.history if "grad_norm" in r]
    assert len(norms) == 16 and min(norms[2:]) > 0.05  # every step clipped
    assert norms == pytest.approx([r["grad_norm"] for r in ref_engine.history if "grad_norm" in r], rel=1e-5)
    assert max_difference(probe.params, ref.params) < 1e-6 and probe.lrs == ref.lrs


def test_an_error_in_the_middle_of_a_window_discards_its_first_pieces(tmp_path):
    """Micro-batch 4 of 8: the second piece's backward runs out of memory once the first piece's gradients exist;
    the redo from zeroed gradients equals micro-batch 2 from the start."""
    fault = Fault(phase="backward", above=2, from_step=3, with_grads=True)
    plugins = [{"auto_batch": {"micro_batch_size": 4}}]
    engine, probe = _fit_quiet(Regression(8, fault=fault), plugins, str(tmp_path / "auto"))
    _, ref = fit(Regression(2), [{"grad_accum": {"steps": 4}}], str(tmp_path / "ref"))
    assert fault.raised == [(3, "backward", 4)]
    assert max_difference(probe.params, ref.params) < 1e-6 and probe.lrs == ref.lrs
    assert _micro_sizes(engine) == [4.0] * 3 + [2.0] * 13


def test_token_normalisation_with_uneven_lengths_is_exact_after_a_back_off(tmp_path):
    """Rows with 1 to 9 labelled tokens: every token of a step weighs 1 / (the step's count), before and after
    the back-off, as in grad_accum(steps=4, tokens) over batches of 2."""
    fault = Fault(phase="backward", above=2, from_step=2)
    plugins = [{"auto_batch": {}}, {"grad_accum": {"normalization": "tokens"}}]
    engine, probe = _fit_quiet(TokenLM(8, fault=fault), plugins, str(tmp_path / "auto"))
    ref_engine, ref = fit(TokenLM(2), [{"grad_accum": {"steps": 4, "normalization": "tokens"}}], str(tmp_path / "r"))
    assert [f[2] for f in fault.raised] == [8, 4]
    assert engine.progress.global_step == ref_engine.progress.global_step == 8
    assert max_difference(probe.params, ref.params) < 1e-6 and probe.lrs == ref.lrs
    # the logged loss is the token mean of each step, as the reference logs it
    losses = [r["train/loss"] for r in engine.history if "train/loss" in r]
    ref_losses = [r["train/loss"] for r in ref_engine.history if "train/loss" in r]
    assert losses == pytest.approx(ref_losses, rel=1e-5)


class Bf16LossLM(TokenLM):
    """`TokenLM` whose loss is bfloat16 (float32 parameters), as a bf16 model's loss is."""

    def training_step(self, batch, batch_idx):
        outputs = super().training_step(batch, batch_idx)
        return {**outputs, "loss": outputs["loss"].to(torch.bfloat16)}


def test_a_bf16_loss_with_token_normalisation_counts_each_piece_once(tmp_path):
    """A bf16 loss: grad_accum multiplies each piece's gradients by its count with gradient hooks; those of one
    piece must not multiply the next one's (they are removed before the next piece registers its own)."""
    plugins = [{"auto_batch": {"micro_batch_size": 2}}, {"grad_accum": {"normalization": "tokens"}}]
    _, probe = _fit_quiet(Bf16LossLM(8), plugins, str(tmp_path / "auto"), max_epochs=1)
    reference = [{"grad_accum": {"steps": 4, "normalization": "tokens"}}]
    _, ref = fit(Bf16LossLM(2), reference, str(tmp_path / "ref"), max_epochs=1)
    assert max_difference(probe.params, ref.params) < 1e-6


def test_a_broken_discard_fails_the_comparison(tmp_path, monkeypatch):
    """The comparison catches a redo that keeps the discarded pieces' gradients (no zero_grad)."""

    def keep_gradients(self, optimizer, accelerator, progress):
        self._window_nonfinite = None

    monkeypatch.setattr(torchloom.StepHooks, "discard_window", keep_gradients)
    fault = Fault(phase="backward", above=2, from_step=3, with_grads=True)
    _, probe = _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {"micro_batch_size": 4}}], str(tmp_path / "a"))
    _, ref = fit(Regression(2), [{"grad_accum": {"steps": 4}}], str(tmp_path / "ref"))
    assert max_difference(probe.params, ref.params) > 1e-4


# ------------------------------------------------------------------------------------------ bounds


def test_max_retries_0_makes_the_first_error_final(tmp_path):
    fault = Fault(phase="forward", above=4)
    with pytest.raises(torchloom.ConfigError, match=r"micro-batch 8, after max_retries = 0 back-off\(s\)"):
        _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {"max_retries": 0}}], str(tmp_path))


def test_a_start_at_micro_batch_1_and_an_effective_batch_that_matches(tmp_path):
    plugins = [{"auto_batch": {"micro_batch_size": 1, "effective_batch_size": 8}}]
    engine, probe = _fit_quiet(Regression(8), plugins, str(tmp_path / "auto"), max_epochs=1)
    _, ref = fit(Regression(1), [{"grad_accum": {"steps": 8}}], str(tmp_path / "ref"), max_epochs=1)
    assert _micro_sizes(engine) == [1.0] * 8
    assert max_difference(probe.params, ref.params) < 1e-6 and probe.lrs == ref.lrs


def test_max_retries_caps_the_back_offs(tmp_path):
    fault = Fault(phase="forward", above=1)
    with pytest.raises(torchloom.ConfigError, match=r"after max_retries = 1 back-off\(s\).*micro_batch_size"):
        _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {"max_retries": 1}}], str(tmp_path))
    assert [f[2] for f in fault.raised] == [8, 4]


def test_a_micro_batch_of_1_that_does_not_fit_is_one_error_with_the_planners_estimate(tmp_path):
    fault = Fault(phase="backward", above=0)
    with pytest.raises(torchloom.ConfigError) as caught:
        _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {}}], str(tmp_path))
    message = str(caught.value)
    assert "a micro-batch of 1 does not fit: out of memory at step 1 on rank 0 (backward)" in message
    assert "planner" in message  # its estimate, or why this plain module has none
    assert [f[2] for f in fault.raised] == [8, 4, 2, 1]


def test_an_error_after_the_optimizer_updated_cannot_be_redone(tmp_path):
    fault = Fault(phase="late step", above=2, from_step=1)
    expected = r"rank 0 \(step \(after updating\)\), after rank\(s\) 0 had updated their parameters: the window"
    with pytest.raises(torchloom.ConfigError, match=expected):
        _fit_quiet(Regression(8, fault=fault), [{"auto_batch": {}}], str(tmp_path))


def test_combinations_that_cannot_be_exact_are_errors(tmp_path):
    with pytest.raises(torchloom.ConfigError, match=r"gradient_accumulation_steps = 2.*set grad_accum's steps to 1"):
        _fit_quiet(Regression(8), [{"auto_batch": {}}, {"grad_accum": {"steps": 2}}], str(tmp_path / "a"))
    with pytest.raises(torchloom.ConfigError, match=r"micro_batch_size = 3 does not divide.*\[1, 2, 4, 8\]"):
        _fit_quiet(Regression(8), [{"auto_batch": {"micro_batch_size": 3}}], str(tmp_path / "b"))
    with pytest.raises(torchloom.ConfigError, match=r"effective_batch_size = 16, but .* 8 rows on 1 process"):
        _fit_quiet(Regression(8), [{"auto_batch": {"effective_batch_size": 16}}], str(tmp_path / "c"))


def test_the_start_and_each_change_are_printed_once(tmp_path):
    fault = Fault(phase="forward", above=4, from_step=1)
    with pytest.warns(UserWarning) as record:
        fit(Regression(8, fault=fault), [{"auto_batch": {}}], str(tmp_path))
    notes = [str(w.message) for w in record if str(w.message).startswith("auto_batch")]
    assert notes == [
        "auto_batch: micro-batch 8 x accumulation 1 x 1 process(es) = effective batch 8 (the whole batch: no memory "
        "budget on this device)",
        "auto_batch: out of memory at step 2 on rank 0 (forward): micro-batch 8 -> 4, accumulation 1 -> 2 "
        "(effective batch 8 unchanged); redoing the step",
    ]


# ------------------------------------------------------------------------------------------ checkpoints


def test_the_chosen_size_is_saved_and_a_resume_continues_with_it_bitwise(tmp_path):
    """Back-off to 2 at step 2; a checkpoint at step 4; the resumed fit starts at micro-batch 2 (no new error,
    though the fault still stands) and ends with the uninterrupted fit's parameters, bit for bit."""
    ckpt = {"checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": None}}
    whole_fault = Fault(phase="backward", above=2, from_step=1)
    whole, probe = _fit_quiet(Regression(8, fault=whole_fault), [{"auto_batch": {}}, ckpt], str(tmp_path / "w"))
    path = os.path.join(whole.run_dir, "checkpoints", "step-00000004")
    assert os.path.isdir(path)
    fault = Fault(phase="backward", above=2, from_step=1)
    resumed = torchloom.Engine(
        plugins=[{"auto_batch": {}}, {"checkpoint": {"every_n_steps": 4, "every_n_epochs": None}}, p2 := _probe()],
        log_every_n_steps=1, output_dir=str(tmp_path / "r"), default_plugins=False, max_epochs=2,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        resumed.fit(Regression(8, fault=fault), ckpt_path=path)
    assert fault.raised == []  # the saved size, 2, fits from the first resumed step
    assert _micro_sizes(resumed)[-12:] == [2.0] * 12
    assert resumed.progress.global_step == whole.progress.global_step == 16
    assert p2.params == probe.params  # bitwise
    assert p2.lrs == probe.lrs[4:]


def _probe():
    from ab_tasks import StepProbe

    return StepProbe()


# ------------------------------------------------------------------------------------------ combinations

COMBINATIONS = {
    "packed": [],
    "bf16": [{"mixed_precision": {"dtype": "bf16"}}],
    "grad_checkpoint": [{"grad_checkpoint": {}}],
    "peft": [{"peft": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}],
}
SLOW = {"bf16", "peft", "grad_checkpoint"}  # 15, 9 and 4-12 s on a loaded CPU core


@pytest.mark.parametrize(
    "combination", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in sorted(COMBINATIONS)]
)
def test_a_packed_causal_lm_backs_off_exactly_with(tmp_path, combination):
    """A tiny Llama on packed rows with the batch's own num_items (counted again for each piece), grad_accum's
    token normalisation, and ``combination``: micro-batch 4 of 4 runs out of memory at the first forward (above 1
    row) and goes down to 1 (so that every step runs the reference's pieces: bf16 rounds a forward of 4 rows
    otherwise than 4 of 1); equal to grad_accum(steps=4) over batches of 1 with the same plugins."""
    from ab_tasks import FaultPlugin, PackedLM

    fault = Fault(phase="forward", above=1)
    extra = COMBINATIONS[combination]
    plugins = [{"auto_batch": {}}, {"grad_accum": {"normalization": "tokens"}}, *extra, FaultPlugin(fault)]
    engine, probe = _fit_quiet(PackedLM(4), plugins, str(tmp_path / "auto"), max_epochs=1)
    reference = [{"grad_accum": {"steps": 4, "normalization": "tokens"}}, *extra]
    ref_engine, ref = _fit_quiet(PackedLM(1), reference, str(tmp_path / "ref"), max_epochs=1)
    assert [f[2] for f in fault.raised] == [4, 2]
    assert engine.progress.global_step == ref_engine.progress.global_step == 4
    assert probe.lrs == ref.lrs
    assert max_difference(probe.params, ref.params) < 1e-6


def test_a_batch_count_that_is_not_the_labels_loss_tokens_is_an_error(tmp_path):
    """A batch's own num_items is counted again per piece only when it is its labels' loss-token count."""
    from ab_tasks import PackedLM, collate_packed

    class OtherCount(PackedLM):
        def train_dataloader(self):
            def collate(rows):
                batch = collate_packed(rows)
                batch["num_items"] = batch["num_items"] + 1  # not what the model's loss averages over
                return batch

            return torch.utils.data.DataLoader(super().train_dataloader().dataset, batch_size=4, collate_fn=collate)

    plugins = [{"auto_batch": {"micro_batch_size": 2}}, {"grad_accum": {"normalization": "tokens"}}]
    with pytest.raises(torchloom.ConfigError, match=r"'num_items' is not \(labels\[\.\.\., 1:\] != -100\)\.sum\(\)"):
        _fit_quiet(OtherCount(4), plugins, str(tmp_path), max_epochs=1)


@pytest.mark.slow  # two traces of the planner and a fit: about 15 s on a CPU core
def test_without_a_size_the_start_is_the_planners_suggestion_for_the_budget(tmp_path):
    """A budget between the planner's totals at micro-batches 2 and 4 (of a batch of 8): the fit starts at 2, the
    size `torchloom.estimate_memory` suggests for it, and says so."""
    from ab_tasks import PackedLM

    model = PackedLM(8).configure_model()
    totals = {
        m: torchloom.estimate_memory(model, batch_size=m, seq_len=16, grad_checkpoint=False).rows[0].total
        for m in (2, 4)
    }
    budget = (totals[2] + totals[4]) // 2
    planned = torchloom.estimate_memory(
        model, batch_size=1, seq_len=16, grad_checkpoint=False, budget=budget, effective_batch_size=8
    )
    assert planned.rows[0].suggestion.micro_batch_size == 2
    plugins = [{"auto_batch": {"budget": budget}}, {"grad_accum": {"normalization": "tokens"}}]
    with pytest.warns(UserWarning, match=r"auto_batch: micro-batch 2 x accumulation 4 .* \(the planner's suggestion"):
        engine, _ = fit(PackedLM(8), plugins, str(tmp_path), max_epochs=1)
    assert _micro_sizes(engine) == [2.0, 2.0]
