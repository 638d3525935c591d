"""A safety net for bugs that the rest of the suite let through (issue 7, item 0).

Each test pins one behaviour that a small plausible bug broke without any other test failing (a mutation run,
plus three bugs only the slow example and docs tests caught), and asserts its exact correct value. All run in
a few seconds on one CPU, except one 2-process run (tests/mp/safety_net_mp.py) shared by three tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_fit
from torchloom_plugins.grad_checkpoint import checkpoint_use_reentrant
from torchloom_plugins.optimizer import optimizer_state_bytes
from torchrun_util import torchrun


class Capture:
    """Keeps the run's optimizer and, after every optimizer step, whether the step was skipped."""

    name = "test.capture"

    def __init__(self) -> None:
        self.optimizer: Any = None
        self.skipped: list[bool] = []

    @torchloom.hookimpl
    def on_fit_start(self, optimizer) -> None:
        self.optimizer = optimizer

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer) -> None:
        self.skipped.append(bool(getattr(optimizer, "step_was_skipped", False)))


class GradProbe:
    """Records the gradient of ``weight`` as the optimizer is about to use it (after every other plugin)."""

    name = "test.grad_probe"

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model) -> None:
        self.grads.append(model.weight.grad.detach().clone())


# ------------------------------------------------------------------------------------------------- optimizer


def test_adafactor_with_a_fixed_lr_is_the_hf_trainers_adafactor(tmp_path):
    """``name: adafactor`` with an lr builds what the HF Trainer's ``optim="adafactor"`` builds (asked of the
    installed Trainer): ``scale_parameter=False, relative_step=False``, not transformers' class default
    ``scale_parameter=True``; the documented default is what the optimizer group holds."""
    from transformers import Trainer, TrainingArguments

    _, trainer_kwargs = Trainer.get_optimizer_cls_and_kwargs(
        TrainingArguments(output_dir=str(tmp_path / "hf"), optim="adafactor", learning_rate=1e-2)
    )
    capture = Capture()
    tiny_fit([{"optimizer": {"name": "adafactor", "lr": 1e-2}}, capture], max_steps=1, output_dir=str(tmp_path))
    group = capture.optimizer.param_groups[0]
    assert (trainer_kwargs["scale_parameter"], trainer_kwargs["relative_step"]) == (False, False)
    assert group["scale_parameter"] is False and group["relative_step"] is False and group["warmup_init"] is False
    assert group["lr"] == trainer_kwargs["lr"] == 1e-2


def test_adafactor_with_its_relative_step_scales_by_the_parameter(tmp_path):
    """``lr: null`` (the relative step) keeps the pairing of the Adafactor paper: ``scale_parameter`` defaults to
    true there."""
    capture = Capture()
    tiny_fit([{"optimizer": {"name": "adafactor", "lr": None}}, capture], max_steps=1, output_dir=str(tmp_path))
    group = capture.optimizer.param_groups[0]
    assert group["scale_parameter"] is True and group["relative_step"] is True


class TiedEmbeddingTask(TinyTask):
    """Embedding(10, 4) -> Linear(4, 10) whose weight is the embedding's (tied), trained on token ids."""

    def configure_model(self) -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
        return model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return torch.nn.functional.cross_entropy(self.model(ids), ids)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(8) % 10), batch_size=4)


def test_tied_weights_counted_once_in_weight_decay_groups(tmp_path):
    """A tied-embedding model with weight decay builds its optimizer: the shared weight is in one group, once."""
    task, capture = TiedEmbeddingTask(validate=False), Capture()
    tiny_fit([{"optimizer": {"name": "adamw", "weight_decay": 0.1}}, capture], task=task, output_dir=str(tmp_path))
    groups = capture.optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [1]
    assert groups[0]["params"][0] is task.model[0].weight and groups[0]["weight_decay"] == 0.1


