"""Runs that used to finish "successfully" with a wrong result, or fail late: each scenario of issue 6 that one
process can show. The 2-process ones (saved model after LocalSGD, seeds, uneven ranks) are in test_multiprocess.py.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_dataset, tiny_fit

# ------------------------------------------------------------------------------------ 1. module modes


class FrozenBackbone(TinyTask):
    """A frozen backbone (Linear + BatchNorm1d in eval mode, no gradients) under a trainable head. Records, at
    every training step, whether the BatchNorm and the head are in training mode."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.modes: list[tuple[bool, bool, bool]] = []  # (model, bn, head) training flags per micro-batch

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        model[0].requires_grad_(False)
        model[1].requires_grad_(False)
        model[1].running_mean.fill_(0.25)  # non-default statistics, as a pretrained backbone has
        model[1].running_var.fill_(2.0)
        model[1].eval()
        return model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        model = self.accelerator.unwrap_model(self.model)
        self.modes.append((model.training, model[1].training, model[2].training))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("val_check_interval", [None, 1])
def test_a_frozen_batchnorm_stays_in_eval_mode_through_fit_and_validation(tmp_path, val_check_interval):
    task = FrozenBackbone(n=16, batch_size=4)
    engine = tiny_fit(task=task, output_dir=str(tmp_path), max_epochs=2, val_check_interval=val_check_interval)
    bn = task.accelerator.unwrap_model(task.model)[1]
    assert engine.progress.global_step == 8
    assert sum(1 for record in engine.history if "val/loss" in record) == (2 if val_check_interval is None else 8)
    assert torch.equal(bn.running_mean, torch.full((8,), 0.25))  # statistics never updated
    assert torch.equal(bn.running_var, torch.full((8,), 2.0))
    assert bn.num_batches_tracked.item() == 0
    assert not bn.training
    # every training step, also the ones right after a validation: model and head train, the BatchNorm does not
    assert task.modes == [(True, False, True)] * 8


def test_a_mode_a_plugin_sets_at_epoch_start_is_kept(tmp_path):
    class FreezeHeadDropout(torchloom.Plugin):
        name = "test_freeze"

        @torchloom.hookimpl
        def on_train_epoch_start(self, progress):
            if progress.epoch == 1:
                self.model[2].eval()

        @torchloom.hookimpl
        def on_fit_start(self, model):
            self.model = model

    task = FrozenBackbone(n=8, batch_size=4)
    tiny_fit([FreezeHeadDropout()], task=task, output_dir=str(tmp_path), max_epochs=2)
    # epoch 0 trains the head; in epoch 1 the plugin's eval() holds, through the validation of epoch 0 and 1
    assert task.modes == [(True, False, True)] * 2 + [(True, False, False)] * 2


def test_a_model_wholly_in_eval_mode_trains_in_train_mode(tmp_path):
    # as transformers' from_pretrained returns it: dropout would silently be off for the whole fine-tune
    class Pretrained(FrozenBackbone):
        def configure_model(self):
            return super().configure_model().eval()

    task = Pretrained(n=8, batch_size=4)
    tiny_fit(task=task, output_dir=str(tmp_path), max_epochs=2)
    assert task.modes == [(True, True, True)] * 4


def test_predict_gives_every_module_its_mode_back(tmp_path):
    task = FrozenBackbone(n=8, batch_size=4)
    engine = tiny_fit(task=task, output_dir=str(tmp_path))
    model = task.accelerator.unwrap_model(task.model)
    engine.predict(task, DataLoader(torch.randn(6, 4), batch_size=3))
    assert [m.training for m in model] == [True, False, True]


# ------------------------------------------------------------------------------ 2. end-of-training order


class WeightSwap(torchloom.Plugin):
    """Replaces the weights at the end of training (as an EMA swap or a last average does)."""

    name = "test_swap"

    @torchloom.hookimpl
    def on_train_end(self, model):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(0.5)


def test_the_saved_model_is_the_model_after_on_train_end(tmp_path):
    from safetensors.torch import load_file

    rec = RecordingPlugin()
    task = TinyTask(n=8, batch_size=4)
    tiny_fit([WeightSwap(), rec], task=task, output_dir=str(tmp_path), save_model=True)
    saved = load_file(tmp_path / "latest" / "model" / "model.safetensors")
    model = task.accelerator.unwrap_model(task.model)
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in saved.values())
    assert rec.calls[-5:] == ["on_train_epoch_end", "on_train_end", "on_save_model", "on_fit_end", "teardown"]


