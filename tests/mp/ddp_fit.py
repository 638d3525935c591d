"""2-process data-parallel fit of TinyTask; each rank writes its final parameters and world size."""

import json
import sys
from pathlib import Path

import torch

from torchloom.testing import TinyTask, tiny_fit

out = Path(sys.argv[1])
# Global batch 8 = 2 ranks x micro-batch 4 (the sampler shards the 32 samples).
engine = tiny_fit(task=TinyTask(n=32, batch_size=4, validate=True), max_epochs=2, output_dir=str(out / "run"))
acc = engine._run.accelerator
model = acc.unwrap_model(engine._run.model)
result = {
    "rank": acc.process_index,
    "world_size": acc.num_processes,
    "distributed_type": str(acc.distributed_type),
    "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
    "global_step": engine.progress.global_step,
    "history": engine.history,
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