def test_optimizer_state_size_not_logged_after_a_skipped_fp16_step(tmp_path):
    """fp16 with an initial loss scale that overflows: step 1 is skipped (no optimizer state yet), so
    ``optimizer/state_bytes`` is not logged there; it is logged once, at step 2, with the real size (AdamW over
    Linear(4, 1): exp_avg and exp_avg_sq of 5 floats and one float32 step per parameter = 48 bytes)."""
    capture = Capture()
    plugins = {
        "mixed_precision": {"dtype": "fp16", "init_scale": 2.0**40, "backoff_factor": 2.0**-30},
        "optimizer": {"name": "adamw"},
    }
    engine = tiny_fit([plugins, capture], task=TinyTask(n=16, validate=False), max_steps=3, output_dir=str(tmp_path))
    assert capture.skipped == [True, False, False]
    logged = [(r["step"], r["optimizer/state_bytes"]) for r in engine.history if "optimizer/state_bytes" in r]
    assert logged == [(2, 48.0)]
    assert optimizer_state_bytes(capture.optimizer) == 48


@pytest.mark.parametrize("source", ["task", "plugin"])
def test_fp16_loss_scaling_with_a_fused_optimizer_is_refused_before_training(tmp_path, source):
    """A fused AdamW skips an overflow step inside step(), where Accelerate cannot see it: the skipped step above
    would count as taken (the scheduler stepped, the state logged). The plugin's default under fp16 is foreach (the
    test above); asked for fused, or a task's own fused AdamW, the fit stops with one ConfigError."""

    class FusedTask(TinyTask):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)

    plugins: dict = {"mixed_precision": {"dtype": "fp16"}}
    if source == "plugin":
        plugins["optimizer"] = {"name": "adamw", "implementation": "fused"}
    task = FusedTask(n=16, validate=False) if source == "task" else TinyTask(n=16, validate=False)
    with pytest.raises(torchloom.ConfigError, match=r"mixed_precision fp16 with a fused AdamW \(fused=True\)"):
        tiny_fit([plugins], task=task, max_steps=1, output_dir=str(tmp_path))
    from torchloom_plugins.optimizer import adamw_kernel

    assert adamw_kernel(None, "cpu", loss_scaling=True) == {"foreach": True}


def test_8bit_adam_keeps_embedding_state_in_32_bits_by_default(tmp_path):
    """adamw8bit with no ``embedding_32bit`` setting: the embedding (6,400 elements, above ``min_8bit_size``)
    has float32 state, while a Linear weight of the same size has uint8 state."""
    pytest.importorskip("bitsandbytes")

    class EmbedTask(TiedEmbeddingTask):
        def configure_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Embedding(10, 640), torch.nn.Linear(640, 10))

    task, capture = EmbedTask(validate=False), Capture()
    tiny_fit([{"optimizer": {"name": "adamw8bit"}}, capture], task=task, max_steps=1, output_dir=str(tmp_path))
    state = capture.optimizer.state
    assert state[task.model[0].weight]["state1"].dtype == torch.float32
    assert state[task.model[1].weight]["state1"].dtype == torch.uint8


# -------------------------------------------------------------------------------------------- grad_checkpoint


def test_hf_checkpointing_keeps_the_non_reentrant_default(tmp_path):
    """``grad_checkpoint`` with its defaults on a tiny BERT (from a config): every layer is checkpointed with
    ``use_reentrant=False``."""
    transformers = pytest.importorskip("transformers")

    class TinyBert(TinyTask):
        def configure_model(self) -> torch.nn.Module:
            config = transformers.BertConfig(
                vocab_size=16,
                hidden_size=8,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=16,
                max_position_embeddings=8,
            )
            return transformers.BertModel(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids).last_hidden_state.pow(2).mean()

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.arange(16).reshape(2, 8)), batch_size=2)

    task = TinyBert(validate=False)
    tiny_fit({"grad_checkpoint": {}}, task=task, max_steps=1, output_dir=str(tmp_path))
    assert [checkpoint_use_reentrant(layer) for layer in task.model.encoder.layer] == [False, False]


