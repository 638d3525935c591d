"""auto_batch on 2 processes, with out-of-memory errors injected (`ab_tasks.Fault`) on one rank only or on both,
in the middle of a window; each case next to a grad_accum run that used the final micro-batch from the start.

Writes, per rank and per case, the final parameters, the learning rate of every optimizer step, the optimizer
steps, the logged micro-batch sizes, the plugin's changes and the injected errors, or the error that ended the fit.
Batch 8 per process (effective batch 16), 64 samples: 4 optimizer steps per epoch, 2 epochs.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from ab_tasks import Fault, Regression, TokenLM, fit

import torchloom

out = Path(sys.argv[1])
warnings.simplefilter("ignore", UserWarning)
CASES = {
    # rank 1 only, its second piece's backward (micro-batch 4: the first piece's gradients exist), from step 3
    "rank1_mid_window": (Regression, {"phase": "backward", "ranks": (1,), "above": 2, "from_step": 2,
                                      "with_grads": True}, {"micro_batch_size": 4}, "mean"),
    # both ranks, at the forward, from step 2: 8 -> 4 -> 2
    "both_forward": (Regression, {"phase": "forward", "ranks": (0, 1), "above": 2, "from_step": 1}, {}, "mean"),
    # rank 1 only, at the forward of the whole batch, from step 2: 8 -> 4 -> 2
    "rank1_forward": (Regression, {"phase": "forward", "ranks": (1,), "above": 2, "from_step": 1}, {}, "mean"),
    # rank 0 only, in the optimizer step... which rank 1 has taken: cannot be redone (an error on both ranks)
    "rank0_step": (Regression, {"phase": "step", "ranks": (0,), "above": 2, "from_step": 1}, {}, "mean"),
    # both ranks in the optimizer step, before updating: redone
    "both_step": (Regression, {"phase": "step", "ranks": (0, 1), "above": 2, "from_step": 1}, {}, "mean"),
    # token normalisation, uneven lengths, rank 1 only, mid-window
    "tokens_rank1_mid_window": (TokenLM, {"phase": "backward", "ranks": (1,), "above": 2, "from_step": 2,
                                          "with_grads": True}, {"micro_batch_size": 4}, "tokens"),
}  # fmt: skip
rank = 0
result = {}
for case, (Task, fault_settings, settings, normalization) in CASES.items():
    fault = Fault(**fault_settings)
    plugins = [{"auto_batch": settings}, {"grad_accum": {"normalization": normalization}}]
    entry = {}
    try:
        engine, probe = fit(Task(8, n=64, fault=fault), plugins, str(out / case / "auto"))
    except torchloom.ConfigError as exc:
        entry["error"] = str(exc)
    else:
        plugin = next(p for p in engine.plugins if p.name == "auto_batch")
        entry.update(
            params=probe.params,
            lrs=probe.lrs,
            global_step=engine.progress.global_step,
            micro=[r["train/micro_batch_size"] for r in engine.history if "train/micro_batch_size" in r],
            changes=[{**c, "phases": {str(k): v for k, v in c["phases"].items()}} for c in plugin.changes],
        )
        rank = engine._run.accelerator.process_index
        final = int(plugin.micro_batch_size)
        reference = [{"grad_accum": {"steps": 8 // final, "normalization": normalization}}]
        ref_engine, ref = fit(Task(final, n=64), reference, str(out / case / "ref"))
        entry.update(ref_params=ref.params, ref_lrs=ref.lrs, ref_global_step=ref_engine.progress.global_step)
    entry["raised"] = fault.raised
    result[case] = entry
# A resume after a back-off: rank 1 backs off to 2 at step 2, a checkpoint at step 4; the resumed fit (the fault
# still there) continues at 2 with no new error and ends with the uninterrupted fit's parameters, bit for bit.
ckpt = {"checkpoint": {"every_n_steps": 4, "every_n_epochs": None, "keep_last": None}}
fault_settings = {"phase": "backward", "ranks": (1,), "above": 2, "from_step": 1}
whole_fault, resumed_fault = Fault(**fault_settings), Fault(**fault_settings)
whole, whole_probe = fit(Regression(8, n=64, fault=whole_fault), [{"auto_batch": {}}, ckpt], str(out / "whole"))
path = str(Path(whole.run_dir) / "checkpoints" / "step-00000004")
resumed, resumed_probe = fit(
    Regression(8, n=64, fault=resumed_fault), [{"auto_batch": {}}, ckpt], str(out / "resumed"), ckpt_path=path
)
result["resume"] = {
    "whole_params": whole_probe.params,
    "resumed_params": resumed_probe.params,
    "whole_lrs": whole_probe.lrs,
    "resumed_lrs": resumed_probe.lrs,
    "whole_raised": whole_fault.raised,
    "resumed_raised": resumed_fault.raised,
    "resumed_micro": [r["train/micro_batch_size"] for r in resumed.history if "train/micro_batch_size" in r],
    "global_steps": [whole.progress.global_step, resumed.progress.global_step],
}
rank = torch.distributed.get_rank()
(out / f"result-{rank}.json").write_text(json.dumps({"rank": rank, **result}))
torch.distributed.barrier()
