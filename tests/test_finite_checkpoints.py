"""No checkpoint of non-finite state is ever written or counted (issue 39, item 1).

The non-finite loss check runs at logging steps only (no per-step sync); a save between two checks used to write NaN
weights, a NaN optimizer state and a NaN EMA average, count it towards ``keep_last`` and delete the finite ones, so
that ``--resume auto`` took a NaN checkpoint. Every save now checks the model's weights, the optimizer's state and
every plugin's tensors first (one fused flag, one all-reduce; a save syncs anyway): with ``nonfinite_loss="error"``
the fit stops with a `TaskError` naming the parts and the step, nothing of that checkpoint is written and retention
does not run; with ``"skip"`` / ``"ignore"`` the checkpoint is not written, the first such save of a fit warns, and
retention does not run for it. Synchronous and background saves alike; two processes in tests/mp/finite_ckpt.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import torchloom
from torchloom.checkpoint.store import find_checkpoint, list_checkpoints, read_manifest, verify_files
from torchloom.testing import TinyTask
from torchloom_plugins.ema import ExponentialMovingAverage
from torchrun_util import torchrun

ALL_PARTS = "model weights, optimizer state and plugin 'ema' state"


class Diverging(TinyTask):
    """TinyTask (8 optimizer steps per epoch) with AdamW, whose micro-batch ``bad_at`` (1-based, counted over the
    fit) is poisoned: ``"input"`` multiplies its input by NaN (the loss is NaN); ``"gradient"`` adds
    ``sqrt(0 * out)`` to a finite loss, whose gradient is ``0 * inf`` = NaN (the loss stays finite)."""

    def __init__(self, bad_at: int | None = None, how: str = "input") -> None:
        super().__init__()
        self.bad_at, self.how, self.calls = bad_at, how, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        bad = self.calls == self.bad_at
        if bad and self.how == "input":
            x = x * float("nan")
        out = self.model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        return loss + torch.sqrt(out.sum() * 0) if bad and self.how == "gradient" else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=0.01)


def _engine(out: Path, keep_last: int, async_save: bool, **settings: Any) -> torchloom.Engine:
    checkpoint = {"every_n_steps": 1, "every_n_epochs": None, "keep_last": keep_last, "async_save": async_save}
    settings = {"max_epochs": 2, "log_every_n_steps": 4, "num_sanity_val_steps": 0, **settings}
    return torchloom.Engine(
        output_dir=str(out), default_plugins=False, plugins={"checkpoint": checkpoint, "ema": {}}, **settings
    )


def _finite(checkpoint: str | Path) -> bool:
    """Whether every tensor of a checkpoint's weights, optimizer state and plugin states is finite (checked whole)."""
    root = Path(checkpoint)
    verify_files(root, read_manifest(root))
    tensors = list(load_file(root / "accelerate" / "model.safetensors").values())
    tensors += list(load_file(root / "plugins" / "ema.safetensors").values())
    optimizer = torch.load(root / "accelerate" / "optimizer.bin", weights_only=True)
    tensors += [v for state in optimizer["state"].values() for v in state.values() if torch.is_tensor(v)]
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors)


def _steps(out: Path) -> list[int]:
    return [read_manifest(p)["global_step"] for p in list_checkpoints(out)]


def _hidden(out: Path) -> list[str]:
    return [p.name for p in out.rglob(".*") if not p.name.startswith(".in-use")]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("keep_last", [1, 3])
