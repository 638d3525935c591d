"""The processed-dataset cache: datasets saved with ``save_to_disk`` under a key that hashes their inputs.

A key is a hash of everything that determines a processed dataset: a fingerprint of the raw data (file
bytes, or table contents) and every preprocessing setting (tokenizer files, ``max_length``, columns, label
names, library versions). Change any of them and the key changes, so a stale entry is never loaded; keep
them all and the entry is loaded with `datasets.load_from_disk` instead of being recomputed.

Entries are written atomically: a dataset is saved into a temporary directory next to its final place and
renamed into place only once it is complete, so a crash or an interrupted run never leaves a half-written
entry under a valid key, and a concurrent reader sees either nothing or the whole entry.

Example:

.. code-block:: python

    from torchloom.data.cache import DatasetCache, cache_key, fingerprint

    key = cache_key(raw=fingerprint("reviews.csv"), tokenizer="bert-base-uncased", max_length=128)
    dataset, hit = DatasetCache("~/.cache/torchloom/processed").get_or_build(key, build_the_dataset)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import datasets

from torchloom.errors import ConfigError

__all__ = ["DatasetCache", "cache_key", "default_cache_dir", "fingerprint"]

#: Bump when the layout of cached entries or the meaning of a key changes: old entries are then ignored.
CACHE_FORMAT = 1
#: The file that marks a complete entry; it holds the settings the key was made from (for people, not code).
INFO_FILE = "torchloom_cache.json"

_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """Return the root of torchloom's caches: ``$TORCHLOOM_CACHE``, else ``~/.cache/torchloom``."""
    return Path(os.environ.get("TORCHLOOM_CACHE") or Path.home() / ".cache" / "torchloom").expanduser()


