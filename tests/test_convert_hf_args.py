"""``torchloom convert-hf-args`` / `torchloom.convert_hf_args` on real ``TrainingArguments`` JSON, built with
transformers itself: the exact settings each argument set becomes, what is reported as not converted and why, the
output validated by the real settings classes and by ``torchloom fit --print_config``, optimizers and schedules
that match the ones the HF Trainer builds from the same arguments, and the command end to end."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from accelerate.state import PartialState
from transformers import Trainer, TrainingArguments, get_scheduler

import torchloom
import torchloom_plugins
from torchloom import cli
from torchloom.data import AudioClassificationData, ImageClassificationData, TextClassificationData
from torchloom.testing import TinyTask
from torchloom.tools.hf_args import convert as _hf_args
from torchloom.tools.hf_args import mapping as _hf_args_tables
from torchloom_plugins.optimizer import OptimizerSwap, create_optimizer, create_scheduler

SOURCE_PATHS = [str(Path(torchloom.__file__).parents[1]), str(Path(torchloom_plugins.__file__).parents[1])]

DATA_MODULE = '''
import torchloom
from torch.utils.data import DataLoader
from torchloom.testing import tiny_dataset


class TinyData(torchloom.DataModule):
    """The names torchloom.data's modules use for the Trainer's per_device_* batch sizes and workers."""

    def __init__(self, batch_size: int = 4, eval_batch_size: int | None = None, num_workers: int = 0):
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size

    def train_dataloader(self):
        return DataLoader(tiny_dataset(32), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(tiny_dataset(16, seed=1), batch_size=self.eval_batch_size)
'''


def training_args(tmp_path: Path, **kwargs: Any) -> TrainingArguments:
    """Real ``TrainingArguments``, built without leaving anything behind in this process: building them starts
    Accelerate's process state (here on the CPU, which a later Accelerator would inherit) and, with older
    Accelerate versions, sets ``ACCELERATE_DYNAMO_*`` variables."""
    kwargs.setdefault("output_dir", str(tmp_path / "hf_out"))
    kwargs.setdefault("use_cpu", True)
    kwargs.setdefault("report_to", "none")
    state_before, environ_before = bool(PartialState._shared_state), dict(os.environ)
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes (fsdp as a string, ...)
            warnings.simplefilter("ignore")
            return TrainingArguments(**kwargs)
    finally:
        if not state_before:
            PartialState._reset_state()
        for key in set(os.environ) - set(environ_before):
            del os.environ[key]
        os.environ.update(environ_before)


def saved(tmp_path: Path, args: TrainingArguments | dict[str, Any], name: str = "args.json") -> Path:
    path = tmp_path / name
    path.write_text(args.to_json_string() if isinstance(args, TrainingArguments) else json.dumps(args))
    return path


def convert(tmp_path: Path, **kwargs: Any) -> _hf_args.HFArgsConversion:
    return torchloom.convert_hf_args(saved(tmp_path, training_args(tmp_path, **kwargs)))


def remarks(items: list[_hf_args.Remark]) -> dict[str, str]:
    return {r.field: r.reason for r in items}


def settings_objects(conversion: _hf_args.HFArgsConversion) -> dict[str, Any]:
    """The engine settings built by `EngineConfig`, each plugin's by its own settings class (found by name among
    the installed plugins, as a run finds it); the YAML the conversion writes parses back to the same config."""
    assert yaml.safe_load(conversion.to_yaml()) == conversion.config()
    installed = torchloom.installed_plugins()
    built = {"engine": torchloom.EngineConfig.from_settings(dict(conversion.engine))}
    for name, settings in conversion.plugins.items():
        built[name] = torchloom.build_config(installed[name][0].load(), settings)
    assert conversion.check() is None
    return built


def print_config(tmp_path: Path, conversion: _hf_args.HFArgsConversion, capsys: pytest.CaptureFixture[str]) -> Any:
    """``torchloom fit --config task.yaml --config converted.yaml --print_config``, in this process: the converted
    file plus a task and a data section that takes the converted batch sizes."""
    (tmp_path / "tinydata.py").write_text(DATA_MODULE)
    task = {
        "task": {"class_path": "torchloom.testing.TinyTask"},
        "data": {"class_path": "tinydata.TinyData", "init_args": conversion.data},
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    (tmp_path / "converted.yaml").write_text(conversion.to_yaml())
    capsys.readouterr()
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        status = cli.main(["fit", "--config", "task.yaml", "--config", "converted.yaml", "--print_config"])
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    assert status == 0, out.err
    return yaml.safe_load(out.out)


# ------------------------------------------------------------------------------------------- argument sets


def test_default_arguments(tmp_path):
    args = training_args(tmp_path)
    conversion = torchloom.convert_hf_args(saved(tmp_path, args))
    assert conversion.engine == {
        "max_epochs": 3,
        "seed": 42,  # the Trainer's default seed, not the engine's 0
        "output_dir": args.output_dir,
        "log_every_n_steps": 500,
    }
    assert conversion.plugins == {
        "optimizer": {
            "name": "adamw",
            "lr": 5e-5,
            "weight_decay": 0.0,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "scheduler": "linear",
        },
        "grad_clip": {"max_norm": 1.0},  # the Trainer clips at 1.0 by default
        # save_total_limit None keeps every checkpoint (the plugin's own default keeps 2)
        "checkpoint": {"every_n_steps": 500, "every_n_epochs": None, "keep_last": None, "save_on_interrupt": False},
    }
    assert conversion.data == {"batch_size": 8}  # the eval batch size is the same, so it is not repeated
    assert set(remarks(conversion.not_converted)) == {"use_cpu"}
    assert "ACCELERATE_USE_CPU=1" in remarks(conversion.not_converted)["use_cpu"]
    expected_differences = {"eval_strategy"} | ({"optim"} if args.optim == "adamw_torch" else set())
    assert set(remarks(conversion.differences)) == expected_differences
    built = settings_objects(conversion)
    assert built["checkpoint"].keep_last is None and built["grad_clip"].max_norm == 1.0
    assert built["engine"].seed == 42


def test_typical_fine_tune(tmp_path, capsys):
    conversion = convert(
        tmp_path,
        bf16=True,
        gradient_accumulation_steps=4,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,  # transformers 5: below 1 it is warmup_ratio
        learning_rate=2e-5,
        weight_decay=0.01,
        eval_strategy="steps",
        eval_steps=500,
        save_steps=500,
        save_total_limit=2,
        load_best_model_at_end=True,
        optim="adamw_torch_fused",
        max_grad_norm=1.0,
        gradient_checkpointing=True,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        logging_steps=50,
        report_to="tensorboard",
    )
    assert conversion.engine == {
        "max_epochs": 3,
        "seed": 42,
        "output_dir": str(tmp_path / "hf_out"),
        "val_check_interval": 500,
        "log_every_n_steps": 50,
    }
    assert conversion.plugins == {
        "grad_accum": {"steps": 4},
        "mixed_precision": {"dtype": "bf16"},
        "grad_checkpoint": {},
        "optimizer": {
            "name": "adamw",
            "lr": 2e-5,
            "weight_decay": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "scheduler": "cosine",
            "warmup_ratio": 0.05,
        },
        "grad_clip": {"max_norm": 1.0},
        "checkpoint": {
            "every_n_steps": 500,
            "every_n_epochs": None,
            "keep_last": 2,
            "monitor": "val/loss",  # metric_for_best_model "loss" (set by load_best_model_at_end) is eval_loss
            "mode": "min",
            "keep_best": 1,
            "save_on_interrupt": False,
        },
        "trackers": {"log_with": ["tensorboard"]},
    }
    assert conversion.data == {"batch_size": 16, "eval_batch_size": 64}
    assert set(remarks(conversion.not_converted)) == {"use_cpu"}
    differences = remarks(conversion.differences)
    assert set(differences) == {"metric_for_best_model", "load_best_model_at_end"}  # adamw_torch_fused: the same
    assert "not loaded at the end" in differences["load_best_model_at_end"]
    built = settings_objects(conversion)
    assert built["optimizer"].implementation is None  # fused where the device has the kernel, as the Trainer's
    assert (built["optimizer"].scheduler, built["optimizer"].warmup_ratio) == ("cosine", 0.05)
    assert (built["checkpoint"].monitor, built["checkpoint"].keep_last) == ("val/loss", 2)
    printed = print_config(tmp_path, conversion, capsys)
    assert printed["plugins"] == conversion.plugins
    assert {k: printed["engine"][k] for k in conversion.engine} == conversion.engine
    assert printed["data"]["init_args"] == {"batch_size": 16, "eval_batch_size": 64, "num_workers": 0}


@pytest.mark.parametrize(
    ("optim", "optim_args", "expected"),
    [
        ("adamw_bnb_8bit", None, {"name": "adamw8bit", "betas": [0.9, 0.98], "eps": 1e-6}),
        ("adamw_8bit", None, {"name": "adamw8bit", "betas": [0.9, 0.98], "eps": 1e-6}),
        ("paged_adamw_8bit", None, {"name": "paged_adamw8bit", "betas": [0.9, 0.98], "eps": 1e-6}),
        # The Trainer builds Adafactor(lr, scale_parameter=False, relative_step=False) and ignores adam_*.
        ("adafactor", None, {"name": "adafactor", "scale_parameter": False}),
        ("sgd", "momentum=0.9", {"name": "sgd", "momentum": 0.9}),
    ],
)
def test_optimizers(tmp_path, optim, optim_args, expected):
    args = training_args(
        tmp_path, optim=optim, optim_args=optim_args, learning_rate=3e-4, weight_decay=0.05, adam_beta2=0.98,
        adam_epsilon=1e-6, lr_scheduler_type="constant",
    )  # fmt: skip
    conversion = torchloom.convert_hf_args(saved(tmp_path, args))
    settings = conversion.plugins["optimizer"]
    assert settings == {"lr": 3e-4, "weight_decay": 0.05, **expected, "scheduler": "constant"}
    assert remarks(conversion.not_converted).keys() == {"use_cpu"}
    config = settings_objects(conversion)["optimizer"]
    if optim == "paged_adamw_8bit":
        return  # pages through CUDA memory: the plugin builds it on a CUDA device only
    # The optimizer torchloom builds has the hyperparameters of the one the Trainer builds from the same arguments.
    model = torch.nn.Linear(4, 3)
    ours = create_optimizer(model, config)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    theirs = cls(model.parameters(), **kwargs)
    if optim in ("adamw_bnb_8bit", "adamw_8bit"):  # bitsandbytes' AdamW(optim_bits=8) is AdamW8bit
        assert ours.args.optim_bits == theirs.args.optim_bits == 8
        assert ours.is_paged is theirs.is_paged is False
    else:
        assert type(ours) is type(theirs)
    assert ours.defaults == theirs.defaults
    assert ours.param_groups[0]["weight_decay"] == 0.05


def test_gradient_checkpointing_kwargs(tmp_path):
    conversion = convert(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert conversion.plugins["grad_checkpoint"] == {"use_reentrant": True}
    assert settings_objects(conversion)["grad_checkpoint"].use_reentrant is True
    conversion = convert(tmp_path, gradient_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert "grad_checkpoint" not in conversion.plugins


def test_an_optimizer_the_plugin_does_not_build_is_reported(tmp_path):
    conversion = convert(tmp_path, optim="lion_8bit")
    assert "optimizer" not in conversion.plugins
    reason = remarks(conversion.not_converted)["optim"]
    assert "adamw, adafactor, adamw8bit" in reason and "configure_optimizers" in reason
    settings_objects(conversion)


def test_fp16_epochs_strategy(tmp_path, capsys):
    conversion = convert(
        tmp_path,
        fp16=True,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=1,
        max_grad_norm=0.0,  # 0 turns clipping off in the Trainer
        num_train_epochs=2.5,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        metric_for_best_model="accuracy",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        dataloader_num_workers=2,
    )
    assert conversion.engine == {
        "max_epochs": 3,  # whole epochs: 2.5 rounded up, reported
        "seed": 42,
        "output_dir": str(tmp_path / "hf_out"),
        "log_every_n_steps": 500,
    }
    assert "grad_clip" not in conversion.plugins
    assert conversion.plugins["mixed_precision"] == {"dtype": "fp16"}
    assert conversion.plugins["optimizer"]["scheduler"] == "constant_with_warmup"
    assert conversion.plugins["optimizer"]["warmup_steps"] == 10
    assert "warmup_ratio" not in conversion.plugins["optimizer"]
    assert conversion.plugins["checkpoint"] == {
        "every_n_steps": None,
        "every_n_epochs": 1,
        "keep_last": 1,
        "monitor": "val/accuracy",  # eval_accuracy; the Trainer's greater_is_better default: True for a non-loss
        "mode": "max",
        "keep_best": 1,
        "save_on_interrupt": False,
    }
    assert conversion.data == {"batch_size": 4, "num_workers": 2}
    assert "whole epochs" in remarks(conversion.differences)["num_train_epochs"]
    settings_objects(conversion)
    printed = print_config(tmp_path, conversion, capsys)
    assert printed["plugins"] == conversion.plugins
    assert printed["engine"].get("val_check_interval") is None  # validation at the end of every epoch


def test_distributed_and_other_unmappable_arguments_are_reported_with_reasons(tmp_path):
    args = training_args(
        tmp_path,
        fsdp="full_shard",
        ddp_find_unused_parameters=True,
        ddp_timeout=7200,
        label_smoothing_factor=0.1,
        report_to=["tensorboard", "azure_ml"],
        resume_from_checkpoint="hf_out/checkpoint-500",
        eval_on_start=True,
        eval_strategy="steps",
        eval_steps=100,
    )
    values = json.loads(args.to_json_string())
    # DeepSpeed is not installed here and TrainingArguments(deepspeed=...) imports it: set the field as a JSON
    # written on a machine with DeepSpeed holds it.
    values["deepspeed"] = "ds_config_zero2.json"
    values["local_rank"] = 0
    conversion = torchloom.convert_hf_args(saved(tmp_path, values))
    reasons = remarks(conversion.not_converted)
    assert set(reasons) == {
        "use_cpu", "fsdp", "fsdp_config", "deepspeed", "local_rank", "ddp_find_unused_parameters", "ddp_timeout",
        "label_smoothing_factor", "report_to", "resume_from_checkpoint", "eval_on_start",
    }  # fmt: skip
    for name in ("fsdp", "deepspeed"):
        assert "accelerate config" in reasons[name] and "accelerate launch" in reasons[name]
    assert "DistributedDataParallelKwargs" in reasons["ddp_find_unused_parameters"]
    assert "launcher" in reasons["local_rank"]
    assert "training_step" in reasons["label_smoothing_factor"]
    assert "--resume" in reasons["resume_from_checkpoint"]
    assert [r.value for r in conversion.not_converted if r.field == "report_to"] == [["azure_ml"]]
    assert conversion.plugins["trackers"] == {"log_with": ["tensorboard"]}
    text = conversion.to_yaml()
    header = text[: text.index("\nengine:")]
    for name in reasons:
        assert f"#   {name} = " in header
    settings_objects(conversion)


def test_max_steps_overrides_epochs_and_fractions_become_steps(tmp_path):
    conversion = convert(
        tmp_path,
        max_steps=999,
        num_train_epochs=1,
        eval_strategy="steps",
        eval_steps=0.1,
        save_steps=0.25,
        logging_steps=0.01,
    )
    # The Trainer trains max_steps whatever num_train_epochs says; max_epochs = max_steps never stops first.
    assert conversion.engine["max_steps"] == 999 and conversion.engine["max_epochs"] == 999
    assert conversion.engine["val_check_interval"] == 100  # ceil(0.1 * 999), as the Trainer rounds
    assert conversion.engine["log_every_n_steps"] == 10  # ceil(9.99)
    assert conversion.plugins["checkpoint"]["every_n_steps"] == 250  # ceil(249.75)
    assert {"eval_steps", "save_steps", "logging_steps"} <= set(remarks(conversion.differences))
    settings_objects(conversion)


@pytest.mark.parametrize(("eval_steps", "expected"), [(0, 7), (None, 7), (1, 1), (13, 13)])
def test_eval_steps_0_or_unset_falls_back_to_logging_steps_as_the_trainer_does(tmp_path, eval_steps, expected):
    """TrainingArguments.__post_init__ sets eval_steps to logging_steps when it is 0 or None under eval_strategy
    'steps'; a JSON file written by hand can still hold 0, and the converter reads it the same way."""
    args = json.loads(training_args(tmp_path, eval_strategy="steps", eval_steps=5, logging_steps=7).to_json_string())
    args["eval_steps"] = eval_steps
    conversion = torchloom.convert_hf_args(saved(tmp_path, args))
    assert conversion.engine["val_check_interval"] == expected
    if eval_steps in (0, None):
        assert training_args(tmp_path, eval_strategy="steps", eval_steps=eval_steps, logging_steps=7).eval_steps == 7


def test_fractions_without_max_steps_are_reported(tmp_path):
    conversion = convert(tmp_path, eval_strategy="steps", eval_steps=0.1, save_steps=0.25)
    reasons = remarks(conversion.not_converted)
    assert "val_check_interval" in reasons["eval_steps"] and "every_n_steps" in reasons["save_steps"]
    assert "val_check_interval" not in conversion.engine and "checkpoint" not in conversion.plugins
    settings_objects(conversion)


@pytest.mark.parametrize(("limit", "keep_last"), [(None, None), (0, None), (3, 3)])
def test_save_total_limit_zero_or_none_keeps_every_checkpoint(tmp_path, limit, keep_last):
    # The Trainer deletes old checkpoints only when save_total_limit > 0.
    conversion = convert(tmp_path, save_total_limit=limit)
    assert conversion.plugins["checkpoint"]["keep_last"] == keep_last
    assert settings_objects(conversion)["checkpoint"].keep_last == keep_last


@pytest.mark.parametrize(("metric", "mode"), [("eval_loss", "min"), ("f1", "max"), ("eval_perplexity", "max")])
def test_without_greater_is_better_the_mode_follows_the_metric_name(tmp_path, metric, mode):
    # TrainingArguments fills greater_is_better in itself; a JSON written by hand may leave it null, and then the
    # Trainer's rule applies: lower is better only for a name that ends with "loss".
    values = json.loads(training_args(tmp_path, metric_for_best_model=metric).to_json_string())
    values["greater_is_better"] = None
    conversion = torchloom.convert_hf_args(saved(tmp_path, values))
    assert conversion.plugins["checkpoint"]["mode"] == mode
    assert conversion.plugins["checkpoint"]["monitor"] == "val/" + metric.removeprefix("eval_")
    settings_objects(conversion)


def test_transformers_4_field_names(tmp_path):
    # transformers 4 wrote evaluation_strategy and warmup_ratio (transformers 5 folded the ratio into warmup_steps)
    # and a logging_dir; the same arguments in those names convert the same way.
    values = json.loads(training_args(tmp_path, eval_strategy="steps", eval_steps=200).to_json_string())
    values["evaluation_strategy"] = values.pop("eval_strategy")
    values.update(warmup_steps=0, warmup_ratio=0.1, logging_dir="hf_out/runs/May01")
    # Fields of another version: at their default there (not reported), set (reported), unknown (reported).
    values.update(half_precision_backend="auto", fp16_opt_level="O2", my_own_flag=True, my_unset_flag=None)
    conversion = torchloom.convert_hf_args(saved(tmp_path, values))
    assert conversion.engine["val_check_interval"] == 200
    assert conversion.plugins["optimizer"]["warmup_ratio"] == 0.1
    reasons = remarks(conversion.not_converted)
    assert set(reasons) == {"use_cpu", "logging_dir", "fp16_opt_level", "my_own_flag"}
    assert "run directory" in reasons["logging_dir"] and "apex" in reasons["fp16_opt_level"]
    assert (
        reasons["my_own_flag"]
        == f"not a TrainingArguments field in transformers {transformers.__version__} (another version?)"
    )
    settings_objects(conversion)


def test_warmup_and_schedule_match_the_trainer(tmp_path):
    """The learning rates torchloom's schedule gives, step by step, are those of the schedule the Trainer builds
    from the same arguments (``Trainer.create_scheduler``: get_scheduler with ``args.get_warmup_steps``)."""
    total = 40
    for kwargs in (
        {"lr_scheduler_type": "cosine", "warmup_steps": 0.1},
        {"lr_scheduler_type": "linear", "warmup_steps": 7},
        {"lr_scheduler_type": "linear", "warmup_steps": 1},  # a step count at the boundary, not a ratio of 1
        {"lr_scheduler_type": "linear", "warmup_steps": 0.999},  # just below it: a ratio
        {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "warmup_steps": 0.2},
    ):
        args = training_args(tmp_path, learning_rate=1e-3, **kwargs)
        conversion = torchloom.convert_hf_args(saved(tmp_path, args))
        config = settings_objects(conversion)["optimizer"]
        ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        ours = create_scheduler(ours_opt, config, total)
        theirs = get_scheduler(
            args.lr_scheduler_type,
            theirs_opt,
            num_warmup_steps=args.get_warmup_steps(total),
            num_training_steps=total,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
        )
        for _ in range(total):
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12), kwargs
            for optimizer, scheduler in ((ours_opt, ours), (theirs_opt, theirs)):
                optimizer.step()
                scheduler.step()


def test_the_converted_default_config_trains(tmp_path):
    conversion = convert(tmp_path)
    engine_settings = {**conversion.engine, "output_dir": str(tmp_path / "runs")}
    engine = torchloom.Engine(torchloom.EngineConfig.from_settings(engine_settings), plugins=conversion.plugins)
    engine.fit(TinyTask(n=32, batch_size=conversion.data["batch_size"]))
    assert engine.progress.global_step == 12  # 3 epochs of 32 / 8 batches
    # The optimizer plugin's linear schedule replaced TinyTask's SGD at lr 0.1: the last step ran at 5e-5 / 12.
    assert engine.logged_metrics["lr"] == pytest.approx(5e-5 / 12)
    assert (tmp_path / "runs" / "latest" / "config.yaml").is_file()


# --------------------------------------------------------------------------------------------- the command


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*SOURCE_PATHS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "torchloom", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_command_end_to_end(tmp_path, monkeypatch):
    saved(tmp_path, training_args(tmp_path, gradient_accumulation_steps=2, fsdp="full_shard"))
    monkeypatch.chdir(tmp_path)
    expected = torchloom.convert_hf_args("args.json")
    proc = run_cli("convert-hf-args", "args.json", "-o", "run.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert (tmp_path / "run.yaml").read_text() == expected.to_yaml()
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["plugins"]["grad_accum"] == {"steps": 2}
    # differences: eval_strategy "no", and optim when its default is adamw_torch (torch < 2.8)
    assert f"wrote run.yaml; 3 arguments not converted, {len(expected.differences)} with a difference" in proc.stderr
    for field in ("fsdp", "fsdp_config", "use_cpu"):
        assert f"  not converted: {field} = " in proc.stderr
    assert "warning" not in proc.stderr


def test_the_command_writes_to_stdout_without_o(tmp_path, monkeypatch, capsys):
    saved(tmp_path, training_args(tmp_path, gradient_accumulation_steps=2))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["convert-hf-args", "args.json"]) == 0
    captured = capsys.readouterr()
    expected = torchloom.convert_hf_args("args.json")
    assert captured.out == expected.to_yaml()
    assert yaml.safe_load(captured.out)["plugins"]["grad_accum"] == {"steps": 2}
    assert captured.err == (
        f"torchloom convert-hf-args: 1 argument not converted, {len(expected.differences)} with a difference "
        "(listed in the comments at the top)\n"
    )


def test_a_config_that_does_not_load_here_is_a_warning(tmp_path, capsys, monkeypatch):
    path = saved(tmp_path, training_args(tmp_path, torch_compile=True, torch_compile_backend="no_such_backend"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["convert-hf-args", str(path), "-o", "run.yaml"]) == 0
    err = capsys.readouterr().err
    assert "warning: the config does not load here: plugin 'compile': setting 'backend' = 'no_such_backend'" in err
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["plugins"]["compile"] == {"backend": "no_such_backend"}


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (None, ["'args.json': cannot read it", "No such file"]),
        ("learning_rate: 1e-4", ["not JSON", "line 1, column 1"]),
        ("[1, 2]", ["the JSON holds a list", "TrainingArguments.to_json_string()"]),
        ('{"best_metric": 0.9, "global_step": 10, "log_history": []}', ["not a TrainingArguments", "'log_history'"]),
        ('{"output_dir": "o", "gradient_accumulation_steps": "4"}', ["'gradient_accumulation_steps' = '4' (str)"]),
        ('{"output_dir": "o", "learning_rate": true}', ["'learning_rate' = True (bool)", "a number"]),
        ('{"output_dir": "o", "eval_strategy": "sometimes"}', ["'sometimes'", "'no', 'steps', 'epoch'"]),
        ('{"output_dir": "o", "bf16": true, "fp16": true}', ["bf16 and fp16 are both true"]),
        ('{"output_dir": "o", "logging_steps": 12.5}', ["'logging_steps' = 12.5", "must be an integer"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, content, fragments):
    if content is not None:
        (tmp_path / "args.json").write_text(content)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["convert-hf-args", "args.json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("torchloom: error: training arguments 'args.json': ")
    assert captured.err.count("\n") == 1
    for fragment in fragments:
        assert fragment in captured.err, captured.err


# ------------------------------------------------------------------------------- names kept in step with


def test_the_names_the_converter_targets_are_the_plugins_own():
    from torchloom_plugins.compile import _MODES
    from torchloom_plugins.trackers import TRACKERS

    assert set(_hf_args_tables.TRACKERS) == set(TRACKERS)
    assert set(_hf_args_tables.COMPILE_MODES) == set(_MODES)
    assert set(_hf_args_tables.PLUGIN_OPTIMIZERS) == set(OptimizerSwap.optimizer_names)
    assert {name for name, _ in _hf_args_tables.OPTIMIZERS.values()} <= set(OptimizerSwap.optimizer_names)
    for data_module in (TextClassificationData, ImageClassificationData, AudioClassificationData):
        assert {"batch_size", "eval_batch_size", "num_workers"} <= set(inspect.signature(data_module).parameters)
