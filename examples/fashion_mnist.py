"""Train a small image classifier on Fashion-MNIST, on CPU, offline: 10 kinds of clothing from 28x28 grey images.

The data is the Debian package ``dataset-fashion-mnist`` (60,000 training / 10,000 test images, 10 balanced classes,
Expat licence, (c) Zalando SE): read from ``/usr/share/datasets/fashion-mnist`` where the package is installed,
otherwise fetched once with ``apt-get download`` and unpacked with ``dpkg-deb -x``. The models are built from
scratch: a small CNN (torch modules) or a small ViT (a transformers ``ViTConfig``); no weights are downloaded.

Run it (from the repository root)::

    torchloom fit --config examples/fashion_mnist.yaml                  # the CNN, through the CLI
    torchloom fit --config examples/fashion_mnist_vit.yaml              # a small ViT, with a ViTImageProcessor
    python examples/fashion_mnist.py                                    # the same config, through Python
    python examples/fashion_mnist.py data.init_args.max_train_samples=512 engine.output_dir=runs/fm_small

What happens:

1. ``FashionMNISTData.prepare_data`` (main process first): find or fetch the four ``*-ubyte.gz`` files, read them
   (`read_idx`) and store each split once as a ``datasets`` table (``image``: ``Array2D`` uint8 28x28, ``label``:
   ``ClassLabel`` with the 10 class names) under ``~/.cache/torchloom/fashion_mnist``. Then
   `torchloom.data.ImageClassificationData` converts the images to grey (``mode: L``), scales them to [0, 1] and
   normalises them (plain ``mean`` / ``std``, or a transformers image processor), and caches the result with
   ``save_to_disk``. A second run reads both caches: no network, no decoding.
2. Training batches are augmented on the fly (random shifts of up to ``random_crop_padding`` pixels, mirrored with
   probability ``horizontal_flip``); validation batches are not.
3. ``FashionMNISTClassifier``: the model, AdamW with a warmup + cosine schedule (transformers' ``get_scheduler``);
   validation logs ``val/accuracy``, ``val/loss`` and ``val/majority_rate`` (always answering the training set's most
   frequent class: 0.100 on this balanced test set, the chance rate).
4. ``<output_dir>/latest/model`` holds the trained weights (safetensors; the ViT also its ``config.json``).

Everything runs in fp32.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import ViTConfig, ViTForImageClassification, get_scheduler

import torchloom
from torchloom.data import ImageClassificationData, default_cache_dir

__all__ = ["FashionMNISTClassifier", "FashionMNISTData", "build_model", "fetch_fashion_mnist", "main", "read_idx"]

#: The classes in id order (the dataset's README).
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DEB_PACKAGE = "dataset-fashion-mnist"
INSTALLED = Path("/usr/share/datasets/fashion-mnist")  # where the Debian package puts the files
FILES = {  # our split name -> (images file, labels file)
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
SIZES = {"train": 60000, "test": 10000}
MEAN, STD = 0.2860, 0.3530  # of the 60,000 training images' pixels, scaled to [0, 1]


# ------------------------------------------------------------------------------------------- the data step


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a (gzipped) IDX file: ``uint8`` images ``(n, rows, cols)`` or labels ``(n,)``.

    The header is two zero bytes, a type byte (``0x08``: unsigned byte) and the number of dimensions, then one
    big-endian 32-bit size per dimension; the data follows.

    Raises:
        ValueError: the file is not an unsigned-byte IDX file or its size does not match its header.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise ValueError(f"'{path}' is not an unsigned-byte IDX file (header {data[:4]!r})")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    if len(data) - offset != int(np.prod(dims)):
        raise ValueError(f"'{path}': {len(data) - offset} bytes of data, but the header says {dims}")
    return np.frombuffer(data, np.uint8, offset=offset).reshape(dims)


def fetch_fashion_mnist(
    cache_dir: str | os.PathLike[str], deb_path: str | os.PathLike[str] | None = None
) -> dict[str, Path]:
    """Return ``{"train": directory, "test": directory}``: each split as a ``datasets`` table, made once.

    Each directory is a ``save_to_disk`` dataset with ``image`` (``Array2D`` uint8, 28x28) and ``label``
    (``ClassLabel`` of `CLASSES`), in the order of the original files; it is written atomically. When both exist
    nothing else runs. The raw files come from ``/usr/share/datasets/fashion-mnist`` when the Debian package is
    installed, else from ``deb_path``, else from ``apt-get download dataset-fashion-mnist`` (``apt-get update``
    first if apt has no package lists, which needs root).

    Raises:
        torchloom.ConfigError: ``apt-get`` or ``dpkg-deb`` is missing, the download fails, or ``deb_path`` does not
            exist (each names what to do instead).
    """
    cache = Path(cache_dir).expanduser()
    paths = {split: cache / f"fashion_mnist_{split}" for split in FILES}
    if all((p / "dataset_info.json").is_file() for p in paths.values()):
        return paths
    if deb_path is not None and not Path(deb_path).expanduser().is_file():
        raise torchloom.ConfigError(
            f"FashionMNISTData: deb_path '{deb_path}' does not exist; expected a {DEB_PACKAGE} .deb"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cache) as work:
        installed = all((INSTALLED / name).is_file() for pair in FILES.values() for name in pair)
        if installed and deb_path is None:
            raw = INSTALLED
        else:
            if shutil.which("dpkg-deb") is None:
                raise torchloom.ConfigError(
                    f"FashionMNISTData: 'dpkg-deb' is not on PATH; it unpacks the Debian package {DEB_PACKAGE}. "
                    f"Run on Debian/Ubuntu, or install the package (files in {INSTALLED})"
                )
            deb = Path(deb_path).expanduser() if deb_path is not None else _apt_download(Path(work))
            _run(["dpkg-deb", "-x", str(deb), os.path.join(work, "root")], "unpack the .deb")
            raw = Path(work, "root", *INSTALLED.parts[1:])
        features = datasets.Features(
            {"image": datasets.Array2D(shape=(28, 28), dtype="uint8"), "label": datasets.ClassLabel(names=CLASSES)}
        )
        for split, (images_file, labels_file) in FILES.items():
            images, labels = read_idx(raw / images_file), read_idx(raw / labels_file)
            if images.shape != (SIZES[split], 28, 28) or labels.shape != (SIZES[split],):
                raise torchloom.ConfigError(
                    f"FashionMNISTData: {raw / images_file} holds {images.shape}, {labels_file} {labels.shape}; "
                    f"expected {SIZES[split]} images of 28x28"
                )
            table = datasets.Dataset.from_dict({"image": images, "label": labels.astype(np.int64)}, features=features)
            tmp = Path(work, f"{split}.tmp")
            table.save_to_disk(str(tmp))
            shutil.rmtree(paths[split], ignore_errors=True)  # a leftover without dataset_info.json
            os.replace(tmp, paths[split])
    return paths


def _apt_download(work: Path) -> Path:
    if shutil.which("apt-get") is None:
        raise torchloom.ConfigError(
            f"FashionMNISTData: 'apt-get' is not on PATH; it fetches the Debian package {DEB_PACKAGE}. Run on "
            "Debian/Ubuntu, or set deb_path to a downloaded .deb"
        )
    result = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=work, capture_output=True, text=True)
    if result.returncode != 0:  # most often: no package lists yet (fresh container)
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            raise torchloom.ConfigError(
                f"FashionMNISTData: 'apt-get download {DEB_PACKAGE}' failed ({_last_line(result)}); run "
                "'sudo apt-get update' and retry, or set deb_path to a downloaded .deb"
            )
        _run(["apt-get", "update"], "update apt's package lists")
        _run(["apt-get", "download", DEB_PACKAGE], f"download {DEB_PACKAGE}", cwd=work)
    debs = sorted(work.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        raise torchloom.ConfigError(f"FashionMNISTData: apt-get download left no {DEB_PACKAGE}_*.deb in '{work}'")
    return debs[-1]


def _run(command: list[str], what: str, cwd: Path | None = None) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise torchloom.ConfigError(
            f"FashionMNISTData: could not {what}: '{' '.join(command)}' exited with {result.returncode} "
            f"({_last_line(result)})"
        )


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (result.stderr or result.stdout or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E:")]
    return (errors or lines or ["no output"])[-1]


class FashionMNISTData(ImageClassificationData):
    """Fashion-MNIST, grey, normalised; validation is the 10,000-image test split.

    Args:
        max_train_samples (`int`, *optional*): a random subset of the 60,000 training images (seeded).
        max_val_samples (`int`, *optional*): a random subset of the 10,000 test images (seeded).
        batch_size (`int`, defaults to 64): training batch size, per process.
        eval_batch_size (`int`, defaults to 500): validation batch size, per process.
        random_crop_padding (`int`, defaults to 0): training only: shift images by up to this many pixels.
        horizontal_flip (`float`, defaults to 0.0): training only: mirror images with this probability.
        image_processor (`dict` or `str`, *optional*): a transformers image processor (a
            ``preprocessor_config.json``-style dict or a directory) instead of the plain normalisation with the
            training set's mean 0.2860 and std 0.3530.
        cache_dir (`str`, *optional*): the converted splits and the processed cache (under ``processed/``);
            defaults to ``$TORCHLOOM_CACHE/fashion_mnist`` or ``~/.cache/torchloom/fashion_mnist``.
        deb_path (`str`, *optional*): a ``dataset-fashion-mnist`` .deb to use instead of the installed files or
            ``apt-get download``.
        seed (`int`, defaults to 0): seeds the subsets and the shuffling.
        num_workers (`int`, defaults to 0): dataloader worker processes.

    Raises:
        torchloom.ConfigError: a bad setting (see `ImageClassificationData`).
    """

    def __init__(
        self,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        batch_size: int = 64,
        eval_batch_size: int = 500,
        random_crop_padding: int = 0,
        horizontal_flip: float = 0.0,
        image_processor: dict[str, Any] | str | None = None,
        cache_dir: str | None = None,
        deb_path: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        self.data_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir() / "fashion_mnist"
        self.deb_path = deb_path
        self.splits = {split: self.data_dir / f"fashion_mnist_{split}" for split in FILES}
        plain = image_processor is None
        super().__init__(
            train=self.splits["train"],
            validation=self.splits["test"],
            label_names=CLASSES,
            mode="L",
            image_processor=image_processor,
            mean=[MEAN] if plain else None,
            std=[STD] if plain else None,
            random_crop_padding=random_crop_padding,
            horizontal_flip=horizontal_flip,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_train_samples=max_train_samples,
            max_val_samples=max_val_samples,
            seed=seed,
            num_workers=num_workers,
            cache_dir=self.data_dir / "processed",
        )

    def prepare_data(self) -> None:
        """Fetch and convert the images (once), then preprocess them (once)."""
        fetch_fashion_mnist(self.data_dir, self.deb_path)
        super().prepare_data()


# -------------------------------------------------------------------------------------------------- the task


def build_model(architecture: str = "cnn", width: int = 32, num_labels: int = 10, image_size: int = 28) -> nn.Module:
    """Build the classifier, randomly initialised.

    - ``"cnn"``: two 3x3 conv blocks (``width`` and ``2 * width`` channels, batch norm, ReLU, 2x2 max-pool), dropout
      0.25, a hidden layer of 128 and the class layer: 421,834 parameters at ``width`` 32.
    - ``"vit"``: `transformers.ViTForImageClassification` from a ``ViTConfig`` with 4x4 patches (49 tokens for
      28x28), hidden size ``2 * width``, 4 layers of 4 heads, MLP size ``4 * width``: 139,018 parameters at
      ``width`` 32. It is a transformers model, so it saves with ``save_pretrained``.
    """
    if architecture == "cnn":
        side = image_size // 4
        return nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(2 * width * side * side, 128),
            nn.ReLU(),
            nn.Linear(128, num_labels),
        )
    if architecture == "vit":
        config = ViTConfig(
            image_size=image_size,
            patch_size=4,
            num_channels=1,
            hidden_size=2 * width,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=4 * width,
            num_labels=num_labels,
            id2label=dict(enumerate(CLASSES)) if num_labels == len(CLASSES) else None,
            label2id={name: i for i, name in enumerate(CLASSES)} if num_labels == len(CLASSES) else None,
        )
        return ViTForImageClassification(config)
    raise torchloom.ConfigError(f"architecture={architecture!r}; expected 'cnn' or 'vit'")


class FashionMNISTClassifier(torchloom.TaskModule):
    """Image classification with a small model trained from scratch.

    Args:
        architecture (`str`, defaults to ``"cnn"``): ``"cnn"`` or ``"vit"`` (`build_model`).
        width (`int`, defaults to 32): the model's width (`build_model`).
        image_size (`int`, defaults to 28): the side of the images the model gets (28 unless an image processor
            resizes them).
        lr (`float`, defaults to 2e-3): AdamW's peak learning rate.
        weight_decay (`float`, defaults to 0.01): AdamW weight decay (not on biases and norm weights).
        warmup_ratio (`float`, defaults to 0.05): the share of optimizer steps that warm up linearly from 0.
        scheduler (`str`, defaults to ``"cosine"``): a `transformers.get_scheduler` name for the rest.

    Logged: ``train/loss`` (by the engine); after each validation pass ``val/loss``, ``val/accuracy`` and
    ``val/majority_rate``, exact means over the validation set (gathered over processes with
    ``gather_for_metrics``).

    Raises:
        torchloom.ConfigError: a bad setting.
    """

    def __init__(
        self,
        architecture: str = "cnn",
        width: int = 32,
        image_size: int = 28,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.05,
        scheduler: str = "cosine",
    ) -> None:
        super().__init__()
        if architecture not in ("cnn", "vit"):
            raise torchloom.ConfigError(
                f"FashionMNISTClassifier: architecture={architecture!r}; expected 'cnn' or 'vit'"
            )
        for name, count in (("width", width), ("image_size", image_size)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise torchloom.ConfigError(f"FashionMNISTClassifier: {name}={count!r}; expected a positive integer")
        if architecture == "cnn" and image_size % 4:
            raise torchloom.ConfigError(
                f"FashionMNISTClassifier: image_size={image_size}; the CNN needs a multiple of 4"
            )
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise torchloom.ConfigError(f"FashionMNISTClassifier: {name}={value!r}; expected a number >= 0")
        if isinstance(warmup_ratio, bool) or not isinstance(warmup_ratio, int | float) or not 0 <= warmup_ratio < 1:
            raise torchloom.ConfigError(f"FashionMNISTClassifier: warmup_ratio={warmup_ratio!r}; expected 0 <= x < 1")
        self.architecture, self.width, self.image_size = architecture, width, image_size
        self.lr, self.weight_decay, self.warmup_ratio, self.scheduler = (
            float(lr),
            float(weight_decay),
            warmup_ratio,
            scheduler,
        )
        self._label_counts: torch.Tensor | None = None  # training labels seen, on device (for the baseline)
        self._majority: torch.Tensor | None = None

    def configure_model(self) -> nn.Module:
        return build_model(self.architecture, self.width, len(CLASSES), self.image_size)

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, Any]:
        if self.num_training_steps is None:
            raise torchloom.ConfigError(
                "FashionMNISTClassifier: the number of training steps is unknown; set the engine's max_steps"
            )
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if p.ndim > 1], "weight_decay": self.weight_decay},
            {"params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0},  # biases, norm weights
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = get_scheduler(
            self.scheduler,
            optimizer,
            num_warmup_steps=round(self.warmup_ratio * self.num_training_steps),
            num_training_steps=self.num_training_steps,
        )
        return optimizer, scheduler

    def _logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.architecture == "vit":
            return self.model(pixel_values=pixel_values).logits
        return self.model(pixel_values)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        labels = batch["labels"]
        counts = torch.bincount(labels, minlength=len(CLASSES))  # on device: no sync
        self._label_counts = counts if self._label_counts is None else self._label_counts + counts
        loss = F.cross_entropy(self._logits(batch["pixel_values"]), labels)
        return {"loss": loss, "num_items": labels.shape[0]}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self._logits(batch["pixel_values"])
        losses = F.cross_entropy(logits, batch["labels"], reduction="none")
        # gather_for_metrics drops the samples that even_batches duplicated, so every count is over the real set.
        preds, labels, losses = self.accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"], losses))
        n = labels.shape[0]
        exact = torch.float64 if labels.device.type != "mps" else torch.float32
        self.log("val/accuracy", (preds == labels).sum().to(exact) / n, weight=n)
        self.log("val/loss", losses.mean(), weight=n)
        if self._label_counts is not None:
            if batch_idx == 0:  # once per validation pass: the training majority class, summed over processes
                self._majority = self.accelerator.reduce(self._label_counts.clone(), reduction="sum").argmax()
            self.log("val/majority_rate", (labels == self._majority).sum().to(exact) / n, weight=n)
        return {"preds": logits.softmax(-1), "target": batch["labels"]}  # this process's rows, for eval_metrics

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Per image: ``label`` (the class id, int64) and ``confidence`` (its softmax probability, float32)."""
        confidence, label = self._logits(batch["pixel_values"]).softmax(-1).max(-1)
        return {"label": label, "confidence": confidence}


