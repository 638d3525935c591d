"""torchloom.data.image: decoding, transforms, augmentation, the cache key and reuse, errors, 2-process preparation.

The images are small PNG / JPEG / TIFF files written by the tests (random pixels from fixed seeds); the real
Fashion-MNIST images are tested with the example (tests/test_example_fashion_mnist.py).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import PIL.Image
import pytest
import torch

import torchloom
from cli_util import run_cli  # the torchloom command, in this process
from torchloom.data import (
    ImageAugmentation,
    ImageClassificationData,
    ImageTransform,
    cache_key,
    image_table,
    load_image,
    load_image_processor,
    preprocess_images,
    random_crop,
    random_horizontal_flip,
    read_image_folder,
)
from torchloom.errors import ConfigError

VIT = {"image_processor_type": "ViTImageProcessor", "size": {"height": 8, "width": 8}}


def pixels(seed: int, shape=(6, 6, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def make_folder(root: Path, counts: dict[str, int], seed: int = 0, shape=(6, 6, 3), suffix=".png") -> Path:
    """``root/<class>/<i>.png`` with ``counts[class]`` random images each."""
    for c, (name, count) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            PIL.Image.fromarray(pixels(seed * 1000 + c * 100 + i, shape)).save(root / name / f"{i:02d}{suffix}")
    return root


def prepared(*args, stage="fit", **kwargs) -> ImageClassificationData:
    data = ImageClassificationData(*args, **kwargs)
    data.prepare_data()
    data.setup(stage)
    return data


@pytest.fixture
def folders(tmp_path):
    train = make_folder(tmp_path / "train", {"dog": 4, "cat": 5, "bird": 3})
    val = make_folder(tmp_path / "val", {"dog": 2, "cat": 2}, seed=1)  # no "bird": ids follow the training classes
    return train, val


# ------------------------------------------------------------------------------- shapes, values, labels


def test_image_folder_gives_normalised_float32_pixels_and_sorted_class_ids(folders, tmp_path):
    train, val = folders
    (train / "cat" / "notes.txt").write_text("not an image: skipped")
    (train / "cat" / ".hidden.png").write_bytes(b"hidden: skipped")
    data = prepared(train, val, mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.5], batch_size=5, cache_dir=tmp_path / "c")
    assert data.label_names == ["bird", "cat", "dog"] and data.num_labels == 3
    assert len(data.train_dataset) == 12 and len(data.val_dataset) == 4
    assert data.train_dataset.features["labels"] == datasets.ClassLabel(names=["bird", "cat", "dog"])
    assert data.train_dataset[:]["labels"].tolist() == [0] * 3 + [1] * 5 + [2] * 4  # sorted by class, then file
    assert data.val_dataset[:]["labels"].tolist() == [1, 1, 2, 2]  # cat, dog keep the training ids

    row = data.train_dataset[3]  # cat/00.png
    assert row["pixel_values"].dtype == torch.float32 and row["pixel_values"].shape == (3, 6, 6)
    raw = np.asarray(PIL.Image.open(train / "cat" / "00.png"), np.float32).transpose(2, 0, 1) / 255
    expected = (raw - np.array([0.5, 0.4, 0.3])[:, None, None]) / np.array([0.2, 0.25, 0.5])[:, None, None]
    np.testing.assert_allclose(row["pixel_values"].numpy(), expected, rtol=0, atol=1e-6)

    batch = next(iter(data.val_dataloader()))
    assert set(batch) == {"pixel_values", "labels"}
    assert batch["pixel_values"].shape == (4, 3, 6, 6) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].dtype == torch.int64
    batches = list(data.train_dataloader())
    assert [len(b["labels"]) for b in batches] == [5, 5, 2]
    seen = torch.cat([b["labels"] for b in batches])
    assert sorted(seen.tolist()) == sorted(data.train_dataset[:]["labels"].tolist())


def test_without_normalisation_values_are_in_0_1_and_size_resizes(tmp_path):
    folder = make_folder(tmp_path / "f", {"a": 2, "b": 2}, shape=(5, 7, 3))
    data = prepared(folder, mode="L", size=[10, 4], resample="nearest", cache_dir=tmp_path / "c")
    values = data.train_dataset[:]["pixel_values"]
    assert values.shape == (4, 1, 10, 4) and values.min() >= 0.0 and values.max() <= 1.0
    grey = PIL.Image.open(folder / "a" / "00.png").convert("L").resize((4, 10), PIL.Image.Resampling.NEAREST)
    np.testing.assert_allclose(values[0, 0].numpy(), np.asarray(grey, np.float32) / 255, atol=1e-7)


def test_arrays_dataset_columns_and_label_kinds(tmp_path):
    images = np.stack([pixels(i, (4, 4)) for i in range(6)])
    # (images, labels) arrays with integer labels: ids kept, names "0".."2"
    data = prepared((images, np.array([2, 0, 1, 2, 0, 1])), mode="L", cache_dir=tmp_path)
    assert data.label_names == ["0", "1", "2"] and data.train_dataset[:]["labels"].tolist() == [2, 0, 1, 2, 0, 1]
    np.testing.assert_allclose(data.train_dataset[1]["pixel_values"][0].numpy(), images[1] / 255, atol=1e-7)
    # a mapping with string labels and chosen names
    mapping = {"img": images, "kind": ["x", "y", "x", "y", "x", "y"]}
    data = prepared(
        mapping, image_column="img", label_column="kind", label_names=["y", "x"], mode="L", cache_dir=tmp_path
    )
    assert data.label_names == ["y", "x"] and data.train_dataset[:]["labels"].tolist() == [1, 0, 1, 0, 1, 0]
    # a datasets Image column (encoded bytes), a ClassLabel column, RGB colour arrays in L mode
    encoded = []
    for i in range(4):
        buffer = io.BytesIO()
        PIL.Image.fromarray(pixels(i)).save(buffer, "PNG")
        encoded.append({"bytes": buffer.getvalue(), "path": None})
    table = datasets.Dataset.from_dict(
        {"picture": encoded, "y": [0, 1, 1, 0]},
        features=datasets.Features({"picture": datasets.Image(), "y": datasets.ClassLabel(names=["no", "yes"])}),
    )
    data = prepared(table, image_column="picture", label_column="y", mode="L", cache_dir=tmp_path)
    grey = np.asarray(PIL.Image.fromarray(pixels(2)).convert("L"), np.float32) / 255
    np.testing.assert_allclose(data.train_dataset[2]["pixel_values"][0].numpy(), grey, atol=1e-7)
    assert data.label_names == ["no", "yes"]
    # a list of images of different sizes, resized to one
    ragged = [pixels(0, (4, 4, 3)), pixels(1, (6, 3, 3))]
    data = prepared((ragged, [0, 1]), size=5, cache_dir=tmp_path)
    assert data.train_dataset[:]["pixel_values"].shape == (2, 3, 5, 5)


def test_load_image_sources_and_mode_rules(tmp_path):
    rgb = pixels(3)
    path = tmp_path / "x.png"
    PIL.Image.fromarray(rgb).save(path)
    expected = np.asarray(PIL.Image.fromarray(rgb))
    for source in (path, str(path), path.read_bytes(), {"bytes": None, "path": str(path)}, rgb, PIL.Image.open(path)):
        image = load_image(source)
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), expected)
    assert load_image(rgb, "L").mode == "L"
    # transparent pixels are laid over white
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)
    assert np.asarray(load_image(rgba)).tolist() == [[[10, 20, 30], [255, 255, 255]], [[255, 255, 255]] * 2]
    # 16-bit grey is scaled to 8 bits, not clipped
    wide = np.array([[0, 257, 65535, 32896]], np.uint16)
    buffer = io.BytesIO()
    PIL.Image.fromarray(wide).save(buffer, "PNG")
    assert np.asarray(load_image(buffer.getvalue(), "L")).tolist() == [[0, 1, 255, 128]]
    # EXIF orientation 6 (rotate 90 degrees clockwise to view) is applied: a 4x2 photo comes out 2x4
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    PIL.Image.fromarray(pixels(4, (2, 4, 3))).save(tmp_path / "turned.jpg", exif=exif)
    assert load_image(tmp_path / "turned.jpg").size == (2, 4)


def test_image_processor_from_a_dict_and_from_a_directory(tmp_path):
    folder = make_folder(tmp_path / "f", {"a": 3, "b": 3})
    processor = load_image_processor(VIT)
    directory = tmp_path / "processor"
    processor.save_pretrained(directory)
    from_dict = prepared(folder, image_processor=VIT, cache_dir=tmp_path / "c")
    from_dir = prepared(folder, image_processor=str(directory), cache_dir=tmp_path / "c")
    assert from_dict.cache_path == from_dir.cache_path and from_dir.cache_hit is True  # the same processor config
    values = from_dict.train_dataset[:]["pixel_values"]
    assert values.shape == (6, 3, 8, 8) and values.dtype == torch.float32
    assert values.min() >= -1.0 and values.max() <= 1.0  # ViT's default mean/std 0.5: [0, 1] -> [-1, 1]
    direct = processor(images=[np.asarray(PIL.Image.open(folder / "a" / "01.png"))], return_tensors="np")
    np.testing.assert_allclose(values[1].numpy(), direct["pixel_values"][0], atol=1e-6)
    grey = prepared(
        folder, mode="L", image_processor={**VIT, "image_mean": [0.5], "image_std": [0.5]}, cache_dir=tmp_path
    )
    assert grey.train_dataset[:]["pixel_values"].shape == (6, 1, 8, 8)


# ------------------------------------------------------------------------------------------ augmentation


def test_random_crop_shifts_each_image_and_flip_mirrors():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).reshape(2, 1, 5, 5)
    g = torch.Generator().manual_seed(0)
    out = random_crop(x, 2, generator=g)
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="replicate")
    for i in range(2):  # every output is a 5x5 window of its own padded image
        windows = [padded[i, :, dy : dy + 5, dx : dx + 5] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], w) for w in windows)
    assert torch.equal(random_crop(x, 2, torch.Generator().manual_seed(0)), out)  # the same draws, the same crops
    assert random_crop(x, 0) is x
    assert torch.equal(random_horizontal_flip(x, 1.0), x.flip(-1)) and random_horizontal_flip(x, 0.0) is x
    flipped = random_horizontal_flip(torch.ones(400, 1, 1, 2) * torch.tensor([0.0, 1.0]), 0.5, torch.Generator())
    assert 120 < int((flipped[:, 0, 0, 0] == 1).sum()) < 280


def test_training_batches_are_augmented_validation_batches_are_not(folders, tmp_path):
    train, _ = folders
    data = prepared(train, train, random_crop_padding=2, horizontal_flip=0.5, batch_size=12, cache_dir=tmp_path)
    stored = data.train_dataset[:]["pixel_values"]
    torch.manual_seed(0)
    first = next(iter(data.train_dataloader()))
    second = next(iter(data.train_dataloader()))
    val = next(iter(data.val_dataloader()))
    assert torch.equal(val["pixel_values"], data.val_dataset[:]["pixel_values"][:12])  # as stored, in order
    assert not torch.equal(first["pixel_values"], second["pixel_values"])  # new draws every pass
    assert first["pixel_values"].shape == (12, 3, 6, 6)
    changed = sum(not any(torch.equal(p, s) for s in stored) for p in first["pixel_values"])
    assert changed >= 6
    with pytest.raises(ConfigError, match="setting 'horizontal_flip' = 2; expected a probability"):
        ImageAugmentation(horizontal_flip=2)


# ---------------------------------------------------------------------------------------------- the cache


def test_second_run_loads_from_the_cache_without_preprocessing(folders, tmp_path, monkeypatch):
    train, val = folders
    first = prepared(train, val, mean=0.5, std=0.5, cache_dir=tmp_path / "cache")
    assert first.cache_hit is False
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.cache_path.name]

    calls = []
    monkeypatch.setattr("torchloom.data.image.preprocess_images", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(datasets.Dataset, "map", lambda *a, **k: calls.append(a))
    second = prepared(train, val, mean=0.5, std=0.5, batch_size=3, random_crop_padding=1, cache_dir=tmp_path / "cache")
    assert calls == [] and second.cache_hit is True and second.cache_path == first.cache_path
    assert all(f["filename"].startswith(str(first.cache_path)) for f in second.train_dataset.cache_files)
    assert torch.equal(second.train_dataset[:]["pixel_values"], first.train_dataset[:]["pixel_values"])
    info = second.cache.info(first.cache_path.name)["settings"]
    assert info["transform"]["mean"] == [0.5, 0.5, 0.5] and info["transform"]["mode"] == "RGB"


def test_cache_key_changes_with_every_setting_and_the_raw_data(folders, tmp_path):
    train, val = folders

    def key(source=train, **settings):
        return cache_key(**ImageClassificationData(source, val, cache_dir=tmp_path, **settings).cache_settings())

    base = key()
    assert key(batch_size=7, random_crop_padding=3, horizontal_flip=0.5, max_train_samples=2, seed=5) == base
    variants = [
        key(mode="L"),
        key(size=8),
        key(size=[8, 6]),
        key(mean=0.5, std=0.5),
        key(mean=0.5, std=0.25),
        key(size=8, resample="bicubic"),
        key(image_processor=VIT),
        key(image_processor={**VIT, "size": {"height": 9, "width": 9}}),
        key(label_names=["dog", "cat", "bird"]),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # the same bytes elsewhere: the same key; one changed pixel, one more file: another key
    moved = tmp_path / "moved"
    shutil.copytree(train, moved)
    assert key(moved) == base
    PIL.Image.fromarray(pixels(99)).save(moved / "dog" / "00.png")
    changed = key(moved)
    (moved / "dog" / "extra.png").write_bytes((train / "dog" / "01.png").read_bytes())
    assert len({base, changed, key(moved)}) == 3
    # a datasets Image column that only names files: editing a file changes the key
    files = sorted(str(p) for p in moved.rglob("*.png"))
    table = datasets.Dataset.from_dict({"image": files, "label": [0] * len(files)}).cast_column(
        "image", datasets.Image()
    )
    before = cache_key(**ImageClassificationData(table, cache_dir=tmp_path).cache_settings())
    PIL.Image.fromarray(pixels(98)).save(files[0])
    assert cache_key(**ImageClassificationData(table, cache_dir=tmp_path).cache_settings()) != before


def test_an_empty_class_folder_is_an_error_that_names_it_and_its_split(tmp_path):
    train = make_folder(tmp_path / "train", {"a": 2, "b": 2})
    assert prepared(train, cache_dir=tmp_path / "cache").label_names == ["a", "b"]
    (train / "aa").mkdir()  # sorts between a and b: as a class it would move b from id 1 to id 2
    (train / "aa" / "notes.txt").write_text("not an image")
    with pytest.raises(ConfigError) as caught:  # not served the entry of the folder without it
        prepared(train, cache_dir=tmp_path / "cache")
    assert str(caught.value) == (
        f"ImageClassificationData train data: class folder '{train / 'aa'}' has no image files; expected at least "
        "one image in each class sub-folder: add images, remove the folder, or set allow_empty_classes=True to keep "
        "it as a class with no samples"
    )
    val = make_folder(tmp_path / "val", {"a": 1, "b": 1}, seed=1)
    (val / "a2").mkdir()
    (val / "a3").mkdir()
    with pytest.raises(ConfigError) as caught:
        prepared(make_folder(tmp_path / "t2", {"a": 1, "a2": 1, "a3": 1, "b": 1}), val, cache_dir=tmp_path / "c2")
    assert str(caught.value).startswith(
        f"ImageClassificationData validation data: class folder '{val / 'a2'}' has no image files (nor do 'a3'); "
    )
    assert not (tmp_path / "c2").exists()  # refused before anything was cached


def test_folders_that_differ_by_an_empty_class_folder_get_other_keys_and_their_own_labels(tmp_path):
    first = make_folder(tmp_path / "first", {"a": 2, "b": 2})
    second = tmp_path / "second"
    shutil.copytree(first, second)
    (second / "aa").mkdir()
    cache = tmp_path / "cache"
    one = prepared(first, allow_empty_classes=True, cache_dir=cache)
    assert one.label_names == ["a", "b"] and one.train_dataset[:]["labels"].tolist() == [0, 0, 1, 1]
    two = prepared(second, allow_empty_classes=True, cache_dir=cache)
    assert two.cache_hit is False and two.cache_path != one.cache_path
    assert two.label_names == ["a", "aa", "b"] and two.train_dataset[:]["labels"].tolist() == [0, 0, 2, 2]
    assert two.cache.info(two.cache_path.name)["settings"]["classes"] == ["a", "aa", "b"]
    # allow_empty_classes only decides whether the folder is an error; it is not part of the key
    assert prepared(first, cache_dir=cache).cache_path == one.cache_path


def test_a_cache_entry_built_from_other_settings_is_refused_not_returned(tmp_path):
    folder = make_folder(tmp_path / "f", {"a": 2, "b": 2})
    cache = tmp_path / "cache"
    rgb, grey = prepared(folder, cache_dir=cache), prepared(folder, mode="L", cache_dir=cache)
    # the two entries swap places (copied by hand, restored from a backup, renamed by a script)
    rgb.cache_path.rename(cache / "swap")
    grey.cache_path.rename(rgb.cache_path)
    (cache / "swap").rename(grey.cache_path)
    with pytest.raises(ConfigError) as caught:
        prepared(folder, cache_dir=cache)
    assert str(caught.value) == (
        f"processed-dataset cache entry '{rgb.cache_path}' was built from other settings than this request's: "
        'transform.mode is "L" in the entry but "RGB" now; delete that directory to rebuild it'
    )
    # and an entry replaced between prepare_data and setup is refused by setup the same way
    shutil.rmtree(cache)
    data = ImageClassificationData(folder, mode="L", cache_dir=cache)
    data.prepare_data()
    assert data.cache_hit is False and data.cache_path == grey.cache_path
    prepared(folder, cache_dir=cache)
    shutil.rmtree(grey.cache_path)
    shutil.copytree(rgb.cache_path, grey.cache_path)
    with pytest.raises(ConfigError) as caught:
        data.setup("fit")
    assert 'transform.mode is "RGB" in the entry but "L" now; delete that directory' in str(caught.value)
    assert data.train_dataset is None


# ------------------------------------------------------------------------------------------------- errors


def errors_of(source, tmp_path, **settings) -> str:
    with pytest.raises(ConfigError) as caught:
        prepared(source, cache_dir=tmp_path / "cache", **settings)
    return str(caught.value)


def test_unreadable_truncated_and_unconvertible_images_name_the_file(tmp_path):
    folder = make_folder(tmp_path / "f", {"a": 2, "b": 2})
    bad = folder / "b" / "02.png"
    bad.write_bytes(b"this is not a PNG")
    message = errors_of(folder, tmp_path)
    assert f"train data: image file '{bad}' is not an image that Pillow can read" in message
    whole = (folder / "a" / "00.png").read_bytes()
    bad.write_bytes(whole[: len(whole) * 2 // 3])
    assert f"image file '{bad}' is truncated or corrupt (image file is truncated" in errors_of(folder, tmp_path)
    bad.unlink()
    PIL.Image.new("LAB", (6, 6), (50, 0, 0)).save(folder / "b" / "lab.tif")
    message = errors_of(folder, tmp_path, mode="L")
    assert (
        f"image file '{folder / 'b' / 'lab.tif'}' is an image in mode 'LAB', which cannot be converted to 'L'"
        in message
    )
    (folder / "b" / "lab.tif").unlink()
    PIL.Image.fromarray(np.ones((6, 6), np.float32)).save(folder / "b" / "float.tif")
    message = errors_of(folder, tmp_path)
    assert "float.tif' is an image in mode 'F' (32-bit floating-point pixels, no fixed value range)" in message
    # bytes in a table: the row is named
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": whole, "path": None}, {"bytes": whole[:100], "path": None}], "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    assert "train data: row 1 of column 'image' is truncated or corrupt" in errors_of(table, tmp_path)
    with pytest.raises(ConfigError, match=r"image file '/nonexistent\.png' does not exist"):
        load_image("/nonexistent.png")


def test_missing_columns_wrong_labels_and_empty_splits(tmp_path):
    images = np.stack([pixels(i, (4, 4)) for i in range(4)])
    mapping = {"image": images, "label": [0, 1, 0, 1]}
    table = image_table(mapping)
    message = errors_of(table, tmp_path, image_column="picture")
    assert "train data: image_column 'picture' is not a column; the columns are image, label" in message
    assert "label_column 'y' is not a column" in errors_of(table, tmp_path, label_column="y")
    floats = image_table({"image": images, "label": [0.5, 1.0, 0.0, 2.5]})
    assert "label_column 'label' has values of type Value('float64')" in errors_of(floats, tmp_path)
    paths = datasets.Dataset.from_dict({"image": ["a.png"], "label": [0]})
    assert "image_column 'image' has type Value('string') (file paths?" in errors_of(paths, tmp_path)
    assert "train data has no rows; an empty split" in errors_of(table.select([]), tmp_path)
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "b").mkdir()
    assert "has no image files in its class sub-folders (a, b); an empty split" in errors_of(
        tmp_path / "empty", tmp_path
    )
    assert "has no class sub-folders" in errors_of(tmp_path / "empty" / "a", tmp_path)
    assert "path '/nonexistent' does not exist" in errors_of("/nonexistent", tmp_path)
    floats_pixels = {"image": images.astype(np.float32), "label": [0, 1, 0, 1]}
    assert "image 0 is an array of dtype float32" in errors_of(floats_pixels, tmp_path)
    assert "4 images but 3 labels" in errors_of((images, [0, 1, 0]), tmp_path)
    make_folder(tmp_path / "val", {"a": 1, "zebra": 1})
    train = make_folder(tmp_path / "train", {"a": 1, "b": 1})
    with pytest.raises(ConfigError, match=r"class sub-folders \['zebra'\] that are not in label_names \['a', 'b'\]"):
        prepared(train, tmp_path / "val", cache_dir=tmp_path / "cache")


def test_bad_settings_are_config_errors(tmp_path):
    cases = {
        "setting 'mode' = 'CMYK'; expected one of RGB, L": {"mode": "CMYK"},
        r"setting 'size' = \[0, 4\]; expected a positive integer or \[height, width\]": {"size": [0, 4]},
        "mean=.* has 2 values; mode has 3 channel": {"mean": [0.5, 0.5], "std": 0.5},
        "set both mean and std, or neither": {"mean": 0.5},
        "image_processor is set together with size/mean/std": {"image_processor": VIT, "size": 8},
        "setting 'resample' = 'fancy'; expected one of": {"resample": "fancy"},
        "setting 'crop_padding' = -1; expected an integer >= 0": {"random_crop_padding": -1},
        "setting 'batch_size' = 0; expected a positive integer": {"batch_size": 0},
        "setting 'label_names' = .*expected a list of 2 or more distinct strings": {"label_names": ["a", "a"]},
    }
    for pattern, settings in cases.items():
        with pytest.raises(ConfigError, match=f"ImageClassificationData: .*{pattern}"):
            ImageClassificationData("x", cache_dir=tmp_path, **settings)
    with pytest.raises(ConfigError, match="has no 'image_processor_type'"):
        load_image_processor({"size": 8})
    with pytest.raises(ConfigError, match=r"has no preprocessor_config\.json"):
        load_image_processor(tmp_path)
    with pytest.raises(ConfigError, match=r"ViTImageProcessor.*failed on .* one value per channel"):
        transform = ImageTransform("L", processor=load_image_processor({**VIT, "image_mean": [0.5, 0.5]}))
        transform([PIL.Image.new("L", (4, 4))])


def test_a_bad_image_stops_the_fit_before_the_first_step(tmp_path):
    folder = make_folder(tmp_path / "f", {"a": 2, "b": 2})
    (folder / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    steps = []

    class Task(torchloom.TaskModule):
        def configure_model(self):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(108, 2))

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return torch.nn.functional.cross_entropy(self.model(batch["pixel_values"]), batch["labels"])

    data = ImageClassificationData(folder, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match=f"image file '{folder / 'a' / 'broken.jpg'}'"):
        torchloom.Engine(max_epochs=1, output_dir=str(tmp_path / "run")).fit(Task(), datamodule=data)
    assert steps == [] and not (tmp_path / "cache").exists()


def test_preprocess_images_directly_and_read_image_folder(tmp_path):
    folder = make_folder(tmp_path / "f", {"b": 1, "a": 2})
    table = read_image_folder(folder)
    assert table.features["label"].names == ["a", "b"] and list(table["label"]) == [0, 0, 1]
    assert [Path(v["path"]).name for v in table[:]["image"]] == ["00.png", "01.png", "00.png"]
    out = preprocess_images(table, ImageTransform("L", size=3), keep_columns=("label",))
    assert out.column_names == ["label", "pixel_values"] and np.asarray(out[:]["pixel_values"]).shape == (3, 1, 3, 3)


# --------------------------------------------------------------------------------------- several processes


@pytest.mark.multiprocess
def test_two_processes_preprocess_once_and_train_on_disjoint_shards(tmp_path):
    from torchrun_util import torchrun

    folder = make_folder(tmp_path / "images", {"a": 8, "b": 8, "c": 8, "d": 8})
    results = torchrun("image_prepare.py", tmp_path, str(folder), str(tmp_path / "cache"))
    main, other = results
    assert [r["world_size"] for r in results] == [2, 2]
    assert main["preprocess_calls"] == ["ImageClassificationData train data"] and other["preprocess_calls"] == []
    assert (main["cache_hit"], other["cache_hit"]) == (False, True)
    assert main["cache_path"] == other["cache_path"] and len(os.listdir(tmp_path / "cache")) == 1
    assert main["data_sha256"] == other["data_sha256"] and main["label_names"] == ["a", "b", "c", "d"]
    everything = main["all_ids"]
    assert len(set(everything)) == 32  # distinct images, so a sample's pixel sum identifies it
    assert len(main["seen"]) == len(other["seen"]) == 16
    assert not set(main["seen"]) & set(other["seen"])
    assert sorted(main["seen"] + other["seen"]) == sorted(everything)
    info = json.loads((Path(main["cache_path"]) / "torchloom_cache.json").read_text())
    assert info["settings"]["sources"] == {"train": "image folder"}


# ------------------------------------------------------------------------------------------ config files


PROBE_TASK = """
import torch, torchloom

