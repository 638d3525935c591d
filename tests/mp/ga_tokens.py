"""C01 on 2 processes: grad_accum(steps=2, normalization="tokens") with different token counts per micro-batch
and per rank. Writes, per rank and per case, the window's final gradients and the logged loss.

Batch size 1, so the prepared dataloader deals the sequences out round-robin: rank 0 trains on sequences 0
and 2, rank 1 on sequences 1 and 3.
"""

import json
import sys
from pathlib import Path

import torch
from ga_tasks import GradProbe, TokenLM, make_sequence

import torchloom

out = Path(sys.argv[1])
CASES = {
    # rank 0: 3 and 5 labelled tokens, rank 1: 1 and 7 (16 in all; 8 per rank).
    "c01": [3, 1, 5, 7],
    # rank 0: 3 and 5, rank 1: 1 and 2 (11 in all): a per-rank count would weight the ranks wrongly.
    "uneven": [3, 1, 5, 2],
}
result = {}
for case, counts in CASES.items():
    sequences = [make_sequence(n, seed=i, length=n + 1 + i) for i, n in enumerate(counts)]
    probe = GradProbe()
    engine = torchloom.Engine(
        plugins=[{"grad_accum": {"steps": 2, "normalization": "tokens"}}, probe],
        log_every_n_steps=1,
        output_dir=str(out / case),
    )
    engine.fit(TokenLM(sequences))
    acc = engine._run.accelerator
    result[case] = {
        "grads": probe.grads,
        "history": engine.history,
        "global_step": engine.progress.global_step,
        "world_size": acc.num_processes,
    }
(out / f"result-{acc.process_index}.json").write_text(json.dumps({"rank": acc.process_index, **result}))
torch.distributed.barrier()
