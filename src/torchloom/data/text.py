"""Text preprocessing: read a table, encode labels, tokenise with batched ``Dataset.map``, pad per batch.

The pieces are plain functions over `datasets.Dataset`, and `TextClassificationData` strings them together as
a `DataModule` for any table with a text column and a label column:

.. code-block:: python

    data = TextClassificationData(
        train="reviews_train.csv", validation="reviews_test.csv", tokenizer="path/to/model",
        text_column="review", label_column="score", label_names=["other", "great"], max_length=128,
    )
    torchloom.Engine(max_epochs=1).fit(task, datamodule=data)

The tokenised splits are saved under a key that hashes the raw data and every setting that shapes them (see
`torchloom.data.cache`), so the second run loads them instead of tokenising again. Sequences are truncated to
``max_length`` but not padded when stored; `transformers.DataCollatorWithPadding` pads each batch to its own
longest sequence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import huggingface_hub
import numpy as np
import pandas as pd
import pyarrow
import pyarrow.compute
import tokenizers
import torch
import transformers
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding, PreTrainedTokenizerBase

from torchloom._settings import invalid
from torchloom.data.base import CachedDataModule
from torchloom.data.cache import cache_key, fingerprint
from torchloom.data.sampling import LengthGroupedSampler
from torchloom.data.tables import TABLE_READERS as TABLE_READERS  # the names text.py had before tables.py
from torchloom.data.tables import TableSource, encode_labels, read_table, require_column, resolve_label_names
from torchloom.errors import ConfigError

__all__ = [
    "TextClassificationData",
    "TextData",
    "encode_labels",
    "load_tokenizer",
    "read_table",
    "resolve_label_names",
    "tokenize",
    "tokenizer_fingerprint",
]

#: Files that define a tokenizer besides its vocabulary files (``tokenizer.vocab_files_names``).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)

#: What a text data module reads for a split (see `read_table`).
TextSource: TypeAlias = TableSource


# ------------------------------------------------------------------------------------------- tokenizers


def load_tokenizer(name_or_path: str | os.PathLike[str], revision: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `transformers.AutoTokenizer` (the fast one where it exists).

    Args:
        name_or_path (`str` or `os.PathLike`): a local model or tokenizer directory, or a Hub repository id
            (offline runs need it in the Hugging Face cache already).
        revision (`str`, *optional*): the Hub revision; ignored for a local directory.

    Returns:
        `transformers.PreTrainedTokenizerBase`

    Raises:
        ConfigError: the path does not exist, the directory holds no tokenizer, or the id cannot be loaded
            (names it and gives the reason).
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    looks_local = path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1
    if looks_local and not path.exists():
        raise ConfigError(f"tokenizer path '{path}' does not exist; expected a model/tokenizer directory or a Hub id")
    if path.is_file():
        raise ConfigError(f"tokenizer path '{path}' is a file; expected the directory that holds tokenizer.json")
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else text, revision=revision)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        what = f"directory '{path}'" if path.is_dir() else f"tokenizer {text!r}"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{what} is not a loadable tokenizer ({reason}); expected a directory with tokenizer.json or "
            "vocabulary files, or a Hub id available offline"
        ) from None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase, revision: str | None = None) -> str:
    """Return a hash of the files that define ``tokenizer``, for a `cache_key`.

    The files are the tokenizer's vocabulary files (``tokenizer.vocab_files_names``) plus ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``added_tokens.json`` and chat templates, read from
    ``tokenizer.name_or_path`` (a local directory, or the Hugging Face cache for a Hub id). The tokenizer class
    name is included. Editing any of those files, or pointing at another tokenizer, changes the fingerprint;
    the tokenizer's in-memory state (which changes when it is called) does not.

    Args:
        tokenizer (`transformers.PreTrainedTokenizerBase`): as returned by `load_tokenizer`.
        revision (`str`, *optional*): the Hub revision it was loaded from.

    Returns:
        `str`: 64 lowercase hex digits.

    Raises:
        ConfigError: none of its files can be found (a tokenizer built in memory): save it with
            ``save_pretrained`` and load it from that directory.
    """
    source = tokenizer.name_or_path
    names = sorted({*_TOKENIZER_FILES, *getattr(tokenizer, "vocab_files_names", {}).values()})
    files: dict[str, str] = {}
    for name in names:
        if os.path.isdir(source):
            candidate: Any = os.path.join(source, name)
        else:
            candidate = huggingface_hub.try_to_load_from_cache(source, name, revision=revision)
        if isinstance(candidate, str) and os.path.isfile(candidate):
            files[name] = fingerprint(candidate)
    if not files:
        raise ConfigError(
            f"tokenizer {source!r}: none of its files ({', '.join(names)}) were found to fingerprint; save it with "
            "save_pretrained(directory) and load it from that directory"
        )
    return cache_key(tokenizer_class=type(tokenizer).__name__, files=files)


# ---------------------------------------------------------------------------------------------- tokenising


def tokenize(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    text_pair_column: str | None = None,
    max_length: int | None = None,
    keep_columns: Sequence[str] = ("labels",),
    batch_size: int = 1000,
    name: str = "data",
) -> datasets.Dataset:
    """Tokenise a text column with a batched `datasets.Dataset.map`, truncating but not padding.

    Args:
        dataset (`datasets.Dataset`): the table.
        tokenizer (`transformers.PreTrainedTokenizerBase`): applied to batches of ``batch_size`` rows.
        text_column (`str`): the text (or first text of a pair).
        text_pair_column (`str`, *optional*): the second text of a pair (NLI, question/passage).
        max_length (`int`, *optional*): truncate to this many tokens, special tokens included; ``None`` uses
            the tokenizer's ``model_max_length``.
        keep_columns (`Sequence[str]`, defaults to ``("labels",)``): columns kept next to the model inputs;
            every other input column is dropped. Missing ones are ignored.
        batch_size (`int`, defaults to 1000): rows per tokenizer call.
        name (`str`, defaults to ``"data"``): what to call the table in error messages.

    Returns:
        `datasets.Dataset`: the ``tokenizer.model_input_names`` columns (e.g. ``input_ids``, ``attention_mask``,
        ``token_type_ids``: lists of int of length <= ``max_length``) plus ``keep_columns``, in memory.

    Raises:
        ConfigError: a text column is missing, is not a string column, or has missing values.
    """
    columns = [text_column] + ([text_pair_column] if text_pair_column else [])
    for setting, column in zip(("text_column", "text_pair_column"), columns):
        require_column(dataset, column, setting, name)
        feature = dataset.features[column]
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            raise ConfigError(f"{name}: {setting} {column!r} has type {feature}; expected a string column")

    def encode(batch: dict[str, list[Any]], indices: list[int]) -> Any:
        texts = [batch[c] for c in columns]
        for column, values in zip(columns, texts):
            if None in values:
                row = indices[values.index(None)]
                raise ConfigError(f"{name}: text column {column!r} has a missing value in row {row}; drop or fill it")
        return tokenizer(*texts, truncation=True, max_length=max_length)

    remove = [c for c in dataset.column_names if c not in keep_columns]
    return dataset.map(
        encode,
        with_indices=True,
        batched=True,
        batch_size=batch_size,
        remove_columns=remove,
        keep_in_memory=True,
        load_from_cache_file=False,
        # A given fingerprint spares datasets from hashing the tokenizer inside `encode` (slow, and not stable
        # across calls); torchloom's own cache key, not this one, decides what is reused.
        new_fingerprint=datasets.fingerprint.generate_random_fingerprint(),
        desc=f"Tokenizing {name}",
    )


# ------------------------------------------------------------------------------------------- DataModule


class TextData(CachedDataModule):
    """The part every tokenised-text data module shares, on `CachedDataModule`: tables and a tokenizer.

    Splits are tables read with `read_table`; the tokenizer is loaded on first use (`load_tokenizer`). For the
    cache key, `source_settings` gives each split's `fingerprint` and reader and `versions` the libraries that
    parse and tokenise; a subclass adds its own settings in `cache_settings` and tokenises in ``preprocess``.
    `TextClassificationData` is one; a language-model or chat module is another.

    Args:
        train: the training table: a ``.csv`` / ``.tsv`` / ``.json`` / ``.jsonl`` / ``.parquet`` path, a
            ``save_to_disk`` directory, a `pandas.DataFrame` or a `datasets.Dataset` (see `read_table`).
        validation (*optional*): the validation table, same kinds.
        tokenizer (`str` or `os.PathLike`): a local model/tokenizer directory or a Hub id (`load_tokenizer`).
        tokenizer_revision (`str`, *optional*): the Hub revision of ``tokenizer``.
        group_by_length (`bool`, defaults to False): batch training rows of similar length together
            (`torchloom.data.LengthGroupedSampler`, the HF Trainer's ``group_by_length``): each epoch a seeded
            random order, cut into megabatches of 50 batches sorted by length, the longest row first; less
            padding per batch. Needs ``shuffle=True``; validation stays in order.
        **settings: the settings of `CachedDataModule` (``label_column``, ``batch_size``, ``cache_dir`` ...).

    Attributes:
        tokenizer_name (`str` or `os.PathLike`): the ``tokenizer`` argument.
        tokenizer_revision (`str` or ``None``): the ``tokenizer_revision`` argument.
        group_by_length (`bool`): the argument.
    """

    train_description = "the training table (a path or a table)"
    preprocessing_description = "tokenising"

    def __init__(
        self,
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        tokenizer_revision: str | None = None,
        group_by_length: bool = False,
        **settings: Any,
    ) -> None:
        owner = type(self).__name__
        if tokenizer is None or not isinstance(tokenizer, str | os.PathLike) or not os.fspath(tokenizer):
            raise invalid("tokenizer", tokenizer, "a model/tokenizer directory or a Hub id", owner=owner)
        if not isinstance(group_by_length, bool):
            raise invalid("group_by_length", group_by_length, "true or false", owner=owner)
        if group_by_length and settings.get("shuffle") is False:
            raise invalid(
                "group_by_length", True, "false with shuffle=False (length groups come in a random order)", owner=owner
            )
        super().__init__(train, validation, **settings)
        self.tokenizer_name, self.tokenizer_revision = tokenizer, tokenizer_revision
        self.group_by_length = group_by_length
        self._tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name, self.tokenizer_revision)
        return self._tokenizer

    def read_split(self, split: str, source: TextSource) -> datasets.Dataset:
        """The table of ``split`` (`read_table`)."""
        return read_table(source, self.split_name(split))

    def row_lengths(self, dataset: datasets.Dataset) -> np.ndarray:
        """The tokens of every row of a set-up split (its ``length`` column where it has one, else the length of
        its ``input_ids``), read from the Arrow table without decoding the rows."""
        column = "length" if "length" in dataset.column_names else "input_ids"
        values = dataset.select_columns([column]).with_format("arrow")[column]  # a subset's rows, as Arrow
        lengths = (values if column == "length" else pyarrow.compute.list_value_length(values)).to_numpy()
        return np.asarray(lengths, dtype=np.int64)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size``: reshuffled every epoch when ``shuffle``; with ``group_by_length``, in the
        order of a `LengthGroupedSampler` over the rows' lengths (`row_lengths`), seeded with ``seed`` (under
        `torchloom.Engine`: the engine's)."""
        if not self.group_by_length or self.train_dataset is None:
            return super().train_dataloader()
        sampler = LengthGroupedSampler(self.row_lengths(self.train_dataset), self.batch_size, seed=self.seed)
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self.collate_fn("train"),
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def source_settings(self) -> dict[str, Any]:
        """The raw tables for the key, without reading them: ``data``, each split's `fingerprint` (file bytes, or
        table contents with every value's type), and ``suffixes``, its reader (a path's suffix, else its type).

        Raises:
            ConfigError: a data path that does not exist (names the split) or cannot be read.
        """
        data, suffixes = {}, {}
        for split, source in self.sources().items():
            if isinstance(source, str | os.PathLike):
                path = Path(source).expanduser()
                if not path.exists():
                    raise ConfigError(f"{type(self).__name__}: {split} data path '{path}' does not exist")
                suffixes[split] = path.suffix.lower()
            else:
                suffixes[split] = type(source).__name__
            data[split] = fingerprint(source)
        return {"data": data, "suffixes": suffixes}

    def versions(self) -> dict[str, str]:
        """The versions of the libraries that parse the tables (pandas and pyarrow decide a label column's type
        too) and tokenise them."""
        return {
            "datasets": datasets.__version__,
            "pandas": pd.__version__,
            "pyarrow": pyarrow.__version__,
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
        }


class TextClassificationData(TextData):
    """Tokenised text classification data from any table with a text column and a label column.

    ``prepare_data`` reads the tables, encodes the labels (`encode_labels`), tokenises (`tokenize`) and saves
    both splits with ``save_to_disk`` in the processed-dataset cache, under a key that hashes the raw data and
    every setting below that shapes the result; a second run with the same inputs loads them instead (the
    ``cache_hit`` attribute says which happened). ``setup`` loads the splits (memory-mapped) and takes the
    ``max_*_samples`` subsets; the dataloaders pad each batch with `transformers.DataCollatorWithPadding`
    (`collator`): a batch is a dict of int64 tensors ``input_ids``, ``attention_mask`` (and ``token_type_ids`` for
    BERT-like tokenizers) of shape ``(batch, longest)`` and ``labels`` of shape ``(batch,)``. The steps are those of
    `CachedDataModule`; the tables and the tokenizer are `TextData`'s; this class adds the columns and `tokenize`.

    Args:
        train: the training table: a ``.csv`` / ``.tsv`` / ``.json`` / ``.jsonl`` / ``.parquet`` path, a
            ``save_to_disk`` directory, a `pandas.DataFrame` or a `datasets.Dataset` (see `read_table`).
        validation (*optional*): the validation table, same kinds.
        tokenizer (`str` or `os.PathLike`): a local model/tokenizer directory or a Hub id (`load_tokenizer`).
        text_column (`str`, defaults to ``"text"``): the text to classify.
        text_pair_column (`str`, *optional*): a second text, for pair tasks.
        label_column (`str`, defaults to ``"label"``): the class of each row.
        label_names (`list[str]`, *optional*): the class names in id order (id 0 first); defaults to the
            sorted distinct labels of ``train`` (`encode_labels`).
        max_length (`int`, defaults to 128): truncate to this many tokens (special tokens included).
        batch_size (`int`, defaults to 16): training batch size, per process.
        eval_batch_size (`int`, *optional*): validation batch size, per process; defaults to ``batch_size``.
        max_train_samples (`int`, *optional*): use a random subset of this many training rows (drawn with
            ``seed``); the cache still holds the full split, so changing it costs nothing.
        max_val_samples (`int`, *optional*): the same for validation.
        shuffle (`bool`, defaults to True): reshuffle the training rows every epoch. Under `torchloom.Engine`
            the order of epoch ``e`` is drawn from the engine's ``seed + e`` (Accelerate's seedable sampler), so
            the same engine seed repeats it; ``seed`` below seeds it when the dataloader is used on its own.
        seed (`int`, defaults to 0): seeds the subsets (and the shuffling outside an engine).
        group_by_length (`bool`, defaults to False): batch training rows of similar length together (the HF
            Trainer's ``group_by_length``; see `TextData`): less padding, the longest batch first. Needs
            ``shuffle=True``.
        pad_to_multiple_of (`int`, *optional*): pad each batch's length up to a multiple of this.
        num_workers (`int`, defaults to 0): dataloader worker processes.
        cache_dir (`str` or `os.PathLike`, *optional*): the processed-dataset cache; defaults to
            ``$TORCHLOOM_CACHE/processed`` or ``~/.cache/torchloom/processed``.
        tokenizer_revision (`str`, *optional*): the Hub revision of ``tokenizer``.

    Attributes:
        cache_hit (`bool` or ``None``): after ``prepare_data``: whether the splits were loaded from the cache.
        cache_path (`pathlib.Path` or ``None``): the cache entry in use.
        label_names (`list[str]`): after ``setup``: the class names, in id order.
        train_dataset (`datasets.Dataset` or ``None``): after ``setup``: the tokenised training split.
        val_dataset (`datasets.Dataset` or ``None``): after ``setup``: the tokenised validation split.

    Raises:
        ConfigError: a bad setting (names it, its value and what is valid); and, from ``prepare_data``, a
            missing or unreadable path, a missing column, an unknown label or a tokenizer that cannot be loaded.
    """

    def __init__(
        self,
        # Typed as paths for config files (a class in this union would make jsonargparse read a path as a
        # config file); a DataFrame or a Dataset is accepted from Python too, see `TextSource`.
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        text_column: str = "text",
        text_pair_column: str | None = None,
        label_column: str = "label",
        label_names: list[str] | None = None,
        max_length: int = 128,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group_by_length: bool = False,
        pad_to_multiple_of: int | None = None,
        num_workers: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
        tokenizer_revision: str | None = None,
    ) -> None:
        self.check_column("text_column", text_column)
        self.check_column("label_column", label_column)  # None would mean no classes: not for classification
        self.check_column("text_pair_column", text_pair_column, optional=True)
        self.check_count("max_length", max_length)
        self.check_count("pad_to_multiple_of", pad_to_multiple_of, optional=True)
        super().__init__(
            train,
            validation,
            tokenizer=tokenizer,
            tokenizer_revision=tokenizer_revision,
            group_by_length=group_by_length,
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
        self.text_column, self.text_pair_column = text_column, text_pair_column
        self.max_length, self.pad_to_multiple_of = max_length, pad_to_multiple_of

    def cache_settings(self) -> dict[str, Any]:
        """Return everything that determines the processed splits; its `cache_key` names the cache entry.

        Raw tables enter as their `fingerprint` (file bytes, or table contents with every value's type) and their
        suffix (the reader); the label mapping (`resolve_label_names`) follows from them and from ``label_column``
        and ``label_names``, so the tables need not be read to make the key; the tokenizer enters as its
        `tokenizer_fingerprint` (its files and class); library versions are included because parsing and
        tokenisation can change between them. ``max_*_samples``, batch sizes, shuffling, ``group_by_length`` and
        padding are left out: they act after the cache.

        Raises:
            ConfigError: a data path that does not exist or cannot be read, or a tokenizer that cannot be loaded.
        """
        return {
            "kind": "torchloom.data.text.TextClassificationData",
            **self.source_settings(),  # "data" and "suffixes"
            "tokenizer": tokenizer_fingerprint(self.tokenizer, self.tokenizer_revision),
            "text_column": self.text_column,
            "text_pair_column": self.text_pair_column,
            "label_column": self.label_column,
            "label_names": self.label_names_setting,
            "max_length": self.max_length,
            "versions": self.versions(),
        }

    def preprocess(self, split: str, table: datasets.Dataset) -> datasets.Dataset:
        """Tokenise ``split`` (`tokenize`), keeping ``labels``."""
        return tokenize(
            table, self.tokenizer, self.text_column, self.text_pair_column, self.max_length, name=self.split_name(split)
        )

    def collator(self) -> DataCollatorWithPadding:
        """The batch collator: pads ``input_ids`` etc. to the batch's longest row; tensors of dtype int64."""
        return DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="pt")

    def collate_fn(self, split: str) -> DataCollatorWithPadding:
        """`collator`, for training and validation alike."""
        return self.collator()
