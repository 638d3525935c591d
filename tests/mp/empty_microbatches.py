"""Micro-batches with no loss token on 2 processes (tests/test_empty_microbatches.py): 24 rows in batches of 2,
grad_accum tokens over windows of 3 micro-batches per process. Rank 0's second micro-batch (rows 4, 5) has no loss
token while rank 1's has; both ranks' last micro-batch (rows 20-23) has none. With the argument ``skip``: 12 rows,
``nonfinite_loss: skip``, one micro-batch per optimizer step. Writes ``result-<rank>.json``: the
final weights, the logged train/loss values and the optimizer steps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the task of the 1-process tests

from test_empty_microbatches import LM, MP_EMPTY, MP_SKIP_EMPTY, fit, losses, model_weights, rows


def main() -> None:
    out = Path(sys.argv[1])
    if sys.argv[2:] == ["skip"]:  # one micro-batch per step, AdamW: step 3's micro-batch is empty on both ranks
        task = LM(rows(12, MP_SKIP_EMPTY), 2, "adamw")
        engine = fit(out, "run", task, [{"grad_accum": {"normalization": "tokens"}}], nonfinite_loss="skip")
    else:
        engine = fit(out, "run", LM(rows(24, MP_EMPTY), 2), [{"grad_accum": {"steps": 3, "normalization": "tokens"}}])
    result = {
        "skipped": engine.logged_metrics.get("train/skipped_steps"),
        "weights": model_weights(engine).tolist(),
        "losses": losses(engine),
        "global_step": engine.progress.global_step,
    }
    (out / f"result-{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
