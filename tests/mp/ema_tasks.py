"""Shared by tests/plugins/test_ema.py and tests/mp/ema_fit.py: the weights after every optimizer step, and the
EMA recurrence over them by hand, in float64."""

from __future__ import annotations

import torch

import torchloom


class Trajectory(torchloom.Plugin):
    """Records the trainable weights at the start of the fit and right after every optimizer step (float64)."""

    name = "test.trajectory"

    def __init__(self) -> None:
        super().__init__()
        self.start: list[torch.Tensor] = []
        self.after_step: list[list[torch.Tensor]] = []

    @torchloom.hookimpl
    def on_fit_start(self, model):
        self.start = [p.detach().double().clone() for p in model.parameters() if p.requires_grad]

    @torchloom.hookimpl
    def after_optimizer_step(self, model):
        # Listed after ema, so this runs after its update (and after local_sgd's average when listed after it).
        self.after_step.append([p.detach().double().clone() for p in model.parameters() if p.requires_grad])


def expected_average(
    start: list[torch.Tensor], steps: list[list[torch.Tensor]], decay: float, every: int, power: float = 0.0
) -> list[torch.Tensor]:
    """``ema = d_t * ema + (1 - d_t) * w`` every ``every`` steps from ``start``; d_t = min(decay, 1 - (1 + t)^-power)
    at the t-th update with a warm-up, else decay."""
    ema, updates = [t.clone() for t in start], 0
    for step, weights in enumerate(steps, start=1):
        if step % every == 0:
            d = min(decay, 1 - (1 + updates) ** -power) if power > 0 else decay
            ema = [d * e + (1 - d) * w for e, w in zip(ema, weights)]
            updates += 1
    return ema
