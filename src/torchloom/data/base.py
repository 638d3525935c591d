"""`CachedDataModule`: the base of torchloom's data modules: raw splits in, processed splits cached, batches out.

Every data module of `torchloom.data` is this class plus one modality's preprocessing. The base owns what they
share:

- the raw sources by split (`sources`: ``train`` first, then ``validation``) and each split's raw table, read once
  per instance (`table`);
- the processed-dataset cache (`torchloom.data.cache`): its directory (``cache_dir``), the key made from
  `cache_settings`, and the check that an entry found or loaded records those settings;
- prepare once, set up everywhere: `prepare_data` (run by the engine on the main process first, under
  ``accelerator.main_process_first()``) builds the processed splits and saves them, or finds them saved; `setup`
  (every process) loads them memory-mapped and takes the ``max_*_samples`` subsets (`subset`), so subsets, batch
  sizes and shuffling never change the key;
- the labels: ``label_column`` is encoded as a `datasets.ClassLabel` column ``labels`` (`encode_labels`), the
  training split fixing the class ids; `class_names` gives that mapping before anything is built (for the key),
  ``label_names`` / `num_labels` after `setup`. A data module without classes (a language model's) passes
  ``label_column=None``;
- the dataloaders and the settings they share (batch sizes, shuffling, seed, workers), validated on construction
  with the same messages for every module (`check_column`, `check_count`).

A subclass supplies its modality:

- ``read_split(split, source)``: the raw table of one split, a `datasets.Dataset` (errors name the split with
  `split_name`);
- ``cache_settings()``: everything that determines the processed splits, JSON-like; its `cache_key` names the
  entry. Start it with a ``"kind"`` naming the class, put raw data in as its `fingerprint` and the label mapping as
  `class_names`, and include every setting and library version that shapes the output;
- ``preprocess(split, table)``: the processed split, from the raw table whose labels are already ``labels``
  (tokenise; decode, resize, normalise; decode, resample, featurise);
- optionally ``format_split(dataset)``, the format a set-up split is served in (default: as stored), and
  ``collate_fn(split)``, the dataloader's ``collate_fn`` (default: torch's).

A subclass keeps its own constructor with explicit arguments (config files read the signature), validates its own
settings, then passes the shared ones to ``super().__init__``:

.. code-block:: python

    from torchloom.data import CachedDataModule, fingerprint, read_table, require_column

    class CSVRegressionData(CachedDataModule):
        train_description = "the training table (a path or a table)"

        def __init__(self, train=None, validation=None, *, column="x", batch_size=16, cache_dir=None):
            self.check_column("column", column)
            self.column = column
            super().__init__(train, validation, label_column=None, batch_size=batch_size, cache_dir=cache_dir)

        def read_split(self, split, source):
            return read_table(source, self.split_name(split))

        def cache_settings(self):
            return {"kind": "mypackage.CSVRegressionData", "column": self.column,
                    "data": {split: fingerprint(source) for split, source in self.sources().items()}}

        def preprocess(self, split, table):
            require_column(table, self.column, "column", self.split_name(split))
            return table.select_columns([self.column])
"""

from __future__ import annotations

import abc
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import datasets
import torch
from torch.utils.data import DataLoader

from torchloom._settings import invalid
from torchloom.data.cache import DatasetCache, cache_key
from torchloom.data.module import DataModule
from torchloom.data.tables import check_rows, encode_labels, resolve_label_names
from torchloom.errors import ConfigError

__all__ = ["CachedDataModule"]

logger = logging.getLogger(__name__)


