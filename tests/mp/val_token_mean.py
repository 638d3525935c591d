"""The token-mean validation loss of a causal LM on N processes, as the project documents it: the
``validation_step`` of ``examples/fine_foods_chat.py`` and the ``LM`` snippet of ``docs/plugins/generate.md``
(``self.log("val/loss", loss, weight=num_items)``), on a tiny Llama (saved by the test in ``<out>/model``, with its
tokenizer), for eval batch sizes 1, 2, 3 and 7 over 11 validation rows (on 2 processes the last round is padded with
copies; with batch 1 one process holds only copies) and over 84 rows (every round full). Also: what
``on_validation_batch_end`` and ``on_predict_batch_end`` see of ``num_items``, and the warning that names a value
logged by hand, weighted by the rows of a padded batch, that the engine cannot correct (logged twice through one
engine: one warning).

Writes ``result-<rank>.json``: ``{kind: {"<rows>/<batch>": val/loss}}``, the hand token mean of each set (every
row alone, no DDP, no engine), the hooks' ``num_items`` totals and rank 0's torchloom warnings.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from generate_fit import pairs
from torch.utils.data import DataLoader

import torchloom
from torchloom.data import PromptCompletionData

ROOT = Path(__file__).resolve().parents[2]
SIZES, BATCHES = (11, 84), (1, 2, 3, 7)


def snippet_class() -> type:
    """The ``LM`` class of docs/plugins/generate.md's first python block, as the page shows it."""
    page = (ROOT / "docs" / "plugins" / "generate.md").read_text(encoding="utf-8")
    code = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class LM(" in b)
    namespace: dict[str, Any] = {"torchloom": torchloom, "torch": torch}
    exec(code, namespace)
    return namespace["LM"]


def snippet_task(model_dir: str) -> torchloom.TaskModule:
    class SnippetLM(snippet_class()):  # type: ignore[misc]
        def configure_model(self) -> torch.nn.Module:
            return transformers.AutoModelForCausalLM.from_pretrained(model_dir)

    return SnippetLM(model_dir)


def example_task(model_dir: str) -> torchloom.TaskModule:
    sys.path.insert(0, str(ROOT / "examples"))
    from fine_foods_chat import FineFoodsChat

    return FineFoodsChat(model_dir=model_dir)


class RowWeighted(torchloom.TaskModule):
    """The batch mean weighted by the batch's rows, without gather_for_metrics: wrong on a padded batch."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.model_dir = model_dir

    def configure_model(self) -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(self.model_dir)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs = {k: v for k, v in batch.items() if k not in ("num_items", "generation")}
        self.log("val/loss", self.model(**inputs).loss, weight=len(inputs["input_ids"]))

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        inputs = {k: v for k, v in batch.items() if k not in ("num_items", "generation", "labels")}
        return {"first": self.model(**inputs).logits[:, 0].argmax(-1)}


class Items:
    """Sums the ``num_items`` of the batches ``on_validation_batch_end`` / ``on_predict_batch_end`` receive."""

    def __init__(self) -> None:
        self.total = 0

    @torchloom.hookimpl
    def on_validation_batch_end(self, batch: Any) -> None:
        self.total += int(batch["num_items"])

    @torchloom.hookimpl
    def on_predict_batch_end(self, batch: Any) -> None:
        self.total += int(batch["num_items"])


def data(tokenizer: str, rows: int, cache_dir: Path) -> PromptCompletionData:
    module = PromptCompletionData(
        pairs(2, seed=6),
        pairs(rows, seed=5),
        tokenizer=tokenizer,
        max_length=64,
        generation=True,
        cache_dir=str(cache_dir),
    )
    module.prepare_data()
    module.setup("validate")
    return module


def token_mean(model_dir: str, module: PromptCompletionData) -> tuple[float, int]:
    """The mean loss over every loss token of the validation set, each row alone, and the number of tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row in module.val_dataset:
            ids = torch.as_tensor(row["input_ids"])[None]
            labels = torch.as_tensor(row["labels"])[None]
            logits = model(input_ids=ids).logits[0, :-1]
            target = labels[0, 1:]
            total += torch.nn.functional.cross_entropy(logits, target, reduction="sum", ignore_index=-100).double()
            tokens += int((target != -100).sum())
    return float(total / tokens), tokens


def main() -> None:
    out = Path(sys.argv[1])
    model_dir = str(out / "model")  # the tiny Llama and its tokenizer, made by the test
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {"example": {}, "snippet": {}, "reference": {}, "hook_items": {}}
    for rows in SIZES:
        module = data(model_dir, rows, out / f"cache-{rank}")
        result["reference"][str(rows)] = token_mean(model_dir, module)
        for batch_size in BATCHES:
            loader = DataLoader(module.val_dataset, batch_size=batch_size, collate_fn=module.collate_fn("validation"))
            for kind, make in (("example", example_task), ("snippet", snippet_task)):
                items = Items()
                engine = torchloom.Engine(output_dir=str(out / "runs"), plugins=[items], default_plugins=False)
                result[kind][f"{rows}/{batch_size}"] = engine.validate(make(model_dir), loader)["val/loss"]
                result["hook_items"][f"{kind} {rows}/{batch_size}"] = items.total
    module = data(model_dir, 11, out / f"cache-{rank}")
    loader = DataLoader(module.val_dataset, batch_size=3, collate_fn=module.collate_fn("validation"))
    items = Items()
    engine = torchloom.Engine(output_dir=str(out / "runs"), plugins=[items], default_plugins=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = RowWeighted(model_dir)
        engine.validate(task, loader)
        engine.validate(task, loader)
    result["warnings"] = [str(w.message) for w in caught if "val/loss" in str(w.message)]
    items.total = 0
    engine.predict(task, loader)
    result["hook_items"]["predict 11/3"] = items.total
    (out / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
