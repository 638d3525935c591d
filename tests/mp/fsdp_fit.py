"""A tiny Llama trained on N CPU processes with the realistic plugin set (grad_accum with token normalisation,
grad_clip, AdamW, checkpoint every 4 optimizer steps), as DDP or as FSDP2.

Arguments: the output directory, the mode (``ddp``; ``fsdp``: the ``fsdp`` plugin; ``fsdp_env``: FSDP from the
environment that ``accelerate launch`` sets, which the test provides), and a checkpoint to resume from (``-`` for
none). Writes ``result-<rank>.json``: the distributed type, the whole parameters after the fit (gathered from the
shards under FSDP2), this process's share of the parameters' elements, the logged history, the summary's sizes and
the checkpoints written.
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
from torchloom.checkpoint import list_checkpoints
from torchloom.parallel.dtensors import full, local

ROWS, LENGTH, VOCAB = 64, 12, 48


class Rows(Dataset):
    """Random token rows whose first tokens (a random number of them, 1-8) are not trained on (label -100)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
        self.prompt = torch.randint(1, 9, (ROWS,), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: int(self.prompt[i])] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class LlamaTask(torchloom.TaskModule):
    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=LENGTH, attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        num_items = (batch["labels"][:, 1:] != -100).sum()
        return {"loss": self.model(**batch).loss, "num_items": num_items}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Rows(), batch_size=2, shuffle=True)


def main() -> None:
    out, mode, resume = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    plugins: dict[str, Any] = {
        "grad_accum": {"steps": 2, "normalization": "tokens"},
        "grad_clip": {"max_norm": 1.0},
        "checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": None},
        "progress": {},
    }
    if mode == "fsdp":
        plugins["fsdp"] = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    engine = torchloom.Engine(
        output_dir=str(out / "run"), max_epochs=2, seed=0, log_every_n_steps=2, plugins=plugins, default_plugins=False
    )
    engine.fit(LlamaTask(), ckpt_path=None if resume == "-" else resume)
    acc = engine.accelerator
    model = engine._run.model
    params = [full(p).detach().double().flatten().tolist() for p in model.parameters()]
    result = {
        "rank": acc.process_index,
        "distributed_type": str(acc.distributed_type.value),
        "model_type": type(acc.unwrap_model(model)).__name__,
        "params": params,
        "local_elements": sum(local(p).numel() for p in model.parameters()),
        "elements": sum(p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "history": engine.history,
        "global_step": engine.progress.global_step,
        "checkpoints": [str(p) for p in list_checkpoints(str(out / "run"))],
        "run_dir": engine._run.run_dir,
        "optimizer_bytes": torchloom.utils.optimizer_state_bytes(engine._run.optimizer),
        "optimizer_process_bytes": torchloom.utils.optimizer_state_bytes(engine._run.optimizer, per_process=True),
    }
    (out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
