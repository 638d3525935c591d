"""``torchloom predict --input FILE`` for the image and audio modules: a ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv``
/ ``.parquet`` file whose image (audio) column holds paths, relative to the file's folder or absolute, decoded
exactly as the module decodes its folders and served in the file's order; the same files as split sources; every
bad row one error naming the file, the row (its line in a JSON lines file) and what is valid.

The images are 6x6 PNGs of random pixels and the clips sine tones (soundfile), written by the tests.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import PIL.Image
import pytest
import torch
import yaml

from cli_util import run_cli
from torchloom.data import AudioClassificationData, ImageClassificationData
from torchloom.errors import ConfigError

TASKS = """
import torch, torchloom


class Pixels(torchloom.TaskModule):
    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.model(batch["pixel_values"]), batch["labels"])

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self.model(batch["pixel_values"])


class Mels(torchloom.TaskModule):
    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(8, 3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_features"].mean(-1))
        return torch.nn.functional.cross_entropy(logits, batch["labels"])

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self.model(batch["input_features"].mean(-1))
"""

#: The file's rows: the validation items (sorted by class, then file, as the module lists a folder) in this order.
ORDER = [4, 0, 3, 1, 2]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """``rows`` as the file ``path`` names by its suffix (JSON lines, a JSON array, CSV, TSV or parquet)."""
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows(rows)
    return path


def predictions(done, cwd: Path) -> list:
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = cwd / done.stdout.split("output in ")[1].split("\n")[0]
    return [json.loads(line)["prediction"] for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def predict_rows(data, source):
    data.set_predict_input(source)
    return data.predict_dataset()


# ------------------------------------------------------------------------------------------------------ images


def make_images(root: Path, counts: dict[str, int], seed: int = 0) -> list[Path]:
    """``root/<class>/<i>.png``; the files in the order the module lists the folder (class, then file)."""
    files = []
    for c, (name, count) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = np.random.default_rng(seed * 1000 + c * 100 + i).integers(0, 256, (6, 6, 3), dtype=np.uint8)
            PIL.Image.fromarray(pixels).save(root / name / f"{i:02d}.png")
            files.append(root / name / f"{i:02d}.png")
    return files


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """train/ (8 images), val/ (5 images: a 2, b 3), a config that trains on them, and a model fitted with it."""
    root = tmp_path_factory.mktemp("media_images")
    make_images(root / "train", {"a": 4, "b": 4})
    make_images(root / "val", {"a": 2, "b": 3}, seed=1)
    (root / "media_tasks.py").write_text(TASKS)
    config = {
        "engine": {"max_epochs": 1, "output_dir": "runs", "save_model": True},
        "task": {"class_path": "media_tasks.Pixels"},
        "data": {
            "class_path": "torchloom.data.ImageClassificationData",
            "init_args": {
                "train": "train",
                "validation": "val",
                "mean": 0.5,
                "std": 0.25,
                "batch_size": 2,
                "cache_dir": str(root / "cache"),
            },
        },
    }
    return _fitted(root, config)


def _fitted(root: Path, config: dict) -> Path:
    """``torchloom fit`` of ``config`` (written to ``root/run.yaml``) in ``root``, which must succeed; ``root``."""
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("fit", "--config", "run.yaml", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def image_rows(root: Path, folder: Path, labels: bool | str = True) -> list[dict]:
    """The validation images in `ORDER`: even rows by a path relative to ``folder``, odd rows by an absolute one;
    with ``labels="some"`` every other row has no label."""
    files = sorted((root / "val").rglob("*.png"))
    rows = []
    for n, i in enumerate(ORDER):
        path = os.path.relpath(files[i], folder) if n % 2 == 0 else str(files[i])
        row = {"image": path}
        if labels:
            row["label"] = files[i].parent.name if labels is True or n % 2 else None
        rows.append(row)
    return rows


def image_data(root: Path, **kwargs) -> ImageClassificationData:
    data = ImageClassificationData(root / "train", root / "val", mean=0.5, std=0.25, cache_dir=root / "cache", **kwargs)
    data.prepare_data()
    data.setup("predict")
    return data


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".tsv", ".parquet"])
def test_image_rows_of_a_file_are_the_folders_pixels_in_the_files_order(images, suffix) -> None:
    (images / "inputs").mkdir(exist_ok=True)
    file = write_rows(images / "inputs" / f"rows{suffix}", image_rows(images, images / "inputs"))
    data = image_data(images)
    got = predict_rows(data, file)
    assert len(got) == 5
    assert torch.equal(got[:]["pixel_values"], data.val_dataset[ORDER]["pixel_values"])  # decoded as the folder
    assert got[:]["labels"].tolist() == data.val_dataset[ORDER]["labels"].tolist()


def test_image_rows_without_labels_or_with_some_missing(images) -> None:
    data = image_data(images)
    some = write_rows(images / "some.jsonl", image_rows(images, images, labels="some"))
    got = predict_rows(data, some)
    expected = data.val_dataset[ORDER]["labels"].tolist()
    assert got[:]["labels"].tolist() == [-1 if n % 2 == 0 else label for n, label in enumerate(expected)]
    none = write_rows(images / "none.csv", image_rows(images, images, labels=False))
    got = predict_rows(data, none)
    assert set(got.column_names) == {"pixel_values"}
    assert torch.equal(got[:]["pixel_values"], data.val_dataset[ORDER]["pixel_values"])


def test_image_split_sources_given_as_files(images, tmp_path) -> None:
    """A file of paths is a split source too: the same pixels and labels as the folders."""
    folders = image_data(images)
    files = sorted((images / "train").rglob("*.png"))
    train = write_rows(tmp_path / "train.csv", [{"image": str(f), "label": f.parent.name} for f in files])
    val = write_rows(tmp_path / "val.jsonl", image_rows(images, tmp_path))
    data = ImageClassificationData(train, val, mean=0.5, std=0.25, cache_dir=tmp_path / "cache")
    data.prepare_data()
    data.setup("fit")
    assert data.label_names == ["a", "b"]
    assert torch.equal(data.train_dataset[:]["pixel_values"], folders.train_dataset[:]["pixel_values"])
    assert data.train_dataset[:]["labels"].tolist() == folders.train_dataset[:]["labels"].tolist()
    assert torch.equal(data.val_dataset[:]["pixel_values"], folders.val_dataset[ORDER]["pixel_values"])
    original = files[1].read_bytes()  # the key hashes the images a file names: editing one makes a new entry
    try:
        files[1].write_bytes(files[2].read_bytes())
        edited = ImageClassificationData(train, val, mean=0.5, std=0.25, cache_dir=tmp_path / "cache")
        edited.prepare_data()
        assert edited.cache_path != data.cache_path and edited.cache_hit is False
    finally:
        files[1].write_bytes(original)


def test_bad_image_rows_name_the_file_the_row_and_what_is_valid(images, tmp_path) -> None:
    data = image_data(images)
    rows = image_rows(images, tmp_path)
    missing = [*rows[:2], {"image": "a/nope.png", "label": "a"}, *rows[2:]]
    file = write_rows(tmp_path / "missing.jsonl", missing)
    (tmp_path / "blank.jsonl").write_text(file.read_text().replace("\n", "\n\n", 1))  # line 4 in that file
    with pytest.raises(ConfigError) as caught:
        predict_rows(data, file)
    message = str(caught.value)
    assert f"'{file}': line 3: image_column 'image' names '{tmp_path / 'a' / 'nope.png'}', which does not exist" in (
        message
    )
    assert f"expected the path of an image file, absolute or relative to the file's folder '{tmp_path}'" in message
    with pytest.raises(ConfigError, match=r"blank\.jsonl': line 4: image_column 'image' names"):
        predict_rows(data, tmp_path / "blank.jsonl")
    with pytest.raises(ConfigError, match=r"missing\.csv': row 3: image_column 'image' names .*nope\.png'"):
        predict_rows(data, write_rows(tmp_path / "missing.csv", missing))
    with pytest.raises(ConfigError, match=r"missing\.json': item 3 of the JSON array: image_column 'image' names"):
        predict_rows(data, write_rows(tmp_path / "missing.json", missing))

    (tmp_path / "broken.png").write_bytes(b"this is not a PNG")
    broken = write_rows(tmp_path / "broken.jsonl", [*rows[:3], {"image": "broken.png"}])
    with pytest.raises(ConfigError) as caught:
        predict_rows(data, broken)
    assert f"'{broken}': line 4: image file '{tmp_path / 'broken.png'}' is not an image that Pillow can read" in str(
        caught.value
    )
    empty = write_rows(tmp_path / "empty.jsonl", [rows[0], {"image": None, "label": "a"}])
    with pytest.raises(ConfigError, match=r"empty\.jsonl': line 2: image_column 'image' has no value; expected"):
        predict_rows(data, empty)
    other = write_rows(tmp_path / "other.jsonl", [{"picture": r["image"]} for r in rows])
    with pytest.raises(ConfigError) as caught:
        predict_rows(data, other)
    assert f"'{other}': image_column 'image' is not a column; the columns are picture" in str(caught.value)


def test_cli_predicts_an_image_file_as_its_folder_in_the_files_order(images) -> None:
    """5 rows, relative and absolute paths, a label in each: the predictions on the folder, reordered."""
    folder = predictions(
        run_cli("predict", "--config", "run.yaml", "--ckpt_path", "runs/version_0", cwd=images), images
    )
    write_rows(images / "inputs.jsonl", image_rows(images, images))
    done = run_cli(
        "predict", "--config", "run.yaml", "--ckpt_path", "runs/version_0", "--input", "inputs.jsonl", cwd=images
    )
    assert "  batches = 3" in done.stdout  # 5 rows in batches of 2
    got = predictions(done, images)
    assert np.allclose(got, [folder[i] for i in ORDER], rtol=1e-5, atol=1e-6)
    write_rows(images / "gone.jsonl", [{"image": "val/a/00.png"}, {"image": "val/c/09.png"}])
    done = run_cli("predict", "--config", "run.yaml", "--input", "gone.jsonl", cwd=images)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "predict input 'gone.jsonl'" in done.stderr and "line 2: image_column 'image' names" in done.stderr


# ------------------------------------------------------------------------------------------------------- audio


def make_clips(root: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` tones cycling through 3 classes (WAV and FLAC, 8 / 16 kHz, 0.2 to 0.4 s), ``metadata.csv``; the files
    in the folder's order (its metadata's)."""
    import soundfile

    tones = {"high": 3000.0, "low": 300.0, "mid": 1000.0}
    root.mkdir(parents=True, exist_ok=True)
    rows, files = [], []
    for i in range(n):
        label = list(tones)[i % 3]
        rate = (8000, 16000)[i % 2]
        name = f"{label}/{i:02d}.{'flac' if i % 2 else 'wav'}"
        (root / label).mkdir(exist_ok=True)
        t = np.arange(round(rate * (0.2 + 0.05 * ((i + seed) % 5)))) / rate
        soundfile.write(root / name, (0.2 + 0.1 * i) * np.sin(2 * np.pi * tones[label] * t), rate)
        rows.append({"file_name": name, "label": label})
        files.append(root / name)
    write_rows(root / "metadata.csv", rows)
    return files


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """train/ (6 clips), val/ (5 clips), a config that trains on them, and a model fitted with it."""
    pytest.importorskip("soundfile")
    pytest.importorskip("soxr")
    root = tmp_path_factory.mktemp("media_clips")
    make_clips(root / "train", 6)
    make_clips(root / "val", 5, seed=3)
    (root / "media_tasks.py").write_text(TASKS)
    config = {
        "engine": {"max_epochs": 1, "output_dir": "runs", "save_model": True},
        "task": {"class_path": "media_tasks.Mels"},
        "data": {
            "class_path": "torchloom.data.AudioClassificationData",
            "init_args": {
                "train": "train",
                "validation": "val",
                "max_duration": 0.25,
                "feature_args": {"n_mels": 8},
                "batch_size": 2,
                "cache_dir": str(root / "cache"),
            },
        },
    }
    return _fitted(root, config)


def clip_rows(root: Path, folder: Path, labels: bool | str = True) -> list[dict]:
    """The validation clips in `ORDER`, paths relative to ``folder`` in even rows and absolute in odd ones."""
    listed = pd.read_csv(root / "val" / "metadata.csv")
    rows = []
    for n, i in enumerate(ORDER):
        file = root / "val" / listed["file_name"][i]
        row = {"file_name": os.path.relpath(file, folder) if n % 2 == 0 else str(file)}
        if labels:
            row["label"] = listed["label"][i] if labels is True or n % 2 else None
        rows.append(row)
    return rows


def audio_data(root: Path) -> AudioClassificationData:
    data = AudioClassificationData(
        root / "train", root / "val", max_duration=0.25, feature_args={"n_mels": 8}, cache_dir=root / "cache"
    )
    data.prepare_data()
    data.setup("predict")
    return data


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".tsv", ".parquet"])
def test_audio_rows_of_a_file_are_the_folders_features_in_the_files_order(clips, suffix) -> None:
    (clips / "inputs").mkdir(exist_ok=True)
    file = write_rows(clips / "inputs" / f"rows{suffix}", clip_rows(clips, clips / "inputs"))
    data = audio_data(clips)
    got = predict_rows(data, file)
    assert len(got) == 5
    assert torch.equal(got[:]["input_features"], data.val_dataset[ORDER]["input_features"])
    assert got[:]["labels"].tolist() == data.val_dataset[ORDER]["labels"].tolist()