class CachedDataModule(DataModule, abc.ABC):
    """A `DataModule` whose splits are preprocessed once, cached under a key, and loaded on every later run.

    ``prepare_data`` computes `cache_settings` and its `cache_key`; if the processed-dataset cache holds an entry
    under that key (and the entry records the same settings), nothing is read or computed (``cache_hit`` is True);
    otherwise `build` reads each split (`table`), encodes its labels, preprocesses it (`preprocess`) and the splits
    are saved with ``save_to_disk``. ``setup`` loads them memory-mapped and takes the ``max_*_samples`` subsets.
    See the module docstring for what a subclass implements.

    Args:
        train: the training data, in whatever form `read_split` reads (a path, a table, arrays).
        validation (*optional*): the validation data, same kinds.
        label_column (`str`, *optional*, defaults to ``"label"``): the class of each row; ``None``: the data has no
            classes (nothing is encoded, ``label_names`` stays empty).
        label_names (`list[str]`, *optional*): the class names in id order (id 0 first); defaults to what
            `resolve_label_names` finds in the training split.
        batch_size (`int`, defaults to 16): training batch size, per process.
        eval_batch_size (`int`, *optional*): validation batch size, per process; defaults to ``batch_size``.
        max_train_samples (`int`, *optional*): use a random subset of this many training rows (drawn with
            ``seed``); the cache still holds the full split, so changing it costs nothing.
        max_val_samples (`int`, *optional*): the same for validation.
        shuffle (`bool`, defaults to True): reshuffle the training rows every epoch. Under `torchloom.Engine` the
            order of epoch ``e`` is drawn from the engine's ``seed + e`` (Accelerate's seedable sampler), so the
            same engine seed repeats it; ``seed`` below seeds it when the dataloader is used on its own.
        seed (`int`, defaults to 0): seeds the subsets (and the shuffling outside an engine).
        num_workers (`int`, defaults to 0): dataloader worker processes.
        cache_dir (`str` or `os.PathLike`, *optional*): the processed-dataset cache; defaults to
            ``$TORCHLOOM_CACHE/processed`` or ``~/.cache/torchloom/processed``.

    Attributes:
        cache (`DatasetCache`): the processed-dataset cache.
        cache_hit (`bool` or ``None``): after ``prepare_data``: whether the splits were loaded from the cache.
        cache_path (`pathlib.Path` or ``None``): the cache entry in use.
        label_names (`list[str]`): after ``setup``: the class names, in id order.
        label_names_setting (`list[str]` or ``None``): the ``label_names`` argument, validated.
        predicting (`bool`): True while `predict_dataset` preprocesses the rows of `set_predict_input` (as the
            validation split, named ``"<class name> predict data"``): a subclass accepts rows without labels then,
            and keeps every row (no packing, no dropping).
        train_dataset (`datasets.Dataset` or ``None``): after ``setup``: the processed training split.
        val_dataset (`datasets.Dataset` or ``None``): after ``setup``: the processed validation split.

    Raises:
        ConfigError: a bad setting (names the class, the setting, its value and what is valid).
    """

    #: What the training data is, for the error when there is none: ``train=None; expected <this>``.
    train_description: ClassVar[str] = "the training data"
    #: What `prepare_data` logs that it is doing when the cache has no entry.
    preprocessing_description: ClassVar[str] = "preprocessing"

    def __init__(
        self,
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        label_column: str | None = "label",
        label_names: Sequence[str] | None = None,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if label_column is not None:
            self.check_column("label_column", label_column)
        if label_names is not None:
            if (
                label_column is None
                or isinstance(label_names, str)
                or not all(isinstance(n, str) for n in label_names)
                or len(set(label_names)) != len(label_names)
                or len(label_names) < 2
            ):
                expected = "a list of 2 or more distinct strings" if label_column is not None else "None (no classes)"
                raise invalid("label_names", label_names, f"{expected}", owner=type(self).__name__)
            label_names = list(label_names)
        self.check_count("batch_size", batch_size)
        for setting, count in (
            ("eval_batch_size", eval_batch_size),
            ("max_train_samples", max_train_samples),
            ("max_val_samples", max_val_samples),
        ):
            self.check_count(setting, count, optional=True)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise invalid("num_workers", num_workers, "an integer >= 0", owner=type(self).__name__)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise invalid("seed", seed, "an integer", owner=type(self).__name__)
        self.train, self.validation = train, validation
        self.label_column, self.label_names_setting = label_column, label_names
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.max_train_samples, self.max_val_samples = max_train_samples, max_val_samples
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.cache = DatasetCache(Path(cache_dir).expanduser() if cache_dir is not None else None)
        self.cache_hit: bool | None = None
        self.cache_path: Path | None = None
        self.label_names: list[str] = []
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self._tables: dict[str, datasets.Dataset] = {}
        #: Raw rows to predict on instead of the validation rows (`set_predict_input`); ``None``: the validation rows.
        self.predict_input: Any = None
        #: True while `predict_dataset` preprocesses the predict input: its rows may have no labels (no label
        #: column, no completion, no assistant reply), and every row must stay one row, in order.
        self.predicting = False
        self._key: str | None = None
        self._settings: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------- what a subclass implements

    @abc.abstractmethod
    def read_split(self, split: str, source: Any) -> datasets.Dataset:
        """Return the raw table of ``split`` read from ``source`` (one value of `sources`); called once per split.

        Raises:
            ConfigError: the source cannot be read (name it with `split_name`).
        """

    @abc.abstractmethod
    def cache_settings(self) -> dict[str, Any]:
        """Return everything that determines the processed splits, JSON-like; its `cache_key` names the cache entry.

        Include a ``"kind"`` naming the data module, the raw data as its `fingerprint`, the label mapping where it
        depends on the data (`class_names`), every setting that acts before the cache and the versions of the
        libraries that read and preprocess; leave out what acts after it (subsets, batch sizes, shuffling).
        """

    @abc.abstractmethod
    def preprocess(self, split: str, table: datasets.Dataset) -> datasets.Dataset:
        """Return the processed ``split`` made from its raw ``table``, whose labels are already the ``labels``
        column (`encode_labels`) when the module has a ``label_column``."""

    def format_split(self, dataset: datasets.Dataset) -> datasets.Dataset:
        """Return a set-up split in the format its rows are served in (e.g. ``with_format("torch")``); default as
        stored."""
        return dataset

    def collate_fn(self, split: str) -> Callable[[list[Any]], Any] | None:
        """Return the ``collate_fn`` of ``split``'s dataloader (``"train"`` or ``"validation"``); ``None``: torch's
        default, which stacks each column."""
        return None

    # ---------------------------------------------------------------------------------------- the steps

    def sources(self) -> dict[str, Any]:
        """Return the raw data by split (``"train"``, ``"validation"``). Override to produce them in code.

        Raises:
            ConfigError: no training data.
        """
        if self.train is None:
            raise ConfigError(f"{type(self).__name__}: train=None; expected {self.train_description}")
        splits: dict[str, Any] = {"train": self.train}
        if self.validation is not None:
            splits["validation"] = self.validation
        return splits

    def split_name(self, split: str) -> str:
        """What error messages call ``split``: ``"<class name> <split> data"`` (``"<class name> predict data"`` for
        the rows `predicting` preprocesses as the validation split)."""
        return f"{type(self).__name__} {'predict' if getattr(self, 'predicting', False) else split} data"

    def table(self, split: str) -> datasets.Dataset:
        """The raw table of ``split`` (`read_split`), read once per instance (until ``setup``).

        Raises:
            ConfigError: it cannot be read, or has no rows (`check_rows`).
        """
        if split not in self._tables:
            table = self.read_split(split, self.sources()[split])
            check_rows(table, self.split_name(split))
            self._tables[split] = table
        return self._tables[split]

    def class_names(self) -> list[str]:
        """The class names, in id order, that `build` encodes the labels with, from the raw tables (nothing is
        encoded): the training split fixes them, the others must fit them. Empty without a ``label_column``."""
        names = self.label_names_setting
        if self.label_column is None:
            return []
        for split in self.sources():
            names = resolve_label_names(self.table(split), self.label_column, names, self.split_name(split))
        return list(names or [])

    def prepare_data(self) -> None:
        """Preprocess the splits and save them to the cache, or find them already there."""
        settings = self.cache_settings()
        self._key = key = cache_key(**settings)
        self._settings = settings
        self.cache_path = self.cache.path(key)
        if key in self.cache:
            self.cache.check(key, settings)  # an entry under this key built from other settings is refused
            self.cache_hit = True
            logger.info("%s: loading the processed splits from %s", type(self).__name__, self.cache_path)
            return
        self.cache_hit = False
        logger.info(
            "%s: %s; the result goes to %s", type(self).__name__, self.preprocessing_description, self.cache_path
        )
        self.cache.save(key, self.build(), settings=settings)

    def build(self) -> datasets.DatasetDict:
        """Read, encode the labels of and preprocess every split (what `prepare_data` saves on a cache miss)."""
        names = self.label_names_setting
        processed = {}
        for split in self.sources():  # "train" first: it fixes the label names
            table = self.table(split)
            if self.label_column is not None:
                table = encode_labels(table, self.label_column, names, self.split_name(split))
                names = table.features["labels"].names
            processed[split] = self.preprocess(split, table)
        return datasets.DatasetDict(processed)

    def setup(self, stage: str) -> None:
        """Load the processed splits from the cache and take the ``max_*_samples`` subsets."""
        if self._key is None or self._key not in self.cache:
            self.prepare_data()
        assert self._key is not None
        splits = self.cache.load(self._key, self._settings)
        self.cache_path = self.cache.path(self._key)
        self._tables.clear()  # the raw tables are not needed any more
        if self.label_column is not None:
            self.label_names = list(splits["train"].features["labels"].names)
        self.train_dataset = self.subset(splits["train"], self.max_train_samples)
        self.val_dataset = self.subset(splits["validation"], self.max_val_samples) if "validation" in splits else None

    def subset(self, dataset: datasets.Dataset, n: int | None) -> datasets.Dataset:
        """A random subset of ``n`` rows of ``dataset`` (drawn with ``seed``; all of it for ``None``), formatted
        (`format_split`)."""
        if n is not None and n < len(dataset):
            dataset = dataset.shuffle(seed=self.seed, keep_in_memory=True).select(range(n), keep_in_memory=True)
        return self.format_split(dataset)

    @property
    def num_labels(self) -> int:
        """The number of classes (after ``setup``)."""
        return len(self.label_names)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size``, reshuffled every epoch when ``shuffle`` (seeded with ``seed``)."""
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}.train_dataloader() called before setup()")
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=self.collate_fn("train"),
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader | None:
        """Batches of ``eval_batch_size`` in order; ``None`` without validation."""
        if self.val_dataset is None:
            return None
        return DataLoader(
            self.val_dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=self.collate_fn("validation"),
            num_workers=self.num_workers,
        )

    def predict_dataloader(self) -> DataLoader | None:
        """The validation rows, in order (what ``torchloom predict`` predicts on; the labels stay in the batches so
        that predictions can be compared with them); ``None`` without validation. After `set_predict_input`, the
        rows of that input instead, in its order."""
        if self.predict_input is not None:
            return DataLoader(
                self.predict_dataset(),
                batch_size=self.eval_batch_size,
                shuffle=False,
                collate_fn=self.collate_fn("validation"),
                num_workers=self.num_workers,
            )
        return self.val_dataloader()

    def set_predict_input(self, source: Any) -> None:
        """Predict on ``source`` instead of the validation rows (``torchloom predict --input FILE``): raw rows in
        any form a split's source takes (a ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` / ``.parquet`` file, ...),
        read (`read_split`) and preprocessed (`preprocess`) as the validation split is, not cached, and served in
        their order. A ``label_column`` in them is encoded with the training split's classes; rows without one
        are predicted as they are. Call it before ``setup``."""
        self.predict_input = source

    def predict_dataset(self) -> datasets.Dataset:
        """The rows of `set_predict_input`'s source, read and preprocessed as the validation split (after ``setup``).

        Rows without a label are predicted as they are (`predicting` is True while they are preprocessed): a label
        column that is absent, or missing in some rows (encoded as -1, datasets' "no label"), is no error here.

        Raises:
            ConfigError: the input cannot be read or preprocessed, or has no rows; the message names it.
        """
        shown = os.fspath(self.predict_input) if isinstance(self.predict_input, str | os.PathLike) else "the input"
        self.predicting = True
        try:
            table = self.read_split("validation", self.predict_input)
            check_rows(table, "the input")
            if self.label_column is not None and self.label_column in table.column_names:
                table = encode_labels(
                    table, self.label_column, self.label_names, f"predict input {shown!r}", allow_missing=True
                )
            return self.format_split(self.preprocess("validation", table))
        except ConfigError as exc:
            raise ConfigError(f"predict input {shown!r}: {exc}") from None
        finally:
            self.predicting = False

    # --------------------------------------------------------------------------------- settings checks

    def check_column(self, setting: str, value: Any, optional: bool = False) -> None:
        """Refuse a column-name setting that is not a non-empty string (or ``None``, when ``optional``)."""
        if optional and value is None:
            return
        if not isinstance(value, str) or not value:
            expected = "a column name or None" if optional else "a column name"
            raise invalid(setting, value, expected, owner=type(self).__name__)

    def check_count(self, setting: str, value: Any, optional: bool = False) -> None:
        """Refuse a count setting that is not a positive integer (or ``None``, when ``optional``)."""
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(setting, value, "a positive integer", owner=type(self).__name__)
