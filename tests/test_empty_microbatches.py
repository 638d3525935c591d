"""Micro-batches with no loss token (every label -100) with the documented causal-LM step (issue 39, item 9).

``training_step`` returns ``{"loss": self.model(**batch).loss, "num_items": ...}`` (docs/data.md). Transformers'
loss of a micro-batch with no labelled token is 0 / 0 = NaN with a zero gradient: such a micro-batch weighs nothing
in a token-normalised window and in ``train/loss`` (not a divergence). Each run is compared with the same run with
the empty micro-batches left out of the data.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import transformers
from torch.utils.data import DataLoader

import torchloom
from torchrun_util import torchrun

VOCAB, LENGTH = 32, 6


def rows(n: int, empty: tuple[int, ...] = (), seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of random tokens; the rows in ``empty`` have every label -100, the others a loss on 3 tokens."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels = ids.clone()
        labels[: 1 + i % 3] = -100  # a varying number of loss tokens per row
        if i in empty:
            labels[:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """As torchloom's causal-LM collators: stacked rows, and ``num_items = (labels[:, 1:] != -100).sum()``."""
    out = {key: torch.stack([row[key] for row in batch]) for key in batch[0]}
    out["num_items"] = (out["labels"][:, 1:] != -100).sum()
    return out


class LM(torchloom.TaskModule):
    """docs/data.md's training step over a tiny Llama; ``custom``: a loss that divides by its count itself."""

    def __init__(self, data: list[dict[str, torch.Tensor]], batch_size: int, optimizer: str = "sgd", custom=False):
        super().__init__()
        self.data, self.batch_size, self.optimizer, self.custom = data, batch_size, optimizer, custom

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        return transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        num_items = batch.pop("num_items")  # the model does not take it
        if not self.custom:
            return {"loss": self.model(**batch).loss, "num_items": num_items}
        logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none"
        )
        return {"loss": (per_token * mask.flatten()).sum() / mask.sum(), "num_items": num_items}

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.model.parameters(), lr=0.01, weight_decay=0.1)
        return torch.optim.SGD(self.model.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate, shuffle=False)


def fit(tmp_path, name: str, task: LM, plugins: Any = None, **settings: Any) -> torchloom.Engine:
    settings.setdefault("log_every_n_steps", 1)
    engine = torchloom.Engine(
        plugins=plugins, max_epochs=1, output_dir=str(tmp_path / name), default_plugins=False, **settings
    )
    engine.fit(task)
    engine.test_task = task  # type: ignore[attr-defined]
    return engine


def losses(engine: torchloom.Engine) -> list[float]:
    return [r["train/loss"] for r in engine.history if "train/loss" in r]


def token_mean_loss(task: LM, batches: list[list[dict[str, torch.Tensor]]]) -> float:
    """The mean loss over every loss token of ``batches`` under the initial weights (one forward, no engine)."""
    model = task.configure_model()
    batch = collate([row for rows_ in batches for row in rows_])
    batch.pop("num_items")
    with torch.no_grad():
        return float(model(**batch).loss)


# 12 rows in micro-batches of 2: micro-batches 1 (rows 2, 3) and 5 (rows 10, 11) have no loss token. With
# grad_accum steps 3 they are the middle and the last micro-batch of the two windows.
EMPTY = (2, 3, 10, 11)
KEPT = [i for i in range(12) if i not in EMPTY]


def test_grad_accum_tokens_window_with_an_empty_micro_batch_is_the_window_without_it(tmp_path) -> None:
    data = rows(12, EMPTY)
    engine = fit(tmp_path, "empty", LM(data, 2), [{"grad_accum": {"steps": 3, "normalization": "tokens"}}])
    # the same data without the empty micro-batches: windows of 2 micro-batches, the same rows in each window
    reference = fit(
        tmp_path, "ref", LM([data[i] for i in KEPT], 2), [{"grad_accum": {"steps": 2, "normalization": "tokens"}}]
    )
    assert engine.progress.global_step == reference.progress.global_step == 2
    torch.testing.assert_close(model_weights(engine), model_weights(reference), rtol=1e-6, atol=1e-7)
    got, expected = losses(engine), losses(reference)
    assert all(v == v for v in got)  # no NaN
    assert got == pytest.approx(expected, rel=1e-6)
    # train/loss of the first window: the token mean over its real tokens (rows 0, 1, 4, 5), the initial weights
    assert got[0] == pytest.approx(token_mean_loss(LM(data, 2), [[data[i] for i in (0, 1, 4, 5)]]), rel=1e-5)


