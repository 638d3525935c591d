"""``torchloom validate``: run the config's task over its validation data once."""

from __future__ import annotations

from typing import Any

from ._run import prepare, report

__all__ = ["add_arguments", "run"]

HELP = "validate a task"


def add_arguments(sub: Any) -> None:
    """``validate`` takes only the run commands' options."""


def run(parser: Any, cfg: Any) -> int:
    """Validate the task of a parsed config; print the run's output directory and its metrics."""
    engine, task, data = prepare(parser, cfg, "validate")
    return report(engine, "validate", engine.validate(task, datamodule=data))
