"""Audio decoding: one clip to mono float32 samples (`soundfile`), resampled (`soxr`), cut or padded to a length.

`read_audio` decodes WAV, FLAC, OGG and the other libsndfile formats (no ffmpeg, no torchcodec) and names the file
in every error; `resample` converts the rate with the SoX resampler; `fix_length` cuts or pads. `decode_clip` reads
one value of a table's audio column (a path, an ``Audio(decode=False)`` dict or an ``{"array", "sampling_rate"}``
dict). Part of `torchloom.data.audio`.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from torchloom._settings import invalid
from torchloom.errors import ConfigError

__all__ = ["fix_length", "read_audio", "resample"]

#: The sample rates `resample` accepts, in Hz (inclusive): below 1 kHz or above 768 kHz a rate is a mistake.
SAMPLE_RATE_RANGE = (1_000, 768_000)

#: soxr's quality settings, fastest first.
RESAMPLE_QUALITIES = ("QQ", "LQ", "MQ", "HQ", "VHQ")

_INSTALL = "install them with: pip install 'torchloom[audio]'"


def load_soundfile() -> Any:
    """Import `soundfile`, or raise a `ConfigError` with the install line."""
    try:
        import soundfile
    except ImportError:
        raise ConfigError(f"decoding audio needs the 'soundfile' package; {_INSTALL}") from None
    return soundfile


def load_soxr() -> Any:
    """Import `soxr`, or raise a `ConfigError` with the install line."""
    try:
        import soxr
    except ImportError:
        raise ConfigError(f"resampling audio needs the 'soxr' package; {_INSTALL}") from None
    return soxr


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
    soundfile = load_soundfile()
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


def check_rate(rate: Any, what: str, target: int | None = None) -> int:
    """Return ``rate`` as an int, or raise a `ConfigError` naming ``what`` if it is not a rate `resample` takes."""
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
    target_rate = check_rate(target_rate, "the target", None)
    orig_rate = check_rate(orig_rate, name, target_rate)
    if quality not in RESAMPLE_QUALITIES:
        raise invalid("quality", quality, f"one of {', '.join(RESAMPLE_QUALITIES)}", owner="resample")
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if orig_rate == target_rate:
        return waveform
    return np.asarray(load_soxr().resample(waveform, orig_rate, target_rate, quality=quality), dtype=np.float32)


def fix_length(waveform: np.ndarray, num_samples: int) -> np.ndarray:
    """Return the first ``num_samples`` samples of ``waveform``, padded with zeros at the end if it is shorter."""
    if len(waveform) >= num_samples:
        return waveform[:num_samples]
    return np.pad(waveform, (0, num_samples - len(waveform)))


def resolve_clip(value: Any, base: Path | None, row: int, column: str, name: str) -> Any:
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
            return {"bytes": None, "path": resolve_clip(value["path"], base, row, column, name)}
    if value is None:
        raise ConfigError(f"{name}: audio_column {column!r} has a missing value in row {row}; every row needs a clip")
    raise ConfigError(
        f"{name}: audio_column {column!r} row {row} holds a {type(value).__name__}; expected a file path, an "
        "Audio(decode=False) {'bytes', 'path'} dict or an {'array', 'sampling_rate'} dict"
    )


def decode_clip(value: Any, row: int, column: str, name: str) -> tuple[np.ndarray, Any, str]:
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
