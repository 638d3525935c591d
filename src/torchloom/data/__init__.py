"""Data for torchloom runs: `DataModule`, text preprocessing and the processed-dataset cache.

`DataModule` is imported with ``torchloom``; the preprocessing names load `datasets` and `transformers`, so
they are imported on first use (``from torchloom.data import TextClassificationData``), not by ``import
torchloom``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchloom.data.module import DataModule

if TYPE_CHECKING:
    from torchloom.data.cache import DatasetCache, cache_key, default_cache_dir, fingerprint
    from torchloom.data.text import (
        TextClassificationData,
        encode_labels,
        load_tokenizer,
        read_table,
        tokenize,
        tokenizer_fingerprint,
    )

_LAZY = {
    "DatasetCache": "torchloom.data.cache",
    "cache_key": "torchloom.data.cache",
    "default_cache_dir": "torchloom.data.cache",
    "fingerprint": "torchloom.data.cache",
    "TextClassificationData": "torchloom.data.text",
    "encode_labels": "torchloom.data.text",
    "load_tokenizer": "torchloom.data.text",
    "read_table": "torchloom.data.text",
    "tokenize": "torchloom.data.text",
    "tokenizer_fingerprint": "torchloom.data.text",
}

__all__ = [
    "DataModule",
    "DatasetCache",
    "TextClassificationData",
    "cache_key",
    "default_cache_dir",
    "encode_labels",
    "fingerprint",
    "load_tokenizer",
    "read_table",
    "tokenize",
    "tokenizer_fingerprint",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchloom.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