def test_an_empty_micro_batch_weighs_nothing_in_train_loss_without_grad_accum(tmp_path) -> None:
    """One optimizer step per micro-batch, log_every_n_steps 3: the interval's loss is the mean over its tokens."""
    data = rows(6, (2, 3))
    engine = fit(tmp_path, "empty", LM(data, 2), log_every_n_steps=3)
    assert engine.progress.global_step == 3
    (loss,) = losses(engine)
    assert loss == loss  # not NaN: the fit did not stop with the divergence advice


def test_skip_mode_keeps_a_window_with_an_empty_micro_batch_and_skips_a_window_with_none(tmp_path) -> None:
    """nonfinite_loss 'skip': a window with an empty micro-batch among others is trained (before: skipped as a
    non-finite loss); a window with no loss token on any process is skipped: AdamW's momentum and weight decay
    would move the weights on zero gradients. Bitwise the run without those micro-batches."""
    data = rows(12, EMPTY)
    plugins = [{"grad_accum": {"steps": 3, "normalization": "tokens"}}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = fit(tmp_path, "skip", LM(data, 2, "adamw"), plugins, nonfinite_loss="skip")
    assert not [w for w in caught if "skipped optimizer step" in str(w.message)]
    assert engine.logged_metrics["train/skipped_steps"] == 0.0
    ref_plugins = [{"grad_accum": {"steps": 2, "normalization": "tokens"}}]
    reference = fit(tmp_path, "ref", LM([data[i] for i in KEPT], 2, "adamw"), ref_plugins, nonfinite_loss="skip")
    torch.testing.assert_close(model_weights(engine), model_weights(reference), rtol=1e-6, atol=1e-7)

    # a window (one micro-batch) with no loss token: skipped, nothing moves; the others as without it
    data = rows(6, (2, 3))
    with pytest.warns(UserWarning, match=r"skipped optimizer step 2 \(epoch 0\): its window had no loss token"):
        engine = fit(tmp_path, "skip-window", LM(data, 2, "adamw"), nonfinite_loss="skip")
    reference = fit(tmp_path, "ref-window", LM([data[i] for i in (0, 1, 4, 5)], 2, "adamw"), nonfinite_loss="skip")
    assert torch.equal(model_weights(engine), model_weights(reference))
    assert engine.progress.global_step == 3 and engine.logged_metrics["train/skipped_steps"] == 1.0


def test_auto_batch_piece_without_loss_tokens(tmp_path) -> None:
    """auto_batch cuts a batch of 4 rows into pieces of 2; the first piece has no loss token. The step equals the
    whole batch in one piece (the pieces' token-weighted mean)."""
    data = rows(8, (0, 1))
    plugins: Any = [{"auto_batch": {"micro_batch_size": 2}}, {"grad_accum": {"normalization": "tokens"}}]
    with pytest.warns(UserWarning, match="auto_batch: micro-batch 2"):
        engine = fit(tmp_path, "pieces", LM(data, 4), plugins)
    plugins = [{"auto_batch": {"micro_batch_size": 4}}, {"grad_accum": {"normalization": "tokens"}}]
    with pytest.warns(UserWarning, match="auto_batch: micro-batch 4"):
        whole = fit(tmp_path, "whole", LM(data, 4), plugins)
    torch.testing.assert_close(model_weights(engine), model_weights(whole), rtol=1e-6, atol=1e-7)
    assert losses(engine) == pytest.approx(losses(whole), rel=1e-6)


def test_a_loss_with_nan_gradients_for_no_items_is_named_not_called_a_divergence(tmp_path) -> None:
    """A custom loss that divides by its count gives a NaN gradient for a micro-batch with no loss token: the
    engine cannot undo that, and says which micro-batch it was. The micro-batch is the last of the first logging
    interval (whose loss is finite); the weights are NaN from the next step on."""
    data = rows(8, (2, 3))
    with pytest.raises(torchloom.TaskError) as caught:
        fit(tmp_path, "custom", LM(data, 2, custom=True), log_every_n_steps=2)
    message = str(caught.value)
    assert "after micro-batch 1 (epoch 0, optimizer step 2) had no loss tokens (num_items 0)" in message
    assert "optimizer steps 3-4" in message and "Lower the learning rate" not in message


def test_a_real_divergence_after_an_empty_micro_batch_keeps_the_divergence_advice(tmp_path) -> None:
    """transformers' loss of an empty micro-batch has a zero gradient: later steps train on finite losses, so a
    later non-finite loss is a divergence, not that micro-batch's."""

    class Diverging(LM):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            if batch_idx == 3:
                out["loss"] = out["loss"] * float("inf")
            return out

    with pytest.raises(torchloom.TaskError, match="Lower the learning rate"):
        fit(tmp_path, "diverging", Diverging(rows(8, (2, 3)), 2), log_every_n_steps=4)


def model_weights(engine: torchloom.Engine) -> torch.Tensor:
    model = engine.accelerator.unwrap_model(engine.test_task.model)  # type: ignore[attr-defined]
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# 2 processes, batches of 2 rows: rank 0 trains on batches 0, 2, 4, ... and rank 1 on 1, 3, 5, ..., so micro-batch
# j of both ranks holds rows 4j..4j+3. Rank 0's micro-batch 1 (rows 4, 5) is empty, rank 1's (rows 6, 7) not; both
# ranks' micro-batch 5 (rows 20-23) is empty.
MP_EMPTY = (4, 5, 20, 21, 22, 23)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_one_rank_empty_and_both_empty(tmp_path) -> None:
    """tests/mp/empty_microbatches.py: the weights equal a 1-process run over the same rows in batches of 4 (both
    ranks' micro-batch j as one) without the micro-batch that is empty on both ranks; every train/loss finite."""
    ranks = torchrun("empty_microbatches.py", tmp_path)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["global_step"] == 2 and ranks[0]["losses"] == ranks[1]["losses"]
    data = rows(24, MP_EMPTY)
    reference = fit(tmp_path, "ref", LM(data[:20], 4), [{"grad_accum": {"steps": 3, "normalization": "tokens"}}])
    got = torch.tensor(ranks[0]["weights"])
    torch.testing.assert_close(got, model_weights(reference), rtol=1e-5, atol=1e-6)
    assert ranks[0]["losses"] == pytest.approx(losses(reference), rel=1e-5)


# nonfinite_loss skip, one micro-batch per step: micro-batch 1 is empty on rank 0 only (rows 4, 5), micro-batch 2
# on both ranks (rows 8-11).
MP_SKIP_EMPTY = (4, 5, 8, 9, 10, 11)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_skip_only_the_step_empty_on_every_rank(tmp_path) -> None:
    """The step whose micro-batch is empty on one rank trains (the other rank's tokens); the step empty on both is
    skipped (AdamW moves nothing): the weights equal a 1-process run over rows 0-7 in batches of 4."""
    ranks = torchrun("empty_microbatches.py", tmp_path, "skip")
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert [r["global_step"] for r in ranks] == [3, 3] and [r["skipped"] for r in ranks] == [1.0, 1.0]
    data = rows(12, MP_SKIP_EMPTY)
    plugins = [{"grad_accum": {"normalization": "tokens"}}]
    reference = fit(tmp_path, "ref", LM(data[:8], 4, "adamw"), plugins, nonfinite_loss="skip")
    torch.testing.assert_close(torch.tensor(ranks[0]["weights"]), model_weights(reference), rtol=1e-5, atol=1e-6)