def test_on_train_end_does_not_fire_after_an_exception(tmp_path):
    class Fails(TinyTask):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    rec = RecordingPlugin()
    with pytest.raises(RuntimeError, match="boom"):
        tiny_fit([rec], task=Fails(), output_dir=str(tmp_path), save_model=True)
    assert "on_train_end" not in rec.calls
    assert rec.calls[-3:] == ["on_exception", "on_fit_end", "teardown"]
    assert not list((tmp_path).rglob("model"))


# ------------------------------------------------------------------------------------------- 4. seeds


class Shuffled(TinyTask):
    """Shuffled training data with dropout; records the order of the samples it trains on."""

    def __init__(self, loader: DataLoader | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loader, self.seen = loader, []

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        if self.loader is not None:
            return self.loader
        return DataLoader(tiny_dataset(self.n, 4, 0), batch_size=self.batch_size, shuffle=True)


def _seeded_fit(tmp_path, task: Shuffled, seed: int) -> tuple[list, list]:
    tiny_fit(task=task, output_dir=str(tmp_path), max_epochs=2, seed=seed)
    params = [p.detach().clone() for p in task.accelerator.unwrap_model(task.model).parameters()]
    return task.seen, params


def test_the_same_seed_repeats_a_run_bitwise_with_new_or_reused_dataloaders(tmp_path):
    order_a, params_a = _seeded_fit(tmp_path, Shuffled(validate=False), seed=7)
    order_b, params_b = _seeded_fit(tmp_path, Shuffled(validate=False), seed=7)
    loader = DataLoader(tiny_dataset(32, 4, 0), batch_size=4, shuffle=True, generator=torch.Generator())
    order_c, params_c = _seeded_fit(tmp_path, Shuffled(loader, validate=False), seed=7)
    order_d, params_d = _seeded_fit(tmp_path, Shuffled(loader, validate=False), seed=7)  # the same object again
    assert order_a == order_b == order_c == order_d  # the order comes from the seed, whatever the loader
    assert order_a[:8] != order_a[8:]  # each epoch has its own shuffle
    # parameters (dropout included) repeat bitwise; a loader with its own generator draws its worker seed from
    # that generator instead of the global one, so it is compared with its own repeat
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    assert all(torch.equal(x, y) for x, y in zip(params_c, params_d))
    order_e, _ = _seeded_fit(tmp_path, Shuffled(validate=False), seed=8)
    assert order_e != order_a  # the seed decides the data order


# ------------------------------------------------------------------------------------- 5. non-finite loss


class NanAt(TinyTask):
    """The loss of micro-batch ``at`` (0-based, in every epoch) is NaN, or ``value``."""

    def __init__(self, at: int, value: float = math.nan, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.value = at, value

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * self.value if batch_idx == self.at else loss


@pytest.mark.parametrize(
    "log_every,value,where", [(1, "nan", "optimizer step 3 "), (50, "inf", "optimizer steps 1-8 ")]
)
def test_a_non_finite_loss_stops_the_run_naming_the_steps_and_saves_nothing(tmp_path, log_every, value, where):
    rec = RecordingPlugin()
    task = NanAt(2, float(value), n=32, batch_size=4)
    # with a later check the mean over the interval is NaN (inf, then NaN weights): either is named
    with pytest.raises(torchloom.TaskError, match=f"training loss became (nan|{value}) in {where}") as info:
        tiny_fit([rec], task=task, output_dir=str(tmp_path), save_model=True, log_every_n_steps=log_every)
    assert "on_exception" in rec.calls and "on_train_end" not in rec.calls
    assert not list((tmp_path).rglob("model"))
    assert "nonfinite_loss" in str(info.value)
    if log_every == 1:  # checked at the first logging step after it: training stopped right there
        assert rec.calls.count("run_train_step") == 3


def test_skip_drops_exactly_the_steps_with_a_non_finite_loss(tmp_path):
    class ZeroAt(NanAt):  # the reference: a zero gradient for micro-batch 2 leaves SGD's weights unchanged
        def training_step(self, batch, batch_idx):
            loss = TinyTask.training_step(self, batch, batch_idx)
            return loss * 0.0 if batch_idx == self.at else loss

    class WithSchedule(NanAt):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
            return optimizer, self.scheduler

    skipped = WithSchedule(2, n=32, batch_size=4, validate=False)
    with pytest.warns(UserWarning, match="skipped optimizer step 3 "):
        engine = tiny_fit(task=skipped, output_dir=str(tmp_path / "a"), nonfinite_loss="skip", save_model=True)
    reference = ZeroAt(2, n=32, batch_size=4, validate=False)
    tiny_fit(task=reference, output_dir=str(tmp_path / "b"))
    for a, b in zip(skipped.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)
    assert engine.progress.global_step == 8  # the skipped window still counts, as an fp16-skipped step does
    assert skipped.scheduler.last_epoch == 7  # but the schedule advanced only for the 7 real steps
    # the NaN is not averaged into train/loss: only the step that had nothing else to log shows it
    assert [math.isfinite(r["train/loss"]) for r in engine.history] == [True, True, False, *[True] * 5]
    assert (tmp_path / "a" / "latest" / "model" / "model.safetensors").exists()


def test_ignore_trains_on(tmp_path):
    task = NanAt(2, n=16, batch_size=4, validate=False)
    engine = tiny_fit(task=task, output_dir=str(tmp_path), nonfinite_loss="ignore")
    assert engine.progress.global_step == 4
    assert all(torch.isnan(p).all() for p in task.model.parameters())


def test_non_finite_weights_are_never_saved(tmp_path):
    class NanGradientLastStep(TinyTask):  # a finite loss with a NaN gradient, in the very last step
        def training_step(self, batch, batch_idx):
            out = self.model(batch[0])
            if batch_idx == 3:
                out.register_hook(lambda grad: grad * math.nan)
            return torch.nn.functional.mse_loss(out, batch[1])

    with pytest.raises(torchloom.TaskError, match="NaN or infinite weights; it is not saved"):
        tiny_fit(task=NanGradientLastStep(n=16, batch_size=4), output_dir=str(tmp_path), save_model=True)
    assert not list((tmp_path).rglob("model"))


def test_nonfinite_loss_setting_is_validated():
    with pytest.raises(
        torchloom.ConfigError, match="engine: setting 'nonfinite_loss' = 'warn'; expected one of 'error', 'skip'"
    ):
        torchloom.Engine(nonfinite_loss="warn")


# ------------------------------------------------------------------------- 6. counts and returns that cannot be right


class Items(TinyTask):
    def __init__(self, items: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.items = items

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "num_items": self.items(batch_idx)}


@pytest.mark.parametrize("plugins", [None, {"grad_accum": {"steps": 2, "normalization": "items"}}])
def test_a_negative_num_items_is_an_error(tmp_path, plugins):
    with pytest.raises(torchloom.TaskError, match=r"returned num_items=-4; expected .* >= 0"):
        tiny_fit(plugins, task=Items(lambda i: -4 if i == 1 else 4), output_dir=str(tmp_path))
    # as a tensor, checked on the device and read at the logging step (here the first): no per-step sync
    step = 2 if plugins is None else 1  # micro-batch 1 ends optimizer step 2, or is in step 1 with accumulation
    with pytest.raises(torchloom.TaskError, match=f"negative num_items in optimizer step {step};"):
        tiny_fit(plugins, task=Items(lambda i: torch.tensor(-4 if i == 1 else 4)), output_dir=str(tmp_path))


@pytest.mark.parametrize("plugins", [None, {"grad_accum": {"steps": 2, "normalization": "items"}}])
@pytest.mark.parametrize("zero", [0, torch.tensor(0)], ids=["int", "tensor"])
def test_num_items_0_in_every_micro_batch_is_reported_as_a_loss_over_no_items(tmp_path, plugins, zero):
    """Every micro-batch with no labelled item: the logged loss is 0 / 0 = NaN, which is not a divergence and gets
    its own message, not the advice to lower the learning rate (read at the logging step, as the loss is)."""
    with pytest.raises(torchloom.TaskError) as caught:
        tiny_fit(plugins, task=Items(lambda i: zero, validate=False), output_dir=str(tmp_path), log_every_n_steps=2)
    assert str(caught.value) == (
        "every micro-batch of optimizer steps 1-2 (epoch 0) returned num_items=0, on every process, so the training "
        "loss is nan: a mean over no items (no labelled tokens), not a divergence; stopping, and the model is not "
        "saved. Check the labels and the loss mask (every label -100, or truncation that cut off every "
        "completion?), and return num_items = the number of items the loss is a mean over"
    )


def test_num_items_0_in_some_micro_batches_and_a_real_divergence_keep_their_own_outcomes(tmp_path):
    """Zero items in every other micro-batch, logged every 2 steps: a finite weighted loss, no error. A NaN loss with
    items: the divergence message."""
    task = Items(lambda i: torch.tensor(0 if i % 2 else 4), validate=False)
    engine = tiny_fit(task=task, output_dir=str(tmp_path), log_every_n_steps=2)
    assert all(math.isfinite(r["train/loss"]) for r in engine.history if "train/loss" in r)

    class Diverges(Items):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            return {**out, "loss": out["loss"] * math.nan}

    with pytest.raises(torchloom.TaskError, match=r"the training loss became nan in optimizer step 1 .* Lower the"):
        tiny_fit(task=Diverges(lambda i: torch.tensor(4), validate=False), output_dir=str(tmp_path))


def test_a_training_dataloader_that_yields_nothing_is_an_error(tmp_path):
    class Nothing(torch.utils.data.Sampler):  # no length: only iterating shows that it is empty
        def __iter__(self):
            return iter(())

    loader = DataLoader(tiny_dataset(8), batch_size=2, sampler=Nothing())
    with pytest.raises(torchloom.ConfigError, match="yielded no batches in epoch 0"):
        torchloom.Engine(output_dir=str(tmp_path), save_model=True).fit(TinyTask(validate=False), loader)
    assert not list((tmp_path).rglob("model"))


def _returning(value_fn: Any) -> TinyTask:
    class Returns(TinyTask):
        def configure_optimizers(self):
            return value_fn(self.model)

    return Returns()


@pytest.mark.parametrize(
    "value_fn,match",
    [
        (lambda m: [torch.optim.SGD(m.parameters(), 0.1), torch.optim.SGD(m.parameters(), 0.1)], "2 optimizers"),
        (lambda m: (torch.optim.SGD(m.parameters(), 0.1), "linear"), "the scheduler is the string 'linear'"),
        (lambda m: None, r"returned None; expected an optimizer"),
        (lambda m: "adamw", r"returned the string 'adamw'"),
        (lambda m: m.parameters(), r"returned an iterator \(generator\)"),
    ],
)
def test_configure_optimizers_returns_that_cannot_be_right(tmp_path, value_fn, match):
    with pytest.raises(torchloom.TaskError, match=match):
        tiny_fit(task=_returning(value_fn), output_dir=str(tmp_path))


@pytest.mark.parametrize("model", [None, torch.nn.Linear, {"w": torch.zeros(1)}])
def test_configure_model_must_return_a_module(tmp_path, model):
    class Bad(TinyTask):
        def configure_model(self):
            return model

    with pytest.raises(torchloom.TaskError, match=r"configure_model\(\) returned .*; expected a torch.nn.Module"):
        tiny_fit(task=Bad(), output_dir=str(tmp_path))


class FrozenTask(TinyTask):
    """TinyTask whose parameters are all frozen, as a model loaded for evaluation."""

    def configure_model(self):
        return super().configure_model().requires_grad_(False)


def test_a_fit_of_a_model_with_nothing_to_train_stops_before_the_run_and_validate_works(tmp_path):
    """One clear error before the optimizer or DDP sees the model (it was backward's "element 0 of tensors does not
    require grad" on one process, DDP's constructor on several); validate and predict need no trainable parameter."""
    with pytest.raises(torchloom.TaskError) as raised:
        tiny_fit(task=FrozenTask(), output_dir=str(tmp_path / "fit"))
    assert str(raised.value) == (
        "fit: the model of FrozenTask.configure_model() (Linear) has nothing to train: all 5 of its parameters have "
        "requires_grad=False; unfreeze what should train (requires_grad_(True)), or evaluate the model with validate "
        "or predict, which need no trainable parameter"
    )
    assert not list((tmp_path / "fit").glob("version_*"))
    metrics = torchloom.Engine(output_dir=str(tmp_path / "validate")).validate(FrozenTask())
    assert metrics["val/loss"] > 0


class AnswersOptimizers(torchloom.Plugin):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    @torchloom.hookimpl
    def configure_optimizers(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)


def test_two_plugins_answering_configure_optimizers_is_an_error_naming_both(tmp_path):
    with pytest.raises(torchloom.PluginError, match="plugins 'opt_a' and 'opt_b' both answer configure_optimizers"):
        tiny_fit([AnswersOptimizers("opt_a"), AnswersOptimizers("opt_b")], output_dir=str(tmp_path))


def test_a_val_check_interval_beyond_the_run_is_an_error(tmp_path):
    with pytest.raises(torchloom.ConfigError, match="'val_check_interval': got 9, but this fit takes only 8"):
        tiny_fit(output_dir=str(tmp_path), val_check_interval=9)
    tiny_fit(task=TinyTask(validate=False), output_dir=str(tmp_path), val_check_interval=9)  # nothing to validate


def test_validation_data_without_validation_step_fails_before_training(tmp_path):
    class NoValidationStep(TinyTask):
        validation_step = torchloom.TaskModule.validation_step

    rec = RecordingPlugin()
    with pytest.raises(torchloom.ConfigError, match="got validation data but defines no validation_step"):
        tiny_fit([rec], task=NoValidationStep(), output_dir=str(tmp_path))
    assert "run_train_step" not in rec.calls


class BrokenValidation(TinyTask):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trained = 0

    def training_step(self, batch, batch_idx):
        self.trained += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        raise KeyError("labels")


def test_the_sanity_pass_finds_a_broken_validation_step_before_training(tmp_path):
    task = BrokenValidation()
    with pytest.raises(KeyError, match="labels"):
        tiny_fit(task=task, output_dir=str(tmp_path))
    assert task.trained == 0
    task = BrokenValidation()
    with pytest.raises(KeyError, match="labels"):  # switched off: found only after the first epoch
        tiny_fit(task=task, output_dir=str(tmp_path), num_sanity_val_steps=0)
    assert task.trained == 8


def test_the_sanity_pass_changes_nothing(tmp_path):
    class Counting(Shuffled):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.val_batches = 0

        def validation_step(self, batch, batch_idx):
            self.val_batches += 1
            return super().validation_step(batch, batch_idx)

    runs = []
    for sanity in (0, 2):
        task = Counting()
        engine = tiny_fit(task=task, output_dir=str(tmp_path), num_sanity_val_steps=sanity)
        runs.append((task, engine))
    (plain, plain_engine), (checked, checked_engine) = runs
    assert checked.val_batches == plain.val_batches + 2
    assert plain.seen == checked.seen  # data order and dropout (the RNG) unchanged
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), checked.model.parameters()))
    assert plain_engine.history == checked_engine.history  # nothing the sanity pass logged is reported


