"""The processed-dataset cache: datasets saved with ``save_to_disk`` under a key that hashes their inputs.

A key is a hash of everything that determines a processed dataset: a fingerprint of the raw data (file
bytes, or table contents) and every preprocessing setting (tokenizer files, ``max_length``, columns, label
names, library versions). Change any of them and the key changes, so a stale entry is never loaded; keep
them all and the entry is loaded with `datasets.load_from_disk` instead of being recomputed.

Entries are written atomically: a dataset is saved into a temporary directory next to its final place and
renamed into place only once it is complete, so a crash or an interrupted run never leaves a half-written
entry under a valid key, and a concurrent reader sees either nothing or the whole entry.

Each entry records the settings its key was made from (in ``torchloom_cache.json``). A request that passes its
settings (``load(key, settings)``, ``check``, ``get_or_build(..., settings=...)``) gets the entry only if the recorded
settings equal its own; an entry moved, copied or renamed under another key is refused with a `ConfigError` that
names the entry, the first setting that differs and both values, instead of being returned as if it matched.

Example:

.. code-block:: python

    from torchloom.data.cache import DatasetCache, cache_key, fingerprint

    settings = {"raw": fingerprint("reviews.csv"), "tokenizer": "bert-base-uncased", "max_length": 128}
    cache = DatasetCache("~/.cache/torchloom/processed")
    dataset, hit = cache.get_or_build(cache_key(**settings), build_the_dataset, settings=settings)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import datasets

from torchloom.errors import ConfigError, RunFileError
from torchloom.rundir.atomic import remove_orphans, temporary_path, write_failure

__all__ = ["DatasetCache", "cache_key", "default_cache_dir", "fingerprint"]

#: Bump when the layout of cached entries or the meaning of a key changes: old entries are then ignored.
#: 2: directory fingerprints hash sub-directories (an empty class folder) and frame every entry; settings checked.
CACHE_FORMAT = 2
#: The file that marks a complete entry; it holds the settings the key was made from, checked when it is loaded.
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
            - a path to a directory: the hash of every entry below it, in sorted order: each sub-directory's
              relative path (an empty one included) and each file's relative path and bytes; symbolic links to
              directories are followed (each real directory once);
            - a `pandas.DataFrame`: the hash of its column names, dtypes, index and values, and of the Python type
              of every value in an ``object`` column (``1`` and ``"1"`` differ);
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
        if not path.is_dir():  # a single file is hashed by content alone: renaming it keeps its fingerprint
            _hash_file(path, digest)
            return digest.hexdigest()
        for entry in _directory_entries(path):  # framed, so that no two trees give the same stream
            digest.update(entry)
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
        # pandas hashes the object values 1 and "1" alike, but they become other columns, other labels
        for i, dtype in enumerate(source.dtypes):
            if pd.api.types.is_object_dtype(dtype):
                types = source.iloc[:, i].map(lambda value: type(value).__qualname__)
                digest.update(pd.util.hash_pandas_object(types, index=False).to_numpy().tobytes())
        return digest.hexdigest()
    raise TypeError(
        f"fingerprint: cannot hash a {type(source).__name__}; expected a path, a pandas.DataFrame, "
        "a datasets.Dataset or a datasets.DatasetDict"
    )


def _hash_file(file: Path, digest: Any) -> Any:
    try:
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise ConfigError(f"data path '{file}' cannot be read: {exc.strerror or exc}") from None
    return digest


def _directory_entries(root: Path) -> list[bytes]:
    """Every sub-directory and file below ``root``, each as framed bytes (kind, relative POSIX path, content hash).

    Links to directories are followed, as listing an image folder does, so a linked class folder's files count; a
    directory reached again (a second link to it, or a link loop) is recorded as the same as the path it was first
    reached by, and not entered again. Directories are walked in sorted order, so the result is deterministic.
    """
    entries: list[tuple[str, bytes]] = []
    first_seen = {os.path.realpath(root): "."}
    for top, dirs, files in os.walk(root, followlinks=True, onerror=_raise_walk_error):
        base = Path(top)
        dirs.sort()
        for name in list(dirs):
            relative = (base / name).relative_to(root).as_posix()
            real = os.path.realpath(base / name)
            if real in first_seen:
                dirs.remove(name)
                entries.append((relative, b"same\0" + relative.encode() + b"\0" + first_seen[real].encode()))
            else:
                first_seen[real] = relative
                entries.append((relative, b"dir\0" + relative.encode()))
        for name in files:
            file = base / name
            if file.is_file():  # a broken link or a socket is not data
                relative = file.relative_to(root).as_posix()
                content = _hash_file(file, hashlib.sha256()).digest()
                entries.append((relative, b"file\0" + relative.encode() + b"\0" + content))
    return [framed + b"\0" for _, framed in sorted(entries, key=lambda entry: entry[0])]


def _raise_walk_error(exc: OSError) -> None:
    raise ConfigError(f"data path '{exc.filename}' cannot be read: {exc.strerror or exc}")


class DatasetCache:
    """Processed datasets on disk, one directory per key, written atomically, checked when loaded.

    Args:
        root (`str` or `os.PathLike`, *optional*): the directory that holds the entries; created when the
            first entry is saved. Defaults to ``default_cache_dir() / "processed"``.

    Each entry ``<root>/<key>/`` is what `datasets.Dataset.save_to_disk` (or
    `datasets.DatasetDict.save_to_disk`) wrote, plus ``torchloom_cache.json`` with the settings the key was
    made from (under ``"settings"``). An entry without that file is incomplete and never loaded. Given the
    settings of a request, `load`, `check` and `get_or_build` return an entry only if its recorded settings equal
    them, so an entry that sits under another key (copied, renamed, swapped) is refused rather than returned.
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

    def load(self, key: str, settings: Mapping[str, Any] | None = None) -> datasets.Dataset | datasets.DatasetDict:
        """Load the entry ``key`` with `datasets.load_from_disk` (memory-mapped, nothing is recomputed).

        Args:
            key (`str`): from `cache_key`.
            settings (`Mapping`, *optional*): the settings the key was made from; when given, the entry is
                loaded only if it records the same settings (`check`).

        Raises:
            KeyError: there is no complete entry for ``key``.
            ConfigError: the entry exists but cannot be read, or (with ``settings``) records other settings (names
                its directory and the first setting that differs; delete it to rebuild).
        """
        if settings is not None:
            self.check(key, settings)
        elif key not in self:
            raise KeyError(key)
        path = self.path(key)
        try:
            return datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"processed-dataset cache entry '{path}' cannot be read ({exc}); delete that directory to rebuild it"
            ) from None

    def info(self, key: str) -> dict[str, Any]:
        """Return what ``torchloom_cache.json`` of the entry ``key`` holds: ``key``, ``cache_format``, ``settings``.

        Raises:
            KeyError: there is no complete entry for ``key``.
            ConfigError: the file cannot be read or is not a JSON object (names the entry; delete it to rebuild).
        """
        if key not in self:
            raise KeyError(key)
        path = self.path(key)
        try:
            record = json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"processed-dataset cache entry '{path}': its {INFO_FILE} cannot be read ({exc}); delete that "
                "directory to rebuild it"
            ) from None
        if not isinstance(record, dict):
            raise ConfigError(
                f"processed-dataset cache entry '{path}': its {INFO_FILE} holds a {type(record).__name__}, not an "
                "object; delete that directory to rebuild it"
            )
        return record

    def check(self, key: str, settings: Mapping[str, Any]) -> None:
        """Check that the entry ``key`` was built from ``settings``: the ones it records must equal them.

        Args:
            key (`str`): from `cache_key`.
            settings (`Mapping`): the request's settings, as passed to `cache_key` (compared as JSON).

        Raises:
            KeyError: there is no complete entry for ``key``.
            ConfigError: the entry records no settings, or other ones (names the entry's directory, the first
                setting that differs with both values, and says to delete the directory).
        """
        record = self.info(key)
        path = self.path(key)
        if "settings" not in record:
            raise ConfigError(
                f"processed-dataset cache entry '{path}' records no settings to check against this request's; "
                "delete that directory to rebuild it"
            )
        difference = _first_difference(record["settings"], _as_json(settings))
        if difference is not None:
            name, recorded, requested = difference
            raise ConfigError(
                f"processed-dataset cache entry '{path}' was built from other settings than this request's: "
                f"{name} is {_show(recorded)} in the entry but {_show(requested)} now; delete that directory to "
                "rebuild it"
            )

    def save(
        self,
        key: str,
        dataset: datasets.Dataset | datasets.DatasetDict,
        info: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save ``dataset`` as the entry ``key``, atomically, and return the entry's directory.

        The dataset is written with ``save_to_disk`` into a temporary directory under ``root``
        (``.<key>.tmp-<pid>-<hex>``, see `torchloom.utils.write_atomically`) and renamed into place; what a save killed
        half-way left in ``root`` is removed first. If another process completed the same entry first, its entry
        is kept and this copy discarded (the same key means the same content).

        Args:
            key (`str`): from `cache_key`.
            dataset (`datasets.Dataset` or `datasets.DatasetDict`): what to store.
            info (`Mapping`, *optional*): JSON-like values stored in ``torchloom_cache.json``, for people.
            settings (`Mapping`, *optional*): the settings ``key`` was made from, stored in ``torchloom_cache.json``
                as ``"settings"`` (overriding one in ``info``); `check` compares a later request with them.

        Raises:
            ConfigError: ``root`` cannot be created or written (names it).
            RunFileError: the entry cannot be written (a full disk; names it and the reason); nothing is left.
        """
        final = self.path(key)
        tmp = temporary_path(final, unique=True)  # several processes may build the same entry at once
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_orphans(self.root)  # what saves killed half-way left here
            tmp.mkdir()
        except OSError as exc:
            raise ConfigError(f"cache directory '{self.root}' cannot be written: {exc.strerror or exc}") from None
        try:
            dataset.save_to_disk(str(tmp))
            record = {"key": key, "cache_format": CACHE_FORMAT, **(info or {})}
            if settings is not None:
                record["settings"] = settings
            (tmp / INFO_FILE).write_text(json.dumps(record, indent=2, default=_jsonable), encoding="utf-8")
            try:
                os.rename(tmp, final)
            except OSError:
                if key not in self:  # not a lost race: a broken leftover or a real I/O error
                    raise
        except Exception as exc:
            reason = write_failure(exc, tmp)
            if reason is None:
                raise
            raise RunFileError(f"cannot write processed-dataset cache entry '{final}': {reason}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def get_or_build(
        self,
        key: str,
        build: Callable[[], datasets.Dataset | datasets.DatasetDict],
        info: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> tuple[datasets.Dataset | datasets.DatasetDict, bool]:
        """Load the entry ``key``, or call ``build()``, save what it returns, and load that.

        Args:
            key (`str`): from `cache_key`.
            build (`Callable`): makes the dataset when there is no entry.
            info (`Mapping`, *optional*): stored with a new entry (`save`).
            settings (`Mapping`, *optional*): the settings ``key`` was made from: stored with a new entry, and
                checked against an existing one (`check`).

        Returns:
            ``(dataset, hit)``: the memory-mapped dataset, and whether it came from the cache (``build`` was
            not called).

        Raises:
            ConfigError: an existing entry records other settings than ``settings``, or cannot be read (`load`).
        """
        if key in self:
            return self.load(key, settings), True
        self.save(key, build(), info, settings)
        return self.load(key, settings), False


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from ``torchloom_cache.json`` (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(value, default=_jsonable))


def _first_difference(recorded: Any, requested: Any, name: str = "") -> tuple[str, Any, Any] | None:
    """``(dotted name, recorded value, requested value)`` of the first setting that differs, or ``None``."""
    if isinstance(recorded, dict) and isinstance(requested, dict):
        for field in [*requested, *(f for f in recorded if f not in requested)]:
            here = f"{name}.{field}" if name else str(field)
            if field not in recorded or field not in requested:
                return here, recorded.get(field, _MISSING), requested.get(field, _MISSING)
            difference = _first_difference(recorded[field], requested[field], here)
            if difference is not None:
                return difference
        return None
    # As JSON text: true is not 1 (though True == 1), and a NaN equals itself
    same = json.dumps(recorded, sort_keys=True) == json.dumps(requested, sort_keys=True)
    return None if same else (name or "the settings", recorded, requested)


class _Missing:
    def __repr__(self) -> str:
        return "(not set)"


_MISSING = _Missing()


def _show(value: Any, limit: int = 120) -> str:
    text = repr(value) if isinstance(value, _Missing) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(
        f"cache_key: a setting of type {type(value).__name__} ({value!r}) cannot be hashed; use JSON-like values"
    )
