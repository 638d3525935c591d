"""One process's memory under FSDP2, measured: a 4-layer Llama trained on N CPU processes with the ``fsdp`` plugin,
once without and once with gradient accumulation (2 micro-batches a step).

Over optimizer step 3 of each fit the allocator's events (`torch.profiler` with ``profile_memory``: every
allocation and free of this process, storage resizes included) give the peak of the bytes allocated during the
step over those allocated at its start; at its start the step holds the sharded parameters and buffers and the
optimizer state (the gradients were freed by ``zero_grad``). Writes ``result-<rank>.json``: per fit (``ga1``,
``ga2``) the bytes of parameters + buffers, of optimizer state, and the step's peak over its start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader, Dataset

import torchloom
from torchloom.parallel.dtensors import local

ROWS, LENGTH, VOCAB, BATCH = 32, 32, 501, 4  # an odd vocabulary: its embedding's shards are padded


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LENGTH, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip


class Rows(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LlamaTask(torchloom.TaskModule):
    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config())

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Rows(), batch_size=BATCH)


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (a DTensor's local shard)."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = local(t).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


class StepMemory:
    """The allocator's events over optimizer step ``step`` (its micro-batches, backward and update)."""

    name = "test.step_memory"

    def __init__(self, step: int) -> None:
        self.step, self.profiler, self.result = step, None, {}

    @torchloom.hookimpl
    def on_train_batch_start(self, progress) -> None:
        if progress.global_step == self.step - 1 and self.profiler is None:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self.profiler.start()

    @torchloom.hookimpl
    def after_optimizer_step(self, model, optimizer) -> None:
        if self.profiler is None or self.result:
            return
        self.profiler.stop()
        events = self.profiler.profiler.kineto_results.events()
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        live = peak = 0
        for _, nbytes in changes:
            live += nbytes
            peak = max(peak, live)
        self.result = {
            "parameters": _bytes([*model.parameters(), *model.buffers()]),
            "optimizer_state": _bytes([v for state in optimizer.state.values() for v in state.values()]),
            "peak_over_start": peak,
        }


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for label, steps in (("ga1", 1), ("ga2", 2)):
        measure = StepMemory(step=3)
        plugins: list[Any] = [{"fsdp": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}, measure]
        if steps > 1:
            plugins.append({"grad_accum": {"steps": steps}})
        engine = torchloom.Engine(
            output_dir=str(out / label), max_steps=3, max_epochs=3, seed=0, plugins=plugins, default_plugins=False
        )
        engine.fit(LlamaTask())
        assert engine.accelerator.distributed_type.value == "FSDP", engine.accelerator.distributed_type
        results[label] = measure.result
    rank = engine.accelerator.process_index
    (out / f"result-{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
