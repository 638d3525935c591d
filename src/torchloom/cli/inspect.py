"""``torchloom inspect PATH [--json]``: describe a checkpoint, a run directory or an exported model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torchloom

__all__ = ["HELP", "parser", "run"]

HELP = "describe a checkpoint, run directory or exported model"


def parser() -> Any:
    from jsonargparse import ArgumentParser

    sub = ArgumentParser(description="Describe a checkpoint, a run directory or an exported model")
    sub.add_argument("path", type=str, help="a checkpoint, a run directory (version_N) or an exported model")
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return sub


def run(parser: Any, cfg: Any) -> int:
    """``torchloom inspect PATH [--json]``: what `torchloom.inspect_path` finds, as text or one JSON object."""
    info = torchloom.inspect_path(cfg.path)
    if cfg.json:
        print(json.dumps(info, indent=2))
        return 0
    for label, value in _inspection_lines(info):
        print(f"{label:<13} {value}")
    return 0


def _inspection_lines(info: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The rows of ``torchloom inspect``'s text: ``(label, value)``, an empty label continuing the row above."""
    rows = [(info["kind"], info["path"]), ("model class", info["model_class"] or "n/a")]
    params = info["parameters"]
    total, trainable = params["total"], params["trainable"]
    rows.append(
        (
            "parameters",
            "n/a (no manifest or model card)"
            if total is None
            else f"{total:,} ({'trainable n/a' if trainable is None else f'{trainable:,} trainable'})",
        )
    )
    weights = info["weights"]
    if weights is None:
        rows.append(("weights", "n/a (no safetensors weights)"))
    else:
        where = f" in {info['weights_from']}" if info["kind"] == "run" else ""
        rows.append(("weights", f"{_amounts(weights)}{where}"))
        rows += [(f"  {dtype}", _amounts(row)) for dtype, row in weights["dtypes"].items()]
    rows += _adapter_lines(info.get("adapter"))
    if info["global_step"] is not None:
        rows.append(("step", f"{info['global_step']} (epoch {info['epoch']})"))
    plugins = info["plugins"]
    if plugins is None and info["stateful_plugins"] is not None:
        plugins = dict.fromkeys(info["stateful_plugins"])
    names = [f"{name} {json.dumps(settings)}" if settings else name for name, settings in (plugins or {}).items()]
    rows += [("plugins" if i == 0 else "", name) for i, name in enumerate(names or ["(none)"])]
    metrics = [f"{name} = {_number(value)}" for name, value in sorted(info["metrics"].items())]
    rows += [("metrics" if i == 0 else "", line) for i, line in enumerate(metrics or ["(none)"])]
    if info["stateful_plugins"] is not None:
        rows.append(("plugin state", ", ".join(info["stateful_plugins"]) or "(none)"))
    if info["checkpoints"] is not None:
        found = [
            f"{c['path']}  (UNUSABLE: {c['unusable']})"
            if c.get("unusable")
            else f"{c['path']}  (step {c['global_step']}, epoch {c['epoch']})"
            for c in info["checkpoints"]
        ]
        rows += [("checkpoints" if i == 0 else "", line) for i, line in enumerate(found or ["(none)"])]
    if info["resumed_from"]:  # the chain of runs it continues, oldest first
        chain = [_link(link) for link in info["resumed_from"]]
        rows += [("continues" if i == 0 else "", line) for i, line in enumerate(chain)]
    if info["kind"] == "run":
        rows.append(("model dir", info["model_dir"] or "(none: the fit saved no model)"))
    if info["size_bytes"] is not None:
        rows.append(("files", f"{_byte_count(info['size_bytes'])} in all (optimizer state included)"))
    return rows


def _adapter_lines(adapter: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """The adapter's rows: method and rank, targets, trainable / total parameters and bytes, the base it needs."""
    if not adapter:
        return []
    rows = [("adapter", f"{adapter.get('method')} r={adapter.get('r')} lora_alpha={adapter.get('lora_alpha')}")]
    targets = adapter.get("targets")
    shown = targets if isinstance(targets, str) else ", ".join(targets or []) or "n/a"
    rows.append(("  targets", shown))
    if adapter.get("modules_to_save"):
        rows.append(("  full", ", ".join(adapter["modules_to_save"])))
    if adapter.get("trainable_parameters") is not None:
        total = adapter.get("total_parameters")
        share = f" ({100 * adapter['trainable_parameters'] / total:.2f} %)" if total else ""
        rows.append(("  trainable", f"{adapter['trainable_parameters']:,} of {total:,} parameters{share}"))
    if adapter.get("bytes") is not None:
        rows.append(("  size", _byte_count(int(adapter["bytes"]))))
    if adapter.get("quantization"):
        rows.append(("  quantized", str(adapter["quantization"])))
    base = adapter.get("base") or {}
    needs = [str(base[k]) for k in ("class", "name_or_path") if base.get(k)]
    if base.get("sha256"):
        needs.append(f"sha256 {str(base['sha256'])[:16]}...")
    rows.append(("  base", ", ".join(needs) or "n/a"))
    return rows


def _link(link: Mapping[str, Any]) -> str:
    """One run of a resumed run's chain: ``runs/x/version_0 up to step 40 (checkpoint step-00000040)``."""
    checkpoint = str(link["checkpoint"])
    if link.get("run_dir") is None:  # a checkpoint outside a run directory
        return f"{checkpoint} (step {link['global_step']})"
    return (
        f"{link['run_dir']} up to step {link['global_step']} (checkpoint {checkpoint.rstrip('/').rsplit('/', 1)[-1]})"
    )


def _amounts(row: Mapping[str, int]) -> str:
    return f"{row['tensors']:,} tensors, {row['elements']:,} elements, {_byte_count(row['bytes'])}"


def _byte_count(size: int) -> str:
    """``1,234,567 bytes (1.18 MiB)``: the exact count, then `torchloom.utils.format_bytes`; under 1 KiB ``20
    bytes``."""
    human = torchloom.utils.format_bytes(size)
    return f"{size:,} bytes" if human.endswith(" B") else f"{size:,} bytes ({human})"


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
