"""Tables and their labels, for every data module: read a table, check a column, encode the labels as classes.

`read_table` turns a file, a ``save_to_disk`` directory or an in-memory table into a `datasets.Dataset`;
`resolve_label_names` gives the class names in id order that `encode_labels` encodes a label column with (the
label mapping, which a data module puts in its cache key); `require_column` names a missing column and lists the
ones there are. Text, image and audio data modules all use them, and so can a data module of your own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import pandas as pd

from torchloom.errors import ConfigError

__all__ = ["check_rows", "encode_labels", "read_table", "require_column", "resolve_label_names"]

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
        ConfigError: the path does not exist, cannot be read or parsed, or has an unsupported suffix; a file with no
            rows (``is empty (0 rows)``); a line of a ``.jsonl`` file (or an item of a ``.json`` array) that is no
            JSON object (names its 1-based line, or item, and what it is); a CSV line with more fields than the
            header (names the line).
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
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises several types for a directory it cannot load
            said = str(exc).strip().splitlines()
            raise ConfigError(
                f"{name} path '{path}' cannot be read as a dataset directory: "
                f"{said[0] if said else type(exc).__name__}; expected a directory written by save_to_disk"
            ) from None
        if not isinstance(loaded, datasets.Dataset):
            raise ConfigError(
                f"{name} path '{path}' holds a DatasetDict (splits {', '.join(loaded)}); give one split's directory"
            )
        return loaded
    suffix = path.suffix.lower()
    reader = TABLE_READERS.get(suffix)
    if reader is None:
        raise ConfigError(
            f"{name} path '{path}' has an unsupported suffix {path.suffix!r}; expected one of "
            f"{', '.join(TABLE_READERS)} or a save_to_disk directory"
        )
    expected = _EXPECTED[suffix]
    if _is_blank(path, binary=reader == "parquet"):
        raise ConfigError(f"{name} path '{path}' is empty (0 rows); expected {expected}")
    if suffix == ".jsonl":
        _check_json_lines(path, name)  # datasets reads a line that is no object as a row, or blames "row 0"
    elif suffix == ".json":
        _check_json_array(path, name)
    kwargs: dict[str, Any] = {"delimiter": "\t"} if suffix == ".tsv" else {}
    try:
        with tempfile.TemporaryDirectory(prefix="torchloom-read-") as scratch, _quiet_readers():
            load = getattr(datasets.Dataset, f"from_{reader}")
            table = load(str(path), keep_in_memory=True, cache_dir=scratch, **kwargs)
    except Exception as exc:  # datasets wraps parse errors in several types (DatasetGenerationError, ArrowInvalid)
        lines = str(exc.__cause__ or exc).strip().splitlines()
        reason = lines[0] if lines else type(exc).__name__
        if "corresponds to no data" in reason or "BatchSize must be greater than 0" in reason:
            raise ConfigError(f"{name} path '{path}' is empty (0 rows); expected {expected}") from None
        if reader == "json":
            _check_json_lines(path, name, parse=True)  # names the first line that is no JSON object, if one is
        raise ConfigError(
            f"{name} path '{path}' cannot be read as {path.suffix}: {_reason(reader, reason)}; expected {expected}"
        ) from None
    if not len(table):
        raise ConfigError(f"{name} path '{path}' is empty (0 rows); expected {expected}")
    return table


#: What a file of each suffix holds, for the messages of `read_table`.
_EXPECTED = {
    ".csv": "a header line, then one line per row",
    ".tsv": "a header line, then one line per row (tab-separated)",
    ".json": "a JSON array of objects, or one JSON object per line",
    ".jsonl": "one JSON object per line",
    ".parquet": "a parquet table with at least one row",
}


def _is_blank(path: Path, binary: bool) -> bool:
    """Whether the file has no bytes (``binary``) or only whitespace, read in chunks until the first other byte."""
    if binary:
        return path.stat().st_size == 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip() and chunk.strip() != b"\xef\xbb\xbf":
                return False
    return True


def _json_kind(text: bytes) -> str:
    """What a line (or item) that is no JSON object is: ``"a JSON array"``, ``"null"`` ... or ``"not JSON"``."""
    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    kinds = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean", type(None): "null"}
    return kinds.get(type(value), "a JSON number")


def _excerpt(text: bytes, size: int = 40) -> str:
    shown = text.decode("utf-8", errors="replace")
    return repr(shown if len(shown) <= size else shown[: size - 3] + "...")


def _check_json_lines(path: Path, name: str, parse: bool = False) -> None:
    """Refuse the first non-blank line of a JSON lines file that is no JSON object (with ``parse``: that is not
    valid JSON either), naming its 1-based line number. Without ``parse`` only each line's first character is
    looked at (a pass over the file, no parsing).

    Raises:
        ConfigError: such a line (names the file, the line, what it is and that one object per line is expected).
    """
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            text = line.removeprefix(b"\xef\xbb\xbf").strip() if number == 1 else line.strip()
            if not text:
                continue
            if text[:1] != b"{":
                what = _json_kind(text)
            elif not parse:
                continue
            else:
                try:
                    value = json.loads(text)
                except ValueError as exc:
                    what = f"not valid JSON ({exc.args[0] if exc.args else exc})"
                else:
                    if isinstance(value, dict):
                        continue
                    what = "not a JSON object"
            raise ConfigError(
                f"{name} path '{path}': line {number} is {what}: {_excerpt(text)}; expected one JSON object per line"
            )


def _check_json_array(path: Path, name: str) -> None:
    """A ``.json`` file that is one JSON array: refuse an item that is no object, naming its 1-based position
    (datasets would read ``[1, 2]`` as a column ``text``, and ``null`` as a row of missing values). A file of
    JSON lines (or one object) is left to the reader.

    Raises:
        ConfigError: the array is not valid JSON, or an item is no object.
    """
    with open(path, "rb") as f:
        head = f.read(1 << 12).removeprefix(b"\xef\xbb\xbf").lstrip()
    if head[:1] != b"[":
        return
    try:
        items = json.loads(path.read_bytes().removeprefix(b"\xef\xbb\xbf"))
    except ValueError as exc:
        raise ConfigError(f"{name} path '{path}' is not valid JSON ({exc}); expected {_EXPECTED['.json']}") from None
    for number, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            text = json.dumps(item).encode()
            raise ConfigError(
                f"{name} path '{path}': item {number} of the JSON array is {_json_kind(text)}: {_excerpt(text)}; "
                f"expected {_EXPECTED['.json']}"
            )


def _reason(reader: str, reason: str) -> str:
    """The library's reason for a file that cannot be read, in the file's terms where it is known (pandas' CSV
    errors name lines and rows of their own)."""
    fields = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", reason)
    if reader == "csv" and fields:
        expected, line, saw = fields.groups()
        return f"line {line} has {saw} fields, the header {expected}"
    quote = re.search(r"EOF inside string starting at row (\d+)", reason)
    if reader == "csv" and quote:
        return f"a quoted field that starts in row {int(quote.group(1)) + 1} (the header is row 1) is never closed"
    return reason.removeprefix("Error tokenizing data. C error: ").removeprefix("JSON parse error: ")


@contextlib.contextmanager
def _quiet_readers() -> Iterator[None]:
    """Silence the log lines datasets' readers write before they raise (`read_table` raises one error instead)."""
    loggers = [
        logging.getLogger(f"datasets.packaged_modules.{name}") for name in ("csv.csv", "json.json", "parquet.parquet")
    ]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels):
            each.setLevel(level)