def test_name_pattern_checkpoints_every_one_of_eleven_blocks(tmp_path):
    """``modules: ["layers.*"]`` on 11 blocks checkpoints all of them: ``layers.10`` is not inside ``layers.1``."""

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(11))
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    class StackTask(TinyTask):
        def configure_model(self) -> torch.nn.Module:
            return Stack()

    task = StackTask(validate=False)
    tiny_fit({"grad_checkpoint": {"modules": ["layers.*"]}}, task=task, max_steps=1, output_dir=str(tmp_path))
    assert [checkpoint_use_reentrant(layer) for layer in task.model.layers] == [False] * 11


# ------------------------------------------------------------------------------------------------ grad_accum


class FailOnce(TinyTask):
    """TinyTask whose first fit raises at micro-batch 1, in the middle of an accumulation window."""

    def __init__(self, fail: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail = fail

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail and batch_idx == 1:
            raise RuntimeError("planned failure")
        return super().training_step(batch, batch_idx)


def test_grad_accum_reused_after_a_failed_fit_matches_a_fresh_plugin(tmp_path):
    """An Engine whose fit failed mid-window (steps=3) fits again exactly as a new Engine: the plugin's window
    state starts empty at every fit."""
    reused = torchloom.Engine(plugins={"grad_accum": {"steps": 3}}, output_dir=str(tmp_path / "a"))
    with pytest.raises(RuntimeError, match="planned failure"):
        reused.fit(FailOnce(True, n=24, validate=False))
    again = FailOnce(False, n=24, validate=False)
    reused.fit(again)
    fresh = FailOnce(False, n=24, validate=False)
    torchloom.Engine(plugins={"grad_accum": {"steps": 3}}, output_dir=str(tmp_path / "b")).fit(fresh)
    assert reused.progress.global_step == 2
    for got, want in zip(again.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(got, want)


class Bf16Tokens(torchloom.TaskModule):
    """One float32 parameter w = 1 and a bf16 loss ``k * w`` (gradient k) with ``num_items`` items, per
    micro-batch ``(k, num_items)`` from ``batches``."""

    def __init__(self, batches: list[tuple[int, int]]) -> None:
        super().__init__()
        self.batches = batches

    def configure_model(self) -> torch.nn.Module:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        return model

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (x,), (k, items) = batch, self.batches[batch_idx]  # x = 1: the forward returns w
        return {"loss": k * self.model(x).to(torch.bfloat16).sum(), "num_items": items}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(len(self.batches), 1)), batch_size=1)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_token_normalisation_is_exact_for_a_bf16_loss(tmp_path, as_tensor):
    """A bf16 loss with 257 items (bf16 holds integers exactly only up to 256): one micro-batch gives the
    gradient 1, not 256/257; a window of (257 items, gradient 1) and (3 items, gradient 2) gives 263/260."""
    count = torch.tensor if as_tensor else int
    for steps, batches, expected in ((1, [(1, 257)], 1.0), (2, [(1, 257), (2, 3)], 263 / 260)):
        probe = GradProbe()
        task = Bf16Tokens([(k, count(items)) for k, items in batches])
        plugins = [{"grad_accum": {"steps": steps, "normalization": "tokens"}}, probe]
        tiny_fit(plugins, task=task, max_steps=1, output_dir=str(tmp_path / str(steps)))
        (grad,) = probe.grads
        assert grad.dtype == torch.float32
        assert grad.item() == pytest.approx(expected, rel=1e-7, abs=0)


def test_val_check_interval_counts_optimizer_steps_under_accumulation(tmp_path):
    """steps=2, val_check_interval=2, 8 micro-batches = 4 optimizer steps: validation after steps 2 and 4."""
    recorder = RecordingPlugin()
    tiny_fit(
        [{"grad_accum": {"steps": 2}}, recorder],
        task=TinyTask(n=32, batch_size=4),
        val_check_interval=2,
        output_dir=str(tmp_path),
    )
    starts = [p.global_step for name, p in recorder.records if name == "on_validation_start"]
    assert starts == [2, 4]


def test_log_interval_counts_optimizer_steps_under_accumulation(tmp_path):
    """steps=2, log_every_n_steps=2, 8 micro-batches = 4 optimizer steps: values logged at steps 2 and 4."""
    engine = tiny_fit(
        {"grad_accum": {"steps": 2}},
        task=TinyTask(n=32, batch_size=4, validate=False),
        log_every_n_steps=2,
        output_dir=str(tmp_path),
    )
    assert [record["step"] for record in engine.history] == [2, 4]