def test_a_nan_between_two_checks_stops_at_the_save_and_keeps_the_finite_checkpoints(tmp_path, keep_last, async_save):
    """Logging every 4 steps, a checkpoint every step, micro-batch 6 has a NaN input: the save of step 6 finds NaN
    weights, optimizer state and EMA average and stops the fit (not the logging check of step 8, after two NaN
    checkpoints); the last keep_last checkpoints before it are left, finite, and --resume auto takes step 5."""
    engine = _engine(tmp_path, keep_last, async_save)
    with pytest.raises(torchloom.TaskError) as caught:
        engine.fit(Diverging(bad_at=6))
    assert str(caught.value).startswith(
        f"the checkpoint of optimizer step 6 is not saved: its {ALL_PARTS} are not finite (NaN or infinite values); "
        "stopping, nothing of it is written and the earlier checkpoints are kept."
    )
    assert _steps(tmp_path) == list(range(6 - keep_last, 6))
    assert all(_finite(p) for p in list_checkpoints(tmp_path))
    assert _hidden(tmp_path) == []  # no temporary directory of step 6 left
    assert find_checkpoint(tmp_path) == list_checkpoints(tmp_path)[-1]
    assert engine.plugins[0].saved == list_checkpoints(tmp_path)
    # The data fixed, the fit resumed from the latest checkpoint ends finite, keep_last bounding the training
    resumed = _engine(tmp_path, keep_last, async_save)
    resumed.fit(Diverging(), ckpt_path="auto")
    assert _steps(tmp_path) == list(range(17 - keep_last, 17))
    assert all(_finite(p) for p in list_checkpoints(tmp_path))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("policy", "how"), [("skip", "gradient"), ("ignore", "input"), ("ignore", "gradient")])
def test_under_skip_or_ignore_a_nonfinite_checkpoint_is_not_written_and_warns_once(tmp_path, policy, how, async_save):
    """A NaN gradient at step 6 (under skip, a finite loss with a NaN gradient: the step is not skipped) makes the
    weights NaN for good: every save from step 6 on is skipped, one warning names step 6, and the checkpoints of
    steps 4 and 5 stay the ones kept (retention never ran for a skipped save)."""
    engine = _engine(tmp_path, 2, async_save, nonfinite_loss=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit(Diverging(bad_at=6, how=how))
    ours = [str(w.message) for w in caught if "checkpoint of optimizer step" in str(w.message)]
    assert ours == [
        f"nonfinite_loss={policy!r}: the checkpoint of optimizer step 6 is not written: its {ALL_PARTS} are not "
        "finite (NaN or infinite values); the earlier checkpoints are kept. Later checkpoints of non-finite state in "
        "this fit are skipped too, without another warning"
    ]
    assert _steps(tmp_path) == [4, 5]
    assert all(_finite(p) for p in list_checkpoints(tmp_path))
    assert engine.plugins[0].saved == list_checkpoints(tmp_path)
    assert _hidden(tmp_path) == []


def test_a_nonfinite_plugin_state_alone_is_named(tmp_path):
    """Finite weights and optimizer state, a NaN in the EMA average only: the message names that part alone."""

    ema = ExponentialMovingAverage()

    class Spoil:
        name = "test.spoil"

        @torchloom.hookimpl
        def after_optimizer_step(self, progress: Any) -> None:
            if progress.global_step == 2:  # the step about to be counted as 3
                ema.averaged_parameters[0].view(-1)[0] = float("inf")

    checkpoint = {"every_n_steps": 1, "every_n_epochs": None, "keep_last": 1}
    engine = torchloom.Engine(
        output_dir=str(tmp_path),
        max_epochs=1,
        default_plugins=False,
        plugins=[Spoil(), {"checkpoint": checkpoint}, ema],
    )
    with pytest.raises(
        torchloom.TaskError, match=r"^the checkpoint of optimizer step 3 is not saved: its plugin 'ema' "
    ):
        engine.fit(Diverging())
    assert _steps(tmp_path) == [2] and _finite(list_checkpoints(tmp_path)[0])


@pytest.mark.multiprocess
def test_a_nan_on_one_process_stops_both_alike(tmp_path):
    """Two processes, a NaN put into process 1's optimizer state only (process 0 writes the optimizer file, so no
    file would show it): both stop at that save with the same TaskError, nothing written, no hang; and a NaN
    batch on process 1 only (DDP spreads its gradient) stops both at the save of that step."""
    ranks = torchrun("finite_ckpt.py", tmp_path)
    for result in ranks:
        assert result["state_error"].startswith(
            "the checkpoint of optimizer step 3 is not saved: its optimizer state is not finite"
        )
        assert result["state_steps"] == [2]
        assert result["batch_error"].startswith(
            "the checkpoint of optimizer step 5 is not saved: its model weights, optimizer state and plugin 'ema' "
            "state are not finite"
        )
        assert result["batch_steps"] == [3, 4]
    assert ranks[0]["hidden"] == []
