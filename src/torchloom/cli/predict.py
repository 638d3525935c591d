"""``torchloom predict``: run the config's task over its prediction data, with ``--ckpt_path``'s weights if given;
``--input FILE`` predicts on the raw rows of a file instead, preprocessed as the data module preprocesses its
validation split, the outputs in the file's order."""

from __future__ import annotations

import os
from typing import Any

from torchloom import ConfigError

from ._run import add_ckpt_path, prepare, report, weights_lines

__all__ = ["INPUT_SUFFIXES", "add_arguments", "run"]

HELP = "predict a task"

#: What ``--input`` reads: JSON lines (or a JSON array) and CSV / TSV of raw rows, and parquet.
INPUT_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")


def add_arguments(sub: Any) -> None:
    """``--ckpt_path``: the weights to load first (`add_ckpt_path`); ``--input``: raw rows to predict on."""
    add_ckpt_path(sub, "predicting")
    sub.add_argument(
        "--input",
        type=str | None,
        default=None,
        help="predict on the raw rows of this file instead of the data module's prediction data: JSON lines "
        f"(or a JSON array) or CSV ({', '.join(INPUT_SUFFIXES)}), with the columns the data module reads (its text, "
        "image or audio column; a label, a completion or an assistant reply is optional: a chat without one is "
        "rendered with the generation prompt), preprocessed as its validation split is (never packed or dropped); "
        "predictions.jsonl has one line per row, in the file's order",
    )


def run(parser: Any, cfg: Any) -> int:
    """Predict with the task of a parsed config; print whose weights it used, the output directory, the batches."""
    source = cfg["predict"].input
    if source is not None:
        _check_input(source)
    engine, task, data = prepare(parser, cfg, "predict")
    if source is not None:
        if not callable(getattr(data, "set_predict_input", None)):
            what = "no data module" if data is None else f"data {type(data).__name__}, which has no set_predict_input"
            raise ConfigError(
                f"predict: --input {source!r} needs a data module that preprocesses raw rows, and the config has "
                f"{what}; expected a data module of torchloom.data (a CachedDataModule) in the config's data section"
            )
        data.set_predict_input(source)
    predictions = engine.predict(task, datamodule=data, ckpt_path=cfg["predict"].ckpt_path)
    return report(engine, "predict", {"batches": float(len(predictions))}, before=weights_lines(engine, "predict"))


def _check_input(source: str) -> None:
    """``--input``: an existing file with one of `INPUT_SUFFIXES`.

    Raises:
        ConfigError: it is not.
    """
    expected = f"expected a file of raw rows: {', '.join(INPUT_SUFFIXES)}"
    if not os.path.exists(source):
        raise ConfigError(f"predict: --input {source!r}: no such file; {expected}")
    if not os.path.isfile(source):
        raise ConfigError(f"predict: --input {source!r} is a directory; {expected}")
    suffix = os.path.splitext(source)[1].lower()
    if suffix not in INPUT_SUFFIXES:
        raise ConfigError(f"predict: --input {source!r} has the suffix {suffix or '(none)'!r}; {expected}")
