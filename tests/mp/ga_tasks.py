"""Tasks and probes shared by the grad_accum tests, in one process and under torchrun.

`TokenLM` is case C01's 1-layer "language model": Embedding(11, 8) -> Linear(8, 11) per position, float64,
with a mean cross-entropy over the labelled tokens (label -100 is ignored) and ``num_items`` = that count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

import torchloom

VOCAB = 11


def make_sequence(num_labelled: int, seed: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of token ids (shape ``(length,)``, int64) and labels with exactly ``num_labelled`` labels
    that are not -100; ``length`` defaults to ``num_labelled + 1`` (one ignored position)."""
    length = num_labelled + 1 if length is None else length
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (length,), generator=g)
    labels = torch.randint(0, VOCAB, (length,), generator=g)
    ignored = torch.randperm(length, generator=g)[: length - num_labelled]
    labels[ignored] = -100
    return ids, labels


def build_lm() -> torch.nn.Module:
    """The C01 model, float64, with a fixed initialisation (independent of the global RNG)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return model


def reference_gradients(sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, Any], float]:
    """One forward / backward over all ``sequences`` together (padded): loss = (sum of the cross-entropy over
    every labelled token) / (number of labelled tokens). Returns ({name: grad as nested lists}, loss)."""
    model = build_lm()
    longest = max(len(ids) for ids, _ in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    labels = torch.full((len(sequences), longest), -100, dtype=torch.long)
    for i, (x, y) in enumerate(sequences):
        ids[i, : len(x)], labels[i, : len(y)] = x, y
    logits = model(ids)
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = total / (labels != -100).sum()
    loss.backward()
    return {n: p.grad.tolist() for n, p in model.named_parameters()}, loss.item()


class TokenLM(torchloom.TaskModule):
    """Trains `build_lm` on ``sequences`` with batch size 1 (in order), SGD with ``lr``."""

    def __init__(self, sequences: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 0.5) -> None:
        super().__init__()
        self.sequences, self.lr = sequences, lr

    def configure_model(self) -> torch.nn.Module:
        return build_lm()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        ids, labels = batch
        logits = self.model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "num_items": (labels != -100).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sequences, batch_size=1)


class GradProbe:
    """Records, at every optimizer step, each parameter's final gradient (after every other plugin's
    ``before_optimizer_step``: it is ``trylast``), as nested lists keyed by parameter name."""

    name = "test.grad_probe"

    def __init__(self) -> None:
        self.grads: list[dict[str, Any]] = []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model: torch.nn.Module, accelerator: Any) -> None:
        named = accelerator.unwrap_model(model).named_parameters()
        self.grads.append({n: p.grad.detach().clone().tolist() for n, p in named if p.grad is not None})
