"""Peak activation memory of one training step, with and without the ``grad_checkpoint`` plugin (CPU).

CPU PyTorch keeps no allocator statistics, so two measurements are taken around the engine's real
``run_train_step`` (forward, backward, optimizer step) by a probe plugin that wraps it:

- ``saved_bytes``: the peak of activation bytes held for backward, tracked with
  `torch.autograd.graph.saved_tensors_hooks` (each distinct storage counted once; parameters excluded). This
  is what checkpointing removes: a checkpointed block keeps only its inputs. The recomputation in backward
  happens under checkpoint's own inner hooks and is not seen here.
- ``peak_bytes``: the peak of all tensor memory allocated during the step and still alive (activations,
  temporaries, recomputed activations, gradients), tracked with a `TorchDispatchMode` that adds each new
  output storage's ``nbytes`` and subtracts it when the storage is freed. Storages that existed before the
  step (parameters) are excluded. This one includes the recomputation.

Run::

    python bench/activation_memory.py                 # an 8-block residual MLP and a 4-layer GPT-2
    python bench/activation_memory.py --kind mlp --batch 512 --width 256 --blocks 8
    python bench/activation_memory.py --kind gpt2 --blocks 12 --json out.json   # what nox -s bench runs
"""

from __future__ import annotations

import argparse
import json
import tempfile
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

import torchloom


class _SavedTensors:
    """Live bytes of distinct storages saved for backward (pack adds, the holder's death subtracts)."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.refs, self.live, self.peak = skip, {}, 0, 0

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return t
        count, nbytes = self.refs.get(key, (0, storage.nbytes()))
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = (count + 1, nbytes)
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed

    def _release(self, key: int) -> None:
        count, nbytes = self.refs[key]
        if count == 1:
            del self.refs[key]
            self.live -= nbytes
        else:
            self.refs[key] = (count - 1, nbytes)


class _Holder:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _LiveTensors(TorchDispatchMode):
    """Live bytes of storages created by any op while active; a storage is subtracted when it is freed."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.seen, self.live, self.peak = skip, set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in self.skip and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


class MemoryProbe:
    """Wraps every training step in both trackers; ``records`` holds one dict per micro-batch."""

    name = "bench.memory_probe"

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    @torchloom.hookimpl(wrapper=True)
    def run_train_step(self, model: torch.nn.Module):
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved, live = _SavedTensors(skip), _LiveTensors(skip)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), live:
            outputs = yield
        self.records.append({"saved_bytes": saved.peak, "peak_bytes": live.peak, "loss": float(outputs["loss"])})
        return outputs


# -------------------------------------------------------------------------------------------------- models


class ResidualMLP(torch.nn.Module):
    """``blocks`` residual blocks ``x + Linear(4w -> w)(GELU(Linear(w -> 4w)(x)))`` and a scalar head."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MLPBlock(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MLPBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class BenchTask(torchloom.TaskModule):
    """One SGD step on one batch of ``kind`` ("mlp": regression; "gpt2": causal LM from a config, offline)."""

    def __init__(self, kind: str, batch: int, width: int, blocks: int, seq: int = 128) -> None:
        super().__init__()
        self.kind, self.batch, self.width, self.blocks, self.seq = kind, batch, width, blocks, seq

    def configure_model(self) -> torch.nn.Module:
        if self.kind == "mlp":
            return ResidualMLP(self.width, self.blocks)
        import transformers

        config = transformers.GPT2Config(
            vocab_size=512,
            n_positions=self.seq,
            n_embd=self.width,
            n_layer=self.blocks,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "mlp":
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        if self.kind == "mlp":
            data = TensorDataset(
                torch.randn(self.batch, self.width, generator=g), torch.randn(self.batch, 1, generator=g)
            )
        else:
            data = TensorDataset(torch.randint(0, 512, (self.batch, self.seq), generator=g))
        return DataLoader(data, batch_size=self.batch)


def compare(
    kind: str = "mlp", batch: int = 512, width: int = 256, blocks: int = 8, output_dir: str | None = None
) -> list[dict[str, Any]]:
    """Run one step without and one with checkpointing; return two rows (``saved_bytes``, ``peak_bytes``:
    bytes; ``loss``)."""
    modules: str | list[str] = ["MLPBlock"] if kind == "mlp" else "hf"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, plugins in (("plain", []), ("checkpointed", [{"grad_checkpoint": {"modules": modules}}])):
            probe = MemoryProbe()
            engine = torchloom.Engine(
                plugins=[*plugins, probe],
                default_plugins=False,
                max_steps=1,
                log_every_n_steps=1,
                output_dir=output_dir or tmp,
            )
            engine.fit(BenchTask(kind, batch, width, blocks))
            rows.append({"kind": kind, "run": label, **probe.records[0]})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [f"{'model':6} {'run':13} {'saved for backward':>22} {'step peak':>22}"]
    for r in rows:
        cells = [f"{r[k] / 2**20:9.2f} MiB ({r[k] / base[k]:.2f}x)" for k in ("saved_bytes", "peak_bytes")]
        lines.append(f"{r['kind']:6} {r['run']:13} {cells[0]:>22} {cells[1]:>22}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["mlp", "gpt2", "all"], default="all")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    defaults = {"mlp": (512, 256, 8), "gpt2": (8, 128, 4)}
    results = []
    for kind in ("mlp", "gpt2") if args.kind == "all" else (args.kind,):
        batch, width, blocks = defaults[kind]
        batch, width, blocks = args.batch or batch, args.width or width, args.blocks or blocks
        rows = compare(kind, batch, width, blocks)
        print(format_rows(rows))
        results.append({"kind": kind, "batch": batch, "width": width, "blocks": blocks, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
