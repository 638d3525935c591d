"""Checkpoints of one layout resumed in another (tests/test_fsdp_reshard.py): ``torchrun --nproc_per_node 2
fsdp_reshard.py OUT CHECKPOINT``, or `fit` called in one process.

The tiny Llama of fsdp_fit.py (grad_accum with token normalisation, grad_clip, AdamW, a checkpoint every 4 optimizer
steps) on a global batch of 4 rows (2 per process on 2 processes, 4 on one), 2 epochs of 8 optimizer steps; every row
carries its index, recorded as trained. On 2 processes, one after another in each process (FSDP2 and DDP fits
alternate: the fits after an FSDP2 fit build their Accelerator from a clean state): F (FSDP2, uninterrupted,
``save_model``), D (DDP, uninterrupted), then from the step-4 checkpoints (the middle of epoch 0): FSDP2 from
CHECKPOINT (a one-process run's), FSDP2 from D's, DDP from F's, FSDP2 from F's with another model (its error), and
FSDP2 with ``async_save`` (its error); and FSDP2 with ``FULL_STATE_DICT`` checkpoints.
Each rank writes ``result-<rank>.json``: per fit its whole parameters (gathered), the rows it
trained, its history and checkpoints (or the error).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from fsdp_fit import LENGTH, VOCAB, LlamaTask, Rows
from torch.utils.data import DataLoader

import torchloom
from torchloom.checkpoint import list_checkpoints
from torchloom.parallel.dtensors import full

GLOBAL_BATCH = 4


class IndexedRows(Rows):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "idx": torch.tensor(i)}


class IndexedTask(LlamaTask):
    """fsdp_fit's task on a global batch of `GLOBAL_BATCH` rows whatever the processes; ``intermediate_size``: the
    MLP's width (another model than the checkpoints' when not 64)."""

    def __init__(self, processes: int, intermediate_size: int = 64) -> None:
        super().__init__()
        self.batch_size, self.intermediate_size = GLOBAL_BATCH // processes, intermediate_size
        self.trained: list[list[int]] = []

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=self.intermediate_size, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH, attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        batch = dict(batch)
        self.trained.append(batch.pop("idx").tolist())
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRows(), batch_size=self.batch_size, shuffle=True)


def fit(
    out: Path, mode: str, resume: str | None = None, *, intermediate_size: int = 64, async_save: bool = False
) -> dict[str, Any]:
    """One fit (``mode``: ``fsdp``, ``fsdp_full`` (FSDP2 with ``FULL_STATE_DICT`` checkpoints), ``ddp`` or
    ``single``) into ``out``; its record, or ``{"error": message}``."""
    plugins: dict[str, Any] = {
        "grad_accum": {"steps": 2, "normalization": "tokens"},
        "grad_clip": {"max_norm": 1.0},
        "checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": None, "async_save": async_save},
    }
    if mode.startswith("fsdp"):
        plugins["fsdp"] = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    if mode == "fsdp_full":
        plugins["fsdp"]["state_dict_type"] = "FULL_STATE_DICT"
    engine = torchloom.Engine(
        output_dir=str(out),
        max_epochs=2,
        seed=0,
        log_every_n_steps=2,
        plugins=plugins,
        default_plugins=False,
        save_model=resume is None,
    )
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # the group starts with the first fit's Accelerator
    task = IndexedTask(processes, intermediate_size)
    try:
        engine.fit(task, ckpt_path=resume)
    except (torchloom.CheckpointError, torchloom.ConfigError) as exc:
        return {"error": str(exc), "steps_trained": len(task.trained)}
    model = engine.accelerator.unwrap_model(engine._run.model)  # the same names under DDP
    return {
        "distributed_type": str(engine.accelerator.distributed_type.value),
        "params": {n: full(p).detach().double().flatten().tolist() for n, p in model.named_parameters()},
        "trained": task.trained,
        "history": engine.history,
        "global_step": engine.progress.global_step,
        "checkpoints": [str(p) for p in list_checkpoints(str(out))],
        "run_dir": engine._run.run_dir,
    }


def _step4(result: dict[str, Any]) -> str:
    return next(p for p in result["checkpoints"] if p.endswith("step-00000004"))


def main() -> None:
    out, checkpoint = Path(sys.argv[1]), sys.argv[2]
    results: dict[str, Any] = {"fsdp": fit(out / "fsdp", "fsdp"), "ddp": fit(out / "ddp", "ddp")}
    results["single_to_fsdp"] = fit(out / "single_to_fsdp", "fsdp", checkpoint)
    results["ddp_to_fsdp"] = fit(out / "ddp_to_fsdp", "fsdp", _step4(results["ddp"]))
    results["fsdp_to_ddp"] = fit(out / "fsdp_to_ddp", "ddp", _step4(results["fsdp"]))
    results["other_model"] = fit(out / "other_model", "fsdp", _step4(results["fsdp"]), intermediate_size=48)
    results["async_save"] = fit(out / "async_save", "fsdp", async_save=True)
    results["fsdp_full"] = fit(out / "fsdp_full", "fsdp_full")
    rank = torch.distributed.get_rank()
    (out / f"result-{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
