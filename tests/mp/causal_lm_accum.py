"""grad_accum's token normalisation over causal-LM micro-batches on N processes, packed or not.

Prompt / completion pairs (tests/mp/generate_fit.py's), a tiny Llama, plain SGD with lr 0 (the step changes
nothing, so every window's gradient is that of the same parameters). The fit is one epoch of one optimizer step:
every micro-batch of every rank is in one accumulation window. Each rank then compares the window's gradient (after
DDP's all-reduce) with the gradient of the whole training set run unpacked as one batch in this process, with no
DDP: with ``normalization="tokens"`` they are equal, whatever the micro-batches' row and token counts.

Arguments: the output directory (holding ``tokenizer/``, made by the test), ``packed`` or ``padded``, the
per-process batch size, and the normalisation (``tokens`` or ``mean``). Writes ``result-<rank>.json``: the largest
difference from the big-batch gradient, the optimizer steps, each micro-batch's loss-token count on this rank, and
the rows the rank trained on, and the throughput plugin's totals.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from generate_fit import pairs, tiny_llama

import torchloom
from torchloom.data import PromptCompletionData

N, MAX_LENGTH = 16, 24


class LMTask(torchloom.TaskModule):
    """The model's mean over the batch's loss tokens, returned with their count; records each micro-batch."""

    def __init__(self, tokenizer: str) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.items: list[int] = []
        self.rows: list[list[int]] = []

    def configure_model(self) -> torch.nn.Module:
        model = tiny_llama(transformers.AutoTokenizer.from_pretrained(self.tokenizer))
        model.config.use_cache = False  # packing needs it off (torchloom.data.packing.check_packed_attention)
        return model

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        num_items = batch.pop("num_items")
        self.items.append(int(num_items))
        self.rows.extend(batch["input_ids"].tolist())
        return {"loss": self.model(**batch).loss, "num_items": num_items}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.0)


class Grads:
    name = "test.grads"

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model: torch.nn.Module, accelerator: Any) -> None:
        params = accelerator.unwrap_model(model).parameters()
        self.grads.append(torch.cat([p.grad.detach().flatten().clone() for p in params]))


def data(tokenizer: str, cache_dir: Path, packing: bool, batch_size: int) -> PromptCompletionData:
    return PromptCompletionData(
        pairs(N, seed=3), tokenizer=tokenizer, max_length=MAX_LENGTH, packing=packing, batch_size=batch_size,
        shuffle=False, cache_dir=str(cache_dir),
    )  # fmt: skip


def big_batch_gradient(tokenizer: str, cache_dir: Path, packing: bool) -> tuple[torch.Tensor, int]:
    """The gradient of the mean loss over every loss token of the training set, unpacked, as one batch; and the
    number of training rows the fit will have (packed: the packed rows)."""
    layout = data(tokenizer, cache_dir / "fit", packing=packing, batch_size=1)
    layout.prepare_data()
    layout.setup("fit")
    reference = data(tokenizer, cache_dir / "reference", packing=False, batch_size=N)
    reference.prepare_data()
    reference.setup("fit")
    batch = reference.collator()([reference.train_dataset[i] for i in range(len(reference.train_dataset))])
    model = tiny_llama(reference.tokenizer)
    batch.pop("num_items")
    model(**batch).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), len(layout.train_dataset)


def main() -> None:
    out, layout, batch_size, normalization = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tokenizer = str(out / "tokenizer")
    datamodule = data(tokenizer, out / "cache", packing=layout == "packed", batch_size=batch_size)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    big, rows = big_batch_gradient(tokenizer, out / f"reference-cache-{rank}", packing=layout == "packed")
    steps = math.ceil(rows / (batch_size * world_size))  # every micro-batch of the epoch in one window
    grads, task = Grads(), LMTask(tokenizer)
    engine = torchloom.Engine(
        plugins=[{"grad_accum": {"steps": steps, "normalization": normalization}}, {"throughput": {}}, grads],
        max_epochs=1, output_dir=str(out / "run"), default_plugins=False,
    )  # fmt: skip
    engine.fit(task, datamodule=datamodule)
    result = {
        "world_size": engine.accelerator.num_processes,
        "global_step": engine.progress.global_step,
        "windows": len(grads.grads),
        "max_diff": max((g - big).abs().max().item() for g in grads.grads),
        "items": task.items,
        "rows": task.rows,
        "train_rows": len(datamodule.train_dataset),
        "throughput": engine.plugins[1].totals,
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
