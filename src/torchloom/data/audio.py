"""Audio preprocessing: decode WAV / FLAC, resample, pad or truncate, compute features, encode labels, cache.

The pieces are plain functions, and `AudioClassificationData` strings them together as a `DataModule` for an
audio folder (a directory with a ``metadata.csv`` whose ``file_name`` column names each clip) or any table with
an audio column and a label column:

.. code-block:: python

    data = AudioClassificationData(
        train="clips/train", validation="clips/test",            # folders with metadata.csv: file_name,label
        sample_rate=16000, max_duration=1.0,                     # every clip: 16 kHz, exactly 1 s
        features="log_mel", feature_args={"n_mels": 40},         # or "WhisperFeatureExtractor", ...
    )
    torchloom.Engine(max_epochs=10).fit(task, datamodule=data)

- **Decoding** (`read_audio`) uses `soundfile` (libsndfile, bundled in its wheel: no system library or ffmpeg);
  it reads WAV, FLAC, OGG/Vorbis and the other formats libsndfile knows, and mixes several channels down to mono.
  The `datasets` ``Audio`` feature is not used for decoding: it needs torchcodec, whose current wheels do not load
  with CPU torch. A column cast to ``Audio(decode=False)`` (``{"bytes", "path"}`` values) is read, though.
- **Resampling** (`resample`) uses `soxr` (the SoX resampler: band-limited, linear phase, ``"VHQ"`` quality by
  default): a clip at another rate is converted to the model's rate, with aliasing suppressed.
- **Length** (`fix_length`): each clip is cut to ``max_duration`` seconds (the start is kept) or padded with
  zeros at the end, so every example has the same shape.
- **Features** (`build_feature_extractor`): ``"log_mel"``, a log-mel spectrogram computed with
  `transformers.audio_utils` (`LogMelSpectrogram`); ``"waveform"``, the samples themselves; the name of a
  transformers feature extractor class built from ``feature_args`` (``WhisperFeatureExtractor``,
  ``ASTFeatureExtractor``, ``Wav2Vec2FeatureExtractor`` ...); or a local directory holding a
  ``preprocessor_config.json``.

The processed splits are saved under a key that hashes the raw data (the table and the bytes of every clip it
names) and every setting that shapes them (see `torchloom.data.cache`), so the second run loads them instead of
decoding again.

The pieces live in one module per concern and are re-exported here: decoding and resampling in
`torchloom.data.audio_decoding`, folders and their fingerprint in `torchloom.data.audio_folders`, feature
extractors in `torchloom.data.audio_features`; `AudioClassificationData` is this module, on
`torchloom.data.base.CachedDataModule`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import transformers

from torchloom._settings import invalid
from torchloom.data.audio_decoding import (
    RESAMPLE_QUALITIES,
    SAMPLE_RATE_RANGE,
    fix_length,
    load_soundfile,
    load_soxr,
    read_audio,
    resample,
)
from torchloom.data.audio_features import (
    LogMelSpectrogram,
    build_feature_extractor,
    extract_features,
    feature_extractor_fingerprint,
)
from torchloom.data.audio_folders import METADATA_FILE as METADATA_FILE  # a constant audio.py had before the split
from torchloom.data.audio_folders import AudioSource, audio_fingerprint, read_audio_folder
from torchloom.data.base import CachedDataModule
from torchloom.data.tables import require_column, row_name, table_path

__all__ = [
    "AudioClassificationData",
    "LogMelSpectrogram",
    "audio_fingerprint",
    "build_feature_extractor",
    "extract_features",
    "feature_extractor_fingerprint",
    "fix_length",
    "read_audio",
    "read_audio_folder",
    "resample",
]


class AudioClassificationData(CachedDataModule):
    """Audio classification data: clips decoded, resampled, cut to one length and featurised, labels as classes.

    ``prepare_data`` reads each split's table (`read_audio_folder`), encodes the labels (`encode_labels`: a
    `datasets.ClassLabel` column named ``labels``), computes the features (`extract_features`) and saves the
    splits with ``save_to_disk`` in the processed-dataset cache, under a key that hashes the tables, the bytes of
    every clip and every setting below that shapes the result (`cache_settings`); a second run with the same
    inputs loads them instead (``cache_hit`` says which happened). ``setup`` loads the splits (memory-mapped)
    and takes the ``max_*_samples`` subsets. Every clip has the same shape, so batches are plain stacks.
    Batches hold the features (float32, e.g. ``input_features`` of shape ``(batch, n_mels, frames)`` for
    ``"log_mel"``) and ``labels`` (int64, ``(batch,)``). The steps are those of `CachedDataModule`; this class
    adds decoding, resampling and the feature extractor.

    Args:
        train: the training clips: an audio folder (a directory with ``metadata.csv``), a metadata table file
            (``.csv``, ``.tsv``, ``.json``, ``.jsonl``, ``.parquet``; paths relative to its folder, or absolute),
            a `pandas.DataFrame` or a `datasets.Dataset` (see `read_audio_folder`).
        validation (*optional*): the validation clips, same kinds. ``set_predict_input`` (``torchloom predict
            --input FILE``) takes a table file too, whose rows need no label (absent, or missing in some rows: -1).
        audio_column (`str`, defaults to ``"file_name"``): the clips (paths, or ``datasets.Audio(decode=False)``
            / ``{"array", "sampling_rate"}`` dicts).
        label_column (`str`, defaults to ``"label"``): the class of each clip (strings or non-negative integers).
        label_names (`list[str]`, *optional*): the class names in id order; defaults to the sorted distinct
            labels of ``train``.
        sample_rate (`int`, *optional*): the model's rate, in Hz; every clip is resampled to it. Defaults to the
            feature extractor's ``sampling_rate`` (16000 for ``"log_mel"`` and ``"waveform"``).
        max_duration (`float`, defaults to 1.0): seconds per clip (truncated at the end or padded with zeros).
        features (`str`, defaults to ``"log_mel"``): ``"log_mel"``, ``"waveform"``, a transformers feature
            extractor class name or a local directory (`build_feature_extractor`).
        feature_args (`dict`, *optional*): the extractor's arguments, e.g. ``{"n_mels": 64}`` for ``"log_mel"``
            or ``{"feature_size": 80, "chunk_length": 1}`` for ``"WhisperFeatureExtractor"``.
        resample_quality (`str`, defaults to ``"VHQ"``): soxr's quality (`resample`).
        batch_size (`int`, defaults to 32): training batch size, per process.
        eval_batch_size (`int`, *optional*): validation batch size, per process; defaults to ``batch_size``.
        max_train_samples (`int`, *optional*): use a random subset of this many training clips (drawn with
            ``seed``); the cache still holds the full split, so changing it costs nothing.
        max_val_samples (`int`, *optional*): the same for validation.
        shuffle (`bool`, defaults to True): reshuffle the training clips every epoch (under `torchloom.Engine`
            from the engine's seed).
        seed (`int`, defaults to 0): seeds the subsets (and the shuffling outside an engine).
        num_workers (`int`, defaults to 0): dataloader worker processes.
        cache_dir (`str` or `os.PathLike`, *optional*): the processed-dataset cache; defaults to
            ``$TORCHLOOM_CACHE/processed`` or ``~/.cache/torchloom/processed``.

    Attributes:
        cache_hit (`bool` or ``None``): after ``prepare_data``: whether the splits were loaded from the cache.
        cache_path (`pathlib.Path` or ``None``): the cache entry in use.
        label_names (`list[str]`): after ``setup``: the class names, in id order.
        train_dataset (`datasets.Dataset` or ``None``): after ``setup``: the processed training split, in torch
            format.
        val_dataset (`datasets.Dataset` or ``None``): the same for the validation split.

    Raises:
        ConfigError: a bad setting (names it, its value and what is valid); and, from ``prepare_data``, a
            missing path, column or clip, an empty split, labels of the wrong type, an unreadable or truncated
            clip, a sample rate that cannot be resampled (each names the file or column; for a table file, the file
            and the row: its line in a JSON lines file).
    """

    train_description = "the training clips (a folder or a table)"
    preprocessing_description = "decoding and featurising"

    def __init__(
        self,
        # Typed as paths for config files; a DataFrame or a Dataset is accepted from Python too (`AudioSource`).
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        audio_column: str = "file_name",
        label_column: str = "label",
        label_names: list[str] | None = None,
        sample_rate: int | None = None,
        max_duration: float = 1.0,
        features: str = "log_mel",
        feature_args: dict[str, Any] | None = None,
        resample_quality: str = "VHQ",
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        cls = type(self).__name__
        self.check_column("audio_column", audio_column)
        self.check_column("label_column", label_column)  # None would mean no classes: not for classification
        low, high = SAMPLE_RATE_RANGE
        if sample_rate is not None and (
            isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not low <= sample_rate <= high
        ):
            raise invalid("sample_rate", sample_rate, f"an integer from {low} to {high} Hz", owner=cls)
        if isinstance(max_duration, bool) or not isinstance(max_duration, int | float) or not 0 < max_duration < 3600:
            raise invalid("max_duration", max_duration, "a number of seconds > 0 (and < 3600)", owner=cls)
        if resample_quality not in RESAMPLE_QUALITIES:
            raise invalid("resample_quality", resample_quality, f"one of {', '.join(RESAMPLE_QUALITIES)}", owner=cls)
        if feature_args is not None and not isinstance(feature_args, Mapping):
            raise invalid("feature_args", feature_args, "a mapping of argument names to values", owner=cls)
        super().__init__(
            train,
            validation,
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
        self.audio_column = audio_column
        self.sample_rate_setting, self.max_duration = sample_rate, float(max_duration)
        self.features, self.feature_args = features, dict(feature_args or {})
        self.resample_quality = resample_quality
        # Built here, so that a bad `features` / `feature_args` / `sample_rate` fails before any data is read.
        self.feature_extractor = build_feature_extractor(features, sample_rate, **self.feature_args)
        self.sample_rate: int = int(self.feature_extractor.sampling_rate)
        self._base_dirs: dict[str, Path | None] = {}
        #: The table file each split was read from (``None``: an in-memory table), for the row in a clip's error.
        self._table_files: dict[str, Path | None] = {}

    def read_split(self, split: str, source: AudioSource) -> datasets.Dataset:
        """The table of ``split`` (`read_audio_folder`); the directory its relative paths start from is kept.

        A table read from a file (an audio folder's ``metadata.csv``, or a ``.jsonl`` / ``.json`` / ``.csv`` /
        ``.tsv`` / ``.parquet`` file) must have ``audio_column``, and every path in it must name a file (checked
        here, before anything is decoded; `torchloom.data.tables.table_path`).

        Raises:
            ConfigError: the source cannot be read; a table file without ``audio_column`` (names the file and its
                columns), or a row without a path or whose path is not a file (names the file, the row: its line in
                a JSON lines file, and what is valid).
        """
        name = self.split_name(split)
        table, self._base_dirs[split] = read_audio_folder(source, name)
        file = None
        if isinstance(source, str | os.PathLike):
            file = Path(source).expanduser()
            file = file / METADATA_FILE if file.is_dir() else file
            require_column(table, self.audio_column, "audio_column", f"{name} path '{file}'")
            for row, value in enumerate(table[self.audio_column]):
                if value is None or isinstance(value, str):
                    table_path(value, file, row, self.audio_column, "audio_column", name, "an audio file")
        self._table_files[split] = file
        return table

    def cache_settings(self) -> dict[str, Any]:
        """Return everything that determines the processed splits; its `cache_key` names the cache entry.

        Each split enters as its `audio_fingerprint` (its table and the bytes of every clip it names); the
        feature extractor as its class and full configuration (`feature_extractor_fingerprint`); then the
        sample rate, the duration, the resampler and its quality, the columns, the label names (the setting, and
        the class names in id order that the labels are encoded with: ``classes``, `resolve_label_names`) and the
        versions of the libraries that decode, resample and featurise. ``max_*_samples``, batch sizes and
        shuffling are left out: they act after the cache.

        Raises:
            ConfigError: a missing path, folder metadata, column or clip, an empty split, or labels that cannot be
                encoded.
        """
        soundfile = load_soundfile()
        data = {
            split: audio_fingerprint(
                self.table(split), self.audio_column, self._base_dirs[split], self.split_name(split)
            )
            for split in self.sources()
        }
        return {
            "kind": "torchloom.data.audio.AudioClassificationData",
            "data": data,
            "audio_column": self.audio_column,
            "label_column": self.label_column,
            "label_names": self.label_names_setting,
            "classes": self.class_names(),
            "sample_rate": self.sample_rate,
            "max_duration": self.max_duration,
            "features": feature_extractor_fingerprint(self.feature_extractor),
            "resampler": {"name": "soxr", "quality": self.resample_quality},
            "versions": {
                "datasets": datasets.__version__,
                "transformers": transformers.__version__,
                "numpy": np.__version__,
                "soundfile": soundfile.__version__,
                "libsndfile": soundfile.__libsndfile_version__,
                "soxr": load_soxr().__version__,
            },
        }

    def preprocess(self, split: str, table: datasets.Dataset) -> datasets.Dataset:
        """Decode, resample, cut and featurise every clip of ``split`` (`extract_features`), keeping ``labels``; a
        clip that cannot be decoded is named with its row in the table file it came from (``line 3`` of a
        ``.jsonl``)."""
        name, file = self.split_name(split), self._table_files.get(split)
        return extract_features(
            table,
            self.feature_extractor,
            self.audio_column,
            self.max_duration,
            self._base_dirs[split],
            ("labels",),
            self.resample_quality,
            name=name,
            row_names=(lambda row: f"{name} path '{file}': {row_name(file, row)}") if file is not None else None,
        )

    def format_split(self, dataset: datasets.Dataset) -> datasets.Dataset:
        """Every column as torch tensors."""
        return dataset.with_format("torch")
