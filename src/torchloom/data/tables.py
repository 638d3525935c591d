"""Tables and their labels, for every data module: read a table, check a column, encode the labels as classes.

`read_table` turns a file, a ``save_to_disk`` directory or an in-memory table into a `datasets.Dataset`;
`resolve_label_names` gives the class names in id order that `encode_labels` encodes a label column with (the
label mapping, which a data module puts in its cache key); `require_column` names a missing column and lists the
ones there are. Text, image and audio data modules all use them, and so can a data module of your own.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import pandas as pd

from torchloom.errors import ConfigError

__all__ = ["encode_labels", "read_table", "require_column", "resolve_label_names"]

#: File suffixes `read_table` reads, and the `datasets` reader each one goes through.
TABLE_READERS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}

#: What `read_table` reads: a path, a `pandas.DataFrame` or a `datasets.Dataset`.
TableSource: TypeAlias = str | os.PathLike[str] | pd.DataFrame | datasets.Dataset


def read_table(source: TableSource, name: str = "data") -> datasets.Dataset:
    """Return ``source`` as a `datasets.Dataset`.

    Args:
        source: a `datasets.Dataset` (returned as is), a `pandas.DataFrame`, a directory written by
            ``save_to_disk``, or a ``.csv`` / ``.tsv`` / ``.json`` / ``.jsonl`` / ``.parquet`` file (read with
            the matching `datasets.Dataset` reader, fully into memory, leaving no Hugging Face cache behind).
        name (`str`, defaults to ``"data"``): what to call it in error messages, e.g. ``"train data"``.

    Raises:
        ConfigError: the path does not exist, cannot be read or parsed, or has an unsupported suffix.
    """
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, pd.DataFrame):
        return datasets.Dataset.from_pandas(source, preserve_index=False)
    if not isinstance(source, str | os.PathLike):
        raise ConfigError(
            f"{name}: got a {type(source).__name__}; expected a file path, a save_to_disk directory, "
            "a pandas.DataFrame or a datasets.Dataset"
        )
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"{name} path '{path}' does not exist")
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if not isinstance(loaded, datasets.Dataset):
                raise ConfigError(
                    f"{name} path '{path}' holds a DatasetDict (splits {', '.join(loaded)}); give one split's directory"
                )
            return loaded
        reader = TABLE_READERS.get(path.suffix.lower())
        if reader is None:
            raise ConfigError(
                f"{name} path '{path}' has an unsupported suffix {path.suffix!r}; expected one of "
                f"{', '.join(TABLE_READERS)} or a save_to_disk directory"
            )
        kwargs: dict[str, Any] = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        with tempfile.TemporaryDirectory(prefix="torchloom-read-") as scratch:
            load = getattr(datasets.Dataset, f"from_{reader}")
            return load(str(path), keep_in_memory=True, cache_dir=scratch, **kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # datasets wraps parse errors in several types (DatasetGenerationError, ArrowInvalid)
        reason = str(exc.__cause__ or exc).strip().splitlines()
        raise ConfigError(
            f"{name} path '{path}' cannot be read as {path.suffix or 'a dataset directory'}: "
            f"{reason[0] if reason else type(exc).__name__}"
        ) from None


def resolve_label_names(
    dataset: datasets.Dataset,
    column: str,
    names: Sequence[str] | None = None,
    name: str = "data",
) -> list[str]:
    """Return the class names, in id order, that `encode_labels` gives ``column``, without encoding anything.

    This is the label mapping of the processed data (class ``i`` is ``names[i]``), so a data module puts it in
    its cache key.

    Args:
        dataset (`datasets.Dataset`): the table.
        column (`str`): the label column: strings, non-negative integers (kept as class ids), or a
            `datasets.ClassLabel`.
        names (`Sequence[str]`, *optional*): the class names in id order. ``None``: the sorted distinct strings of
            the column, or ``"0" ... "<max>"`` for integers, or the column's own `ClassLabel` names.
        name (`str`, defaults to ``"data"``): what to call the table in error messages.

    Returns:
        `list[str]`: the class names, in id order.

    Raises:
        ConfigError: ``column`` is missing or has missing values, a value is not one of ``names``, an integer label
            is negative or out of range, or the values are of another type.
    """
    require_column(dataset, column, "label_column", name)
    feature = dataset.features[column]
    values = dataset.unique(column)
    if any(v is None for v in values):
        raise ConfigError(f"{name}: label_column {column!r} has missing values; every row needs a label")
    if isinstance(feature, datasets.ClassLabel):
        target = list(names) if names is not None else list(feature.names)
        if sorted(target) != sorted(feature.names):
            raise ConfigError(f"{name}: label_names {target} do not match the classes of {column!r} ({feature.names})")
    elif all(isinstance(v, str) for v in values):
        target = list(names) if names is not None else sorted(values)
        unknown = sorted(set(values) - set(target))
        if unknown:
            raise ConfigError(
                f"{name}: label_column {column!r} has values {unknown[:5]} that are not in label_names {target}"
            )
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        target = list(names) if names is not None else [str(i) for i in range(max(values) + 1)]
        bad = sorted(v for v in values if not 0 <= v < len(target))
        if bad:
            raise ConfigError(
                f"{name}: label_column {column!r} has integer labels {bad[:5]} outside 0..{len(target) - 1} "
                f"(label_names {target})"
            )
    else:
        raise ConfigError(
            f"{name}: label_column {column!r} has values of type {feature}; expected strings, non-negative "
            "integers or a ClassLabel"
        )
    return target


def encode_labels(
    dataset: datasets.Dataset,
    column: str,
    names: Sequence[str] | None = None,
    name: str = "data",
) -> datasets.Dataset:
    """Encode ``column`` as a `datasets.ClassLabel` column named ``labels`` (what transformers models expect).

    Args:
        dataset (`datasets.Dataset`): the table.
        column (`str`): the label column: strings, non-negative integers (kept as class ids), or a
            `datasets.ClassLabel`.
        names (`Sequence[str]`, *optional*): the class names in id order. ``None``: the sorted distinct strings of
            the column, or ``"0" ... "<max>"`` for integers, or the column's own `ClassLabel` names
            (`resolve_label_names`).
        name (`str`, defaults to ``"data"``): what to call the table in error messages.

    Returns:
        `datasets.Dataset`: ``column`` replaced by ``labels`` of dtype int64 with a `ClassLabel` feature.

    Raises:
        ConfigError: ``column`` is missing or has missing values, a value is not one of ``names``, or an
            integer label is negative or out of range.
    """
    target = resolve_label_names(dataset, column, names, name)
    feature = dataset.features[column]
    if isinstance(feature, datasets.ClassLabel):
        if target != list(feature.names):
            dataset = dataset.align_labels_with_mapping({n: i for i, n in enumerate(target)}, column)
    else:
        dataset = dataset.cast_column(column, datasets.ClassLabel(names=target))
    if column != "labels":
        if "labels" in dataset.column_names:
            dataset = dataset.remove_columns("labels")
        dataset = dataset.rename_column(column, "labels")
    return dataset


def require_column(dataset: datasets.Dataset, column: str, setting: str, name: str) -> None:
    """Raise a `ConfigError` unless ``dataset`` has ``column``; the message names ``setting`` and lists the columns.

    Args:
        dataset (`datasets.Dataset`): the table.
        column (`str`): the column required.
        setting (`str`): the setting that named it (``"label_column"``), for the message.
        name (`str`): what to call the table in the message (``"TextClassificationData train data"``).
    """
    if column not in dataset.column_names:
        raise ConfigError(
            f"{name}: {setting} {column!r} is not a column; the columns are {', '.join(dataset.column_names)}"
        )
