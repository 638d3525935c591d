"""DeepSpeed ZeRO on 2 CPU processes (gloo) through torchloom, against DDP, in one launch (tests/test_deepspeed.py).

A tiny Llama with the plugin set DeepSpeed takes over (grad_accum by the mean, grad_clip at 0.5, AdamW, checkpoints
every 4 optimizer steps). Arguments: the output directory. In order, each in a new Engine: the DDP fit, ZeRO-1 and
ZeRO-2 (the ``deepspeed`` plugin; ZeRO-2 with ``save_model``), ZeRO-2 resumed from its step-8 checkpoint, ZeRO-2
from the environment ``accelerate launch --use_deepspeed --zero_stage 2`` sets (and with ``--gradient_clipping
0.5`` instead of the grad_clip plugin), ZeRO-2 without grad_clip, LoRA (the ``peft`` plugin) under
DDP, under ZeRO-2 and resumed, and the requests that must stop at start-up (their errors). Writes
``result-<rank>.json``: for each fit its distributed type, the classes of the prepared model and optimizer, the
trainable parameters after it, the logged history, the checkpoints and the run directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader, Dataset

import torchloom
from torchloom.checkpoint import list_checkpoints

sys.path.insert(0, str(Path(__file__).parent))

from peft_fit import LORA, LoraTask

ROWS, LENGTH, VOCAB = 64, 12, 48
#: What ``accelerate launch --use_deepspeed --zero_stage 2`` sets (accelerate/utils/launch.py, no config file).
ACCELERATE_DEEPSPEED_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
#: Refused at start-up: (name, plugins added to the ZeRO-2 fit's).
REFUSED = {
    "zero3": {"deepspeed": {"zero_stage": 3}},
    "offload": {"deepspeed": {"zero_stage": 2, "offload_optimizer_device": "cpu"}},
    "clip_value": {"grad_clip": {"clip_value": 0.1}},
    "tokens": {"grad_accum": {"steps": 2, "normalization": "tokens"}},
    "bf16": {"mixed_precision": {"dtype": "bf16"}},
    # 16 micro-batches per process and epoch: windows of 3 leave one of 1 at the end of epoch 0 (during the fit)
    "short_window": {"grad_accum": {"steps": 3}},
    # accelerate launch --use_deepspeed --gradient_clipping 1.0 (below), and grad_clip's max_norm 0.5
    "clip_explicit": {},
}
#: The environment of the fits that take DeepSpeed from it (no deepspeed plugin).
ENVIRONMENTS = {
    "env": ACCELERATE_DEEPSPEED_ENV,
    "clip_explicit": {**ACCELERATE_DEEPSPEED_ENV, "ACCELERATE_GRADIENT_CLIPPING": "1.0"},
    # DeepSpeed's own clipping at 0.5 without the grad_clip plugin: the same run as zero2's
    "env_clip": {**ACCELERATE_DEEPSPEED_ENV, "ACCELERATE_GRADIENT_CLIPPING": "0.5"},
}


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


def plugins_for(name: str) -> dict[str, Any]:
    """The plugins of fit ``name``: ``ddp``, ``zero1``, ``zero2``, ``env`` (no deepspeed plugin: the environment
    asks), ``peft_ddp`` / ``peft_zero2``, or a `REFUSED` name."""
    plugins: dict[str, Any] = {
        "grad_accum": {"steps": 2},  # 16 micro-batches per process and epoch: whole windows
        "grad_clip": {"max_norm": 0.5},  # not 1.0, what Accelerate would fill DeepSpeed's "auto" with
        "checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": None},
    }
    if name in ("zero1", "zero2", "peft_zero2") or (name in REFUSED and name not in ENVIRONMENTS):
        plugins["deepspeed"] = {"zero_stage": 1 if name == "zero1" else 2}
    if name in ("env_clip", "noclip"):
        del plugins["grad_clip"]
    if name == "noclip":
        plugins["deepspeed"] = {"zero_stage": 2}
    if name.startswith("peft"):
        plugins["peft"] = {**LORA, "merge": True}
    return {**plugins, **REFUSED.get(name, {})}


def fit(out: Path, name: str, resume: str | None = None, save_model: bool = False) -> dict[str, Any]:
    os.environ.update(ENVIRONMENTS.get(name, {}))
    try:
        return _fit(out, name, resume, save_model)
    finally:
        for key in ENVIRONMENTS.get(name, {}):
            del os.environ[key]


def _fit(out: Path, name: str, resume: str | None, save_model: bool) -> dict[str, Any]:
    engine = torchloom.Engine(
        output_dir=str(out / name), max_epochs=2, seed=0, log_every_n_steps=2,
        save_model=save_model or name.startswith("peft"),  # merge: true needs it
        plugins=plugins_for(name), default_plugins=False,
    )  # fmt: skip
    task = LoraTask(n=64, lr=5e-2) if name.startswith("peft") else LlamaTask()
    engine.fit(task, ckpt_path=resume)
    acc, model = engine.accelerator, engine._run.model
    chain, optimizer = [], engine._run.optimizer
    while optimizer is not None and len(chain) < 5:  # Accelerate's wrapper, DeepSpeed's wrapper, ZeRO's optimizer
        chain.append(type(optimizer).__name__)
        optimizer = getattr(optimizer, "optimizer", None)
    named = dict(acc.unwrap_model(model).named_parameters())
    return {
        "distributed_type": str(acc.distributed_type.value),
        "model_type": type(model).__name__,
        "optimizer_types": chain,
        # what DeepSpeed's engine clips at (0: not at all)
        "clipping": model.gradient_clipping() if hasattr(model, "gradient_clipping") else None,
        "trainable": {n: p.detach().double().flatten().tolist() for n, p in named.items() if p.requires_grad},
        "history": engine.history,
        "global_step": engine.progress.global_step,
        "checkpoints": [str(p) for p in list_checkpoints(str(out / name))],
        "run_dir": engine._run.run_dir,
    }


def middle(result: dict[str, Any]) -> str:
    return next(p for p in result["checkpoints"] if p.endswith("step-00000008"))


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {}
    for name in ("ddp", "zero1", "zero2"):
        results[name] = fit(out, name, save_model=name == "zero2")
    results["resumed"] = fit(out / "resumed", "zero2", resume=middle(results["zero2"]))
    results["env"] = fit(out, "env")
    results["env_clip"] = fit(out, "env_clip")
    results["noclip"] = fit(out, "noclip")
    results["peft_ddp"] = fit(out, "peft_ddp")
    results["peft_zero2"] = fit(out, "peft_zero2", save_model=True)
    results["peft_resumed"] = fit(out / "resumed", "peft_zero2", resume=middle(results["peft_zero2"]))
    for name in REFUSED:
        try:
            fit(out, name)
            results[name] = None
        except (torchloom.ConfigError, torchloom.PluginError) as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
    results["flags"] = {key: os.environ.get(key) for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU")}
    rank = torch.distributed.get_rank()
    (out / f"result-{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