def test_an_optimizer_over_another_modules_parameters_is_an_error_naming_them(tmp_path):
    """An optimizer over a module the task keeps beside the model (or a fresh instance) never changes the model: an
    error at set-up, also in a second fit in the same process (a warning would be shown once per process), naming
    the parameters as the task holds them, or by shape."""

    class Stray(TinyTask):
        def configure_model(self):
            self.head = torch.nn.Linear(4, 1)  # built beside the model; the optimizer takes it by mistake
            return torch.nn.Linear(4, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.1)

    for _ in range(2):
        with pytest.raises(torchloom.TaskError) as caught:
            tiny_fit(task=Stray(), output_dir=str(tmp_path))
        assert str(caught.value) == (
            "Stray.configure_optimizers(): the optimizer holds none of the model's parameters: its 2 parameters "
            "(self.head.weight [1, 4], self.head.bias [1]) are not parameters of the Linear that configure_model "
            "returned (2 parameters), so the model would never change. Build the optimizer from "
            "self.model.parameters() in configure_optimizers"
        )
    assert not list(tmp_path.rglob("metrics.jsonl"))  # refused before the first step

    class Fresh(TinyTask):
        def configure_optimizers(self):
            return torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1)

    with pytest.raises(torchloom.TaskError, match=r"its 2 parameters \(a tensor of shape \[1, 4\], a tensor of shape "):
        tiny_fit(task=Fresh(), output_dir=str(tmp_path))


