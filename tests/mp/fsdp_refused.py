"""A sharding request on CPU processes that cannot take effect: each process writes the ConfigError it got.

Arguments: the output directory and the request: ``fsdp1`` (the ``fsdp`` plugin with version 1) or ``local_sgd``
(the ``fsdp`` plugin with ``local_sgd``, which Accelerate's LocalSGD does not support: a PluginError).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.testing import TinyTask

out, request = Path(sys.argv[1]), sys.argv[2]
plugins = {"fsdp": {"version": 1}} if request == "fsdp1" else {}
if request == "local_sgd":
    plugins = {"fsdp": {"auto_wrap_policy": "no_wrap"}, "local_sgd": {"sync_every": 2}}  # TinyTask: no blocks
engine = torchloom.Engine(output_dir=str(out / "run"), max_epochs=1, plugins=plugins)
try:
    engine.fit(TinyTask())
    message = None
except (torchloom.ConfigError, torchloom.PluginError) as exc:
    message = str(exc)
rank = torch.distributed.get_rank()
flags = {key: os.environ.get(key) for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")}
(out / f"result-{rank}.json").write_text(json.dumps({"error": message, "flags": flags}))
torch.distributed.barrier()
