"""Tasks, a fault injector and probes shared by the auto_batch tests, in one process and under torchrun.

Out-of-memory errors do not happen on demand on a CPU: `Fault` raises the real exception type,
`torch.OutOfMemoryError` (what CUDA's caching allocator raises), with CUDA's message, whenever a micro-batch of more
than ``above`` rows reaches the chosen phase (``forward``, ``backward`` or ``step``) on the chosen ranks, as a
memory limit would: a smaller micro-batch fits, a larger one never does. ``with_grads``: only once the window has
gradients (the second piece of a batch onwards: an error in the middle of a window, after a backward that counts).
``from_step``: only from that optimizer step on (the first steps fit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom

VOCAB, LENGTH = 11, 9


@dataclass
class Fault:
    """Where and when `torch.OutOfMemoryError` is raised (see the module docstring)."""

    # forward | backward | step | late step (after optimizer.step() updated) | cpu allocator (a real allocation in
    # the forward that the CPU allocator refuses: its RuntimeError, not an injected exception)
    phase: str = "forward"
    ranks: tuple[int, ...] = (0,)
    above: int = 2
    from_step: int = 0
    with_grads: bool = False
    raised: list[tuple[int, str, int]] = field(default_factory=list)  # (optimizer step, phase, rows)

    def check(self, phase: str, rows: int, model: torch.nn.Module, steps: int) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        real = self.phase == "cpu allocator" and phase == "forward"
        if (phase != self.phase and not real) or rank not in self.ranks or rows <= self.above or steps < self.from_step:
            return
        if self.with_grads and all(p.grad is None for p in model.parameters()):
            return
        self.raised.append((steps, self.phase, rows))
        if real:  # no injection: an allocation the CPU allocator refuses, 2**47 bytes per row (a RuntimeError)
            torch.empty(rows * 2**47, dtype=torch.uint8)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (injected: {rows} rows > {self.above} in {phase})"
        )


class _RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward asks the fault first (an error in the middle of the backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, check: Any) -> torch.Tensor:
        ctx.check = check
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.check(grad.shape[0])
        return grad, None


class FaultyLinear(torch.nn.Module):
    """``Linear(4, 1)`` (fixed initialisation) whose forward and backward ask `Fault`; ``rows``: the last forward's."""

    def __init__(self, fault: Fault | None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.fault, self.rows, self.steps = fault, 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows = x.shape[0]
        if self.fault is not None:
            self.fault.check("forward", self.rows, self, self.steps)
        h = torch.tanh(self.hidden(x))
        if self.fault is not None:
            h = _RaiseInBackward.apply(h, lambda rows: self.fault.check("backward", rows, self, self.steps))
        return self.out(h)


class FaultyAdamW(torch.optim.AdamW):
    """AdamW whose ``step`` asks `Fault` first (before updating anything: the optimizer state is untouched)."""

    def __init__(self, params: Any, model: FaultyLinear, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.model = model

    def step(self, closure: Any = None) -> Any:
        m = self.model
        if m.fault is not None:
            m.fault.check("step", m.rows, m, m.steps)
        result = super().step(closure)
        if m.fault is not None:  # after updating: the optimizer state has moved (a step that cannot be redone)
            m.fault.check("late step", m.rows, m, m.steps)
        m.steps += 1
        return result


def regression_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def _lambda(steps: int) -> Any:
    return lambda step: max(0.0, 1.0 - step / steps)  # linear decay over the fit


class Regression(torchloom.TaskModule):
    """Mean-squared error on `regression_data` (``n`` rows, in order), `FaultyAdamW`, a linearly decaying LR."""

    def __init__(self, batch_size: int, n: int = 64, fault: Fault | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.batch_size, self.n, self.fault, self.lr = batch_size, n, fault, lr

    def configure_model(self) -> torch.nn.Module:
        return FaultyLinear(self.fault)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        opt = FaultyAdamW(self.model.parameters(), self.model, lr=self.lr, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lambda(20))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(self.n), batch_size=self.batch_size)


def lm_data(n: int) -> TensorDataset:
    """``n`` rows of ``LENGTH`` token ids, labelled on 1 to ``LENGTH`` positions (uneven: -100 elsewhere)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    for i in range(n):
        labelled = 1 + (i * 7 + 3) % LENGTH
        labels[i, labelled:] = -100
    return TensorDataset(ids, labels)


class FaultyLM(torch.nn.Module):
    """Embedding(11, 8) -> tanh -> Linear(8, 11) per position (fixed initialisation), asking `Fault` like
    `FaultyLinear`."""

    def __init__(self, fault: Fault | None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.fault, self.rows, self.steps = fault, 0, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.rows = ids.shape[0]
        if self.fault is not None:
            self.fault.check("forward", self.rows, self, self.steps)
        h = torch.tanh(self.embed(ids))
        if self.fault is not None:
            h = _RaiseInBackward.apply(h, lambda rows: self.fault.check("backward", rows, self, self.steps))
        return self.head(h)


class TokenLM(torchloom.TaskModule):
    """A token-level cross-entropy (mean over the labelled tokens, ``num_items`` = their count) on `lm_data`."""

    def __init__(self, batch_size: int, n: int = 32, fault: Fault | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.batch_size, self.n, self.fault, self.lr = batch_size, n, fault, lr

    def configure_model(self) -> torch.nn.Module:
        return FaultyLM(self.fault)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        ids, labels = batch
        logits = self.model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "num_items": (labels != -100).sum()}

    def configure_optimizers(self) -> Any:
        opt = FaultyAdamW(self.model.parameters(), self.model, lr=self.lr)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lambda(20))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(lm_data(self.n), batch_size=self.batch_size)


class StepProbe:
    """Records every optimizer step's learning rate (after the scheduler stepped) and the final parameters."""

    name = "test.step_probe"

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.params: dict[str, list[Any]] = {}

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    @torchloom.hookimpl
    def on_train_end(self, accelerator: Any, model: Any) -> None:
        named = accelerator.unwrap_model(model).named_parameters()
        self.params = {n: p.detach().clone().flatten().tolist() for n, p in named}


def max_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(max(abs(x - y) for x, y in zip(a[k], b[k], strict=True)) for k in a)


def fit(
    task: torchloom.TaskModule, plugins: list[Any], out: str, ckpt_path: str | None = None, **settings: Any
) -> tuple[Any, StepProbe]:
    """Fit ``task`` with ``plugins`` and a `StepProbe` (from ``ckpt_path``, if given); return the engine and the
    probe."""
    probe = StepProbe()
    settings.setdefault("max_epochs", 2)
    engine = torchloom.Engine(
        plugins=[*plugins, probe], log_every_n_steps=1, output_dir=out, default_plugins=False, **settings
    )
    engine.fit(task, ckpt_path=ckpt_path)
    return engine, probe


def finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


# ------------------------------------------------------------------------- a packed causal LM (transformers)

PACKED_LENGTH, PACKED_VOCAB = 16, 32


def packed_rows(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` packed rows of ``PACKED_LENGTH`` tokens, as torchloom's causal-LM collator lays them out: 2 to 4
    sequences per row, ``position_ids`` restarting at each, the first label of each sequence -100 (and some more),
    so that the rows have uneven loss-token counts."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        cuts = sorted(torch.randperm(PACKED_LENGTH - 2, generator=g)[: int(torch.randint(1, 4, (1,), generator=g))])
        starts = [0, *(int(c) + 1 for c in cuts)]
        ids = torch.randint(1, PACKED_VOCAB, (PACKED_LENGTH,), generator=g)
        labels = ids.clone()
        labels[torch.rand(PACKED_LENGTH, generator=g) < 0.3] = -100
        positions = torch.zeros(PACKED_LENGTH, dtype=torch.long)
        for i, start in enumerate(starts):
            stop = starts[i + 1] if i + 1 < len(starts) else PACKED_LENGTH
            labels[start] = -100
            positions[start:stop] = torch.arange(stop - start)
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def collate_packed(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["num_items"] = (batch["labels"][..., 1:] != -100).sum()  # torchloom.data.packing.count_loss_tokens
    return batch


class PackedLM(torchloom.TaskModule):
    """A tiny Llama (2 layers, float32, fixed seed) on `packed_rows`, the loss the model's mean over the batch's
    loss tokens with ``num_items`` from the batch (as torchloom's causal-LM data gives it), SGD with momentum, a
    decaying LR."""

    def __init__(self, batch_size: int, n: int = 16, lr: float = 0.5) -> None:
        super().__init__()
        self.batch_size, self.n, self.lr = batch_size, n, lr

    def configure_model(self) -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=PACKED_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
            use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).float()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        num_items = batch.pop("num_items")
        return {"loss": self.model(**batch).loss, "num_items": num_items}

    def configure_optimizers(self) -> Any:
        # SGD: a gradient off by a factor shows in the parameters (AdamW would normalise most of it away)
        opt = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lambda(20))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(packed_rows(self.n), batch_size=self.batch_size, collate_fn=collate_packed)


class FaultPlugin:
    """Injects `Fault` into any model: a forward pre-hook on the unwrapped model (the rows of its ``input_ids``)
    and the optimizer steps counted after each one."""

    name = "test.fault"

    def __init__(self, fault: Fault) -> None:
        self.fault, self.steps = fault, 0

    @torchloom.hookimpl
    def on_fit_start(self, accelerator: Any, model: Any) -> None:
        def check(module: Any, args: Any, kwargs: Any) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.fault.check("forward", int(ids.shape[0]), module, self.steps)

        accelerator.unwrap_model(model).register_forward_pre_hook(check, with_kwargs=True)

    @torchloom.hookimpl
    def after_optimizer_step(self) -> None:
        self.steps += 1
