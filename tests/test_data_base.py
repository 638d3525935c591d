"""torchloom.data.base: the contract a data module on `CachedDataModule` follows, shown on the smallest one.

`PowersData` reads a table with a number ``x`` and a label, and preprocesses it into ``y = x ** power``. It implements
only what a modality supplies (``read_split``, ``cache_settings``, ``preprocess``, ``format_split``); everything
else (prepare once, the cache hit, the settings check, subsets, label names, dataloaders, settings errors) is the
base's, and is what text, image and audio (and the causal-LM module to come) rely on.
"""

from __future__ import annotations

import shutil

import datasets
import pandas as pd
import pytest
import torch

from torchloom.data import CachedDataModule, cache_key, fingerprint, read_table, require_column
from torchloom.errors import ConfigError


class PowersData(CachedDataModule):
    """``x ** power`` of a table's ``x`` column; ``calls`` records what was read and preprocessed."""

    train_description = "the training rows (a table)"

    def __init__(
        self,
        train=None,
        validation=None,
        *,
        power: int = 2,
        label_column: str | None = "label",
        label_names: list[str] | None = None,
        batch_size: int = 4,
        eval_batch_size: int | None = None,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir=None,
    ) -> None:
        self.check_count("power", power)
        self.power = power
        self.calls: list[tuple[str, str]] = []
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

    def read_split(self, split, source):
        self.calls.append(("read", split))
        return read_table(source, self.split_name(split))

    def cache_settings(self):
        return {
            "kind": "tests.PowersData",
            "data": {split: fingerprint(source) for split, source in self.sources().items()},
            "label_column": self.label_column,
            "label_names": self.label_names_setting,
            "classes": self.class_names(),
            "power": self.power,
        }

    def preprocess(self, split, table):
        self.calls.append(("preprocess", split))
        require_column(table, "x", "x column", self.split_name(split))
        keep = [c for c in table.column_names if c == "labels"]
        return table.map(lambda row: {"y": float(row["x"]) ** self.power}, keep_in_memory=True).select_columns(
            [*keep, "y"]
        )

    def format_split(self, dataset):
        return dataset.with_format("torch")


def table(n: int = 12, labels=("b", "a", "c")) -> pd.DataFrame:
    return pd.DataFrame({"x": list(range(n)), "label": [labels[i % len(labels)] for i in range(n)]})


def prepared(*args, **kwargs) -> PowersData:
    data = PowersData(*args, **kwargs)
    data.prepare_data()
    data.setup("fit")
    return data


def test_prepares_once_and_a_second_instance_loads_the_entry(tmp_path, monkeypatch):
    first = prepared(table(), table(6), cache_dir=tmp_path)
    assert first.cache_hit is False and first.calls.count(("preprocess", "train")) == 1
    assert [p.name for p in tmp_path.iterdir()] == [first.cache_path.name]  # one entry, nothing half-written
    assert first.train_dataset[:]["y"].tolist() == [float(x * x) for x in range(12)]

    monkeypatch.setattr(datasets.Dataset, "map", lambda *a, **k: pytest.fail("preprocessed again"))
    second = prepared(table(), table(6), cache_dir=tmp_path, batch_size=2, max_train_samples=3)
    assert second.cache_hit is True and second.cache_path == first.cache_path
    assert ("preprocess", "train") not in second.calls and ("preprocess", "validation") not in second.calls
    assert all(f["filename"].startswith(str(first.cache_path)) for f in second.train_dataset.cache_files)
    # setup without prepare_data (another process, or a caller that skipped it) prepares first
    third = PowersData(table(), table(6), cache_dir=tmp_path)
    third.setup("validate")
    assert third.cache_hit is True and third.val_dataset[:]["y"].tolist() == [float(x * x) for x in range(6)]


def test_the_key_follows_the_data_and_the_settings_and_a_swapped_entry_is_refused(tmp_path):
    def key(*args, **kwargs):
        return cache_key(**PowersData(*args, cache_dir=tmp_path, **kwargs).cache_settings())

    base = key(table())
    assert key(table(), batch_size=2, max_train_samples=3, shuffle=False, seed=5) == base  # after the cache
    assert len({base, key(table(), power=3), key(table(13)), key(table(), label_names=["c", "b", "a"])}) == 4

    cubes = prepared(table(), power=3, cache_dir=tmp_path / "c")
    squares = PowersData(table(), cache_dir=tmp_path / "c")
    squares.prepare_data()
    shutil.rmtree(squares.cache_path, ignore_errors=True)
    shutil.copytree(cubes.cache_path, squares.cache_path)  # an entry under another's key
    with pytest.raises(ConfigError, match=r"was built from other settings than this request's: power is 3 .* but 2"):
        prepared(table(), cache_dir=tmp_path / "c")


