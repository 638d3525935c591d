"""Audio sources: an audio folder (a directory with ``metadata.csv``), a metadata table file or an in-memory table.

`read_audio_folder` reads a split's table and the directory its relative paths start from; `audio_fingerprint`
hashes the table and the bytes of every clip it names, for a cache key. Part of `torchloom.data.audio`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias

import datasets
import numpy as np
import pandas as pd

from torchloom.data.audio_decoding import resolve_clip
from torchloom.data.cache import fingerprint
from torchloom.data.tables import read_table, require_column
from torchloom.errors import ConfigError

__all__ = ["audio_fingerprint", "read_audio_folder"]

#: The metadata file an audio folder holds.
METADATA_FILE = "metadata.csv"


AudioSource: TypeAlias = str | os.PathLike[str] | pd.DataFrame | datasets.Dataset


def read_audio_folder(source: AudioSource, name: str = "data") -> tuple[datasets.Dataset, Path | None]:
    """Return the table of an audio source and the directory its relative paths are relative to.

    Args:
        source: a directory holding ``metadata.csv`` (an audio folder: ``file_name`` names each clip relative to
            the directory, the other columns are labels or anything else); a metadata table file (``.csv``,
            ``.tsv``, ``.json``, ``.jsonl``, ``.parquet``; paths relative to its directory); or a
            `pandas.DataFrame` / `datasets.Dataset` (paths used as they are: absolute, or relative to the current
            directory).
        name (`str`, defaults to ``"data"``): what to call it in error messages, e.g. ``"train data"``.

    Returns:
        ``(table, base_dir)``: the rows as a `datasets.Dataset`, and the directory relative paths start from
        (``None`` for an in-memory table).

    Raises:
        ConfigError: the path does not exist, a folder without ``metadata.csv``, a table that cannot be read,
            or a table without rows (names the file).
    """
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"{name} path '{path}' does not exist")
        if path.is_dir():
            if not (path / METADATA_FILE).is_file():
                raise ConfigError(
                    f"{name}: audio folder '{path}' has no {METADATA_FILE}; expected one with a file_name column "
                    "(each clip's path, relative to the folder) and a label column"
                )
            path = path / METADATA_FILE
        if path.suffix.lower() in (".csv", ".tsv") and _data_lines(path) == 0:  # datasets refuses a bare header
            raise ConfigError(f"{name} is empty: '{path}' has no rows; expected one row per audio clip")
        table, base, where = read_table(path, name), path.parent, f"'{path}'"
    else:
        table, base, where = read_table(source, name), None, f"the {type(source).__name__}"
    if len(table) == 0:
        raise ConfigError(f"{name} is empty: {where} has no rows; expected one row per audio clip")
    return table, base


def _data_lines(path: Path) -> int:
    """The non-blank lines of a text table after its header (0 for a header alone or an empty file)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return max(0, sum(1 for line in f if line.strip()) - 1)
    except OSError:
        return -1  # read_table reports it


def audio_fingerprint(table: datasets.Dataset, column: str, base: Path | None = None, name: str = "data") -> str:
    """Return a hash of a table and of the content of every clip its ``column`` names, for a `cache_key`.

    The table is hashed as `fingerprint` does (its rows, as written: moving the folder keeps the hash); each
    clip enters by its bytes (or its samples and rate, for an ``{"array", "sampling_rate"}`` value), in row
    order. Editing one byte of one clip, or of the table, changes the hash.

    Raises:
        ConfigError: ``column`` is missing, a value is missing or of the wrong kind, or a named file does not
            exist or cannot be read (names it).
    """
    require_column(table, column, "audio_column", name)
    digest = hashlib.sha256(fingerprint(table).encode())
    seen: dict[Path, str] = {}
    for row, value in enumerate(table[column]):
        value = resolve_clip(value, base, row, column, name)
        if isinstance(value, Mapping) and value.get("array") is not None:
            array = np.ascontiguousarray(value["array"], dtype=np.float32)
            digest.update(f"{value.get('sampling_rate')}:{array.shape}".encode() + array.tobytes())
            continue
        if isinstance(value, Mapping) and value.get("bytes"):
            digest.update(hashlib.sha256(value["bytes"]).digest())
            continue
        path = Path(value["path"] if isinstance(value, Mapping) else value)
        if path not in seen:
            if not path.is_file():
                raise ConfigError(
                    f"{name}: audio file '{path}' (row {row} of {column!r}) does not exist"
                    if not path.exists()
                    else f"{name}: audio file '{path}' (row {row} of {column!r}) is not a file"
                )
            seen[path] = fingerprint(path)
        digest.update(seen[path].encode())
    return digest.hexdigest()