# ---------------------------------------------------------------------------------------------- engine modes


class ModeTask(TinyTask):
    """TinyTask with dropout that records ``model.training`` in every training and validation step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_modes: list[bool] = []
        self.val_modes: list[bool] = []

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(self.in_features, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_modes.append(self.model.training)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.val_modes.append(self.model.training)
        return super().validation_step(batch, batch_idx)


def test_train_mode_restored_after_every_mid_epoch_validation(tmp_path):
    """``val_check_interval=1``: a validation after every step, and every training step runs in train mode."""
    task = ModeTask(n=16, batch_size=4)
    tiny_fit(None, task=task, val_check_interval=1, max_epochs=2, output_dir=str(tmp_path))
    assert task.train_modes == [True] * 8
    assert task.model.training is True


def test_validation_runs_in_eval_mode(tmp_path):
    """Every validation step (the sanity pass and the 2 epoch-end passes of 2 batches) runs in eval mode."""
    task = ModeTask(n=16, batch_size=4)
    tiny_fit(None, task=task, max_epochs=2, num_sanity_val_steps=1, output_dir=str(tmp_path))
    assert task.val_modes == [False] * 5


def test_predict_runs_in_eval_mode(tmp_path):
    """Predictions through a dropout model equal its eval-mode forward; the model is in train mode after."""
    task = ModeTask(n=16, batch_size=4, validate=False)
    engine = tiny_fit(None, task=task, output_dir=str(tmp_path))
    x = torch.randn(8, task.in_features, generator=torch.Generator().manual_seed(3))
    predictions = engine.predict(task, DataLoader(x, batch_size=4))
    assert task.model.training is True
    task.model.eval()
    with torch.no_grad():
        expected = task.model(x)
    assert torch.equal(torch.cat(predictions), expected)


# --------------------------------------------------------------------------------------------------- logging


def test_logged_values_are_summed_in_float64(tmp_path):
    """300 logs of a bf16 1.0 in one step reduce to exactly 1.0 (a bf16 sum would stop at 256)."""

    class Logs300(TinyTask):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            for _ in range(300):
                self.log("probe", torch.ones((), dtype=torch.bfloat16))
            return super().training_step(batch, batch_idx)

    engine = tiny_fit(None, task=Logs300(n=4, batch_size=4, validate=False), output_dir=str(tmp_path))
    assert [record["probe"] for record in engine.history] == [1.0]


# ------------------------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    return torchrun("safety_net_mp.py", tmp_path_factory.mktemp("safety_net_mp"), nproc=2)


@pytest.mark.multiprocess
def test_drop_last_counted_in_training_steps_on_two_processes(two_process_results):
    """11 samples, batch 2, ``drop_last=True``: 5 batches, 2 per process, so ``num_training_steps`` is 2."""
    for rank in two_process_results:
        assert rank["drop_last"] == {"num_training_steps": 2, "global_step": 2}


@pytest.mark.multiprocess
def test_local_sgd_does_not_average_after_a_failed_fit(two_process_results):
    """A LocalSGD fit (sync_every 100) that raised on both ranks at batch 3: no average happened, not in the
    loop and not in teardown, so the parameters trained on different shards still differ between ranks."""
    first, second = (rank["lsgd_failed"] for rank in two_process_results)
    assert first["error"] == second["error"] == "planned failure"
    assert first["params"] != second["params"]


@pytest.mark.multiprocess
def test_token_normalisation_is_exact_for_a_bf16_loss_on_two_processes(two_process_results):
    """bf16 losses with 257 items (gradient 1) on rank 0 and 3 items (gradient 2) on rank 1: the all-reduced
    gradient is the mean over the 260 items, 263/260, on both ranks."""
    for rank in two_process_results:
        assert rank["bf16_tokens"]["grads"] == [pytest.approx(263 / 260, rel=1e-7, abs=0)]
