"""``torchloom validate``: run the config's task over its validation data once, with ``--ckpt_path``'s weights if
given (Lightning's ``trainer.validate(ckpt_path=...)``)."""

from __future__ import annotations

from typing import Any

from ._run import add_ckpt_path, prepare, report, weights_lines

__all__ = ["add_arguments", "run"]

HELP = "validate a task"


def add_arguments(sub: Any) -> None:
    """``--ckpt_path``: the weights to load first (`add_ckpt_path`)."""
    add_ckpt_path(sub, "validating")


def run(parser: Any, cfg: Any) -> int:
    """Validate the task of a parsed config; print whose weights it used, the run's output directory, its metrics."""
    engine, task, data = prepare(parser, cfg, "validate")
    metrics = engine.validate(task, datamodule=data, ckpt_path=cfg["validate"].ckpt_path)
    return report(engine, "validate", metrics, before=weights_lines(engine, "validate"))
