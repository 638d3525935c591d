"""The files of a run: its own directory ``<output_dir>/version_N`` with ``config.yaml``, ``metrics.jsonl`` and
``model/``, and the ``latest`` link to the last completed fit.

Every ``fit``, ``validate`` and ``predict`` call gets a directory no other call writes into: ``os.mkdir`` either
creates ``version_N`` or fails because another run took it, so two runs started at once never share one
(Lightning's versioned log directories). The main process creates it and tells the others its name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate.utils import broadcast_object_list

from torchloom._guards import check_finite_parameters
from torchloom._strict_json import json_dumps
from torchloom.errors import RunFileError
from torchloom.hookspecs import hookimpl
from torchloom.rundir.atomic import (
    atomic_directory,
    mark_in_use,
    remove_orphans,
    temporary_path,
    write_atomically,
    write_failure,
)
from torchloom.rundir.export import MODEL_CARD, model_card
from torchloom.rundir.layout import CHECKPOINTS_DIR, LATEST, MODEL_DIR, RUN_DIR, run_directories

__all__ = [
    "MetricsFile",
    "config_dict",
    "create_run_dir",
    "discard_run_dir",
    "finish_fit",
    "release_run_dir",
    "start_run_files",
    "write_model_card",
    "write_predictions",
]


def create_run_dir(output_dir: str, accelerator: Any, in_use: bool = False) -> str:
    """Create ``<output_dir>/version_N`` (the next free N) on the main process; return its path on every process.

    Also removes the temporary files that a killed save left in ``output_dir`` (their process is gone). With
    ``in_use`` (a fit) the directory is marked in use by the main process (`torchloom.rundir.atomic.mark_in_use`) until
    `release_run_dir`: another fit in the same ``output_dir`` then deletes none of its checkpoints.

    Raises:
        RunFileError: on every process, when ``output_dir`` cannot be created or written (a file of that name,
            no permission, a full disk): one line naming the path and the OS error.
    """
    result: list[Any] = [None, None]
    if accelerator.is_main_process:
        try:
            result[0] = _make_version_dir(output_dir)
            if in_use:
                mark_in_use(result[0])
        except OSError as exc:
            result[1] = f"cannot create a run directory in output_dir {output_dir!r}: {exc.strerror or exc}"
    if accelerator.num_processes > 1:
        broadcast_object_list(result)  # the others wait here for the name (or the error)
    if result[1] is not None:
        raise RunFileError(result[1])
    return result[0]


def release_run_dir(run_dir: str, accelerator: Any) -> None:
    """Remove the in-use mark of `create_run_dir` (main process; nothing when there is none)."""
    if accelerator.is_main_process:
        with contextlib.suppress(OSError):  # a directory removed meanwhile: nothing to release
            mark_in_use(run_dir, in_use=False)


def discard_run_dir(run_dir: str | None, accelerator: Any) -> None:
    """Remove the directory of a run whose set-up failed (nothing of value was written into it)."""
    if run_dir is not None and accelerator.is_main_process:
        shutil.rmtree(run_dir, ignore_errors=True)


def start_run_files(run_dir: str, run_config: Mapping[str, Any]) -> None:
    """Write ``config.yaml`` atomically and an empty ``metrics.jsonl`` (main process)."""
    _replace_atomically(os.path.join(run_dir, "config.yaml"), yaml.safe_dump(_plain(run_config), sort_keys=False))
    _write(os.path.join(run_dir, "metrics.jsonl"), "")


def finish_fit(task: Any, run: Any, config: Any, logs: Any) -> None:
    """The end of a completed fit: save ``<run_dir>/model`` with `TaskModule.save_model` (``save_model: true``; every
    rank calls it), unless the weights are not finite, with its model card ``torchloom_model.json`` next to it
    (`write_model_card`, from the run log ``logs``: its latest values and last record); then point
    ``<output_dir>/latest`` at this run (not after a ``fast_dev_run``, which saves no model either).

    Raises:
        TaskError: a weight is NaN or infinite (``nonfinite_loss`` other than ``"ignore"``).
        RunFileError: the model, its card or the link cannot be written.
    """
    acc = run.accelerator
    if config.save_model:
        if config.nonfinite_loss != "ignore":
            check_finite_parameters(run.model.parameters(), acc, "it is not saved")
        path = os.path.join(run.run_dir, MODEL_DIR)
        pid = [os.getpid()]
        if acc.num_processes > 1:
            broadcast_object_list(pid)  # every process passes the main process's temporary directory
        try:
            # Written under .model.tmp-<pid> and renamed when complete (the card included): a save killed half-way
            # leaves only that directory, which the next run in output_dir removes.
            with atomic_directory(path, pid=pid[0], rename=acc.is_main_process) as tmp:
                task.save_model(str(tmp))
                run.relay.call("on_save_model", directory=str(tmp), model=run.model, accelerator=acc)
                if acc.is_main_process and tmp.is_dir():  # an overridden save_model may write elsewhere
                    write_model_card(str(tmp), run, logs.latest, logs.history[-1] if logs.history else {})
        except Exception as exc:
            reason = write_failure(exc, path)
            if reason is None:
                raise
            raise RunFileError(f"cannot save the model to {path!r}: {reason}") from exc
        acc.wait_for_everyone()  # the model is in place on return, on every process
    if acc.is_main_process and not getattr(config, "is_fast_dev_run", False):  # a quick-debug fit is no result
        link = os.path.join(config.output_dir, LATEST)
        tmp_link = temporary_path(link)
        try:
            os.symlink(os.path.basename(run.run_dir), tmp_link)
            os.replace(tmp_link, link)  # a symlink replaced in one step: readers see the old run or the new one
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp_link)
            raise RunFileError(f"cannot point {link!r} at {run.run_dir!r}: {exc.strerror or exc}") from exc


def write_model_card(directory: str, run: Any, metrics: Mapping[str, float], last: Mapping[str, Any]) -> str:
    """Write the model card of a completed fit, ``<directory>/torchloom_model.json``, atomically (main process).

    It holds the run's resolved config (``config.yaml``, read back), the plugins and their settings, the final
    logged values ``metrics`` and the step and epoch of ``last``, the last record of them (what ``fit`` returns),
    the model's class and parameter counts, and the versions of torchloom, torch, accelerate and the other
    libraries installed.

    Raises:
        RunFileError: the card cannot be written.
    """
    try:
        with open(os.path.join(run.run_dir, "config.yaml"), encoding="utf-8") as f:
            run_config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        run_config = None
    model = run.accelerator.unwrap_model(run.model)
    card = model_card(model, run_config, dict(metrics), last.get("step"), last.get("epoch"))
    path = os.path.join(directory, MODEL_CARD)
    _replace_atomically(path, json_dumps(card, indent=1) + "\n")
    return path


def write_predictions(run_dir: str, predictions: list[Any], accelerator: Any) -> str:
    """Write this process's ``predict`` outputs as JSON lines; return the file's path.

    One line per sample when a batch's output is a tensor or a mapping of tensors (a transformers ``ModelOutput``
    too) whose first dimension is the batch, or of lists of texts of the batch's length (``{"prompt": [...],
    "generation": [...]}``); one line per batch otherwise (numbers and lists as they are, anything
    else as its ``repr``). The main process writes ``predictions.jsonl``; with several processes, process r also
    writes its own shard, ``predictions.rank<r>.jsonl``.

    Raises:
        RunFileError: the file cannot be written.
    """
    name = (
        "predictions.jsonl" if accelerator.num_processes == 1 else f"predictions.rank{accelerator.process_index}.jsonl"
    )
    rows = [json_dumps(row) for outputs in predictions for row in _prediction_rows(outputs)]
    path = os.path.join(run_dir, name)
    _write(path, "".join(f"{row}\n" for row in rows))
    return path


def _prediction_rows(outputs: Any) -> list[dict[str, Any]]:
    tensors = dict(outputs) if isinstance(outputs, Mapping) else {"prediction": outputs}
    sizes = {_rows(v) for v in tensors.values()}
    if len(sizes) == 1 and -1 not in sizes:  # batch-first tensors, lists of texts: one row per sample
        columns = {k: v.detach().cpu().tolist() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
        return [{k: column[i] for k, column in columns.items()} for i in range(sizes.pop())]
    return [{k: _plain_value(v) for k, v in tensors.items()}]


def _rows(value: Any) -> int:
    """The batch size of a per-sample column: a tensor's first dimension, or the length of a non-empty list of
    strings (texts, as a generating ``predict_step`` returns); -1 for anything else."""
    if isinstance(value, torch.Tensor):
        return len(value) if value.ndim else -1
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return len(value)
    return -1


def _plain_value(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if value is None or isinstance(value, bool | int | float | str | list):
        return value
    return repr(value)


def config_dict(config: Any) -> Any:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config


def _make_version_dir(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    _remove_orphans(root)
    taken = [int(m.group(1)) for name in os.listdir(root) if (m := RUN_DIR.fullmatch(name))]
    n = max(taken, default=-1) + 1
    while True:
        path = os.path.join(root, f"version_{n}")
        try:
            os.mkdir(path)  # atomic: exactly one run creates it
            return path
        except FileExistsError:
            n += 1


def _remove_orphans(root: str) -> None:
    """Remove what saves killed half-way left (`torchloom.rundir.atomic`: entries of processes that no longer run) in
    ``root``, in its run directories and in their checkpoint folders."""
    runs = run_directories(root)
    for folder in [Path(root), *runs, *(run / CHECKPOINTS_DIR for run in runs)]:
        remove_orphans(folder)


def _replace_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half a file.

    Raises:
        RunFileError: it cannot be written.
    """
    try:
        write_atomically(path, text)
    except OSError as exc:
        raise RunFileError(f"cannot write {path!r}: {exc.strerror or exc}") from exc


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise RunFileError(f"cannot write {path!r}: {exc.strerror or exc}") from exc


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
    """Writes every ``on_log`` record as one JSON line to the run's ``metrics.jsonl`` (main process).

    Each line is written with one ``write`` of bytes and flushed; if the write fails (a full disk) the file is cut
    back to its last complete line and a `RunFileError` names the file, so every line in it is a complete JSON
    object. A file that ends in a partial line (a process killed mid-write) is cut back the same way when opened.
    """

    name = "torchloom.metrics_file"

    def __init__(self) -> None:
        self.path: str | None = None
        self._file: Any = None

    def start(self, path: str) -> None:
        """Write the records of the next call to ``path`` (the engine calls it once the run directory exists)."""
        self.close()
        self.path = path

    @hookimpl
    def on_log(self, metrics: dict[str, float], progress, accelerator) -> None:
        if not accelerator.is_main_process or self.path is None:
            return
        record = {"step": progress.global_step, "epoch": progress.epoch, **metrics}
        # Strict JSON: a non-finite value (a NaN loss, an fp16 overflow's inf gradient norm) is written as the
        # string "NaN" / "Infinity" / "-Infinity", which float() reads back.
        line = (json_dumps(record) + "\n").encode("utf-8")
        try:
            if self._file is None:  # unbuffered: nothing is left in a buffer to flush after a failed write
                self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed in teardown)
                _cut_partial_tail(self._file)
            end = self._file.seek(0, os.SEEK_END)
            try:
                written = 0
                while written < len(line):  # a full disk can take part of a line, then fail
                    written += self._file.write(line[written:])
            except OSError:
                self._file.truncate(end)  # back to the last complete line
                raise
        except OSError as exc:
            raise RunFileError(f"cannot write {self.path!r}: {exc.strerror or exc}") from exc

    @hookimpl
    def teardown(self) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # what could not be flushed was cut back already
                file.close()


def _cut_partial_tail(file: Any) -> None:
    """Truncate an append-mode binary file after its last newline (drop a line a killed process half wrote)."""
    size = file.seek(0, os.SEEK_END)
    if size == 0:
        return
    with open(file.name, "rb") as reader:
        data = reader.read()
    if not data.endswith(b"\n"):
        file.truncate(data.rfind(b"\n") + 1)
        file.seek(0, os.SEEK_END)
