"""``torchloom predict``: run the config's task over its prediction data, with ``--ckpt_path``'s weights if given."""

from __future__ import annotations

from typing import Any

from ._run import prepare, report

__all__ = ["add_arguments", "run"]

HELP = "predict a task"


def add_arguments(sub: Any) -> None:
    """``--ckpt_path``: the weights to load first."""
    sub.add_argument(
        "--ckpt_path",
        type=str | None,
        default=None,
        help="Load these weights before predicting: a checkpoint, an exported model (model/), a run "
        "directory (its model/, else its latest checkpoint) or an output_dir (its latest checkpoint).",
    )


def run(parser: Any, cfg: Any) -> int:
    """Predict with the task of a parsed config; print whose weights it used, the output directory, the batches."""
    engine, task, data = prepare(parser, cfg, "predict")
    predictions = engine.predict(task, datamodule=data, ckpt_path=cfg["predict"].ckpt_path)
    weights = []
    if engine.weights_from is not None:
        kind, path = engine.weights_from
        weights.append(
            f"torchloom predict: weights of {'checkpoint' if kind == 'checkpoint' else 'saved model'} {path}"
        )
    return report(engine, "predict", {"batches": float(len(predictions))}, before=weights)