def test_subsets_are_seeded_and_leave_the_cache_whole(tmp_path):
    one = prepared(table(), table(8), max_train_samples=5, max_val_samples=2, seed=3, cache_dir=tmp_path)
    two = prepared(table(), table(8), max_train_samples=5, max_val_samples=2, seed=3, cache_dir=tmp_path)
    other = prepared(table(), table(8), max_train_samples=5, seed=4, cache_dir=tmp_path)
    assert len(one.train_dataset) == 5 and len(one.val_dataset) == 2 and len(other.val_dataset) == 8
    assert one.train_dataset[:]["y"].tolist() == two.train_dataset[:]["y"].tolist()
    assert one.train_dataset[:]["y"].tolist() != other.train_dataset[:]["y"].tolist()
    assert one.cache_path == other.cache_path and len(one.cache.load(one.cache_path.name)["train"]) == 12
    everything = prepared(table(), max_train_samples=50, cache_dir=tmp_path)  # more than there is: all of it
    assert len(everything.train_dataset) == 12 and everything.val_dataset is None


def test_label_names_come_from_the_training_split_or_the_setting(tmp_path):
    data = prepared(table(), table(4, labels=("c", "a")), cache_dir=tmp_path)
    assert data.label_names == ["a", "b", "c"] and data.num_labels == 3  # sorted, from train
    assert data.val_dataset[:]["labels"].tolist() == [2, 0, 2, 0]  # validation keeps train's ids
    assert data.class_names() == ["a", "b", "c"]  # the mapping is known before anything is built
    ordered = prepared(table(), label_names=["c", "b", "a"], cache_dir=tmp_path)
    assert ordered.label_names == ["c", "b", "a"] and ordered.train_dataset[:3]["labels"].tolist() == [1, 2, 0]
    with pytest.raises(ConfigError, match=r"PowersData validation data: label_column 'label' has values \['z'\]"):
        prepared(table(), table(3, labels=("z",)), label_names=["a", "b", "c"], cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="PowersData train data: label_column 'label' is not a column"):
        prepared(table().rename(columns={"label": "y"}), cache_dir=tmp_path)


def test_a_module_without_classes_passes_label_column_none(tmp_path):
    data = prepared(table().drop(columns="label"), label_column=None, cache_dir=tmp_path)
    assert data.label_names == [] and data.num_labels == 0 and data.class_names() == []
    assert data.train_dataset.column_names == ["y"]
    no_classes = r"PowersData: setting 'label_names' = \['a', 'b'\]; expected None \(no classes\)"
    with pytest.raises(ConfigError, match=no_classes):
        PowersData(table(), label_column=None, label_names=["a", "b"])


def test_dataloaders_batch_shuffle_and_serve_the_format(tmp_path):
    data = PowersData(table(), table(6), batch_size=5, eval_batch_size=4, cache_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"PowersData.train_dataloader\(\) called before setup\(\)"):
        data.train_dataloader()
    assert data.val_dataloader() is None and data.predict_dataloader() is None
    data.prepare_data()
    data.setup("fit")
    train = list(data.train_dataloader())
    assert [len(b["y"]) for b in train] == [5, 5, 2] and isinstance(train[0]["labels"], torch.Tensor)
    assert sorted(torch.cat([b["y"] for b in train]).tolist()) == [float(x * x) for x in range(12)]
    assert torch.cat([b["y"] for b in train]).tolist() == torch.cat([b["y"] for b in data.train_dataloader()]).tolist()
    val = [b["y"].tolist() for b in data.val_dataloader()]
    assert val == [[0.0, 1.0, 4.0, 9.0], [16.0, 25.0]]  # in order
    assert [b["y"].tolist() for b in data.predict_dataloader()] == val
    ordered = prepared(table(), shuffle=False, batch_size=12, cache_dir=tmp_path)
    assert next(iter(ordered.train_dataloader()))["y"].tolist() == [float(x * x) for x in range(12)]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "setting 'batch_size' = 0; expected a positive integer"),
        ({"eval_batch_size": True}, "setting 'eval_batch_size' = True; expected a positive integer"),
        ({"max_train_samples": -1}, "setting 'max_train_samples' = -1; expected a positive integer"),
        ({"num_workers": -1}, "setting 'num_workers' = -1; expected an integer >= 0"),
        ({"seed": "0"}, "setting 'seed' = '0'; expected an integer"),
        ({"label_column": ""}, "setting 'label_column' = ''; expected a column name"),
        ({"label_names": ["a", "a"]}, r"setting 'label_names' = \['a', 'a'\]; expected a list of 2 or more \w+ \w+"),
        ({"power": 0}, "setting 'power' = 0; expected a positive integer"),  # a subclass's own, checked alike
    ],
)
def test_bad_settings_name_the_class_the_setting_and_what_is_valid(settings, message):
    with pytest.raises(ConfigError, match=f"^PowersData: {message}$"):
        PowersData(table(), **settings)


def test_missing_training_data_and_missing_methods():
    with pytest.raises(ConfigError, match=r"PowersData: train=None; expected the training rows \(a table\)"):
        PowersData().prepare_data()

    class NoPreprocessing(CachedDataModule):
        def read_split(self, split, source):
            return read_table(source)

        def cache_settings(self):
            return {}

    with pytest.raises(TypeError, match=r"abstract method.*preprocess"):
        NoPreprocessing(table())
