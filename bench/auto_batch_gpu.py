"""The memory planner's micro-batch suggestion against what really fits on one NVIDIA GPU, through auto_batch.

    python bench/auto_batch_gpu.py                     # a machine with an NVIDIA GPU: a few minutes
    python bench/auto_batch_gpu.py --precision bf16 --batch 64 --seq-len 1024
    python bench/auto_batch_gpu.py --tiny              # tiny sizes on the CPU (automatic without CUDA): what CI runs
    python bench/auto_batch_gpu.py --json out.json

**No GPU was available when this script was written**: it has been run only with ``--tiny`` on a CPU, and no GPU
number from it has been reported. Run it on a GPU machine and quote its table.

The model is GPT-2 small from ``transformers.GPT2Config()`` (124 M parameters, randomly initialised, offline),
trained as a causal LM on random token ids with torch's AdamW, the effective batch ``--batch`` rows of
``--seq-len`` tokens on one process. Rows of the table:

1. ``planner``: `torchloom.estimate_memory` with the device's total memory as the budget: the suggested
   micro-batch (a divisor of the batch) and its estimated total.
2. ``suggested``: a fit of ``--steps`` optimizer steps with the ``auto_batch`` plugin at the suggested micro-batch
   and ``max_retries: 0``: whether it fits, and its peak ``torch.cuda.max_memory_allocated``.
3. ``next larger``: the same at the next larger divisor: whether the suggestion was the largest that fits.
4. ``back-off``: a fit that starts at the whole batch and backs off on the real CUDA out-of-memory errors: the
   micro-batch it ends at, its changes, and the parameters' agreement with nothing else (the exactness is the
   tests' business; this row shows the mechanism on real errors).

With ``--tiny`` (CPU: no out-of-memory error happens on demand) the model is a 2-layer GPT-2 and the budget lies
between the planner's totals at micro-batches 2 and 4 of 8: the rows then check the plumbing only.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom


class RandomLM(torchloom.TaskModule):
    """A causal LM on ``rows`` random sequences (fixed seed), AdamW."""

    def __init__(self, config: Any, rows: int, seq_len: int, batch: int) -> None:
        super().__init__()
        self.config, self.rows, self.seq_len, self.batch = config, rows, seq_len, batch

    def configure_model(self) -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.config.vocab_size, (self.rows, self.seq_len), generator=g)
        return DataLoader(TensorDataset(ids), batch_size=self.batch)


def trial(args: Any, config: Any, micro: int, retries: int, precision: str) -> dict[str, Any]:
    """A short fit at ``micro`` with ``max_retries``: whether it fitted, its peak memory, the plugin's changes."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    plugins: list[Any] = [{"auto_batch": {"micro_batch_size": micro, "max_retries": retries}}]
    if precision != "fp32":
        plugins.append({"mixed_precision": {"dtype": precision}})
    engine = torchloom.Engine(
        plugins=plugins, max_steps=args.steps, log_every_n_steps=1, default_plugins=False,
        output_dir=tempfile.mkdtemp(prefix="auto_batch_gpu-"), num_sanity_val_steps=0,
    )  # fmt: skip
    task = RandomLM(config, args.batch * args.steps, args.seq_len, args.batch)
    row: dict[str, Any] = {"micro_batch_size": micro}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            engine.fit(task)
    except torchloom.ConfigError as exc:
        row.update(fits=False, error=str(exc).split(". ")[0])
    else:
        plugin = next(p for p in engine.plugins if p.name == "auto_batch")
        row.update(
            fits=True, final=plugin.micro_batch_size, changes=[f"{c['from']}->{c['to']}" for c in plugin.changes]
        )
    if torch.cuda.is_available():
        row["peak_allocated"] = torch.cuda.max_memory_allocated()
    del engine, task
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    parser.add_argument("--batch", type=int, default=64, help="the effective batch (one process)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per trial")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    if tiny:
        args.batch, args.seq_len = 8, 64
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    else:
        config = transformers.GPT2Config()
    model = transformers.GPT2LMHeadModel(config)
    common = {"seq_len": args.seq_len, "precision": args.precision, "grad_checkpoint": False}
    if tiny:
        totals = {m: torchloom.estimate_memory(model, batch_size=m, **common).rows[0].total for m in (2, 4)}
        budget = (totals[2] + totals[4]) // 2
    else:
        budget = torch.cuda.get_device_properties(0).total_memory
    planned = torchloom.estimate_memory(model, batch_size=1, budget=budget, effective_batch_size=args.batch, **common)
    del model
    suggestion = planned.rows[0].suggestion
    divisors = [d for d in range(1, args.batch + 1) if args.batch % d == 0]
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if not tiny else "cpu (tiny: the plumbing only)",
        "budget": budget,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "planner": None
        if suggestion is None
        else {"micro_batch_size": suggestion.micro_batch_size, "total": suggestion.total},
    }
    if suggestion is not None:
        results["suggested"] = trial(args, config, suggestion.micro_batch_size, 0, args.precision)
        larger = [d for d in divisors if d > suggestion.micro_batch_size]
        if larger:
            results["next larger"] = trial(args, config, larger[0], 0, args.precision)
    results["back-off"] = trial(args, config, args.batch, 8, args.precision)
    fmt = torchloom.utils.format_bytes
    print(f"auto_batch on {results['device']}: batch {args.batch} x {args.seq_len} tokens, {args.precision}, "
          f"budget {fmt(budget)}")  # fmt: skip
    if suggestion is not None:
        print(f"  planner      micro-batch {suggestion.micro_batch_size}, estimated {fmt(suggestion.total)}")
    else:
        print("  planner      not even a micro-batch of 1 fits")
    for name in ("suggested", "next larger", "back-off"):
        row = results.get(name)
        if row is None:
            continue
        peak = f", peak {fmt(row['peak_allocated'])}" if "peak_allocated" in row else ""
        what = f"fits (ends at {row['final']}, changes {row['changes']})" if row["fits"] else row["error"]
        print(f"  {name:<12} micro-batch {row['micro_batch_size']}: {what}{peak}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
