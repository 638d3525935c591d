"""The files a run writes itself: ``config.yaml`` (the resolved settings) and ``metrics.jsonl`` (every record)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import yaml

from torchloom._guards import check_finite_parameters
from torchloom.hookspecs import hookimpl

__all__ = ["MetricsFile", "config_dict", "save_final_model", "start_run_files"]


def save_final_model(task: Any, run: Any, config: Any) -> None:
    """With ``save_model: true``, write ``<output_dir>/model`` with `TaskModule.save_model` (every rank calls it),
    unless the weights are not finite (``nonfinite_loss`` other than ``"ignore"``).

    Raises:
        TaskError: a weight is NaN or infinite.
    """
    if not config.save_model:
        return
    if config.nonfinite_loss != "ignore":
        check_finite_parameters(run.model.parameters(), run.accelerator, "it is not saved")
    task.save_model(os.path.join(config.output_dir, "model"))


def start_run_files(output_dir: str, run_config: Mapping[str, Any]) -> None:
    """Write ``config.yaml`` atomically and start an empty ``metrics.jsonl``, together, so that the two always
    belong to one run (main process only; a run that fails to start leaves neither)."""
    _write_run_config(output_dir, run_config)
    open(os.path.join(output_dir, "metrics.jsonl"), "w").close()


def config_dict(config: Any) -> Any:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config


def _write_run_config(output_dir: str, run_config: Mapping[str, Any]) -> None:
    """Write ``config.yaml`` atomically (a crash never leaves half a file)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "config.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(_plain(run_config), f, sort_keys=False)
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    """Turn tuples and other YAML-unsafe containers into lists / strings."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


class MetricsFile:
    """Writes every ``on_log`` call as one JSON line to ``<output_dir>/metrics.jsonl`` (main process)."""

    name = "torchloom.metrics_file"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: Any = None  # appends: the engine empties the file when a fit starts

    @hookimpl
    def on_log(self, metrics: dict[str, float], progress, accelerator) -> None:
        if not accelerator.is_main_process:
            return
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in teardown)
        record = {"step": progress.global_step, "epoch": progress.epoch, **metrics}
        # Strict JSON: a non-finite value (a NaN loss, an fp16 overflow's inf gradient norm) is written as the
        # string "NaN" / "Infinity" / "-Infinity", which float() reads back.
        record = {
            k: v
            if not isinstance(v, float) or math.isfinite(v)
            else str(v).replace("inf", "Infinity").replace("nan", "NaN")
            for k, v in record.items()
        }
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    @hookimpl
    def teardown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