# ---------------------------------------------------------------------------------------------- the runner


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run ``examples/fashion_mnist.yaml`` (or a YAML given first) with ``dotted.key=value`` overrides; print the
    accuracy next to the chance rate. Returns the final logged metrics."""
    import importlib
    import time

    from example_config import read_config  # examples/example_config.py, next to this file

    config = read_config(__file__, sys.argv[1:] if argv is None else argv)

    def build(section: dict[str, Any]) -> Any:
        module, _, name = section["class_path"].rpartition(".")
        local = module in ("fashion_mnist", __name__)
        cls = globals()[name] if local else getattr(importlib.import_module(module), name)
        return cls(**(section.get("init_args") or {}))

    start = time.perf_counter()
    task, data = build(config["task"]), build(config["data"])
    engine = torchloom.Engine(plugins=config.get("plugins") or None, **config.get("engine", {}))
    engine.run_config = config
    metrics = engine.fit(task, datamodule=data)
    elapsed = time.perf_counter() - start
    print(
        f"fashion_mnist ({task.architecture}): {len(data.train_dataset or [])} training / "
        f"{len(data.val_dataset or [])} validation images, {engine.progress.global_step} optimizer steps, "
        f"{elapsed:.1f} s"
    )
    print(f"  val/accuracy      = {metrics['val/accuracy']:.4f}   (chance: 1 of {len(CLASSES)} classes = 0.1000)")
    print(
        f"  val/majority_rate = {metrics.get('val/majority_rate', float('nan')):.4f}   (always the most frequent class)"
    )
    print(f"  val/loss          = {metrics['val/loss']:.4f}   (chance: ln 10 = {np.log(10):.4f})")
    if engine.config.save_model:
        print(f"  model in {os.path.join(str(engine.run_dir), 'model')}")
    return metrics


if __name__ == "__main__":
    main()
