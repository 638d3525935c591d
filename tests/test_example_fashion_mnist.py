"""examples/fashion_mnist: the image example end to end on a small slice of the real images (CPU, offline once cached).

The images come from the Debian package dataset-fashion-mnist: the installed files in /usr/share/datasets/fashion-mnist,
else fetched once with ``apt-get download`` into ``~/.cache/torchloom/fashion_mnist`` (or
``$TORCHLOOM_CACHE/fashion_mnist``); later runs read the cached tables.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
import PIL.Image
import pytest
import torch
import yaml

import torchloom
from cli_util import run_cli  # the torchloom command, in this process
from example_results import assert_reaches_recorded
from torchloom.data import ImageClassificationData

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "fashion_mnist.yaml"
SMALL = {"max_train_samples": 1024, "max_val_samples": 500, "batch_size": 64, "eval_batch_size": 250}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fashion_mnist():
    """The example module, with the data fetched (skipped only where it cannot be fetched at all)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import fashion_mnist

        data_dir = fashion_mnist.FashionMNISTData().data_dir
        cached = all((data_dir / f"fashion_mnist_{s}" / "dataset_info.json").is_file() for s in ("train", "test"))
        installed = all((fashion_mnist.INSTALLED / f).is_file() for pair in fashion_mnist.FILES.values() for f in pair)
        fetchable = shutil.which("apt-get") is not None and shutil.which("dpkg-deb") is not None
        if not (cached or installed or fetchable):
            pytest.skip(
                "Fashion-MNIST is not cached or installed, and apt-get / dpkg-deb are not available to fetch it"
            )
        fashion_mnist.fetch_fashion_mnist(data_dir)
        yield fashion_mnist
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def threads():
    """The example sets torch's thread count; give the rest of the session back its own."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def raw_split(fashion_mnist, split: str) -> datasets.Dataset:
    return datasets.load_from_disk(str(fashion_mnist.FashionMNISTData().splits[split]))


def test_data_step_reads_both_splits(fashion_mnist):
    train, test = raw_split(fashion_mnist, "train"), raw_split(fashion_mnist, "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.features["label"].names == fashion_mnist.CLASSES
    assert train.features["image"] == datasets.Array2D(shape=(28, 28), dtype="uint8")
    assert np.bincount(train[:]["label"], minlength=10).tolist() == [6000] * 10
    assert np.bincount(test[:]["label"], minlength=10).tolist() == [1000] * 10
    # the first training labels of the original files: ankle boot, T-shirt/top, T-shirt/top, dress, ...
    assert list(train[:10]["label"]) == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    first = np.asarray(train.with_format("numpy")[0]["image"])
    assert first.shape == (28, 28) and first.min() == 0 and first.max() == 255


def test_real_images_through_a_folder_arrays_and_the_example_keep_labels_and_pixels(fashion_mnist, tmp_path):
    """30 real test images: written as PNG files into class folders, given as arrays, and as the example's own
    processed validation split: the same labels, and pixel values (x / 255 - mean) / std of the raw bytes."""
    mean, std = fashion_mnist.MEAN, fashion_mnist.STD
    test = raw_split(fashion_mnist, "test").with_format("numpy")[:30]
    images, labels = test["image"].astype(np.uint8), test["label"]
    names = fashion_mnist.CLASSES
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = tmp_path / "images" / names[label].replace("/", "-")  # "T-shirt/top" is not a folder name
        folder.mkdir(parents=True, exist_ok=True)
        PIL.Image.fromarray(image).save(folder / f"{i:02d}.png")
    by_folder = ImageClassificationData(tmp_path / "images", mode="L", mean=mean, std=std, cache_dir=tmp_path / "c")
    by_folder.prepare_data()
    by_folder.setup("fit")
    folder_names = sorted({names[label].replace("/", "-") for label in labels})
    assert by_folder.label_names == folder_names
    got = by_folder.train_dataset[:]
    rows = sorted(range(30), key=lambda i: (folder_names.index(names[labels[i]].replace("/", "-")), i))
    expected = (images[rows].astype(np.float32) / 255 - mean) / std
    np.testing.assert_allclose(got["pixel_values"][:, 0].numpy(), expected, atol=1e-6)
    assert [by_folder.label_names[i] for i in got["labels"]] == [names[labels[i]].replace("/", "-") for i in rows]

    by_arrays = ImageClassificationData(
        (images, labels), label_names=names, mode="L", mean=mean, std=std, cache_dir=tmp_path / "c"
    )
    by_arrays.prepare_data()
    by_arrays.setup("fit")
    arrays = by_arrays.train_dataset[:]
    assert arrays["labels"].tolist() == labels.tolist() and by_arrays.label_names == names
    np.testing.assert_allclose(arrays["pixel_values"][:, 0].numpy(), (images / 255 - mean) / std, atol=1e-6)
    assert float(arrays["pixel_values"].min()) == pytest.approx(-mean / std, abs=1e-6)  # black background

    example = fashion_mnist.FashionMNISTData()
    example.prepare_data()
    example.setup("fit")
    val = example.val_dataset[:30]
    assert val["labels"].tolist() == labels.tolist() and example.label_names == names
    torch.testing.assert_close(val["pixel_values"], arrays["pixel_values"], rtol=0, atol=0)
    assert example.train_dataset[:]["pixel_values"].shape == (60000, 1, 28, 28)


def test_cli_fit_learns_well_above_chance_and_saves_a_reloadable_model(fashion_mnist, tmp_path):
    out = tmp_path / "run"
    overrides = [f"--data.init_args.{k}={v}" for k, v in SMALL.items()]
    command = ["fit", "--config", str(CONFIG), *overrides, "--engine.max_epochs=1", f"--engine.output_dir={out}"]
    result = run_cli(*command, cwd=os.getcwd())
    assert result.returncode == 0, result.stderr[-3000:]
    config = yaml.safe_load((out / "latest" / "config.yaml").read_text())
    assert config["task"]["class_path"] == "fashion_mnist.FashionMNISTClassifier"
    records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "val/accuracy" in r][-1]
    assert final["step"] == 16  # 1024 images / batch 64, one epoch
    assert final["val/majority_rate"] < 0.2 < 0.5 < final["val/accuracy"]  # chance is 0.1
    assert_reaches_recorded("fashion_mnist/test_slice", final)  # what the page shows (examples/results.py)
    assert "val/accuracy" in result.stdout

    # The saved weights reload into the same model and reproduce the logged accuracy over the same 500 images.
    model = torchloom.TaskModule.load_model(fashion_mnist.build_model("cnn", 32), out / "latest" / "model").eval()
    data = fashion_mnist.FashionMNISTData(**SMALL)
    data.prepare_data()
    data.setup("validate")
    assert data.cache_hit is True
    with torch.no_grad():
        correct = sum((model(b["pixel_values"]).argmax(-1) == b["labels"]).sum().item() for b in data.val_dataloader())
    assert correct / 500 == pytest.approx(final["val/accuracy"], abs=1e-12)


def test_vit_config_with_an_image_processor_trains_through_python(fashion_mnist, tmp_path, threads):
    from transformers import ViTForImageClassification

    config = yaml.safe_load((EXAMPLES / "fashion_mnist_vit.yaml").read_text())
    task = fashion_mnist.FashionMNISTClassifier(**config["task"]["init_args"])
    data = fashion_mnist.FashionMNISTData(**{**config["data"]["init_args"], **SMALL, "max_train_samples": 256})
    engine = torchloom.Engine(**{**config["engine"], "max_epochs": 1, "output_dir": str(tmp_path)})
    metrics = engine.fit(task, datamodule=data)
    assert engine.progress.global_step == 4 and 0.0 <= metrics["val/accuracy"] <= 1.0
    assert data.transform.settings()["processor"]["class"].startswith("ViTImageProcessor")
    # ViTImageProcessor without resizing does the same normalisation as the plain settings
    plain = fashion_mnist.FashionMNISTData(**SMALL)
    plain.prepare_data()
    plain.setup("fit")
    torch.testing.assert_close(
        data.val_dataset[:8]["pixel_values"], plain.val_dataset[:8]["pixel_values"], atol=1e-6, rtol=0
    )
    assert data.cache_path != plain.cache_path
    reloaded = ViTForImageClassification.from_pretrained(tmp_path / "latest" / "model").eval()
    assert reloaded.config.id2label[9] == "Ankle boot"
    batch = next(iter(data.val_dataloader()))
    trained = task.accelerator.unwrap_model(task.model).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(pixel_values=batch["pixel_values"]).logits, trained(pixel_values=batch["pixel_values"]).logits
        )


def test_bad_settings_are_config_errors(fashion_mnist, tmp_path):
    with pytest.raises(torchloom.ConfigError, match="architecture='resnet'; expected 'cnn' or 'vit'"):
        fashion_mnist.FashionMNISTClassifier(architecture="resnet")
    with pytest.raises(torchloom.ConfigError, match="lr=-1; expected a number >= 0"):
        fashion_mnist.FashionMNISTClassifier(lr=-1)
    with pytest.raises(torchloom.ConfigError, match="image_size=30; the CNN needs a multiple of 4"):
        fashion_mnist.FashionMNISTClassifier(image_size=30)
    with pytest.raises(
        torchloom.ConfigError, match="FashionMNISTData: setting 'batch_size' = 0; expected a positive integer"
    ):
        fashion_mnist.FashionMNISTData(batch_size=0)
    with pytest.raises(torchloom.ConfigError, match=r"deb_path '/nonexistent\.deb' does not exist"):
        fashion_mnist.fetch_fashion_mnist(tmp_path, deb_path="/nonexistent.deb")
    (tmp_path / "bad.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="is not an unsigned-byte IDX file"):
        fashion_mnist.read_idx(tmp_path / "bad.gz")
