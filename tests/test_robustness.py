"""Bad input and odd data: one clear error, or the right behaviour; nothing from an earlier run leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import torchloom
from cli_util import run_cli  # the torchloom command, in this process
from torchloom.testing import TinyTask, tiny_fit


class Noop(torchloom.Plugin):
    name = "noop"

    @torchloom.hookimpl
    def on_fit_start(self) -> None:
        pass


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ({"noop_a", "noop_b"}, "a set has no order"),
        ([None], "entry None is not a plugin"),
        ([5], "entry 5 is not a plugin"),
        (5, "got 5"),
        ([Noop], "got the class Noop; pass an instance, Noop(...)"),
    ],
)
def test_plugins_that_are_not_plugins_are_one_clear_error(plugins, message):
    with pytest.raises(torchloom.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        torchloom.Engine(plugins=plugins)


def test_a_multi_entry_mapping_in_a_list_enables_each_in_order():
    engine = torchloom.Engine(plugins=[{"grad_clip": {"max_norm": 2.0}, "grad_accum": {"steps": 2}}, Noop()])
    assert [p.name for p in engine.plugins] == ["grad_clip", "grad_accum", "noop", "progress"]  # then the default
    assert engine.plugins[0].config.max_norm == 2.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"output_dir": None}, r"^engine: setting 'output_dir' = None \(NoneType\); expected str$"),
        ({"save_model": "no"}, r"^engine: setting 'save_model' = 'no' \(str\); expected bool$"),
    ],
)
def test_engine_settings_are_type_checked(settings, message):
    with pytest.raises(torchloom.ConfigError, match=message):
        torchloom.Engine(**settings)


class LossTask(TinyTask):
    def __init__(self, make_loss):
        super().__init__(validate=False)
        self.make_loss = make_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.make_loss(torch.nn.functional.mse_loss(self.model(x), y))


@pytest.mark.parametrize(
    ("make_loss", "message"),
    [
        (lambda loss: loss.detach().long(), "dtype torch.int64; expected a floating-point tensor"),
        (lambda loss: loss.detach(), "does not require grad"),
        (lambda loss: {"los": loss}, r"got NoneType \(its keys: \['los'\]\)"),
        (lambda loss: loss.expand(3), r"shape \(3,\); expected a scalar"),
    ],
)
def test_bad_losses_are_task_errors(make_loss, message, tmp_path):
    with pytest.raises(torchloom.TaskError, match=message):
        tiny_fit(task=LossTask(make_loss), output_dir=str(tmp_path))


def test_logging_a_non_number_names_the_metric(tmp_path):
    class LogsText(TinyTask):
        def training_step(self, batch, batch_idx):
            self.log("notes", "hello")
            return super().training_step(batch, batch_idx)

    with pytest.raises(TypeError, match=r"log\('notes'\): value 'hello' is a str"):
        tiny_fit(task=LogsText(), output_dir=str(tmp_path))


def test_an_empty_dataloader_given_explicitly_is_used_not_replaced(tmp_path):
    # An explicit empty dataloader is the one checked (the task's own 32 samples are not used instead), and a fit
    # without batches is an error, not an untrained model reported as a success.
    engine = torchloom.Engine(output_dir=str(tmp_path), save_model=True)
    empty = DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1)), batch_size=4)
    with pytest.raises(torchloom.ConfigError, match="the training dataloader has no batches"):
        engine.fit(TinyTask(), train_dataloader=empty, val_dataloader=empty)
    assert not list((tmp_path).rglob("model"))


def test_an_iterable_dataset_without_a_length_trains(tmp_path):
    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(12):
                yield torch.randn(4, generator=g), torch.randn(1, generator=g)

    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=2)
    engine.fit(TinyTask(validate=False), train_dataloader=DataLoader(Stream(), batch_size=4))
    assert engine.progress.global_step == 6


def test_values_logged_by_a_failed_run_do_not_leak_into_the_next(tmp_path):
    class FailsAtBatch3(TinyTask):
        def training_step(self, batch, batch_idx):
            self.log("boom/marker", 1000.0)
            if batch_idx == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    engine = torchloom.Engine(output_dir=str(tmp_path), log_every_n_steps=50)
    with pytest.raises(RuntimeError, match="boom"):
        engine.fit(FailsAtBatch3())
    engine.fit(TinyTask())
    assert all("boom/marker" not in record for record in engine.history)


def test_a_failed_run_never_touches_the_previous_good_run(tmp_path):
    tiny_fit(output_dir=str(tmp_path), max_epochs=2, save_model=True)
    good = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "version_0").rglob("*") if p.is_file()}
    assert len((tmp_path / "version_0" / "metrics.jsonl").read_text().splitlines()) > 0

    class FailsFirstStep(TinyTask):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("first step fails")

    with pytest.raises(RuntimeError):
        tiny_fit(task=FailsFirstStep(), output_dir=str(tmp_path), max_epochs=1, save_model=True)
    # The failed run has its own directory, with its own config.yaml (and an empty metrics.jsonl); the good run's
    # files are byte for byte as they were, and latest still names it.
    assert "max_epochs: 1" in (tmp_path / "version_1" / "config.yaml").read_text()
    assert (tmp_path / "version_1" / "metrics.jsonl").read_text() == ""
    assert {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "version_0").rglob("*") if p.is_file()} == good
    assert (tmp_path / "latest").resolve() == (tmp_path / "version_0").resolve()


def test_cli_reports_a_config_error_raised_by_a_task_init_in_one_line(tmp_path):
    (tmp_path / "strict.py").write_text(
        "import torchloom\nfrom torchloom.testing import TinyTask\n\n"
        "class Strict(TinyTask):\n"
        "    def __init__(self, lr: float = 0.1):\n"
        "        if lr <= 0:\n"
        "            raise torchloom.ConfigError(f'Strict: lr={lr!r}; expected a number > 0')\n"
        "        super().__init__(lr=lr)\n"
    )
    (tmp_path / "c.yaml").write_text(
        json.dumps({"engine": {"output_dir": str(tmp_path / "run")}, "task": {"class_path": "strict.Strict"}})
    )
    proc = run_cli("fit", "--config", "c.yaml", "--task.init_args.lr=-1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "torchloom: error: Strict: lr=-1.0; expected a number > 0\n"


def test_a_value_logged_after_a_fit_does_not_leak_into_the_next_validation(tmp_path):
    engine = torchloom.Engine(output_dir=str(tmp_path))
    task = TinyTask()
    engine.fit(task)
    with pytest.raises(RuntimeError, match=r"log\('stale'\) called outside Engine.fit / validate / predict"):
        task.log("stale", 123.0)  # no run is active: nowhere to log to
    assert set(engine.validate(task)) == {"val/loss"}


def test_metrics_jsonl_is_strict_json_with_non_finite_values(tmp_path):
    class NanLoss(TinyTask):
        def training_step(self, batch, batch_idx):
            self.log("overflow", float("inf"))
            return super().training_step(batch, batch_idx) * float("nan")

    engine = tiny_fit(task=NanLoss(validate=False), output_dir=str(tmp_path), max_epochs=1, nonfinite_loss="ignore")
    lines = (Path(engine.run_dir) / "metrics.jsonl").read_text().splitlines()

    def strict(token):
        raise ValueError(f"non-standard JSON token {token}")

    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert records[0]["train/loss"] == "NaN" and records[0]["overflow"] == "Infinity"
    assert float(records[0]["overflow"]) == float("inf")
