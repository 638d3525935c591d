"""``torchloom export CHECKPOINT OUT [--config FILE] [--merge]``: write the model of a checkpoint as an ordinary
folder (`torchloom.Engine.export`): a transformers folder, or ``model.safetensors`` for a plain module, or an adapter
in peft's format (``--merge``: and the merged model in ``OUT/merged``), with the model card."""

from __future__ import annotations

import os
from typing import Any

from torchloom import CheckpointError, ConfigError

__all__ = ["HELP", "parser", "run"]

HELP = "write a checkpoint's model as a transformers / safetensors folder"


def parser() -> Any:
    from jsonargparse import ArgumentParser

    sub = ArgumentParser(description="Write the model of a checkpoint as a folder that loads without torchloom")
    sub.add_argument("checkpoint", type=str, help="a checkpoint directory (with manifest.json)")
    sub.add_argument("out", type=str, help="the folder to write (must not exist, or be empty)")
    sub.add_argument(
        "--config",
        type=str | None,
        default=None,
        help="the run config that builds the model (default: the config.yaml of the checkpoint's run directory)",
    )
    sub.add_argument(
        "--merge", action="store_true", help="with an adapter (the 'peft' plugin): also write the merged model"
    )
    return sub


def run(parser: Any, cfg: Any) -> int:
    """Export the checkpoint; print where the model is and what it holds. ``parser``: the full parser (with the run
    commands' sections), which reads the run config as ``predict`` would."""
    from ._config import load_run_config
    from ._environment import put_config_dir_on_path
    from ._run import prepare

    checkpoint = cfg.checkpoint
    # Before the config is looked for (next to the checkpoint); Engine.export says the same, and verifies its files.
    expected = "expected a checkpoint directory (with manifest.json, as <run_dir>/checkpoints/step-00000040)"
    if not os.path.exists(checkpoint):
        raise ConfigError(f"export: checkpoint {checkpoint!r}: no such file or directory; {expected}")
    if not os.path.isfile(os.path.join(checkpoint, "manifest.json")):
        raise CheckpointError(f"export: {checkpoint!r} is not a checkpoint: it has no manifest.json; {expected}")
    config = cfg.config or os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(checkpoint))), "config.yaml")
    if not os.path.isfile(config):
        given = "--config" if cfg.config else "the checkpoint's run config"
        raise ConfigError(
            f"export: {given} {config!r}: no such file; expected the run config that builds the model (config.yaml "
            "of the run directory <run_dir>/checkpoints/<name> is in, or --config FILE)"
        )
    put_config_dir_on_path(["--config", config])
    run_cfg, _ = load_run_config(parser, ["predict", "--config", config], "predict", [])
    plugins = run_cfg["predict"].plugins
    if cfg.merge:  # the merge setting of the plugin that injects the adapter (its declared capability)
        from torchloom.utils import plugins_with

        adapters = [name for name, _ in plugins_with("adapter", [n for n in plugins if isinstance(n, str)])]
        if not adapters:
            raise ConfigError(
                f"export: --merge merges an adapter into its base, and the run config {config!r} enables no 'peft' "
                "plugin (none that declares the capability 'adapter'); drop --merge"
            )
        for name in adapters:
            plugins[name] = {**(plugins[name] or {}), "merge": True}
    engine, task, _ = prepare(parser, run_cfg, "predict")
    out = engine.export(task, checkpoint, cfg.out)
    print(f"torchloom export: model of checkpoint {checkpoint} in {out}")
    for name in sorted(os.listdir(out)):
        print(f"  {name}")
    return 0
