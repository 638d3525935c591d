"""The text of the ``progress`` plugin's end-of-run summary: the lines under its table, the one line of a
``fast_dev_run``, the numbers' formats, and ``summary.json`` (`torchloom_plugins.progress.ProgressBar` prints and
writes them)."""

from __future__ import annotations

from typing import Any

import torchloom

__all__ = ["counts", "epoch_label", "fast_dev_run_line", "info_lines", "rate", "short", "write_json"]


def fast_dev_run_line(summary: dict[str, Any], batches: int) -> str:
    """The one-line summary of a ``fast_dev_run``: what ran, the last values, the time, and what was not saved.
    A fit that made no optimizer step (for whatever reason) checked nothing: it is never said to have passed."""
    steps = summary["optimizer_steps"]
    values = ", ".join(f"{name} {short(m['last'])}" for name, m in sorted(summary["metrics"].items()))
    wall = seconds(summary["wall_time_s"])
    if not (summary.get("this_run") or summary)["optimizer_steps"]:  # this run's own steps, not those resumed
        return (
            f"fast_dev_run did NOT pass: it trained 0 optimizer steps of the {batches} batch"
            f"{'es' if batches != 1 else ''} it was to train, so nothing was checked; wall time {wall} s; nothing "
            f"saved; run directory: {summary['run_dir']}"
        )
    return (
        f"fast_dev_run passed ({batches} batch{'es' if batches != 1 else ''}): {steps} optimizer "
        f"step{'s' if steps != 1 else ''}{', ' + values if values else ''}; wall time {wall} s; "
        f"nothing saved; run directory: {summary['run_dir']}"
    )


def counts(steps: int, samples: int | None, train_time: float, wall_time: float) -> dict[str, Any]:
    """A summary's counts of some optimizer steps: the samples and seconds they took, and the rates."""
    return {
        "optimizer_steps": steps,
        "samples": samples,
        "train_time_s": train_time,
        "samples_per_s": samples / train_time if samples is not None and train_time > 0 else None,
        "steps_per_s": steps / train_time if train_time > 0 else None,
        "wall_time_s": wall_time,
    }


def epoch_label(epoch: int, max_epochs: int | None) -> str:
    """``epoch 0/2``: the 0-based index of the epoch (`torchloom.Progress.epoch`, ``epoch`` in ``metrics.jsonl`` and
    ``torchloom inspect``) out of the index of the last one, as Lightning's ``RichProgressBar`` shows
    ``current_epoch``."""
    return f"epoch {epoch}" + (f"/{max_epochs - 1}" if max_epochs else "")


def short(value: float) -> str:
    """A value for a progress line: 4 significant digits."""
    return f"{value:.4g}"


def rate(value: float) -> str:
    """A rate: 3 significant digits, without exponent notation for large ones."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def info_lines(summary: dict[str, Any]) -> list[str]:
    """The lines under the table. Each rate is printed beside the time it is measured over (the HF Trainer's
    ``train_samples_per_second = samples / train_runtime``, printed with ``train_runtime``): samples and steps per
    second of training time, validation excluded; the wall time on its own line, labelled with what it includes."""
    fit = summary["stage"] == "fit"
    if not fit:
        return [
            f"wall time {seconds(summary['wall_time_s'])} s (the whole validate call, set-up included)",
            f"run directory: {summary['run_dir']}",
        ]
    epochs = f"{summary['epochs']} epoch{'s' if summary['epochs'] != 1 else ''}"
    resumed = summary["resumed_from"] is not None
    if not resumed:
        lines = counts_lines(summary, epochs, "", "the whole fit call")
    else:  # the whole training, then this run's own part
        lines = counts_lines(summary, epochs, f"whole training ({summary['runs']} runs): ", "the fit calls")
        lines += counts_lines(summary["this_run"], None, "this run: ", "this fit call")
        lines.append(f"resumed from {summary['resumed_from']}")
    if summary.get("parameters") is not None:
        lines.append(
            sizes_line(
                summary["parameters"], summary["optimizer_state_bytes"], summary.get("optimizer_state_process_bytes")
            )
        )
    lines.append(f"run directory: {summary['run_dir']}")
    lines.append(f"model: {summary['model_dir'] or 'not saved (engine setting save_model: false)'}")
    return lines


def sizes_line(parameters: dict[str, int], optimizer_bytes: int, optimizer_process_bytes: int | None = None) -> str:
    """``parameters 134,515,008 (921,600 trainable, 0.69 %), 513 MiB; optimizer state 7.03 MiB``: the HF Trainer's
    "Number of trainable parameters", Lightning's model summary. Where a process holds a shard (FSDP2), each size
    is followed by what this process holds: ``513 MiB (257 MiB on this process)``."""
    total, trainable = parameters["total"], parameters["trainable"]
    share = f", {100 * trainable / total:.3g} %" if 0 < trainable < total else ""
    return (
        f"parameters {total:,} ({trainable:,} trainable{share}), "
        f"{_held(parameters['bytes'], parameters.get('process_bytes'))}; "
        f"optimizer state {_held(optimizer_bytes, optimizer_process_bytes)}"
    )


def _held(whole: int, here: int | None) -> str:
    text = torchloom.utils.format_bytes(whole)
    return text if here is None or here == whole else f"{text} ({torchloom.utils.format_bytes(here)} on this process)"


def counts_lines(counts: dict[str, Any], epochs: str | None, prefix: str, wall: str) -> list[str]:
    """What was trained; the training time with the rates measured over it; the wall time."""
    what = [f"{counts['optimizer_steps']} optimizer steps", *([epochs] if epochs else [])]
    if counts["samples"] is not None:
        what.append(f"{counts['samples']} samples")
    rates = [
        f"{rate(counts[key])} {unit}/s"
        for key, unit in (("samples_per_s", "samples"), ("steps_per_s", "steps"))
        if counts[key] is not None
    ]
    training = f"training time {seconds(counts['train_time_s'])} s (validation excluded)"
    indent = "  " if prefix else ""
    return [
        prefix + ", ".join(what),
        indent + training + (f": {', '.join(rates)}" if rates else ""),
        indent + f"wall time {seconds(counts['wall_time_s'])} s ({wall}: set-up, validation and saving included)",
    ]


def seconds(value: float) -> str:
    """A duration: 3 significant digits under 10 s (``0.183``), tenths above (``103.2``), so that a rate printed
    beside it can be checked against it."""
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as strict JSON (a non-finite number as the string ``"NaN"`` / ``"Infinity"`` /
    ``"-Infinity"``, as in ``metrics.jsonl``: `torchloom.utils.json_dumps`) atomically
    (`torchloom.utils.write_atomically`).

    Raises:
        RunFileError: the file cannot be written (the message names it and the OS error).
    """
    text = torchloom.utils.json_dumps(data, indent=2) + "\n"
    try:
        torchloom.utils.write_atomically(path, text)  # readers see no file or the whole file
    except OSError as exc:
        raise torchloom.RunFileError(f"cannot write {path!r}: {exc.strerror or exc}") from exc
