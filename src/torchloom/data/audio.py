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
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import numpy as np
import pandas as pd
import torch
import transformers
from torch.utils.data import DataLoader

from torchloom.data.cache import DatasetCache, cache_key, fingerprint
from torchloom.data.module import DataModule
from torchloom.data.text import encode_labels, read_table, resolve_label_names
from torchloom.errors import ConfigError

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

logger = logging.getLogger(__name__)

#: The sample rates `resample` accepts, in Hz (inclusive): below 1 kHz or above 768 kHz a rate is a mistake.
SAMPLE_RATE_RANGE = (1_000, 768_000)
#: soxr's quality settings, fastest first.
RESAMPLE_QUALITIES = ("QQ", "LQ", "MQ", "HQ", "VHQ")
#: The metadata file an audio folder holds.
METADATA_FILE = "metadata.csv"

AudioSource: TypeAlias = str | os.PathLike[str] | pd.DataFrame | datasets.Dataset
_INSTALL = "install them with: pip install 'torchloom[audio]'"


def _soundfile() -> Any:
    try:
        import soundfile
    except ImportError:
        raise ConfigError(f"decoding audio needs the 'soundfile' package; {_INSTALL}") from None
    return soundfile


def _soxr() -> Any:
    try:
        import soxr
    except ImportError:
        raise ConfigError(f"resampling audio needs the 'soxr' package; {_INSTALL}") from None
    return soxr


# ------------------------------------------------------------------------------------------- decoding


