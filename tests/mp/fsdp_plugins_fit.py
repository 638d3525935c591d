"""ema, eval_metrics, early_stopping and generate in one fit of a tiny Llama on N CPU processes, as DDP or as FSDP2
(issue 41, item 2): validation every 4 optimizer steps with the EMA weights swapped in, generation and a
token-accuracy metric at each validation, early stopping on the validation loss, a checkpoint every 8 steps (not
after the validations at steps 4 and 12: in our runs a checkpoint saved right after a validation hid a model
left gathered by it, since the save leaves the model sharded).

Arguments: the output directory (its parent holds ``tokenizer/``, made by the test), the mode (``ddp`` or ``fsdp``: the
``fsdp`` plugin) and a checkpoint to resume from (``-`` for none). Writes ``result-<rank>.json``: the distributed
type, the trained weights and the EMA weights at the end (whole, gathered from the shards under FSDP2), the weights
after ``ema.copy_to``, each process's share of the EMA's elements, the logged history, early stopping's outcome and
the checkpoints written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from generate_fit import BATCH, GenTask, pairs

import torchloom
from torchloom.checkpoint import list_checkpoints
from torchloom.data import PromptCompletionData
from torchloom.parallel.dtensors import full, is_dtensor, local


class TrainedGenTask(GenTask):
    """GenTask trained with AdamW; validation logs the loss and returns each token's argmax for eval_metrics."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        labels = batch["labels"]
        batch = {k: v for k, v in batch.items() if k not in ("num_items", "generation")}
        output = self.model(**batch)
        self.log("val/loss", output.loss)
        return {"preds": output.logits[:, :-1].argmax(-1), "target": labels[:, 1:]}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)


def datamodule(tokenizer: str, cache_dir: Path) -> PromptCompletionData:
    """32 training pairs (8 optimizer steps an epoch on 2 processes), 12 validation pairs (no padded batch)."""
    return PromptCompletionData(
        pairs(32, seed=1), pairs(12), tokenizer=tokenizer, max_length=64, generation=True, batch_size=BATCH,
        eval_batch_size=BATCH, cache_dir=str(cache_dir),
    )  # fmt: skip


def uneven_generation(engine: torchloom.Engine, tokenizer: str) -> int:
    """How many tokens this process generates from one prompt with the generate plugin's settings, when process 0's
    first token ends its generation (its ``eos_token_id``) and the others run to ``max_new_tokens`` = 6 (their
    ``eos_token_id`` is the pad token, which is never a label): under FSDP
    the processes must keep running forwards together after process 0 has finished (``synced_gpus``)."""
    import transformers

    plugin = next(p for p in engine.plugins if getattr(p, "name", None) == "generate")
    model = engine.accelerator.unwrap_model(engine._run.model)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    encoded = tok(["the cat sat on"], return_tensors="pt", add_special_tokens=False)
    prompt = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    synced = {k: v for k, v in plugin._settings().items() if k == "synced_gpus"}
    pad = tok.pad_token_id
    model.eval()
    with torch.no_grad():
        first = int(model.generate(**prompt, max_new_tokens=1, do_sample=False, pad_token_id=pad, **synced)[0, -1])
        eos = first if engine.accelerator.process_index == 0 else pad  # a token the trained model does not emit
        output = model.generate(
            **prompt, max_new_tokens=6, do_sample=False, pad_token_id=pad, eos_token_id=eos, **synced
        )
    model.train()
    new = output[0, prompt["input_ids"].shape[1] :].tolist()
    return len(new[: new.index(eos) + 1] if eos in new else new)


def main() -> None:
    out, mode, resume = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokenizer = str(out.parent / "tokenizer")
    vocab = len(__import__("transformers").AutoTokenizer.from_pretrained(tokenizer))
    plugins: dict[str, Any] = {
        "ema": {"decay": 0.9, "validate_with_ema": True, "swap_at_end": False},
        "eval_metrics": {"metrics": {"accuracy": {"task": "multiclass", "num_classes": vocab, "ignore_index": -100}}},
        "early_stopping": {"monitor": "val/loss", "mode": "max", "patience": 2},
        "generate": {"max_new_tokens": 4, "metrics": ["generate_fit.count", "generate_fit.checksum"]},
        "checkpoint": {"every_n_steps": 8, "every_n_epochs": None, "keep_last": None},  # not at step 4 or 12
        "progress": {},
    }
    if mode == "fsdp":
        plugins["fsdp"] = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    engine = torchloom.Engine(
        output_dir=str(out / "run"), max_epochs=3, seed=0, log_every_n_steps=2, val_check_interval=4,
        num_sanity_val_steps=0, plugins=plugins, default_plugins=False,
    )  # fmt: skip
    task, ckpt = TrainedGenTask(tokenizer), None if resume == "-" else resume
    engine.fit(task, datamodule=datamodule(tokenizer, out / "cache"), ckpt_path=ckpt)
    acc = engine.accelerator
    model = engine._run.model
    ema = next(p for p in engine.plugins if getattr(p, "name", None) == "ema")
    stopping = next(p for p in engine.plugins if getattr(p, "name", None) == "early_stopping")
    shadow = ema.averaged_parameters

    def whole(tensors: list[torch.Tensor]) -> list[list[float]]:
        return [full(t).detach().double().flatten().tolist() for t in tensors]

    generated = uneven_generation(engine, tokenizer)
    # The throughput plugin's FLOP count and the memory estimate trace a copy of the (sharded) model
    from torchloom_plugins.throughput import FlopsPerRow

    unwrapped = acc.unwrap_model(model)  # as the plugin's on_fit_start gets it (FSDP2: the sharded model itself)
    flops = [FlopsPerRow(unwrapped)(length) for length in (8, 12)]
    estimate = torchloom.estimate_memory(unwrapped, batch_size=2, seq_len=8, optimizers="adamw", grad_checkpoint=False)
    trained = whole(list(model.parameters()))
    averaged = whole(shadow)
    ema.copy_to(model)  # into the shards under FSDP2
    result = {
        "rank": acc.process_index,
        "distributed_type": str(acc.distributed_type.value),
        "trained": trained,
        "ema": averaged,
        "copied": whole(list(model.parameters())),
        "shadow_sharded": [is_dtensor(t) for t in shadow],
        "shadow_local_elements": sum(local(t).numel() for t in shadow),
        "elements": sum(t.numel() for t in shadow),
        "updates": ema.updates,
        "generated": generated,
        "flops_per_row": flops,
        "estimated": {
            "model": estimate.model,
            **{k: getattr(estimate.rows[0], k) for k in ("weights", "gradients", "activations")},
        },
        "history": engine.history,
        "stopped_step": stopping.stopped_step,
        "global_step": engine.progress.global_step,
        "checkpoints": [str(p) for p in list_checkpoints(str(out / "run"))],
    }
    (out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
