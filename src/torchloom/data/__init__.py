"""Data for torchloom runs: `DataModule`, its cached base, text (classification, causal LM), image and audio
preprocessing, the cache.

`DataModule` is imported with ``torchloom``; the preprocessing names load `datasets` and `transformers`, so
they are imported on first use (``from torchloom.data import TextClassificationData``), not by ``import
torchloom``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchloom.data.module import DataModule

if TYPE_CHECKING:
    from torchloom.data.audio import AudioClassificationData
    from torchloom.data.audio_decoding import (
        fix_length,
        read_audio,
        resample,
    )
    from torchloom.data.audio_features import (
        LogMelSpectrogram,
        build_feature_extractor,
        extract_features,
        feature_extractor_fingerprint,
    )
    from torchloom.data.audio_folders import (
        audio_fingerprint,
        read_audio_folder,
    )
    from torchloom.data.base import CachedDataModule
    from torchloom.data.cache import (
        DatasetCache,
        cache_key,
        default_cache_dir,
        fingerprint,
    )
    from torchloom.data.causal_lm import (
        CausalLMData,
        LanguageModelingData,
        PromptCompletionData,
    )
    from torchloom.data.chat import ChatData
    from torchloom.data.image import ImageClassificationData
    from torchloom.data.image_decoding import load_image
    from torchloom.data.image_folders import (
        image_data_fingerprint,
        image_table,
        read_image_folder,
    )
    from torchloom.data.image_transforms import (
        ImageAugmentation,
        ImageTransform,
        load_image_processor,
        preprocess_images,
        random_crop,
        random_horizontal_flip,
    )
    from torchloom.data.packing import (
        CausalLMCollator,
        check_packed_attention,
        count_loss_tokens,
        pack_best_fit,
    )
    from torchloom.data.sampling import (
        LengthGroupedSampler,
        length_grouped_indices,
    )
    from torchloom.data.tables import (
        encode_labels,
        read_table,
        require_column,
        resolve_label_names,
    )
    from torchloom.data.text import (
        TextClassificationData,
        TextData,
        load_tokenizer,
        tokenize,
        tokenizer_fingerprint,
    )

_LAZY = {
    "AudioClassificationData": "torchloom.data.audio",
    "fix_length": "torchloom.data.audio_decoding",
    "read_audio": "torchloom.data.audio_decoding",
    "resample": "torchloom.data.audio_decoding",
    "LogMelSpectrogram": "torchloom.data.audio_features",
    "build_feature_extractor": "torchloom.data.audio_features",
    "extract_features": "torchloom.data.audio_features",
    "feature_extractor_fingerprint": "torchloom.data.audio_features",
    "audio_fingerprint": "torchloom.data.audio_folders",
    "read_audio_folder": "torchloom.data.audio_folders",
    "CachedDataModule": "torchloom.data.base",
    "CausalLMData": "torchloom.data.causal_lm",
    "ChatData": "torchloom.data.chat",
    "LanguageModelingData": "torchloom.data.causal_lm",
    "PromptCompletionData": "torchloom.data.causal_lm",
    "DatasetCache": "torchloom.data.cache",
    "cache_key": "torchloom.data.cache",
    "default_cache_dir": "torchloom.data.cache",
    "fingerprint": "torchloom.data.cache",
    "ImageClassificationData": "torchloom.data.image",
    "load_image": "torchloom.data.image_decoding",
    "image_data_fingerprint": "torchloom.data.image_folders",
    "image_table": "torchloom.data.image_folders",
    "read_image_folder": "torchloom.data.image_folders",
    "ImageAugmentation": "torchloom.data.image_transforms",
    "ImageTransform": "torchloom.data.image_transforms",
    "load_image_processor": "torchloom.data.image_transforms",
    "preprocess_images": "torchloom.data.image_transforms",
    "random_crop": "torchloom.data.image_transforms",
    "random_horizontal_flip": "torchloom.data.image_transforms",
    "LengthGroupedSampler": "torchloom.data.sampling",
    "length_grouped_indices": "torchloom.data.sampling",
    "encode_labels": "torchloom.data.tables",
    "read_table": "torchloom.data.tables",
    "require_column": "torchloom.data.tables",
    "resolve_label_names": "torchloom.data.tables",
    "CausalLMCollator": "torchloom.data.packing",
    "check_packed_attention": "torchloom.data.packing",
    "count_loss_tokens": "torchloom.data.packing",
    "pack_best_fit": "torchloom.data.packing",
    "TextClassificationData": "torchloom.data.text",
    "TextData": "torchloom.data.text",
    "load_tokenizer": "torchloom.data.text",
    "tokenize": "torchloom.data.text",
    "tokenizer_fingerprint": "torchloom.data.text",
}

__all__ = [
    "AudioClassificationData",
    "CachedDataModule",
    "CausalLMCollator",
    "CausalLMData",
    "ChatData",
    "DataModule",
    "DatasetCache",
    "ImageAugmentation",
    "ImageClassificationData",
    "ImageTransform",
    "LanguageModelingData",
    "LengthGroupedSampler",
    "LogMelSpectrogram",
    "PromptCompletionData",
    "TextClassificationData",
    "TextData",
    "audio_fingerprint",
    "build_feature_extractor",
    "cache_key",
    "check_packed_attention",
    "count_loss_tokens",
    "default_cache_dir",
    "encode_labels",
    "extract_features",
    "feature_extractor_fingerprint",
    "fingerprint",
    "fix_length",
    "image_data_fingerprint",
    "image_table",
    "length_grouped_indices",
    "load_image",
    "load_image_processor",
    "load_tokenizer",
    "pack_best_fit",
    "preprocess_images",
    "random_crop",
    "random_horizontal_flip",
    "read_audio",
    "read_audio_folder",
    "read_image_folder",
    "read_table",
    "require_column",
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
