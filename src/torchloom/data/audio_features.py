"""Audio features: a log-mel spectrogram, the waveform, or a transformers feature extractor, over every clip.

`build_feature_extractor` makes the extractor a name stands for (`LogMelSpectrogram`, ``"waveform"``, a
transformers class, a directory); `feature_extractor_fingerprint` hashes its configuration for a cache key;
`extract_features` decodes, resamples, cuts and featurises a table's clips with a batched ``Dataset.map``. Part of
`torchloom.data.audio`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import transformers

from torchloom._settings import invalid
from torchloom.data.audio_decoding import check_rate, decode_clip, fix_length, resample, resolve_clip
from torchloom.data.cache import cache_key
from torchloom.data.tables import require_column
from torchloom.errors import ConfigError

__all__ = ["LogMelSpectrogram", "build_feature_extractor", "extract_features", "feature_extractor_fingerprint"]


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
                raise invalid(field, value, "a positive integer", owner="LogMelSpectrogram")
        self.sampling_rate = check_rate(self.sampling_rate, "LogMelSpectrogram")
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
        self.sampling_rate = check_rate(sampling_rate, "features='waveform'")

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
    row_names: Callable[[int], str] | None = None,
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
        row_names (*optional*): what to call row ``i`` in the error about its clip, in place of ``name``: e.g.
            ``"<name> path 'clips.jsonl': line 3"`` for a table read from a file.

    Returns:
        `datasets.Dataset`: the extractor's outputs (``input_features`` of shape ``(n_mels, frames)`` for
        ``"log_mel"``; ``input_values`` of shape ``(samples,)`` for ``"waveform"``; whatever a transformers
        extractor returns), fixed-shape float32 arrays, plus ``keep_columns``; in memory.

    Raises:
        ConfigError: a missing column; a clip that is missing, unreadable, truncated or empty; a sample rate that
            cannot be resampled (each names the file or row).
    """
    require_column(dataset, audio_column, "audio_column", name)
    rate = check_rate(extractor.sampling_rate, "the feature extractor")
    if isinstance(max_duration, bool) or not isinstance(max_duration, int | float) or not max_duration > 0:
        raise invalid("max_duration", max_duration, "a positive number of seconds", owner=name)
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
            try:
                samples, clip_rate, what = decode_clip(
                    resolve_clip(value, base, row, audio_column, name), row, audio_column, name
                )
                clip_rate = check_rate(clip_rate, what, rate)
                clips.append(fix_length(resample(samples, clip_rate, rate, resample_quality, what), num_samples))
            except ConfigError as exc:
                if row_names is None:
                    raise
                raise ConfigError(f"{row_names(row)}: {str(exc).removeprefix(f'{name}: ')}") from None
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
