"""The ``peft`` plugin's LoRA (with a head trained in full, ``modules_to_save``) on 2 CPU processes, as DDP and as
FSDP2 (the ``fsdp`` plugin), in one launch (tests/test_fsdp_peft.py).

Arguments: the output directory. In order, each in a new Engine: the DDP fit, the FSDP2 fit (checkpoints every 4
optimizer steps, ``save_model`` with ``merge``), the FSDP2 fit resumed from its step-8 checkpoint, and a 4-bit and an
8-bit base under FSDP2 (each must stop at start-up: their errors). Writes ``result-<rank>.json``: for each fit its
distributed type, the trainable parameters' whole values after it (gathered from the shards under FSDP2), this
process's share of the parameters' elements, the logged history, the checkpoints and the run directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import torchloom
from torchloom.checkpoint import list_checkpoints
from torchloom.parallel.dtensors import full, local

sys.path.insert(0, str(Path(__file__).parent))

from peft_fit import LORA, LoraTask

#: LoRA on q_proj / v_proj (dropout 0.1: the random streams must resume too) and lm_head trained in full.
SETTINGS = {**LORA, "modules_to_save": ["lm_head"], "merge": True}
FSDP = {"fsdp": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}


def _engine(out: Path, plugins: dict[str, Any]) -> torchloom.Engine:
    return torchloom.Engine(
        output_dir=str(out),
        max_epochs=2,
        seed=0,
        log_every_n_steps=2,
        save_model=True,
        plugins={**plugins, "checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": None}},
        default_plugins=False,
    )


def _fit(out: Path, plugins: dict[str, Any], resume: str | None = None) -> dict[str, Any]:
    engine = _engine(out, plugins)
    engine.fit(LoraTask(n=32, lr=5e-2), ckpt_path=resume)
    acc, model = engine.accelerator, engine._run.model
    named = dict(acc.unwrap_model(model).named_parameters())
    return {
        "distributed_type": str(acc.distributed_type.value),
        "trainable": {n: full(p).detach().double().flatten().tolist() for n, p in named.items() if p.requires_grad},
        "local_elements": sum(local(p).numel() for p in named.values()),
        "elements": sum(p.numel() for p in named.values()),
        "history": engine.history,
        "global_step": engine.progress.global_step,
        "checkpoints": [str(p) for p in list_checkpoints(str(out))],
        "run_dir": engine._run.run_dir,
    }


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {}
    results["ddp"] = _fit(out / "ddp", {"peft": SETTINGS})
    results["fsdp"] = _fit(out / "fsdp", {"peft": SETTINGS, **FSDP})
    middle = next(p for p in results["fsdp"]["checkpoints"] if p.endswith("step-00000008"))
    results["resumed"] = _fit(out / "resumed", {"peft": SETTINGS, **FSDP}, resume=middle)
    for bits in ("load_in_4bit", "load_in_8bit"):  # refused at start-up, on every process alike
        try:
            _fit(out / bits, {"peft": {**LORA, bits: True}, **FSDP})
            results[bits] = None
        except Exception as exc:  # recorded for the test
            results[bits] = f"{type(exc).__name__}: {exc}"
    rank = torch.distributed.get_rank()
    results["rank"] = rank
    (out / f"result-{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