def read_audio(source: Any, name: str = "audio") -> tuple[np.ndarray, int]:
    """Decode one clip to mono float32 samples with `soundfile`.

    Args:
        source: a path (`str` or `os.PathLike`), the file's `bytes`, or a ``{"bytes": ..., "path": ...}`` dict as
            a ``datasets.Audio(decode=False)`` column holds (the bytes are used when present).
        name (`str`, defaults to ``"audio"``): what to call the clip in error messages when it has no path.

    Returns:
        ``(samples, sample_rate)``: a 1-D `numpy.ndarray` of float32 (integer PCM scaled to [-1, 1); several
        channels averaged into one) and the file's sample rate in Hz.

    Raises:
        ConfigError: the file does not exist, cannot be decoded (not audio, an unsupported format, a broken
            header), is truncated (a WAV whose data chunk is shorter than its header says, a FLAC cut short),
            holds no samples or non-finite ones, or declares a sample rate of 0. The message names the file.
    """
    if isinstance(source, Mapping):
        data, path = source.get("bytes"), source.get("path")
        source = data if data else path
        if source is None:
            raise ConfigError(f"{name}: an audio value with neither bytes nor a path")
        if isinstance(source, bytes):
            name = f"{name} ({path})" if path else name
    if isinstance(source, bytes):
        what, raw, size = name, source, len(source)
        opened: Any = io.BytesIO(source)
    elif isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        what = f"audio file '{path}'"
        if not path.is_file():
            raise ConfigError(f"{what} does not exist" if not path.exists() else f"{what} is not a file")
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 16)  # the header: enough for the WAV checks below
        except OSError as exc:
            raise ConfigError(f"{what} cannot be read: {exc.strerror or exc}") from None
        opened = str(path)
        size = path.stat().st_size
    else:
        raise ConfigError(f"{name}: got a {type(source).__name__}; expected a file path, bytes or an Audio dict")
    _check_wav_header(raw, size, what)
    soundfile = _soundfile()
    try:
        with soundfile.SoundFile(opened) as f:
            declared, rate = f.frames, f.samplerate
            samples = f.read(dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError, ValueError) as exc:
        reason = str(exc).replace(f"Error opening {opened!r}: ", "").strip() or type(exc).__name__
        raise ConfigError(
            f"{what} cannot be decoded ({reason}); expected a WAV, FLAC or other libsndfile format"
        ) from None
    if len(samples) < declared:
        raise ConfigError(f"{what} is truncated: its header declares {declared} frames, {len(samples)} could be read")
    if len(samples) == 0:
        raise ConfigError(f"{what} holds no samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if not np.isfinite(mono).all():
        raise ConfigError(f"{what} holds NaN or infinite samples")
    return np.ascontiguousarray(mono, dtype=np.float32), int(rate)


def _check_wav_header(raw: bytes, size: int, what: str) -> None:
    """Catch what libsndfile lets through in a RIFF/WAVE file: a data chunk cut short (it silently reads fewer
    frames) and a sample rate of 0 (it refuses the file with an unhelpful message)."""
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        return
    offset = 12
    while offset + 8 <= len(raw):
        chunk, length = raw[offset : offset + 4], struct.unpack("<I", raw[offset + 4 : offset + 8])[0]
        if chunk == b"fmt " and offset + 16 <= len(raw):
            rate = struct.unpack("<I", raw[offset + 12 : offset + 16])[0]
            if rate == 0:
                raise ConfigError(
                    f"{what} has sample rate 0 Hz, which cannot be resampled; expected a rate from "
                    f"{SAMPLE_RATE_RANGE[0]} to {SAMPLE_RATE_RANGE[1]} Hz"
                )
        if chunk == b"data":
            available = size - (offset + 8)
            if length not in (0, 0xFFFFFFFF) and length > available:  # 0 / 0xFFFFFFFF: a stream of unknown length
                raise ConfigError(
                    f"{what} is truncated: its header declares {length} bytes of audio, the file holds {available}"
                )
            return
        offset += 8 + length + (length & 1)


# ----------------------------------------------------------------------------------------- resampling


def _check_rate(rate: Any, what: str, target: int | None = None) -> int:
    low, high = SAMPLE_RATE_RANGE
    valid = not isinstance(rate, bool) and isinstance(rate, int | float | np.integer | np.floating)
    if not valid or not np.isfinite(rate) or rate != int(rate) or not low <= rate <= high:
        to = f" to {target} Hz" if target is not None else ""
        raise ConfigError(
            f"{what} has sample rate {rate!r} Hz, which cannot be resampled{to}; expected an integer from "
            f"{low} to {high} Hz"
        )
    return int(rate)


def resample(
    waveform: np.ndarray, orig_rate: int, target_rate: int, quality: str = "VHQ", name: str = "audio"
) -> np.ndarray:
    """Resample a 1-D float signal from ``orig_rate`` to ``target_rate`` with `soxr` (the SoX resampler).

    soxr filters with a linear-phase, band-limited filter: content below the lower Nyquist frequency keeps its
    frequency and amplitude, content above it is removed rather than aliased. The output has
    ``ceil(len(waveform) * target_rate / orig_rate)`` samples; equal rates return the input unchanged.

    Args:
        waveform (`numpy.ndarray`): 1-D float32 or float64 samples.
        orig_rate (`int`): its sample rate, in Hz.
        target_rate (`int`): the rate wanted, in Hz.
        quality (`str`, defaults to ``"VHQ"``): soxr's ``"QQ"``, ``"LQ"``, ``"MQ"``, ``"HQ"`` or ``"VHQ"``.
        name (`str`, defaults to ``"audio"``): what to call the signal in error messages (e.g. the file).

    Returns:
        `numpy.ndarray`: float32.

    Raises:
        ConfigError: a rate that is not an integer from 1 kHz to 768 kHz (names ``name`` and the rate), or an
            unknown ``quality``.
    """
    target_rate = _check_rate(target_rate, "the target", None)
    orig_rate = _check_rate(orig_rate, name, target_rate)
    if quality not in RESAMPLE_QUALITIES:
        raise ConfigError(f"resample: quality={quality!r}; expected one of {', '.join(RESAMPLE_QUALITIES)}")
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if orig_rate == target_rate:
        return waveform
    return np.asarray(_soxr().resample(waveform, orig_rate, target_rate, quality=quality), dtype=np.float32)


def fix_length(waveform: np.ndarray, num_samples: int) -> np.ndarray:
    """Return the first ``num_samples`` samples of ``waveform``, padded with zeros at the end if it is shorter."""
    if len(waveform) >= num_samples:
        return waveform[:num_samples]
    return np.pad(waveform, (0, num_samples - len(waveform)))


# ------------------------------------------------------------------------------------------- features


@dataclasses.dataclass
class LogMelSpectrogram:
    """A log-mel spectrogram, computed with `transformers.audio_utils` (no torchaudio, no librosa).

    Frames of ``n_fft`` samples under a periodic Hann window, every ``hop_length`` samples (centred, reflect
    padding: ``1 + num_samples // hop_length`` frames); the power spectrum is mapped to ``n_mels`` Slaney-style
    mel bands from ``f_min`` to ``f_max`` and converted to decibels, floored at -100 dB (power 1e-10).

    Args:
        sampling_rate (`int`, defaults to 16000): the input's rate, in Hz.
        n_mels (`int`, defaults to 40): mel bands.
        n_fft (`int`, defaults to 400): frame and FFT length (25 ms at 16 kHz).
        hop_length (`int`, defaults to 160): samples between frames (10 ms at 16 kHz).
        f_min (`float`, defaults to 20.0): lowest band edge, in Hz.
        f_max (`float`, *optional*): highest band edge, in Hz; defaults to ``sampling_rate / 2``.

    Called like a transformers feature extractor: ``extractor(list_of_waveforms, sampling_rate=...)`` returns
    ``{"input_features": array of shape (batch, n_mels, frames)}``, float32, in dB (values from -100 up; a
    full-scale sine gives about +40 dB at its band).
    """

    sampling_rate: int = 16000
    n_mels: int = 40
    n_fft: int = 400
    hop_length: int = 160
    f_min: float = 20.0
    f_max: float | None = None

    model_input_names = ("input_features",)

    def __post_init__(self) -> None:
        for field in ("n_mels", "n_fft", "hop_length"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"LogMelSpectrogram: {field}={value!r}; expected a positive integer")
        self.sampling_rate = _check_rate(self.sampling_rate, "LogMelSpectrogram")
        nyquist = self.sampling_rate / 2
        f_max = nyquist if self.f_max is None else self.f_max
        if not 0 <= self.f_min < f_max <= nyquist:
            raise ConfigError(
                f"LogMelSpectrogram: f_min={self.f_min!r}, f_max={self.f_max!r}; expected 0 <= f_min < f_max <= "
                f"{nyquist:g} (half the sampling rate)"
            )
        if self.n_mels > self.n_fft // 2 + 1:
            raise ConfigError(
                f"LogMelSpectrogram: n_mels={self.n_mels} is more than the {self.n_fft // 2 + 1} frequency bins "
                f"of n_fft={self.n_fft}"
            )
        from transformers.audio_utils import mel_filter_bank, window_function

        self._window = window_function(self.n_fft, "hann")
        self._mel = mel_filter_bank(
            num_frequency_bins=self.n_fft // 2 + 1,
            num_mel_filters=self.n_mels,
            min_frequency=float(self.f_min),
            max_frequency=float(f_max),
            sampling_rate=self.sampling_rate,
            norm="slaney",
            mel_scale="slaney",
        )

    def __call__(
        self, waveforms: Sequence[np.ndarray], sampling_rate: int | None = None, **kwargs: Any
    ) -> dict[str, np.ndarray]:
        from transformers.audio_utils import spectrogram_batch

        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ConfigError(
                f"LogMelSpectrogram: got audio at {sampling_rate} Hz; it was built for {self.sampling_rate} Hz"
            )
        specs = spectrogram_batch(
            [np.asarray(w, dtype=np.float32) for w in waveforms],
            self._window,
            frame_length=self.n_fft,
            hop_length=self.hop_length,
            power=2.0,
            mel_filters=self._mel,
            log_mel="dB",
            min_value=1e-10,
        )
        return {"input_features": np.stack(specs).astype(np.float32)}

    def to_dict(self) -> dict[str, Any]:
        """The settings (what `feature_extractor_fingerprint` hashes)."""
        return {"feature_extractor_type": type(self).__name__, **dataclasses.asdict(self)}


class _Waveform:
    """The ``"waveform"`` features: the samples themselves, as ``input_values`` of shape (batch, samples)."""

    model_input_names = ("input_values",)

    def __init__(self, sampling_rate: int = 16000) -> None:
        self.sampling_rate = _check_rate(sampling_rate, "features='waveform'")

    def __call__(self, waveforms: Sequence[np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
        return {"input_values": np.stack([np.asarray(w, dtype=np.float32) for w in waveforms])}

    def to_dict(self) -> dict[str, Any]:
        return {"feature_extractor_type": "waveform", "sampling_rate": self.sampling_rate}


def build_feature_extractor(
    features: str | os.PathLike[str] | Any = "log_mel",
    sample_rate: int | None = None,
    **feature_args: Any,
) -> Any:
    """Return the feature extractor that ``features`` names.

    Args:
        features: one of

            - ``"log_mel"``: a `LogMelSpectrogram` built with ``feature_args`` (``n_mels``, ``n_fft``,
              ``hop_length``, ``f_min``, ``f_max``);
            - ``"waveform"``: the padded samples, as ``input_values``;
            - the name of a transformers feature extractor class (``"WhisperFeatureExtractor"``,
              ``"ASTFeatureExtractor"``, ``"Wav2Vec2FeatureExtractor"``, ...), built from ``feature_args``;
            - a local directory with a ``preprocessor_config.json`` (`transformers.AutoFeatureExtractor`);
            - an extractor object (returned as is).
        sample_rate (`int`, *optional*): the model's rate, in Hz. ``None``: the extractor's own
            ``sampling_rate`` (16000 for ``"log_mel"`` / ``"waveform"``).
        **feature_args: the extractor's constructor arguments.

    Returns:
        A callable ``extractor(list_of_waveforms, sampling_rate=...)`` returning a dict of arrays, with a
        ``sampling_rate`` attribute and ``to_dict()``.

    Raises:
        ConfigError: an unknown name, arguments the class does not take, a directory without a feature
            extractor, or a ``sample_rate`` that differs from the extractor's ``sampling_rate``.
    """
    if not isinstance(features, str | os.PathLike):
        extractor = features
    elif features in ("log_mel", "waveform"):
        if sample_rate is not None:
            feature_args.setdefault("sampling_rate", sample_rate)
        maker: Callable[..., Any] = LogMelSpectrogram if features == "log_mel" else _Waveform
        try:
            extractor = maker(**feature_args)
        except TypeError as exc:
            raise ConfigError(f"features={features!r}: {_reason(exc)}") from None
    elif Path(features).expanduser().is_dir():
        path = Path(features).expanduser()
        try:
            extractor = transformers.AutoFeatureExtractor.from_pretrained(str(path), **feature_args)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"features directory '{path}' holds no loadable feature extractor ({_reason(exc)}); expected a "
                "preprocessor_config.json"
            ) from None
    else:
        name = os.fspath(features)
        cls = getattr(transformers, name, None) if name.isidentifier() else None
        base = transformers.SequenceFeatureExtractor
        if not (isinstance(cls, type) and issubclass(cls, base)):
            if not name.isidentifier() or "/" in name or os.sep in name:
                raise ConfigError(f"features directory '{Path(name).expanduser()}' does not exist")
            raise ConfigError(
                f"features={name!r} is not a transformers audio feature extractor; expected 'log_mel', 'waveform', "
                "a class such as 'WhisperFeatureExtractor' or 'ASTFeatureExtractor', or a directory"
            )
        if sample_rate is not None:
            feature_args.setdefault("sampling_rate", sample_rate)
        try:
            extractor = cls(**feature_args)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"features={name!r} with feature_args {feature_args}: {_reason(exc)}") from None
    rate = getattr(extractor, "sampling_rate", None)
    if sample_rate is not None and rate != sample_rate:
        raise ConfigError(
            f"sample_rate={sample_rate} but the feature extractor expects {rate} Hz; set one of them to match"
        )
    if rate is None or not callable(extractor):
        raise ConfigError(f"features: {type(extractor).__name__} is not a feature extractor (no sampling_rate)")
    return extractor


def feature_extractor_fingerprint(extractor: Any) -> str:
    """Return a hash of an extractor's class and full configuration (``to_dict()``), for a `cache_key`."""
    if isinstance(extractor, LogMelSpectrogram | _Waveform):
        config: Any = extractor.to_dict()
    elif hasattr(extractor, "to_json_string"):  # transformers: arrays become lists, private state is dropped
        config = json.loads(extractor.to_json_string())
    else:
        raise ConfigError(f"features: cannot fingerprint a {type(extractor).__name__}; it needs to_json_string()")
    return cache_key(feature_extractor=type(extractor).__qualname__, config=config)


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# ------------------------------------------------------------------------------------------------ tables


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


def _require_column(dataset: datasets.Dataset, column: str, setting: str, name: str) -> None:
    if column not in dataset.column_names:
        raise ConfigError(
            f"{name}: {setting} {column!r} is not a column; the columns are {', '.join(dataset.column_names)}"
        )


def _resolve(value: Any, base: Path | None, row: int, column: str, name: str) -> Any:
    """One audio-column value as what `read_audio` takes (a path made absolute against ``base``)."""
    if isinstance(value, str | os.PathLike):
        path = Path(value).expanduser()
        return path if base is None or path.is_absolute() else base / path
    if isinstance(value, Mapping):
        if value.get("array") is not None:
            return value
        if value.get("bytes") or value.get("path"):
            if value.get("bytes"):
                return value
            return {"bytes": None, "path": _resolve(value["path"], base, row, column, name)}
    if value is None:
        raise ConfigError(f"{name}: audio_column {column!r} has a missing value in row {row}; every row needs a clip")
    raise ConfigError(
        f"{name}: audio_column {column!r} row {row} holds a {type(value).__name__}; expected a file path, an "
        "Audio(decode=False) {'bytes', 'path'} dict or an {'array', 'sampling_rate'} dict"
    )


def _decode(value: Any, row: int, column: str, name: str) -> tuple[np.ndarray, Any, str]:
    """``(samples, rate, what)`` of a resolved audio value (the rate not yet checked); ``what`` names it in errors."""
    if isinstance(value, Mapping) and value.get("array") is not None:
        what = f"{name}: audio_column {column!r} row {row}"
        array = np.asarray(value["array"], dtype=np.float32)
        if array.ndim == 2:  # (channels, samples), as datasets' Audio feature decodes several channels
            array = array.mean(axis=0)
        if array.ndim != 1 or array.size == 0 or not np.isfinite(array).all():
            raise ConfigError(f"{what}: expected a non-empty 1-D array of finite samples, got shape {array.shape}")
        return array, value.get("sampling_rate"), what
    samples, rate = read_audio(value, name=f"{name}: audio_column {column!r} row {row}")
    if isinstance(value, Mapping):
        path = value.get("path")
        what = f"audio file '{path}'" if path else f"{name}: audio_column {column!r} row {row}"
    else:
        what = f"audio file '{value}'"
    return samples, rate, what


def audio_fingerprint(table: datasets.Dataset, column: str, base: Path | None = None, name: str = "data") -> str:
    """Return a hash of a table and of the content of every clip its ``column`` names, for a `cache_key`.

    The table is hashed as `fingerprint` does (its rows, as written: moving the folder keeps the hash); each
    clip enters by its bytes (or its samples and rate, for an ``{"array", "sampling_rate"}`` value), in row
    order. Editing one byte of one clip, or of the table, changes the hash.

    Raises:
        ConfigError: ``column`` is missing, a value is missing or of the wrong kind, or a named file does not
            exist or cannot be read (names it).
    """
    _require_column(table, column, "audio_column", name)
    digest = hashlib.sha256(fingerprint(table).encode())
    seen: dict[Path, str] = {}
    for row, value in enumerate(table[column]):
        value = _resolve(value, base, row, column, name)
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


def extract_features(
    dataset: datasets.Dataset,
    extractor: Any,
    audio_column: str = "file_name",
    max_duration: float = 1.0,
    base_dir: str | os.PathLike[str] | None = None,
    keep_columns: Sequence[str] = ("labels",),
    resample_quality: str = "VHQ",
    batch_size: int = 64,
    name: str = "data",
) -> datasets.Dataset:
    """Decode, resample, pad / truncate and featurise every clip with a batched `datasets.Dataset.map`.

    Args:
        dataset (`datasets.Dataset`): the table.
        extractor: from `build_feature_extractor`; its ``sampling_rate`` is the rate every clip is resampled to.
        audio_column (`str`, defaults to ``"file_name"``): file paths (relative ones start at ``base_dir``),
            ``{"bytes", "path"}`` dicts or ``{"array", "sampling_rate"}`` dicts.
        max_duration (`float`, defaults to 1.0): seconds per clip: longer clips keep their start, shorter ones
            are padded with zeros at the end (``round(max_duration * sampling_rate)`` samples).
        base_dir (*optional*): where relative paths start; ``None``: the current directory.
        keep_columns (`Sequence[str]`, defaults to ``("labels",)``): columns kept next to the features.
        resample_quality (`str`, defaults to ``"VHQ"``): soxr's quality (`resample`).
        batch_size (`int`, defaults to 64): clips per extractor call.
        name (`str`, defaults to ``"data"``): what to call the table in error messages.

    Returns:
        `datasets.Dataset`: the extractor's outputs (``input_features`` of shape ``(n_mels, frames)`` for
        ``"log_mel"``; ``input_values`` of shape ``(samples,)`` for ``"waveform"``; whatever a transformers
        extractor returns), fixed-shape float32 arrays, plus ``keep_columns``; in memory.

    Raises:
        ConfigError: a missing column; a clip that is missing, unreadable, truncated or empty; a sample rate that
            cannot be resampled (each names the file or row).
    """
    _require_column(dataset, audio_column, "audio_column", name)
    rate = _check_rate(extractor.sampling_rate, "the feature extractor")
    if isinstance(max_duration, bool) or not isinstance(max_duration, int | float) or not max_duration > 0:
        raise ConfigError(f"{name}: max_duration={max_duration!r}; expected a positive number of seconds")
    num_samples = max(1, round(max_duration * rate))
    base = Path(base_dir).expanduser() if base_dir is not None else None

    # One silent clip shows the output's names, shapes and dtypes: the stored columns get fixed-shape types.
    probe = extractor([np.zeros(num_samples, dtype=np.float32)], sampling_rate=rate, return_tensors="np")
    outputs = {key: np.asarray(value)[0] for key, value in probe.items()}
    kept = [c for c in keep_columns if c in dataset.column_names]
    features = datasets.Features({c: dataset.features[c] for c in kept})
    for key, value in outputs.items():
        dtype = "float32" if np.issubdtype(value.dtype, np.floating) else str(value.dtype)
        if value.ndim == 1:
            features[key] = datasets.List(datasets.Value(dtype), length=value.shape[0])
        elif value.ndim == 2:
            features[key] = datasets.Array2D(shape=value.shape, dtype=dtype)
        elif value.ndim == 3:
            features[key] = datasets.Array3D(shape=value.shape, dtype=dtype)
        else:
            raise ConfigError(f"features: output {key!r} has {value.ndim} dimensions per clip; expected 1 to 3")

    def featurise(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, Any]:
        clips = []
        for row, value in zip(indices, batch[audio_column]):
            samples, clip_rate, what = _decode(_resolve(value, base, row, audio_column, name), row, audio_column, name)
            clip_rate = _check_rate(clip_rate, what, rate)
            clips.append(fix_length(resample(samples, clip_rate, rate, resample_quality, what), num_samples))
        out = extractor(clips, sampling_rate=rate, return_tensors="np")
        result: dict[str, Any] = {c: batch[c] for c in kept}
        for key, reference in outputs.items():
            value = np.asarray(out[key])
            result[key] = value.astype(np.float32) if np.issubdtype(value.dtype, np.floating) else value
            if value.shape[1:] != reference.shape:
                raise ConfigError(
                    f"features: output {key!r} has shape {value.shape[1:]} for {name} rows {indices[0]}.."
                    f"{indices[-1]}, {reference.shape} for a {max_duration} s clip; the extractor must give every "
                    "clip one shape"
                )
        return result

    return dataset.map(
        featurise,
        with_indices=True,
        batched=True,
        batch_size=batch_size,
        remove_columns=dataset.column_names,
        features=features,
        keep_in_memory=True,
        load_from_cache_file=False,
        # torchloom's own cache key, not datasets' fingerprint of `featurise`, decides what is reused.
        new_fingerprint=datasets.fingerprint.generate_random_fingerprint(),
        desc=f"Decoding {name}",
    )


# ------------------------------------------------------------------------------------------- DataModule


class AudioClassificationData(DataModule):
    """Audio classification data: clips decoded, resampled, cut to one length and featurised, labels as classes.

    ``prepare_data`` reads each split's table (`read_audio_folder`), encodes the labels (`encode_labels`: a
    `datasets.ClassLabel` column named ``labels``), computes the features (`extract_features`) and saves the
    splits with ``save_to_disk`` in the processed-dataset cache, under a key that hashes the tables, the bytes of
    every clip and every setting below that shapes the result (`cache_settings`); a second run with the same
    inputs loads them instead (``cache_hit`` says which happened). ``setup`` loads the splits (memory-mapped)
    and takes the ``max_*_samples`` subsets. Every clip has the same shape, so batches are plain stacks.

    Args:
        train: the training clips: an audio folder (a directory with ``metadata.csv``), a metadata table file,
            a `pandas.DataFrame` or a `datasets.Dataset` (see `read_audio_folder`).
        validation (*optional*): the validation clips, same kinds.
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
        train_dataset, val_dataset (`datasets.Dataset` or ``None``): after ``setup``: the processed splits, in
            torch format.

    Raises:
        ConfigError: a bad setting (names it, its value and what is valid); and, from ``prepare_data``, a
            missing path, column or clip, an empty split, labels of the wrong type, an unreadable or truncated
            clip, a sample rate that cannot be resampled (each names the file or column).
    """

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
        for setting, value in (("audio_column", audio_column), ("label_column", label_column)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{cls}: {setting}={value!r}; expected a column name")
        if label_names is not None:
            if (
                isinstance(label_names, str)
                or not all(isinstance(n, str) for n in label_names)
                or len(set(label_names)) != len(label_names)
                or len(label_names) < 2
            ):
                raise ConfigError(f"{cls}: label_names={label_names!r}; expected a list of 2 or more distinct strings")
            label_names = list(label_names)
        low, high = SAMPLE_RATE_RANGE
        if sample_rate is not None and (
            isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not low <= sample_rate <= high
        ):
            raise ConfigError(f"{cls}: sample_rate={sample_rate!r}; expected an integer from {low} to {high} Hz")
        if isinstance(max_duration, bool) or not isinstance(max_duration, int | float) or not 0 < max_duration < 3600:
            raise ConfigError(f"{cls}: max_duration={max_duration!r}; expected a number of seconds > 0 (and < 3600)")
        if resample_quality not in RESAMPLE_QUALITIES:
            raise ConfigError(
                f"{cls}: resample_quality={resample_quality!r}; expected one of {', '.join(RESAMPLE_QUALITIES)}"
            )
        if feature_args is not None and not isinstance(feature_args, Mapping):
            raise ConfigError(f"{cls}: feature_args={feature_args!r}; expected a mapping of argument names to values")
        optional = {
            "eval_batch_size": eval_batch_size,
            "max_train_samples": max_train_samples,
            "max_val_samples": max_val_samples,
        }
        for setting, count in [("batch_size", batch_size), *((k, v) for k, v in optional.items() if v is not None)]:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"{cls}: {setting}={count!r}; expected a positive integer")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"{cls}: num_workers={num_workers!r}; expected an integer >= 0")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{cls}: seed={seed!r}; expected an integer")
        self.train, self.validation = train, validation
        self.audio_column, self.label_column, self.label_names_setting = audio_column, label_column, label_names
        self.sample_rate_setting, self.max_duration = sample_rate, float(max_duration)
        self.features, self.feature_args = features, dict(feature_args or {})
        self.resample_quality = resample_quality
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.max_train_samples, self.max_val_samples = max_train_samples, max_val_samples
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        # Built here, so that a bad `features` / `feature_args` / `sample_rate` fails before any data is read.
        self.feature_extractor = build_feature_extractor(features, sample_rate, **self.feature_args)
        self.sample_rate: int = int(self.feature_extractor.sampling_rate)
        self.cache = DatasetCache(Path(cache_dir).expanduser() if cache_dir is not None else None)
        self.cache_hit: bool | None = None
        self.cache_path: Path | None = None
        self.label_names: list[str] = []
        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self._tables: dict[str, tuple[datasets.Dataset, Path | None]] = {}
        self._key: str | None = None
        self._settings: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- steps

    def sources(self) -> dict[str, AudioSource]:
        """Return the raw sources by split (``"train"``, ``"validation"``). Override to produce them in code.

        Raises:
            ConfigError: no training source.
        """
        if self.train is None:
            raise ConfigError(f"{type(self).__name__}: train=None; expected the training clips (a folder or a table)")
        splits: dict[str, AudioSource] = {"train": self.train}
        if self.validation is not None:
            splits["validation"] = self.validation
        return splits

    def _table(self, split: str, source: AudioSource) -> tuple[datasets.Dataset, Path | None]:
        if split not in self._tables:
            self._tables[split] = read_audio_folder(source, f"{type(self).__name__} {split} data")
        return self._tables[split]

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
        import soundfile

        data, names = {}, self.label_names_setting
        for split, source in self.sources().items():  # "train" first: it fixes the label names, as in `_build`
            table, base = self._table(split, source)
            where = f"{type(self).__name__} {split} data"
            data[split] = audio_fingerprint(table, self.audio_column, base, where)
            names = resolve_label_names(table, self.label_column, names, where)
        return {
            "kind": "torchloom.data.audio.AudioClassificationData",
            "data": data,
            "audio_column": self.audio_column,
            "label_column": self.label_column,
            "label_names": self.label_names_setting,
            "classes": list(names or []),
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
                "soxr": _soxr().__version__,
            },
        }

    def prepare_data(self) -> None:
        """Decode and featurise the splits and save them to the cache, or find them already there."""
        settings = self.cache_settings()
        self._key = key = cache_key(**settings)
        self._settings = settings
        self.cache_path = self.cache.path(key)
        if key in self.cache:
            self.cache.check(key, settings)  # an entry under this key built from other settings is refused
            self.cache_hit = True
            logger.info("%s: loading the processed splits from %s", type(self).__name__, self.cache_path)
            return
        self.cache_hit = False
        logger.info("%s: decoding and featurising; the result goes to %s", type(self).__name__, self.cache_path)
        self.cache.save(key, self._build(), settings=settings)

    def _build(self) -> datasets.DatasetDict:
        names = self.label_names_setting
        processed = {}
        for split, source in self.sources().items():  # "train" first: it fixes the label names
            where = f"{type(self).__name__} {split} data"
            table, base = self._table(split, source)
            table = encode_labels(table, self.label_column, names, where)
            names = table.features["labels"].names
            processed[split] = extract_features(
                table,
                self.feature_extractor,
                self.audio_column,
                self.max_duration,
                base,
                ("labels",),
                self.resample_quality,
                name=where,
            )
        return datasets.DatasetDict(processed)

    def setup(self, stage: str) -> None:
        """Load the processed splits from the cache and take the ``max_*_samples`` subsets."""
        if self._key is None or self._key not in self.cache:
            self.prepare_data()
        assert self._key is not None
        splits = self.cache.load(self._key, self._settings)
        self.cache_path = self.cache.path(self._key)
        self.label_names = list(splits["train"].features["labels"].names)
        self.train_dataset = self._subset(splits["train"], self.max_train_samples)
        self.val_dataset = self._subset(splits["validation"], self.max_val_samples) if "validation" in splits else None

    def _subset(self, dataset: datasets.Dataset, n: int | None) -> datasets.Dataset:
        if n is not None and n < len(dataset):
            dataset = dataset.shuffle(seed=self.seed, keep_in_memory=True).select(range(n), keep_in_memory=True)
        return dataset.with_format("torch")

    @property
    def num_labels(self) -> int:
        """The number of classes (after ``setup``)."""
        return len(self.label_names)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size``: a dict of the features (float32, e.g. ``input_features`` of shape
        ``(batch, n_mels, frames)`` for ``"log_mel"``) and ``labels`` (int64, shape ``(batch,)``)."""
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}.train_dataloader() called before setup()")
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader | None:
        """Batches of ``eval_batch_size`` in order, shaped as in `train_dataloader`; ``None`` without validation."""
        if self.val_dataset is None:
            return None
        return DataLoader(
            self.val_dataset, batch_size=self.eval_batch_size, shuffle=False, num_workers=self.num_workers
        )

    def predict_dataloader(self) -> DataLoader | None:
        """The validation clips, in order (labels included, for comparing); ``None`` without validation."""
        return self.val_dataloader()