class Probe(torchloom.TaskModule):
    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        print("batch", tuple(batch["pixel_values"].shape), batch["pixel_values"].dtype, flush=True)
        return torch.nn.functional.cross_entropy(self.model(batch["pixel_values"]), batch["labels"])
"""


def test_cli_config_with_an_image_processor_mapping(tmp_path):
    """The user guide's YAML: a processor given as a mapping reaches load_image_processor as a dict (not as its
    string form), and augmentation settings parse."""

    import yaml

    make_folder(tmp_path / "images" / "train", {"a": 4, "b": 4})
    (tmp_path / "probe_task.py").write_text(PROBE_TASK)
    config = {
        "engine": {"max_epochs": 1, "output_dir": str(tmp_path / "runs")},
        "task": {"class_path": "probe_task.Probe"},
        "data": {
            "class_path": "torchloom.data.ImageClassificationData",
            "init_args": {
                "train": str(tmp_path / "images" / "train"),
                "image_processor": {**VIT, "size": {"height": 16, "width": 16}},
                "random_crop_padding": 4,
                "horizontal_flip": 0.5,
                "batch_size": 4,
                "cache_dir": str(tmp_path / "cache"),
            },
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("fit", "--config", str(tmp_path / "config.yaml"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("batch (4, 3, 16, 16) torch.float32") == 2
    (entry,) = (tmp_path / "cache").iterdir()
    settings = json.loads((entry / "torchloom_cache.json").read_text())["settings"]
    assert settings["transform"]["processor"]["config"]["size"] == {"height": 16, "width": 16}