def cache_key(**settings: Any) -> str:
    """Return a 32-hex-digit key that changes whenever any of ``settings`` changes.

    The settings are serialised as canonical JSON (sorted keys), so the key does not depend on argument order
    or on the process: the same settings give the same key in every run.

    Args:
        **settings: JSON-like values: `str`, `int`, `float`, `bool`, ``None``, lists / tuples and dicts of
            them, and `os.PathLike` (hashed as its string). Put raw data in as its `fingerprint`.

    Returns:
        `str`: the key, 32 lowercase hex digits (128 bits of SHA-256).

    Raises:
        TypeError: a setting that is not JSON-like (names its type).
    """
    text = json.dumps({"cache_format": CACHE_FORMAT, **settings}, sort_keys=True, default=_jsonable)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def fingerprint(source: Any) -> str:
    """Return a hash of the contents of raw data, for use in a `cache_key`.

    Args:
        source: one of

            - a path (`str` or `os.PathLike`) to a file: the hash of its bytes (not of its name);
            - a path to a directory: the hash of every file's relative path and bytes, in sorted order;
            - a `pandas.DataFrame`: the hash of its column names, dtypes, index and values;
            - a `datasets.Dataset`: the hash of its features and of the contents of the rows it shows, in order
              (a ``select`` / ``shuffle`` view hashes its own rows);
            - a `datasets.DatasetDict`: the hash of every split's fingerprint, by split name.

    Returns:
        `str`: 64 lowercase hex digits (SHA-256).

    Raises:
        ConfigError: the path does not exist or cannot be read (names the path).
        TypeError: any other kind of ``source``.
    """
    digest = hashlib.sha256()
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"data path '{path}' does not exist")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if path.is_dir():  # a single file is hashed by content alone: renaming it keeps its fingerprint
                digest.update(str(file.relative_to(path)).encode() + b"\0")
            try:
                with open(file, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
            except OSError as exc:
                raise ConfigError(f"data path '{file}' cannot be read: {exc.strerror or exc}") from None
        return digest.hexdigest()
    if isinstance(source, datasets.DatasetDict):
        for split in sorted(source):
            digest.update(f"{split}={fingerprint(source[split])};".encode())
        return digest.hexdigest()
    if isinstance(source, datasets.Dataset):
        digest.update(json.dumps(source.features.to_dict(), sort_keys=True).encode())
        # The visible rows as one Arrow table: a select()/shuffle() view hashes the rows it shows, in order.
        digest.update(datasets.fingerprint.Hasher.hash(source.with_format("arrow")[:]).encode())
        return digest.hexdigest()
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas is a dependency of datasets
        pd = None
    if pd is not None and isinstance(source, pd.DataFrame):
        digest.update(json.dumps([[str(c), str(t)] for c, t in source.dtypes.items()]).encode())
        digest.update(pd.util.hash_pandas_object(source, index=True).to_numpy().tobytes())
        return digest.hexdigest()
    raise TypeError(
        f"fingerprint: cannot hash a {type(source).__name__}; expected a path, a pandas.DataFrame, "
        "a datasets.Dataset or a datasets.DatasetDict"
    )


class DatasetCache:
    """Processed datasets on disk, one directory per key, written atomically.

    Args:
        root (`str` or `os.PathLike`, *optional*): the directory that holds the entries; created when the
            first entry is saved. Defaults to ``default_cache_dir() / "processed"``.

    Each entry ``<root>/<key>/`` is what `datasets.Dataset.save_to_disk` (or
    `datasets.DatasetDict.save_to_disk`) wrote, plus ``torchloom_cache.json`` with the settings the key was
    made from. An entry without that file is incomplete and never loaded.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_dir() / "processed"

    def path(self, key: str) -> Path:
        """Return the directory of the entry ``key`` (whether or not it exists)."""
        if not key or os.sep in key or key.startswith("."):
            raise ConfigError(f"cache key {key!r} is not valid; expected a name such as cache_key() returns")
        return self.root / key

    def __contains__(self, key: str) -> bool:
        return (self.path(key) / INFO_FILE).is_file()

    def load(self, key: str) -> datasets.Dataset | datasets.DatasetDict:
        """Load the entry ``key`` with `datasets.load_from_disk` (memory-mapped, nothing is recomputed).

        Raises:
            KeyError: there is no complete entry for ``key``.
            ConfigError: the entry exists but cannot be read (names its directory; delete it to rebuild).
        """
        if key not in self:
            raise KeyError(key)
        path = self.path(key)
        try:
            return datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"processed-dataset cache entry '{path}' cannot be read ({exc}); delete that directory to rebuild it"
            ) from None

    def info(self, key: str) -> dict[str, Any]:
        """Return the settings stored with the entry ``key``.

        Raises:
            KeyError: there is no complete entry for ``key``.
        """
        if key not in self:
            raise KeyError(key)
        return json.loads((self.path(key) / INFO_FILE).read_text(encoding="utf-8"))

    def save(
        self,
        key: str,
        dataset: datasets.Dataset | datasets.DatasetDict,
        info: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save ``dataset`` as the entry ``key``, atomically, and return the entry's directory.

        The dataset is written with ``save_to_disk`` into a temporary directory under ``root`` and renamed into
        place. If another process completed the same entry first, its entry is kept and this copy discarded
        (the same key means the same content).

        Args:
            key (`str`): from `cache_key`.
            dataset (`datasets.Dataset` or `datasets.DatasetDict`): what to store.
            info (`Mapping`, *optional*): JSON-like settings stored in ``torchloom_cache.json``.

        Raises:
            ConfigError: ``root`` cannot be created or written (names it).
        """
        final = self.path(key)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
        except OSError as exc:
            raise ConfigError(f"cache directory '{self.root}' cannot be written: {exc.strerror or exc}") from None
        try:
            dataset.save_to_disk(str(tmp))
            record = {"key": key, "cache_format": CACHE_FORMAT, **(info or {})}
            (tmp / INFO_FILE).write_text(json.dumps(record, indent=2, default=_jsonable), encoding="utf-8")
            try:
                os.rename(tmp, final)
            except OSError:
                if key not in self:  # not a lost race: a broken leftover or a real I/O error
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def get_or_build(
        self,
        key: str,
        build: Callable[[], datasets.Dataset | datasets.DatasetDict],
        info: Mapping[str, Any] | None = None,
    ) -> tuple[datasets.Dataset | datasets.DatasetDict, bool]:
        """Load the entry ``key``, or call ``build()``, save what it returns, and load that.

        Returns:
            ``(dataset, hit)``: the memory-mapped dataset, and whether it came from the cache (``build`` was
            not called).
        """
        if key in self:
            return self.load(key), True
        self.save(key, build(), info)
        return self.load(key), False


def _jsonable(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(
        f"cache_key: a setting of type {type(value).__name__} ({value!r}) cannot be hashed; use JSON-like values"
    )
