"""Tokens/s and model-FLOP utilisation of a 124M-parameter GPT-2 on one NVIDIA GPU: torchloom vs the hand loop.

    python bench/gpu.py                      # a machine with an NVIDIA GPU: about 2-4 minutes, at most 8
    python bench/gpu.py --peak-tflops 989    # a GPU the script does not know: its dense bf16 peak
    python bench/gpu.py --tiny               # tiny sizes on the CPU (automatic without CUDA): what CI runs
    python bench/gpu.py --json out.json

**No GPU was available when this script was written and tested**: it has been run only with ``--tiny`` on a CPU,
and no GPU number from it has been reported. Run it on a GPU machine and quote its table.

The model is GPT-2 small from ``transformers.GPT2Config()`` (12 layers, 12 heads, width 768, vocabulary 50257,
context 1024; 124 M parameters), randomly initialised (offline), trained as a causal LM on random token ids
(batch 16 x 1024 tokens by default). GPT-2's projections are `transformers.Conv1D` modules, which Accelerate's fp8
backends (they convert `torch.nn.Linear`) would leave alone, so every row replaces each ``Conv1D`` by the
equivalent ``nn.Linear`` (the same weights, transposed; the same FLOPs) before training.

Rows: bf16 and fp16 (and fp8 where the GPU has it: compute capability >= 8.9 and an fp8 backend for Accelerate,
``Accelerator(mixed_precision="fp8")``, torchao / transformer-engine / MS-AMP; else the row says why not), each
with AdamW; bf16 with ``grad_checkpoint``; bf16 with bitsandbytes' 8-bit AdamW (its CUDA kernels). Each by
torchloom (``Engine`` with the ``mixed_precision``, ``grad_checkpoint`` and ``optimizer`` plugins) and by the
hand-written Accelerate loop doing the same work (`hand_loop`). Each run: set-up and ``--warmup`` optimizer steps
not timed, then ``--steps`` timed steps between two ``torch.cuda.synchronize()`` calls (the same clock as the
CPU suite, `workloads.Clock`, plus the syncs).

Model FLOPs per token, as in PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
arXiv:2204.02311, Appendix B): ``6 N + 12 L H Q T`` with N the parameters (the position embeddings left out: they
cost no matmul; the token embedding counted once, for the tied output projection), L layers, H heads, Q the head
width and T the sequence length (the second term is attention's QK^T and AV, forward and backward). MFU = model
FLOPs per token x tokens per second / the GPU's dense peak for the precision (``--peak-tflops``, or a table of
known GPUs: bf16 = fp16 peak, fp8 twice that). Recomputation under ``grad_checkpoint`` is not counted in model
FLOPs (that is what makes MFU lower with it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

if os.path.dirname(os.path.abspath(__file__)) not in map(os.path.abspath, sys.path):  # imported from elsewhere
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import torchloom

#: Dense (no sparsity) bf16 / fp16 tensor-core peaks in TFLOP/s, from the vendors' data sheets, by a substring of
#: ``torch.cuda.get_device_name()`` (first match wins). fp8 is twice these on GPUs that have it.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
)

LR = 6e-4


@dataclass(frozen=True)
class Config:
    precision: str  # bf16 | fp16 | fp8
    grad_checkpoint: bool
    optimizer: str  # adamw | adamw8bit

    def label(self) -> str:
        return f"{self.precision}{' + grad_checkpoint' if self.grad_checkpoint else ''}, {self.optimizer}"


CONFIGS = [
    Config("bf16", False, "adamw"),
    Config("fp16", False, "adamw"),
    Config("fp8", False, "adamw"),
    Config("bf16", True, "adamw"),
    Config("bf16", False, "adamw8bit"),
]


@dataclass(frozen=True)
class Size:
    layers: int
    heads: int
    width: int
    vocab: int
    seq: int
    batch: int


FULL = Size(layers=12, heads=12, width=768, vocab=50257, seq=1024, batch=16)
TINY = Size(layers=2, heads=2, width=64, vocab=256, seq=32, batch=2)


def build_model(size: Size) -> torch.nn.Module:
    """GPT-2 from a config, with every ``Conv1D`` replaced by the equivalent ``nn.Linear``."""
    import transformers
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    special = min(50256, size.vocab - 1)  # GPT-2's <|endoftext|>, inside a tiny vocabulary too
    config = transformers.GPT2Config(
        n_layer=size.layers,
        n_head=size.heads,
        n_embd=size.width,
        vocab_size=size.vocab,
        n_positions=size.seq,
        bos_token_id=special,
        eos_token_id=special,
    )
    model = transformers.GPT2LMHeadModel(config)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                n_in, n_out = child.weight.shape
                linear = torch.nn.Linear(n_in, n_out)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(module, name, linear)
    return model


def flops_per_token(model: torch.nn.Module, size: Size) -> float:
    """PaLM's model FLOPs per token (Appendix B): 6 N + 12 L H Q T."""
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return 6 * n + 12 * size.layers * size.heads * (size.width // size.heads) * size.seq


def data(size: Size, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size.vocab, (steps * size.batch, size.seq), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=size.batch)


class SyncClock(workloads.Clock):
    """`workloads.Clock` with a device synchronisation before each reading (on CUDA)."""

    def tick(self) -> None:
        if self.count in (self.start, self.stop) and torch.cuda.is_available():
            torch.cuda.synchronize()
        super().tick()


def loss_of(model: torch.nn.Module, batch: Any, clock: workloads.Clock) -> torch.Tensor:
    clock.tick()
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def enable_checkpointing(model: torch.nn.Module) -> None:
    """What the grad_checkpoint plugin does for a transformers model (``modules: hf``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """What the optimizer plugin builds for ``{name, lr}`` (weight decay 0: one group; 8-bit: 32-bit embeddings)."""
    group = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(group, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    import bitsandbytes as bnb

    optimizer = bnb.optim.AdamW8bit(group, lr=LR, betas=(0.9, 0.999), eps=1e-8, min_8bit_size=4096)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def hand_loop(config: Config, size: Size, clock: workloads.Clock, steps: int) -> None:
    """The hand-written Accelerate loop doing the same work as the torchloom run."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision=config.precision)
    if accelerator.device.type == "cpu" and config.precision == "fp16":
        # On a CPU Accelerate gives fp16 neither autocast nor a loss scaler; the mixed_precision plugin installs
        # them (see its page), so the hand loop does the same to do the same work.
        from torchloom_plugins.mixed_precision import install_cpu_grad_scaler

        install_cpu_grad_scaler(accelerator)
    model = build_model(size)
    if config.grad_checkpoint:
        enable_checkpointing(model)
    optimizer = make_optimizer(model, config.optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data(size, steps))
    model.train()
    try:
        for batch in loader:
            accelerator.backward(loss_of(model, batch, clock))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except workloads.Done:
        pass
    finally:
        workloads.release_optimizer(model, optimizer)


class GPTTask(torchloom.TaskModule):
    def __init__(self, size: Size, clock: workloads.Clock, steps: int) -> None:
        super().__init__()
        self.size, self.clock, self.steps = size, clock, steps

    def configure_model(self) -> torch.nn.Module:
        return build_model(self.size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(self.model, batch, self.clock)

    def train_dataloader(self) -> DataLoader:
        return data(self.size, self.steps)


def torchloom_run(config: Config, size: Size, clock: workloads.Clock, steps: int) -> None:
    plugins: dict[str, Any] = {"mixed_precision": {"dtype": config.precision}}
    if config.grad_checkpoint:
        plugins["grad_checkpoint"] = {"modules": "hf"}
    plugins["optimizer"] = {"name": config.optimizer, "lr": LR}
    with tempfile.TemporaryDirectory() as out, contextlib.suppress(workloads.Done):
        engine = torchloom.Engine(
            plugins=plugins,
            default_plugins=False,
            max_epochs=1,
            log_every_n_steps=50,
            num_sanity_val_steps=0,
            output_dir=out,
        )
        engine.fit(GPTTask(size, clock, steps))


def why_not(config: Config, device: str) -> str | None:
    """Why ``config`` cannot run here, or None."""
    if config.precision == "fp8":
        if device != "cuda":
            return "fp8 needs an NVIDIA GPU of compute capability >= 8.9"
        if torch.cuda.get_device_capability() < (8, 9):
            return f"fp8 needs compute capability >= 8.9; this GPU has {torch.cuda.get_device_capability()}"
        from accelerate.utils import is_fp8_available

        if not is_fp8_available():
            return "no fp8 backend for Accelerate installed (torchao, transformer-engine or ms-amp)"
    if config.optimizer == "adamw8bit":
        problem = workloads.bitsandbytes_available()
        if problem is not None:
            return f"bitsandbytes 8-bit AdamW unavailable: {problem}"
    return None


def peak_tflops(precision: str, override: float | None) -> float | None:
    if not torch.cuda.is_available():
        return None
    base = override
    if base is None:
        name = torch.cuda.get_device_name()
        base = next((peak for key, peak in PEAK_TFLOPS if key in name), None)
    if base is None:
        return None
    return 2 * base if precision == "fp8" else base


def measure(size: Size, warmup: int, steps: int, override_peak: float | None) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens_per_step = size.batch * size.seq
    per_token = flops_per_token(build_model(size), size)
    rows = []
    for config in CONFIGS:
        reason = why_not(config, device)
        for runner in ("torchloom", "hand"):
            row: dict[str, Any] = {"runner": runner, "config": config.label()}
            if reason is not None:
                row["skipped"] = reason
                rows.append(row)
                continue
            clock = SyncClock(warmup, steps)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (torchloom_run if runner == "torchloom" else hand_loop)(config, size, clock, warmup + steps + 1)
            step = clock.seconds() / steps
            tokens = tokens_per_step / step
            peak = peak_tflops(config.precision, override_peak)
            row |= {
                "step_ms": step * 1e3,
                "tokens_per_s": tokens,
                "model_tflops": per_token * tokens / 1e12,
                "mfu": per_token * tokens / (peak * 1e12) if peak else None,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                "wall_s": time.perf_counter() - started,
            }
            rows.append(row)
    for row in rows:  # torchloom's tokens/s over the hand loop's, same config
        if row["runner"] == "torchloom" and "tokens_per_s" in row:
            hand = next(r for r in rows if r["runner"] == "hand" and r["config"] == row["config"])
            if "tokens_per_s" in hand:
                row["vs_hand"] = row["tokens_per_s"] / hand["tokens_per_s"]
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "size": size.__dict__,
        "parameters": sum(p.numel() for p in build_model(size).parameters()),
        "flops_per_token": per_token,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    s = result["size"]
    lines = [
        f"GPT-2 {result['parameters'] / 1e6:.1f} M parameters ({s['layers']} layers, width {s['width']}), batch "
        f"{s['batch']} x {s['seq']} tokens, on {result['device']}: {result['timed_steps']} timed steps after "
        f"{result['warmup_steps']} warm-up; model FLOPs/token {result['flops_per_token'] / 1e6:.1f} M (PaLM App. B)",
        "",
        "| runner | config | tokens/s | vs hand | step ms | model TFLOP/s | MFU | peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['runner']} | {row['config']} | skipped: {row['skipped']} | | | | | |")
            continue
        vs = f"{row['vs_hand']:.3f}" if "vs_hand" in row else ""
        mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "-"
        mem = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
        lines.append(
            f"| {row['runner']} | {row['config']} | {row['tokens_per_s']:.0f} | {vs} | {row['step_ms']:.1f} | "
            f"{row['model_tflops']:.3g} | {mfu} | {mem} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="optimizer steps not timed (default 5; tiny 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 20; tiny 2)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 16)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, TFLOP/s")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    if tiny and not args.tiny:
        print("no CUDA device: running at tiny sizes on the CPU (--tiny)", file=sys.stderr)
    size = TINY if tiny else FULL
    if args.batch:
        size = Size(**{**size.__dict__, "batch": args.batch})
    if tiny:
        torch.set_num_threads(1)
    result = measure(size, args.warmup or (1 if tiny else 5), args.steps or (2 if tiny else 20), args.peak_tflops)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if any(not math.isfinite(row.get("tokens_per_s", 1.0)) for row in result["rows"]):
        raise SystemExit("a run measured a non-finite rate")


if __name__ == "__main__":
    main()
