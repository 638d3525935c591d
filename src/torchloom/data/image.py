"""Image preprocessing: decode with Pillow, resize and normalise, augment training batches, cache the result.

The pieces are plain functions and small classes over `datasets.Dataset`, and `ImageClassificationData` strings
them together as a `DataModule`:

- `load_image` decodes one image (a file, encoded bytes, a ``datasets`` Image value, an array or a
  `PIL.Image.Image`) and converts it to ``"RGB"`` or ``"L"``; every failure is a `ConfigError` naming the file
  or the row.
- `read_image_folder` lists an image folder with one sub-folder per class; `image_table` turns any source (an
  image folder, a ``save_to_disk`` directory, a table file of image paths, a `datasets.Dataset` with an ``Image``
  or array column, or arrays) into a table.
- `ImageTransform` resizes and normalises, either with a transformers image processor (`load_image_processor`:
  from a local directory, a Hub id in the local cache, or a ``preprocessor_config.json``-style dict) or with
  plain settings (``size``, ``mean``, ``std``); `preprocess_images` applies it with a batched ``Dataset.map``
  and stores ``pixel_values`` as float32 ``(channels, height, width)``.
- `random_crop`, `random_horizontal_flip` and `ImageAugmentation` augment training batches on the fly, with
  torch ops (after the cache, so every epoch sees new draws).

.. code-block:: python

    data = ImageClassificationData(
        train="images/train", validation="images/test",          # one sub-folder per class
        mode="RGB", size=[64, 64], mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5],
        random_crop_padding=4, horizontal_flip=0.5, batch_size=64,
    )
    torchloom.Engine(max_epochs=1).fit(task, datamodule=data)

The processed splits are saved under a key that hashes the raw data and every setting that shapes them (see
`torchloom.data.cache`), so a second run loads them instead of decoding again. Pillow is the one extra
dependency: ``pip install 'torchloom[vision]'``.

The pieces live in one module per concern and are re-exported here: decoding in `torchloom.data.image_decoding`,
folders and tables in `torchloom.data.image_folders`, transforms and augmentation in
`torchloom.data.image_transforms`; `ImageClassificationData` is this module, on `torchloom.data.base.CachedDataModule`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import transformers

from torchloom._settings import invalid
from torchloom.data.base import CachedDataModule
from torchloom.data.cache import fingerprint
from torchloom.data.image_decoding import MODES as MODES  # constants image.py had before the split
from torchloom.data.image_decoding import PILLOW_VERSION, load_image
from torchloom.data.image_folders import ImageSource, image_data_fingerprint, image_table, read_image_folder
from torchloom.data.image_transforms import RESAMPLE as RESAMPLE
from torchloom.data.image_transforms import (
    ImageAugmentation,
    ImageTransform,
    load_image_processor,
    preprocess_images,
    random_crop,
    random_horizontal_flip,
)
from torchloom.data.tables import TABLE_READERS, require_column, row_name
from torchloom.errors import ConfigError

__all__ = [
    "ImageAugmentation",
    "ImageClassificationData",
    "ImageTransform",
    "image_data_fingerprint",
    "image_table",
    "load_image",
    "load_image_processor",
    "preprocess_images",
    "random_crop",
    "random_horizontal_flip",
    "read_image_folder",
]


class ImageClassificationData(CachedDataModule):
    """Preprocessed image classification data from an image folder, a ``datasets`` table or arrays.

    ``prepare_data`` reads each split (`image_table`), encodes the labels as a `datasets.ClassLabel` column
    ``labels`` (`torchloom.data.encode_labels`), decodes and transforms every image (`preprocess_images`) and
    saves both splits with ``save_to_disk`` in the processed-dataset cache, under a key that hashes the raw data
    and every setting below that shapes the result; a second run with the same inputs loads them instead (the
    ``cache_hit`` attribute says which happened). ``setup`` loads the splits (memory-mapped) and takes the
    ``max_*_samples`` subsets. Batches hold ``pixel_values`` float32 ``(batch, channels, height, width)`` and
    ``labels`` int64 ``(batch,)``; training batches are augmented on the fly (`ImageAugmentation`), validation
    batches are not. The steps are those of `CachedDataModule`; this class adds the image transform.

    Args:
        train: the training images (see `image_table`): an image folder (one sub-folder per class), a
            ``save_to_disk`` directory, a ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` / ``.parquet`` file whose
            ``image_column`` holds image paths (relative to the file's folder, or absolute: decoded exactly as a
            folder's images, in the file's order; `read_image_file_table`), a `datasets.Dataset`,
            ``(images, labels)`` arrays or a mapping of them.
        validation (*optional*): the validation images, same kinds. ``set_predict_input`` (``torchloom predict
            --input FILE``) takes such a file too, whose rows need no label (absent, or missing in some rows: -1).
        image_column (`str`, defaults to ``"image"``): a ``datasets.Image`` column, encoded bytes or pixel arrays;
            in a table file, image paths.
        label_column (`str`, defaults to ``"label"``): the class of each row: a `datasets.ClassLabel`, strings or
            non-negative integers.
        label_names (`list[str]`, *optional*): the class names in id order; defaults to the sorted class
            sub-folders, the `ClassLabel` names, the sorted distinct strings, or ``"0"`` .. ``"<max>"``.
        allow_empty_classes (`bool`, defaults to False): keep a class sub-folder without image files as a class
            with no samples in that split; by default it is an error naming the folder and the split.
        mode (`str`, defaults to ``"RGB"``): ``"RGB"`` or ``"L"`` (grey, one channel).
        image_processor (*optional*): a transformers image processor that resizes and normalises: a local
            directory with ``preprocessor_config.json``, a Hub id in the local cache, or that file's contents as a
            dict (`load_image_processor`). Leave ``size`` / ``mean`` / ``std`` unset then.
        processor_backend (`str`, *optional*, defaults to ``"pil"``): the processor's backend (``None``: let
            transformers choose; ``"torchvision"`` needs torchvision).
        size (`int` or `[height, width]`, *optional*): plain resizing (without a processor); ``None`` keeps the
            images' own size, which must then be the same for all.
        mean (`float` or `list[float]`, *optional*): plain normalisation per channel, on values scaled to
            ``[0, 1]``; ``None``: no normalisation.
        std (`float` or `list[float]`, *optional*): the standard deviations of that normalisation, with ``mean``.
        resample (`str`, defaults to ``"bilinear"``): the filter of plain resizing.
        random_crop_padding (`int`, defaults to 0): training only: shift each image by up to this many pixels
            (`random_crop`).
        horizontal_flip (`float`, defaults to 0.0): training only: mirror each image with this probability.
        batch_size (`int`, defaults to 32): training batch size, per process.
        eval_batch_size (`int`, *optional*): validation batch size, per process; defaults to ``batch_size``.
        max_train_samples (`int`, *optional*): use a random subset of this many training images (drawn with
            ``seed``); the cache still holds the whole split, so changing it costs nothing.
        max_val_samples (`int`, *optional*): the same for validation.
        shuffle (`bool`, defaults to True): reshuffle the training images every epoch (under `torchloom.Engine`
            the order of epoch ``e`` comes from the engine's ``seed + e``).
        seed (`int`, defaults to 0): seeds the subsets (and the shuffling outside an engine).
        num_workers (`int`, defaults to 0): dataloader worker processes.
        cache_dir (`str` or `os.PathLike`, *optional*): the processed-dataset cache; defaults to
            ``$TORCHLOOM_CACHE/processed`` or ``~/.cache/torchloom/processed``.

    Attributes:
        cache_hit (`bool` or ``None``): after ``prepare_data``: whether the splits were loaded from the cache.
        cache_path (`pathlib.Path` or ``None``): the cache entry in use.
        label_names (`list[str]`): after ``setup``: the class names, in id order.
        train_dataset (`datasets.Dataset` or ``None``): after ``setup``: the processed training split, in torch
            format: ``pixel_values`` float32 ``(channels, height, width)``, ``labels`` int64.
        val_dataset (`datasets.Dataset` or ``None``): the same for the validation split.

    Raises:
        ConfigError: a bad setting (names it, its value and what is valid); and, from ``prepare_data``, a missing
            path or column, labels of the wrong type, an unreadable, truncated or unconvertible image (naming the
            file or row; for a table file, the file and the row: its line in a JSON lines file) or an empty split.
    """

    train_description = "the training images (a folder or a table)"
    label_column: str  # always set: classification

    def __init__(
        self,
        # Typed loosely for config files (a class in this union would make jsonargparse read a path as a config
        # file); a Dataset or arrays are accepted from Python too, see `image_table`.
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        image_column: str = "image",
        label_column: str = "label",
        label_names: list[str] | None = None,
        allow_empty_classes: bool = False,
        mode: str = "RGB",
        # dict first: jsonargparse tries the types in order, and a str would swallow a YAML mapping
        image_processor: dict[str, Any] | str | os.PathLike[str] | None = None,
        processor_backend: str | None = "pil",
        size: int | list[int] | None = None,
        mean: float | list[float] | None = None,
        std: float | list[float] | None = None,
        resample: str = "bilinear",
        random_crop_padding: int = 0,
        horizontal_flip: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        cls = type(self).__name__
        self.check_column("image_column", image_column)
        self.check_column("label_column", label_column)  # None would mean no classes: not for classification
        if image_column == label_column:
            raise ConfigError(f"{cls}: image_column and label_column are both {image_column!r}; expected two columns")
        super().__init__(
            train,
            validation,
            label_column=label_column,
            label_names=label_names,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_train_samples=max_train_samples,
            max_val_samples=max_val_samples,
            shuffle=shuffle,
            seed=seed,
            num_workers=num_workers,
            cache_dir=cache_dir,
        )
        if not isinstance(allow_empty_classes, bool):
            raise invalid("allow_empty_classes", allow_empty_classes, "True or False", owner=cls)
        try:
            # Validated now (a bad size fails at construction); the processor itself is loaded on first use.
            self._plain = ImageTransform(mode, size, mean, std, resample)
            self.augmentation = ImageAugmentation(random_crop_padding, horizontal_flip)
        except ConfigError as exc:
            raise ConfigError(f"{cls}: {str(exc).split(': ', 1)[-1]}") from None
        if image_processor is not None and any(v is not None for v in (size, mean, std)):
            raise ConfigError(
                f"{cls}: image_processor is set together with size/mean/std; set the processor's own size, "
                "image_mean and image_std instead"
            )
        self.image_column, self.allow_empty_classes, self.mode = image_column, allow_empty_classes, mode
        self.image_processor_spec, self.processor_backend = image_processor, processor_backend
        self._transform: ImageTransform | None = None
        #: The table file each split was read from (`read_image_file_table`), for the row in an image's error.
        self._table_files: dict[str, Path | None] = {}

    @property
    def transform(self) -> ImageTransform:
        """The `ImageTransform` (the image processor is loaded on first use)."""
        if self._transform is None:
            if self.image_processor_spec is None:
                self._transform = self._plain
            else:
                processor = load_image_processor(self.image_processor_spec, self.processor_backend)
                self._transform = ImageTransform(self.mode, processor=processor)
        return self._transform

    def read_split(self, split: str, source: ImageSource) -> datasets.Dataset:
        """The raw table of ``split`` (`image_table`), checked to hold images: the image column and a row."""
        names = self.label_names_setting
        folder = isinstance(source, str | os.PathLike) and Path(source).expanduser().is_dir()
        if split != "train" and names is None and folder:
            names = self._folder_classes()  # a validation folder may lack a class: keep the training ids
        where = self.split_name(split)
        file = _table_file(source)
        self._table_files[split] = file.absolute() if file is not None else None
        table = image_table(source, self.image_column, self.label_column, names, where, self.allow_empty_classes)
        require_column(table, self.image_column, "image_column", where)
        if len(table) == 0:
            raise ConfigError(f"{where} has no rows; an empty split")
        return table

    def _folder_classes(self) -> list[str] | None:
        train = self.table("train")
        feature = train.features.get(self.label_column)
        return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None

    def cache_settings(self) -> dict[str, Any]:
        """Return everything that determines the processed splits; its `cache_key` names the cache entry.

        Raw data enters as its fingerprint (for a folder: every file's path and bytes and every sub-folder, an empty
        one included; a table's contents plus any image files it only names; or the arrays); the class names in id
        order that the labels are encoded with (``classes``, `resolve_label_names`: the label mapping); the
        transform as its settings (or the processor's class and full config); library versions are included
        because decoding and resizing can change between them. ``max_*_samples``, batch sizes, shuffling and
        augmentation are left out: they act after the cache; so is ``allow_empty_classes``, which only decides
        whether an empty class folder is an error (the folder itself is in the fingerprint and in ``classes``).

        Raises:
            ConfigError: a source that cannot be read (`image_table`), or labels that cannot be encoded.
        """
        sources = self.sources()
        return {
            "kind": "torchloom.data.image.ImageClassificationData",
            "data": {split: self._fingerprint(split) for split in sources},
            "sources": {split: _source_kind(source) for split, source in sources.items()},
            "image_column": self.image_column,
            "label_column": self.label_column,
            "label_names": self.label_names_setting,
            "classes": self.class_names(),
            "transform": self.transform.settings(),
            "versions": {
                "datasets": datasets.__version__,
                "numpy": np.__version__,
                "pillow": PILLOW_VERSION,
                "transformers": transformers.__version__,
            },
        }

    def _fingerprint(self, split: str) -> str:
        table, source = self.table(split), self.sources()[split]  # reading the table checks the source first
        if isinstance(source, str | os.PathLike) and _source_kind(source) == "image folder":
            return fingerprint(source)  # file bytes and paths relative to the folder: moving it keeps the key
        return image_data_fingerprint(table, self.image_column)

    def preprocess(self, split: str, table: datasets.Dataset) -> datasets.Dataset:
        """Decode and transform every image of ``split`` (`preprocess_images`), keeping ``labels``; an image that
        cannot be decoded is named with its row in the table file it came from (``line 3`` of a ``.jsonl``)."""
        name, file = self.split_name(split), self._table_files.get(split)
        if file is None:  # a folder, a save_to_disk directory, a Dataset or arrays: rows are named as they are
            return preprocess_images(table, self.transform, self.image_column, name=name)
        return preprocess_images(
            table,
            self.transform,
            self.image_column,
            name=name,
            row_names=lambda row: f"{name} path '{file}': {row_name(file, row)}",
        )

    def format_split(self, dataset: datasets.Dataset) -> datasets.Dataset:
        """``pixel_values`` and ``labels`` as torch tensors."""
        return dataset.with_format(
            "torch", columns=[c for c in ("pixel_values", "labels") if c in dataset.column_names]
        )

    def collate_fn(self, split: str) -> ImageAugmentation | None:
        """Training batches: `ImageAugmentation` when it does anything; validation batches: stacked as they are."""
        augment = self.augmentation.crop_padding or self.augmentation.horizontal_flip
        return self.augmentation if split == "train" and augment else None


def _source_kind(source: Any) -> str:
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if path.is_file():
            return f"table file ({path.suffix.lower()})"
        return "save_to_disk" if (path / "state.json").is_file() else "image folder"
    return type(source).__name__


def _table_file(source: Any) -> Path | None:
    """The table file of image paths that ``source`` is (`read_image_file_table`), or ``None``."""
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        return path if path.is_file() and path.suffix.lower() in TABLE_READERS else None
    return None
