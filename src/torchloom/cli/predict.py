"""``torchloom predict``: run the config's task over its prediction data, with ``--ckpt_path``'s weights if given."""

from __future__ import annotations

from typing import Any

from ._run import add_ckpt_path, prepare, report, weights_lines

__all__ = ["add_arguments", "run"]

HELP = "predict a task"


def add_arguments(sub: Any) -> None:
    """``--ckpt_path``: the weights to load first (`add_ckpt_path`)."""
    add_ckpt_path(sub, "predicting")


def run(parser: Any, cfg: Any) -> int:
    """Predict with the task of a parsed config; print whose weights it used, the output directory, the batches."""
    engine, task, data = prepare(parser, cfg, "predict")
    predictions = engine.predict(task, datamodule=data, ckpt_path=cfg["predict"].ckpt_path)
    return report(engine, "predict", {"batches": float(len(predictions))}, before=weights_lines(engine, "predict"))