def resolve_label_names(
    dataset: datasets.Dataset,
    column: str,
    names: Sequence[str] | None = None,
    name: str = "data",
    allow_missing: bool = False,
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
        allow_missing (`bool`, defaults to False): accept rows without a label (rows to predict on); the classes
            come from the labelled rows, or are ``names``.

    Returns:
        `list[str]`: the class names, in id order.

    Raises:
        ConfigError: ``column`` is missing or (unless ``allow_missing``) has missing values, a value is not one of
            ``names``, an integer label is negative or out of range, or the values are of another type.
    """
    require_column(dataset, column, "label_column", name)
    feature = dataset.features[column]
    values = dataset.unique(column)
    if any(v is None for v in values):
        if not allow_missing:
            raise ConfigError(f"{name}: label_column {column!r} has missing values; every row needs a label")
        values = [v for v in values if v is not None]
        if not values and names is not None:
            return list(names)
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
    allow_missing: bool = False,
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
        allow_missing (`bool`, defaults to False): rows without a label (rows to predict on) get the label -1,
            datasets' "no label" (as in the test splits of GLUE).

    Returns:
        `datasets.Dataset`: ``column`` replaced by ``labels`` of dtype int64 with a `ClassLabel` feature.

    Raises:
        ConfigError: ``column`` is missing or (unless ``allow_missing``) has missing values, a value is not one of
            ``names``, or an integer label is negative or out of range.
    """
    target = resolve_label_names(dataset, column, names, name, allow_missing)
    feature = dataset.features[column]
    if allow_missing and None in dataset.unique(column):
        ids = {n: i for i, n in enumerate(target)}
        old = feature.names if isinstance(feature, datasets.ClassLabel) else None
        codes = [
            -1 if v is None else ids[old[v]] if old is not None else ids[v] if isinstance(v, str) else v
            for v in dataset[column]
        ]
        dataset = dataset.remove_columns([c for c in (column, "labels") if c in dataset.column_names])
        return dataset.add_column("labels", codes, feature=datasets.ClassLabel(names=target))
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


def check_rows(dataset: datasets.Dataset, name: str) -> None:
    """Raise a `ConfigError` when ``dataset`` has no rows (a table from a file is refused by `read_table` already;
    this catches an empty `pandas.DataFrame`, `datasets.Dataset` or folder).

    Args:
        dataset (`datasets.Dataset`): the table.
        name (`str`): what to call it in the message (``"ChatData train data"``).
    """
    if not len(dataset):
        raise ConfigError(f"{name} is empty (0 rows); expected at least one row")


def row_name(path: str | os.PathLike[str], row: int) -> str:
    """What to call row ``row`` (0-based) of the table `read_table` read from the file ``path``, in a message.

    ``"line N"`` for a JSON lines file (``.jsonl``, or a ``.json`` file of one object per line: its 1-based line,
    blank lines counted, as an editor shows it); ``"item N of the JSON array"`` for a ``.json`` array; ``"row N"``
    (1-based, the header not counted) for CSV, TSV and parquet. The file is read only when this is called (for an
    error message).
    """
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            if suffix == ".json" and f.read(1 << 12).removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"[":
                return f"item {row + 1} of the JSON array"
            f.seek(0)
            seen = -1
            for number, line in enumerate(f, start=1):
                if line.removeprefix(b"\xef\xbb\xbf").strip():
                    seen += 1
                    if seen == row:
                        return f"line {number}"
    return f"row {row + 1}"


def table_path(
    value: Any, file: str | os.PathLike[str], row: int, column: str, setting: str, name: str, what: str
) -> Path:
    """One value of a path column of the table `read_table` read from ``file``, as the path of an existing file: a
    relative path starts at ``file``'s folder, an absolute one is kept (``~`` expanded).

    Args:
        value: the value (a path as a string).
        file (`str` or `os.PathLike`): the table's file.
        row (`int`): the value's row (0-based), named in messages as `row_name` does (``line 3``).
        column (`str`): the column, named in messages with ``setting`` (``image_column 'image'``).
        setting (`str`): the setting that names the column.
        name (`str`): what to call the table in messages (``"ImageClassificationData predict data"``).
        what (`str`): what the files are (``"an image file"``), for the messages.

    Returns:
        `pathlib.Path`: the file, absolute when ``file`` is.

    Raises:
        ConfigError: the value is missing or no string, or the path does not exist or is no file (names ``file``,
            the row, the path and what is valid).
    """
    file = Path(file).expanduser()
    where = f"{name} path '{file}': {row_name(file, row)}: {setting} {column!r}"
    expected = f"expected the path of {what}, absolute or relative to the file's folder '{file.parent}'"
    if value is None or value == "":
        raise ConfigError(f"{where} has no value; {expected}")
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"{where} holds {_excerpt(repr(value).encode())}, of type {type(value).__name__}; {expected}")
    path = Path(value).expanduser()
    path = path if path.is_absolute() else file.parent / path
    if not path.is_file():
        state = "does not exist" if not path.exists() else "is not a file"
        raise ConfigError(f"{where} names '{path}', which {state}; {expected}")
    return path
