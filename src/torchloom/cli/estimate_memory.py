"""``torchloom estimate-memory MODEL ...``: the training memory of a model, per optimizer, as a table or JSON."""

from __future__ import annotations

import json
from typing import Any

import torchloom

from ._environment import put_config_dir_on_path

__all__ = ["HELP", "parser", "run"]

HELP = "estimate training memory"


def parser() -> Any:
    from jsonargparse import ArgumentParser

    sub = ArgumentParser(
        description="Estimate the memory of training MODEL: weights, gradients, optimizer state and activations, "
        "for each optimizer, without and with activation checkpointing (torchloom.estimate_memory; see "
        "docs/memory.md for the method and its limits)"
    )
    sub.add_argument(
        "model",
        type=str,
        help="a local Hugging Face model directory, a transformers config .json or a run config .yaml",
    )
    sub.add_argument("--batch_size", type=int, default=8, help="micro-batch size (samples per forward)")
    sub.add_argument(
        "--seq_len", type=int | None, default=None, help="tokens per sample (default: the model's maximum)"
    )
    sub.add_argument("--precision", type=str, default="fp32", help="fp32, bf16 or fp16 (mixed, fp32 master weights)")
    sub.add_argument(
        "--optimizer", type=str | None, default=None, help="comma-separated optimizer names, e.g. adamw,adafactor"
    )
    sub.add_argument("--grad_checkpoint", type=bool, default=True, help="also estimate with activation checkpointing")
    sub.add_argument(
        "--budget",
        type=str | None,
        default=None,
        help="memory per process, e.g. 8GiB: suggest micro-batch x accumulation",
    )
    sub.add_argument(
        "--effective_batch_size",
        type=int | None,
        default=None,
        help="samples per optimizer step (default: --batch_size)",
    )
    sub.add_argument(
        "--architecture",
        type=str | None,
        default=None,
        help="the transformers class to build, e.g. BertForSequenceClassification",
    )
    sub.add_argument(
        "--fused_attention",
        type=bool,
        default=True,
        help="attention keeps no seq_len^2 matrix (as CUDA's fused kernels)",
    )
    sub.add_argument(
        "--peft",
        type=dict[str, Any] | bool | None,
        default=None,
        help="the peft plugin's settings, e.g. '{r: 8, load_in_4bit: true}' (default: a run config's; false: none)",
    )
    sub.add_argument(
        "--dp_shard_size",
        type=int,
        default=1,
        help="processes FSDP2 shards over: every size is then one process's (default 1: not sharded)",
    )
    sub.add_argument(
        "--transformer_layer_cls_to_wrap",
        type=list[str] | None,
        default=None,
        help="with --dp_shard_size: the layer classes FSDP2 shards as units (default: the model's _no_split_modules)",
    )
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return sub


def run(parser: Any, cfg: Any) -> int:
    """``torchloom estimate-memory MODEL ...``: `torchloom.estimate_memory` as a table or one JSON object."""
    if cfg.model.endswith((".yaml", ".yml")):  # the task's module may sit next to its run config
        put_config_dir_on_path(["--config", cfg.model])
    optimizers = None if cfg.optimizer is None else [n.strip() for n in cfg.optimizer.split(",")]
    estimate = torchloom.estimate_memory(
        cfg.model,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        precision=cfg.precision,
        optimizers=optimizers,
        grad_checkpoint=cfg.grad_checkpoint,
        budget=cfg.budget,
        effective_batch_size=cfg.effective_batch_size,
        architecture=cfg.architecture,
        fused_attention=cfg.fused_attention,
        peft=cfg.peft,
        dp_shard_size=cfg.dp_shard_size,
        transformer_layer_cls_to_wrap=cfg.transformer_layer_cls_to_wrap,
    )
    print(json.dumps(estimate.to_dict(), indent=2) if cfg.json else estimate.table())
    return 0
