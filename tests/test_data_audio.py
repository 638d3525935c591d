"""torchloom.data.audio: decoding, resampling, features, lengths, labels, the cache key and reuse, errors, 2 processes.

The clips are sine tones written by the tests with soundfile (WAV and FLAC, several rates, mono and stereo), so
their content is known exactly; real speech is tested with the keyword example (tests/test_example_keywords.py).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import struct
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
import torch

import torchloom
from cli_util import run_cli  # the torchloom command, in this process
from torchloom.data import (
    AudioClassificationData,
    LogMelSpectrogram,
    build_feature_extractor,
    cache_key,
    extract_features,
    feature_extractor_fingerprint,
    fix_length,
    read_audio,
    read_audio_folder,
    resample,
)
from torchloom.errors import ConfigError

sf = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

#: class -> tone frequency (Hz)
TONES = {"low": 300.0, "mid": 1000.0, "high": 3000.0}


def tone(freq: float, rate: int, seconds: float, amplitude: float = 0.5, channels: int = 1) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    x = amplitude * np.sin(2 * np.pi * freq * t)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def make_folder(root: Path, n: int = 12, seed: int = 0) -> Path:
    """``n`` clips cycling through the classes, at 8 / 16 / 22.05 kHz, WAV and FLAC, mono and stereo, 0.4-1.5 s,
    each a different amplitude (so every clip is distinct); ``metadata.csv`` with ``file_name,label,speaker``."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        label = list(TONES)[i % 3]
        rate = (8000, 16000, 22050)[(i // 3) % 3]
        name = f"{label}/{i:02d}.{'flac' if i % 2 else 'wav'}"
        (root / label).mkdir(exist_ok=True)
        x = tone(TONES[label], rate, 0.4 + 0.1 * ((i + seed) % 12), 0.2 + 0.05 * i, channels=1 + i % 2)
        sf.write(root / name, x, rate)
        rows.append([name, label, f"s{i % 4}"])
    write_metadata(root, rows)
    return root


def write_metadata(root: Path, rows, header=("file_name", "label", "speaker")) -> None:
    with open(root / "metadata.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def prepared(*args, stage="fit", **kwargs) -> AudioClassificationData:
    data = AudioClassificationData(*args, **kwargs)
    data.prepare_data()
    data.setup(stage)
    return data


def peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[spectrum.argmax()])


@pytest.fixture
def folders(tmp_path):
    return make_folder(tmp_path / "train"), make_folder(tmp_path / "val", n=6, seed=5)


# ------------------------------------------------------------------------------------ decoding, features


def test_audio_folder_gives_log_mel_float32_and_sorted_class_ids(folders, tmp_path):
    data = prepared(*folders, cache_dir=tmp_path / "cache", batch_size=5)
    train = data.train_dataset
    assert data.label_names == ["high", "low", "mid"] and len(train) == 12 and len(data.val_dataset) == 6
    assert train.features["labels"] == datasets.ClassLabel(names=["high", "low", "mid"])
    assert train.features["input_features"] == datasets.Array2D((40, 101), "float32")
    assert set(train.column_names) == {"input_features", "labels"}
    metadata = pd.read_csv(folders[0] / "metadata.csv")
    assert [data.label_names[i] for i in train[:]["labels"].tolist()] == metadata.label.tolist()  # the label mapping

    batches = list(data.train_dataloader())
    assert [len(b["labels"]) for b in batches] == [5, 5, 2]
    for batch in batches:
        assert set(batch) == {"input_features", "labels"}
        assert batch["input_features"].dtype == torch.float32 and batch["labels"].dtype == torch.int64
        assert batch["input_features"].shape[1:] == (40, 101)
    features = train[:]["input_features"]
    assert features.min() >= -100.0 and features.max() < 60.0  # dB, floored at -100
    # Each clip's loudest band is the one holding its tone: the 300 Hz band < the 1 kHz band < the 3 kHz band.
    centres = _mel_centres(LogMelSpectrogram())
    for row, label in enumerate(metadata.label):
        band = features[row, :, :30].mean(-1).argmax().item()  # the first 0.3 s: every clip is sounding there
        assert abs(centres[band] - TONES[label]) < 0.15 * TONES[label] + 60, (row, label, centres[band])
    # Shorter clips are padded with silence, so their last frames sit at the floor.
    short = [i for i in range(12) if 0.4 + 0.1 * i < 0.9]
    assert all(features[i, :, -5:].max() <= -90 for i in short)


def _mel_centres(extractor: LogMelSpectrogram) -> np.ndarray:
    bins = np.fft.rfftfreq(extractor.n_fft, 1 / extractor.sampling_rate)
    return bins[extractor._mel.argmax(axis=0)]


def test_resampling_keeps_frequencies_and_removes_what_cannot_be_represented():
    # 1 kHz at 8 kHz -> 16 kHz: twice the samples, the tone stays at 1 kHz with the same amplitude.
    x = tone(1000.0, 8000, 1.0).astype(np.float32)
    y = resample(x, 8000, 16000)
    assert y.dtype == np.float32 and len(y) == 16000
    assert peak_hz(y, 16000) == pytest.approx(1000.0, abs=1.0)
    assert np.abs(y[2000:-2000]).max() == pytest.approx(0.5, abs=0.005)
    # 44.1 kHz -> 16 kHz: 1 kHz survives; 10 kHz is above the new Nyquist (8 kHz) and is removed, not aliased
    # to 6 kHz (what dropping samples would give).
    mix = (tone(1000.0, 44100, 1.0) + tone(10000.0, 44100, 1.0)).astype(np.float32)
    z = resample(mix, 44100, 16000)
    assert len(z) == 16000 and peak_hz(z, 16000) == pytest.approx(1000.0, abs=1.0)
    spectrum = np.abs(np.fft.rfft(z[1000:-1000]))
    freqs = np.fft.rfftfreq(len(z) - 2000, 1 / 16000)
    assert spectrum[np.abs(freqs - 6000) < 50].max() < 1e-3 * spectrum.max()
    # Equal rates: the input, unchanged.
    assert resample(x, 8000, 8000) is not None and np.array_equal(resample(x, 8000, 8000), x)
    for bad in (0, 3, 10_000_000, 8000.5, float("nan")):
        with pytest.raises(ConfigError, match=r"clip\.wav' has sample rate .* cannot be resampled to 16000 Hz"):
            resample(x, bad, 16000, name="audio file 'clip.wav'")
    with pytest.raises(ConfigError, match="setting 'quality' = 'best'; expected one of QQ, LQ, MQ, HQ, VHQ"):
        resample(x, 8000, 16000, quality="best")


def test_read_audio_scales_mixes_down_and_reads_bytes(tmp_path):
    stereo = np.stack([np.full(100, 0.5), np.full(100, -0.25)], axis=1)
    sf.write(tmp_path / "s.wav", stereo, 16000, subtype="PCM_16")
    samples, rate = read_audio(tmp_path / "s.wav")
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == (100,)
    np.testing.assert_allclose(samples, 0.125, atol=1e-4)  # the mean of the two channels
    sf.write(tmp_path / "i.flac", np.array([-32768, 0, 16384], dtype=np.int16), 8000)
    samples, rate = read_audio(tmp_path / "i.flac")
    assert rate == 8000 and samples.tolist() == [-1.0, 0.0, 0.5]  # int16 PCM scaled to [-1, 1)
    raw = (tmp_path / "i.flac").read_bytes()
    assert read_audio(raw)[0].tolist() == [-1.0, 0.0, 0.5]
    assert read_audio({"bytes": raw, "path": "i.flac"})[0].tolist() == [-1.0, 0.0, 0.5]
    assert read_audio({"bytes": None, "path": str(tmp_path / "i.flac")})[1] == 8000
    assert fix_length(np.ones(5, np.float32), 3).tolist() == [1, 1, 1]
    assert fix_length(np.ones(2, np.float32), 4).tolist() == [1, 1, 0, 0]


def test_transformers_feature_extractors_built_from_arguments(folders, tmp_path):
    whisper = prepared(
        folders[0],
        features="WhisperFeatureExtractor",
        feature_args={"feature_size": 32, "chunk_length": 1},
        cache_dir=tmp_path,
    )
    assert whisper.train_dataset.features["input_features"] == datasets.Array2D((32, 100), "float32")
    values = whisper.train_dataset[:]["input_features"]
    assert values.dtype == torch.float32 and values.min() >= -1.5 and values.max() <= 1.5  # Whisper's scaling
    ast = prepared(
        folders[0],
        features="ASTFeatureExtractor",
        feature_args={"num_mel_bins": 24, "max_length": 60},
        cache_dir=tmp_path,
    )
    assert ast.train_dataset.features["input_values"] == datasets.Array2D((60, 24), "float32")
    wave = prepared(folders[0], features="waveform", sample_rate=8000, max_duration=0.5, cache_dir=tmp_path)
    assert wave.train_dataset.features["input_values"] == datasets.List(datasets.Value("float32"), length=4000)
    first = wave.train_dataset[:]["input_values"][0].numpy()  # 300 Hz written at 8 kHz: the samples themselves
    np.testing.assert_allclose(first[:3200], tone(300.0, 8000, 0.4, 0.2)[:3200], atol=1e-4)
    assert np.all(first[3200:] == 0)  # 0.4 s of tone, padded to 0.5 s
    # A transformers extractor saved to a directory loads from it, with the same fingerprint.
    extractor = build_feature_extractor("WhisperFeatureExtractor", 16000, feature_size=32, chunk_length=1)
    extractor.save_pretrained(tmp_path / "fe")
    loaded = build_feature_extractor(tmp_path / "fe")
    assert type(loaded).__name__ == "WhisperFeatureExtractor"
    assert feature_extractor_fingerprint(loaded) == feature_extractor_fingerprint(extractor)
    # The model's rate follows the extractor; a contradicting sample_rate is an error.
    assert AudioClassificationData(folders[0], features="WhisperFeatureExtractor").sample_rate == 16000
    with pytest.raises(ConfigError, match="sample_rate=8000 but the feature extractor expects 16000 Hz"):
        build_feature_extractor("WhisperFeatureExtractor", 8000, sampling_rate=16000)
    with pytest.raises(ConfigError, match="features='BertTokenizer' is not a transformers audio feature extractor"):
        AudioClassificationData(folders[0], features="BertTokenizer")
    with pytest.raises(ConfigError, match=r"features='log_mel': .*unexpected keyword argument 'n_mel'"):
        AudioClassificationData(folders[0], feature_args={"n_mel": 40})
    with pytest.raises(ConfigError, match="n_mels=300 is more than the 201 frequency bins of n_fft=400"):
        AudioClassificationData(folders[0], feature_args={"n_mels": 300})
    with pytest.raises(ConfigError, match=r"features directory '.*nowhere' does not exist"):
        AudioClassificationData(folders[0], features="./nowhere")


def test_tables_with_paths_audio_dicts_arrays_and_integer_labels(folders, tmp_path):
    metadata = pd.read_csv(folders[0] / "metadata.csv")
    paths = [str(folders[0] / name) for name in metadata.file_name]
    ids = [list(TONES).index(label) for label in metadata.label]
    frame = pd.DataFrame({"clip": paths, "y": ids})
    reference = prepared(folders[0], cache_dir=tmp_path / "a", label_names=list(TONES))
    from_frame = prepared(
        frame, audio_column="clip", label_column="y", label_names=list(TONES), cache_dir=tmp_path / "b"
    )
    assert from_frame.label_names == list(TONES) and from_frame.train_dataset[:]["labels"].tolist() == ids
    assert torch.equal(from_frame.train_dataset[:]["input_features"], reference.train_dataset[:]["input_features"])

    # A datasets Audio(decode=False) column (bytes, no torchcodec needed) and decoded {"array", "sampling_rate"}.
    raw = datasets.Dataset.from_dict({"audio": paths, "label": metadata.label.tolist()})
    as_audio = raw.cast_column("audio", datasets.Audio(decode=False))
    with_bytes = as_audio.map(lambda row: {"audio": {"bytes": Path(row["audio"]["path"]).read_bytes(), "path": None}})
    arrays = [read_audio(p) for p in paths]
    as_arrays = datasets.Dataset.from_dict(
        {"audio": [{"array": a.tolist(), "sampling_rate": r} for a, r in arrays], "label": metadata.label.tolist()}
    )
    for table in (as_audio, with_bytes, as_arrays):
        data = prepared(table, audio_column="audio", label_names=list(TONES), cache_dir=tmp_path / "c")
        got = data.train_dataset[:]["input_features"]
        torch.testing.assert_close(got, reference.train_dataset[:]["input_features"], rtol=0, atol=1e-4)

    # Relative paths in a metadata file start at its own directory, wherever the process runs.
    table_file = folders[0] / "labels.parquet"
    metadata.to_parquet(table_file)
    again = prepared(table_file, label_names=list(TONES), cache_dir=tmp_path / "d")
    assert torch.equal(again.train_dataset[:]["input_features"], reference.train_dataset[:]["input_features"])


def test_extract_features_and_read_audio_folder_directly(folders):
    table, base = read_audio_folder(folders[0])
    assert base == folders[0] and table.column_names == ["file_name", "label", "speaker"] and len(table) == 12
    extractor = build_feature_extractor("log_mel", 16000, n_mels=16, hop_length=320)
    out = extract_features(table, extractor, max_duration=0.5, base_dir=base, keep_columns=("speaker",))
    assert out.column_names == ["speaker", "input_features"]
    assert np.asarray(out[:]["input_features"]).shape == (12, 16, 26)  # 1 + 8000 // 320 frames


# -------------------------------------------------------------------------------------------- the cache


def test_second_run_loads_from_the_cache_without_decoding(folders, tmp_path, monkeypatch):
    import torchloom.data.audio as audio_module

    calls = []
    real = audio_module.extract_features

    def counting(*args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(audio_module, "extract_features", counting)
    first = prepared(*folders, cache_dir=tmp_path / "cache")
    assert first.cache_hit is False and len(calls) == 2  # train and validation
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.cache_path.name]  # no temporary left

    def fail(*args, **kwargs):
        raise AssertionError("recomputed instead of loading from the cache")

    monkeypatch.setattr("torchloom.data.audio_decoding.read_audio", fail)  # where the clips are decoded
    monkeypatch.setattr("torchloom.data.base.encode_labels", fail)  # where every data module encodes its labels
    second = prepared(*folders, cache_dir=tmp_path / "cache", batch_size=3, max_train_samples=5)
    assert second.cache_hit is True and second.cache_path == first.cache_path and len(calls) == 2
    assert all(f["filename"].startswith(str(first.cache_path)) for f in second.train_dataset.cache_files)
    assert len(second.train_dataset) == 5 and torch.equal(
        second.val_dataset[:]["labels"], first.val_dataset[:]["labels"]
    )
    info = second.cache.info(first.cache_path.name)["settings"]
    assert info["sample_rate"] == 16000 and info["max_duration"] == 1.0 and info["resampler"]["name"] == "soxr"


def test_cache_key_changes_with_every_setting_and_the_raw_data(folders, tmp_path):
    train, val = folders

    def key(*sources, **settings):
        return cache_key(**AudioClassificationData(*sources, **settings).cache_settings())

    base = key(train, val)
    assert key(train, val) == base
    moved = tmp_path / "elsewhere"
    shutil.copytree(train, moved)
    for same in (
        key(train, val, batch_size=3, max_train_samples=5, shuffle=False, seed=7, cache_dir=tmp_path / "x"),
        key(moved, val),  # the same bytes in another place
        key(train, val, sample_rate=16000, feature_args={"n_mels": 40}),  # the defaults, spelt out
    ):
        assert same == base
    changed = [
        key(train, val, sample_rate=8000),
        key(train, val, max_duration=0.5),
        key(train, val, feature_args={"n_mels": 32}),
        key(train, val, feature_args={"hop_length": 80}),
        key(train, val, features="waveform"),
        key(train, val, features="WhisperFeatureExtractor", feature_args={"chunk_length": 1}),
        key(train, val, features="WhisperFeatureExtractor", feature_args={"chunk_length": 2}),
        key(train, val, resample_quality="HQ"),
        key(train, val, label_names=["low", "mid", "high"]),
        key(train, None),
        key(val, val),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    # One byte of one clip...
    clip = moved / "mid" / "01.flac"
    samples, rate = sf.read(clip)
    samples[100] += 0.01
    sf.write(clip, samples, rate)
    assert key(moved, val) != base
    # ...or one cell of the metadata.
    shutil.rmtree(moved)
    shutil.copytree(train, moved)
    assert key(moved, val) == base
    table = pd.read_csv(moved / "metadata.csv")
    table.loc[0, "speaker"] = "someone else"
    table.to_csv(moved / "metadata.csv", index=False)
    assert key(moved, val) != base


def test_a_swapped_audio_entry_is_refused_and_the_classes_are_recorded(tmp_path):
    train = make_folder(tmp_path / "train", n=6)
    cache = tmp_path / "cache"
    long, short = prepared(train, cache_dir=cache), prepared(train, max_duration=0.5, cache_dir=cache)
    assert long.cache.info(long.cache_path.name)["settings"]["classes"] == ["high", "low", "mid"] == long.label_names
    long.cache_path.rename(cache / "swap")
    short.cache_path.rename(long.cache_path)
    with pytest.raises(torchloom.ConfigError) as caught:
        prepared(train, cache_dir=cache)
    assert str(caught.value) == (
        f"processed-dataset cache entry '{long.cache_path}' was built from other settings than this request's: "
        "max_duration is 0.5 in the entry but 1.0 now; delete that directory to rebuild it"
    )


# ---------------------------------------------------------------------------------------------- errors


def test_unreadable_truncated_and_unresamplable_files_name_the_file(tmp_path):
    folder = make_folder(tmp_path / "f", n=3)
    good = (folder / "low" / "00.wav").read_bytes()
    flac = (folder / "mid" / "01.flac").read_bytes()
    cases = {
        "garbage.wav": (b"hello, not audio" * 20, r"cannot be decoded \(Format not recognised"),
        "cut.wav": (good[: len(good) // 2], r"is truncated: its header declares \d+ bytes of audio, the file holds"),
        "cut.flac": (flac[: len(flac) // 2], r"cannot be decoded \(.*flac decoder"),
        "zero-rate.wav": (_with_rate(good, 0), "has sample rate 0 Hz, which cannot be resampled"),
        "slow.wav": (_with_rate(good, 3), "has sample rate 3 Hz, which cannot be resampled to 16000 Hz"),
        "empty.wav": (_empty_wav(tmp_path), "holds no samples"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        write_metadata(folder, [["low/00.wav", "low"], [str(bad), "mid"]], header=("file_name", "label"))
        with pytest.raises(ConfigError, match=re.escape(f"audio file '{bad}'") + " " + message):
            AudioClassificationData(folder, cache_dir=tmp_path / "cache").prepare_data()
        if name == "slow.wav":  # a valid file: the rate is refused when resampling
            assert read_audio(bad)[1] == 3
        else:
            with pytest.raises(ConfigError, match=re.escape(f"audio file '{bad}'")):
                read_audio(bad)
    assert not (tmp_path / "cache").exists()  # nothing half-made was cached
    write_metadata(folder, [["low/00.wav", "low"], ["missing.wav", "mid"]], header=("file_name", "label"))
    missing = f"'{folder / 'metadata.csv'}': row 2: audio_column 'file_name' names '{folder / 'missing.wav'}', which"
    with pytest.raises(ConfigError, match=re.escape(f"{missing} does not exist; expected the path of an audio file")):
        AudioClassificationData(folder, cache_dir=tmp_path / "cache").prepare_data()
    array = datasets.Dataset.from_dict({"file_name": [{"array": [0.1, 0.2], "sampling_rate": 0}], "label": ["a"]})
    with pytest.raises(ConfigError, match=r"audio_column 'file_name' row 0 has sample rate 0 Hz"):
        AudioClassificationData(array, cache_dir=tmp_path / "cache").prepare_data()


def _with_rate(wav: bytes, rate: int) -> bytes:
    data = bytearray(wav)  # soundfile writes the canonical 44-byte header: fmt at 12, sample rate at 24
    assert data[12:16] == b"fmt "
    data[24:28] = struct.pack("<I", rate)
    return bytes(data)


def _empty_wav(tmp_path: Path) -> bytes:
    sf.write(tmp_path / "nothing.wav", np.zeros(0), 16000)
    return (tmp_path / "nothing.wav").read_bytes()


def test_missing_columns_wrong_labels_and_empty_splits(tmp_path):
    folder = make_folder(tmp_path / "f", n=3)
    with pytest.raises(ConfigError, match="audio_column 'path' is not a column; the columns are file_name, label"):
        AudioClassificationData(folder, audio_column="path", cache_dir=tmp_path).prepare_data()
    with pytest.raises(ConfigError, match="label_column 'word' is not a column; the columns are file_name"):
        AudioClassificationData(folder, label_column="word", cache_dir=tmp_path).prepare_data()
    write_metadata(folder, [["low/00.wav", 0.5], ["mid/01.flac", 1.5]], header=("file_name", "label"))
    with pytest.raises(ConfigError, match=r"train data: label_column 'label' has values of type .*float.*expected str"):
        AudioClassificationData(folder, cache_dir=tmp_path).prepare_data()
    write_metadata(folder, [["low/00.wav", "low"], ["mid/01.flac", "loud"]], header=("file_name", "label"))
    with pytest.raises(ConfigError, match=r"label_column 'label' has values \['loud'\] that are not in label_names"):
        AudioClassificationData(folder, label_names=["low", "mid"], cache_dir=tmp_path).prepare_data()
    write_metadata(folder, [], header=("file_name", "label"))
    with pytest.raises(ConfigError, match=re.escape(f"train data is empty: '{folder / 'metadata.csv'}' has no rows")):
        AudioClassificationData(folder, cache_dir=tmp_path).prepare_data()
    empty = pd.DataFrame({"file_name": pd.Series([], dtype=str), "label": pd.Series([], dtype=str)})
    with pytest.raises(ConfigError, match="validation data is empty: the DataFrame has no rows"):
        AudioClassificationData(make_folder(tmp_path / "g", n=3), empty, cache_dir=tmp_path).prepare_data()
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"audio folder '{bare}' has no metadata.csv")):
        AudioClassificationData(bare, cache_dir=tmp_path).prepare_data()
    with pytest.raises(ConfigError, match=re.escape(f"train data path '{tmp_path / 'nope'}' does not exist")):
        AudioClassificationData(tmp_path / "nope", cache_dir=tmp_path).prepare_data()
    holes = pd.DataFrame({"file_name": [str(folder / "low" / "00.wav"), None], "label": ["a", "b"]})
    with pytest.raises(ConfigError, match="audio_column 'file_name' has a missing value in row 1"):
        AudioClassificationData(holes, cache_dir=tmp_path).prepare_data()
    with pytest.raises(ConfigError, match="train=None; expected the training clips"):
        AudioClassificationData(None).prepare_data()


def test_bad_settings_are_config_errors(tmp_path):
    for setting, value, expected in [
        ("sample_rate", 0, "expected an integer from 1000 to 768000 Hz"),
        ("sample_rate", 44100.5, "expected an integer from 1000 to 768000 Hz"),
        ("max_duration", 0, r"expected a number of seconds > 0"),
        ("resample_quality", "best", "expected one of QQ, LQ, MQ, HQ, VHQ"),
        ("batch_size", 0, "expected a positive integer"),
        ("max_val_samples", 2.5, "expected a positive integer"),
        ("label_names", ["a"], "expected a list of 2 or more distinct strings"),
        ("num_workers", -1, "expected an integer >= 0"),
        ("audio_column", "", "expected a column name"),
        ("feature_args", [1], "expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=rf"AudioClassificationData: setting '{setting}' = .*{expected}"):
            AudioClassificationData(tmp_path, **{setting: value})
    with pytest.raises(ConfigError, match=r"f_min=20.0, f_max=9000; expected 0 <= f_min < f_max <= 8000"):
        LogMelSpectrogram(f_max=9000)


def test_a_bad_clip_stops_the_fit_before_the_first_step(tmp_path):
    folder = make_folder(tmp_path / "f", n=4)
    (folder / "high" / "02.wav").write_bytes(b"RIFF....WAVEjunk")
    steps = []

    class Task(torchloom.TaskModule):
        def configure_model(self):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(40 * 101, 3))

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return torch.nn.functional.cross_entropy(self.model(batch["input_features"]), batch["labels"])

    data = AudioClassificationData(folder, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match=re.escape(f"audio file '{folder / 'high' / '02.wav'}' cannot be decoded")):
        torchloom.Engine(max_epochs=1, output_dir=str(tmp_path / "run")).fit(Task(), datamodule=data)
    assert steps == [] and not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------- several processes


@pytest.mark.multiprocess
def test_two_processes_decode_once_and_train_on_disjoint_shards(tmp_path):
    from torchrun_util import torchrun

    folder = make_folder(tmp_path / "clips", n=16)
    results = torchrun("audio_prepare.py", tmp_path, str(folder), str(tmp_path / "cache"))
    main, other = results
    assert [r["world_size"] for r in results] == [2, 2]
    assert main["extract_calls"] == ["AudioClassificationData train data"] and other["extract_calls"] == []
    assert (main["cache_hit"], other["cache_hit"]) == (False, True)
    assert main["cache_path"] == other["cache_path"] and len(os.listdir(tmp_path / "cache")) == 1
    assert main["data_sha256"] == other["data_sha256"] and main["label_names"] == ["high", "low", "mid"]
    everything = main["all_ids"]
    assert len(set(everything)) == 16  # distinct clips, so a clip's feature sum identifies it
    assert len(main["seen"]) == len(other["seen"]) == 8
    assert not set(main["seen"]) & set(other["seen"])
    assert sorted(main["seen"] + other["seen"]) == sorted(everything)


# ------------------------------------------------------------------------------------------ config files


PROBE_TASK = """
import torch, torchloom

class Probe(torchloom.TaskModule):
    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(20 * 100, 3))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        print("batch", tuple(batch["input_features"].shape), batch["input_features"].dtype, flush=True)
        return torch.nn.functional.cross_entropy(self.model(batch["input_features"]), batch["labels"])
"""


def test_cli_config_with_a_transformers_feature_extractor(tmp_path):
    """A YAML config names a transformers extractor and gives its arguments as a mapping; the CLI trains on it."""
    import yaml

    folder = make_folder(tmp_path / "clips", n=6)
    (tmp_path / "probe_task.py").write_text(PROBE_TASK)
    config = {
        "engine": {"max_epochs": 1, "output_dir": str(tmp_path / "runs")},
        "task": {"class_path": "probe_task.Probe"},
        "data": {
            "class_path": "torchloom.data.AudioClassificationData",
            "init_args": {
                "train": str(folder),
                "features": "WhisperFeatureExtractor",
                "feature_args": {"feature_size": 20, "chunk_length": 1},
                "batch_size": 3,
                "cache_dir": str(tmp_path / "cache"),
            },
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("fit", "--config", str(tmp_path / "config.yaml"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("batch (3, 20, 100) torch.float32") == 2
    (entry,) = (tmp_path / "cache").iterdir()
    settings = json.loads((entry / "torchloom_cache.json").read_text())["settings"]
    assert settings["max_duration"] == 1.0 and settings["sample_rate"] == 16000