def test_audio_rows_without_labels_or_with_some_missing(clips) -> None:
    data = audio_data(clips)
    got = predict_rows(data, write_rows(clips / "some.jsonl", clip_rows(clips, clips, labels="some")))
    expected = data.val_dataset[ORDER]["labels"].tolist()
    assert got[:]["labels"].tolist() == [-1 if n % 2 == 0 else label for n, label in enumerate(expected)]
    got = predict_rows(data, write_rows(clips / "none.csv", clip_rows(clips, clips, labels=False)))
    assert set(got.column_names) == {"input_features"}
    assert torch.equal(got[:]["input_features"], data.val_dataset[ORDER]["input_features"])


def test_bad_audio_rows_name_the_file_the_row_and_what_is_valid(clips, tmp_path) -> None:
    data = audio_data(clips)
    rows = clip_rows(clips, tmp_path)
    missing = write_rows(tmp_path / "missing.jsonl", [*rows[:2], {"file_name": "low/nope.wav"}, *rows[2:]])
    with pytest.raises(ConfigError) as caught:
        predict_rows(data, missing)
    message = str(caught.value)
    assert f"'{missing}': line 3: audio_column 'file_name' names '{tmp_path / 'low' / 'nope.wav'}', which does not" in (
        message
    )
    assert f"expected the path of an audio file, absolute or relative to the file's folder '{tmp_path}'" in message
    with pytest.raises(ConfigError, match=r"missing\.parquet': row 3: audio_column 'file_name' names"):
        predict_rows(data, write_rows(tmp_path / "missing.parquet", [*rows[:2], {"file_name": "low/nope.wav"}]))
    (tmp_path / "noise.wav").write_bytes(b"RIFF not really a wav file at all")
    broken = write_rows(tmp_path / "broken.jsonl", [*rows[:3], {"file_name": "noise.wav"}])
    with pytest.raises(ConfigError) as caught:
        predict_rows(data, broken)
    assert f"'{broken}': line 4: audio file '{tmp_path / 'noise.wav'}'" in str(caught.value)
    other = write_rows(tmp_path / "other.jsonl", [{"path": r["file_name"]} for r in rows])
    with pytest.raises(ConfigError) as caught:
        predict_rows(data, other)
    assert f"'{other}': audio_column 'file_name' is not a column; the columns are path" in str(caught.value)


def test_cli_predicts_an_audio_file_as_its_folder_in_the_files_order(clips) -> None:
    """5 rows, relative and absolute paths: the predictions on the folder, reordered."""
    folder = predictions(run_cli("predict", "--config", "run.yaml", "--ckpt_path", "runs/version_0", cwd=clips), clips)
    (clips / "inputs").mkdir(exist_ok=True)
    write_rows(clips / "inputs" / "clips.csv", clip_rows(clips, clips / "inputs", labels=False))
    done = run_cli(
        "predict", "--config", "run.yaml", "--ckpt_path", "runs/version_0", "--input", "inputs/clips.csv", cwd=clips
    )
    assert "  batches = 3" in done.stdout
    got = predictions(done, clips)
    assert np.allclose(got, [folder[i] for i in ORDER], rtol=1e-5, atol=1e-6)
