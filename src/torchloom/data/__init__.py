"""Data for torchloom runs: `DataModule`, text, image and audio preprocessing and the processed-dataset cache.

`DataModule` is imported with ``torchloom``; the preprocessing names load `datasets` and `transformers`, so
they are imported on first use (``from torchloom.data import TextClassificationData``), not by ``import
torchloom``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchloom.data.module import DataModule

if TYPE_CHECKING:
    from torchloom.data.audio import (
        AudioClassificationData,
        LogMelSpectrogram,
        audio_fingerprint,
        build_feature_extractor,
        extract_features,
        feature_extractor_fingerprint,
        fix_length,
        read_audio,
        read_audio_folder,
        resample,
    )
    from torchloom.data.cache import DatasetCache, cache_key, default_cache_dir, fingerprint
    from torchloom.data.image import (
        ImageAugmentation,
        ImageClassificationData,
        ImageTransform,
        image_data_fingerprint,
        image_table,
        load_image,
        load_image_processor,
        preprocess_images,
        random_crop,
        random_horizontal_flip,
        read_image_folder,
    )
    from torchloom.data.text import (
        TextClassificationData,
        encode_labels,
        load_tokenizer,
        read_table,
        resolve_label_names,
        tokenize,
        tokenizer_fingerprint,
    )

_LAZY = {
    "AudioClassificationData": "torchloom.data.audio",
    "LogMelSpectrogram": "torchloom.data.audio",
    "audio_fingerprint": "torchloom.data.audio",
    "build_feature_extractor": "torchloom.data.audio",
    "extract_features": "torchloom.data.audio",
    "feature_extractor_fingerprint": "torchloom.data.audio",
    "fix_length": "torchloom.data.audio",
    "read_audio": "torchloom.data.audio",
    "read_audio_folder": "torchloom.data.audio",
    "resample": "torchloom.data.audio",
    "DatasetCache": "torchloom.data.cache",
    "cache_key": "torchloom.data.cache",
    "default_cache_dir": "torchloom.data.cache",
    "fingerprint": "torchloom.data.cache",
    "ImageAugmentation": "torchloom.data.image",
    "ImageClassificationData": "torchloom.data.image",
    "ImageTransform": "torchloom.data.image",
    "image_data_fingerprint": "torchloom.data.image",
    "image_table": "torchloom.data.image",
    "load_image": "torchloom.data.image",
    "load_image_processor": "torchloom.data.image",
    "preprocess_images": "torchloom.data.image",
    "random_crop": "torchloom.data.image",
    "random_horizontal_flip": "torchloom.data.image",
    "read_image_folder": "torchloom.data.image",
    "TextClassificationData": "torchloom.data.text",
    "encode_labels": "torchloom.data.text",
    "load_tokenizer": "torchloom.data.text",
    "read_table": "torchloom.data.text",
    "resolve_label_names": "torchloom.data.text",
    "tokenize": "torchloom.data.text",
    "tokenizer_fingerprint": "torchloom.data.text",
}

__all__ = [
    "AudioClassificationData",
    "DataModule",
    "DatasetCache",
    "ImageAugmentation",
    "ImageClassificationData",
    "ImageTransform",
    "LogMelSpectrogram",
    "TextClassificationData",
    "audio_fingerprint",
    "build_feature_extractor",
    "cache_key",
    "default_cache_dir",
    "encode_labels",
    "extract_features",
    "feature_extractor_fingerprint",
    "fingerprint",
    "fix_length",
    "image_data_fingerprint",
    "image_table",
    "load_image",
    "load_image_processor",
    "load_tokenizer",
    "preprocess_images",
    "random_crop",
    "random_horizontal_flip",
    "read_audio",
    "read_audio_folder",
    "read_image_folder",
    "read_table",
    "resample",
    "resolve_label_names",
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