def test_an_optimizer_over_the_model_and_more_warns_naming_the_others(tmp_path):
    """A learnable temperature on the task beside the model's parameters trains, but is not saved with the model and
    not averaged by DDP: a warning naming it. The usual optimizer: nothing."""

    class Temperature(TinyTask):
        def configure_optimizers(self):
            self.temperature = torch.nn.Parameter(torch.ones(()))
            return torch.optim.SGD([*self.model.parameters(), self.temperature], lr=0.1)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tiny_fit(task=Temperature(), output_dir=str(tmp_path))
    said = [str(w.message) for w in record if "optimizer" in str(w.message)]
    assert said == [
        "Temperature.configure_optimizers(): 1 of the optimizer's 3 parameters is not a parameter of the model: "
        "self.temperature []. They are stepped, but not saved with the model, and on several processes their "
        "gradients are not averaged. Put them in the module configure_model returns (as submodules or nn.Parameter "
        "attributes)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tiny_fit(output_dir=str(tmp_path))  # the usual optimizer: no warning


# ------------------------------------------------------------------ 9. plugins cannot break each other's clean-up


class Cleaner(torchloom.Plugin):
    def __init__(self, name: str, fail: bool, log: list[str]) -> None:
        super().__init__()
        self.name, self.fail, self.log = name, fail, log

    @torchloom.hookimpl
    def teardown(self):
        self.log.append(self.name)
        if self.fail:
            raise OSError(f"{self.name} could not close its file")


def test_every_teardown_runs_and_the_first_error_is_reported_with_the_others_as_notes(tmp_path):
    log: list[str] = []
    plugins = [Cleaner("a", False, log), Cleaner("b", True, log), Cleaner("c", True, log)]
    with pytest.raises(OSError, match="c could not close its file") as info:  # teardown runs c, b, a
        tiny_fit(plugins, output_dir=str(tmp_path))
    assert log == ["c", "b", "a"]
    notes = "\n".join(info.value.__notes__)
    assert "raised in hook 'teardown' of plugin 'c'" in notes
    assert "hook 'teardown' also raised OSError('b could not close its file')" in notes


def test_a_failing_teardown_does_not_replace_the_error_of_the_run(tmp_path):
    log: list[str] = []

    class Fails(TinyTask):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("the real problem")

    with pytest.raises(RuntimeError, match="the real problem") as info:
        tiny_fit([Cleaner("a", True, log), Cleaner("b", False, log)], task=Fails(), output_dir=str(tmp_path))
    assert log == ["b", "a"]
    assert any("also raised OSError('a could not close its file')" in note for note in info.value.__notes__)


def test_a_run_train_step_wrapper_that_returns_nothing_is_named(tmp_path):
    class Forgetful(torchloom.Plugin):
        name = "forgetful"

        @torchloom.hookimpl(wrapper=True)
        def run_train_step(self):
            yield  # should be: return (yield)

    with pytest.raises(torchloom.PluginError, match=r"plugin 'forgetful' wraps run_train_step and must return"):
        tiny_fit([Forgetful()], output_dir=str(tmp_path))


def test_the_cli_reports_a_task_error_in_one_line_with_status_2(tmp_path, capsys):
    from torchloom.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text(
        "task:\n  class_path: torchloom.testing.TinyTask\n"
        f"engine:\n  output_dir: {tmp_path / 'run'}\n  val_check_interval: 100\n"
    )
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "val_check_interval" in err and "Traceback" not in err


def test_the_user_guide_shows_the_messages_the_engine_prints():
    from pathlib import Path

    from torchloom._guards import nonfinite_loss_error

    guide = (Path(__file__).parent.parent / "docs" / "user-guide.md").read_text(encoding="utf-8")
    assert f"torchloom: error: {nonfinite_loss_error(float('nan'), 3, 3, 0)}\n" in guide
    assert "the processes have different numbers of training batches (rank 0: 2, rank 1: 4); every process" in guide
