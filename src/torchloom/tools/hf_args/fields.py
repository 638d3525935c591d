"""The conversion of `torchloom.convert_hf_args`, field by field (`Converter`): each group of ``TrainingArguments``
fields (length, batches, accumulation, precision, checkpointing, compile, optimizer and schedule, clipping,
evaluation, logging, saving, trackers, progress) becomes engine or plugin settings, or a remark; then every other
field that differs from its default is reported."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torchloom.errors import ConfigError
from torchloom.tools.hf_args.conversion import HFArgsConversion, Remark
from torchloom.tools.hf_args.mapping import (
    COMPILE_MODES,
    IGNORED,
    OPTIMIZERS,
    PLUGIN_OPTIMIZERS,
    REASONS,
    SAVE_STRATEGIES,
    STRATEGIES,
    TRACKERS,
    UNSUPPORTED_SCHEDULES,
)

__all__ = ["Converter"]


class Converter:
    """One conversion: reads the fields it maps, remembers them, and reports every other non-default field."""

    def __init__(self, args: dict[str, Any], source: str, defaults: dict[str, Any]) -> None:
        self.args, self.source, self.defaults = args, source, defaults
        known = [k for k in args if k in defaults]
        if not known or len(known) * 2 < len(args):
            unknown = [k for k in args if k not in defaults]
            raise ConfigError(
                f"training arguments {source!r}: not a TrainingArguments JSON: {len(known)} of its {len(args)} keys "
                f"are TrainingArguments fields (not: {', '.join(map(repr, unknown[:4]))}"
                f"{', ...' if len(unknown) > 4 else ''}); expected what TrainingArguments.to_json_string() writes"
            )
        self.used: set[str] = set(IGNORED)
        self.engine: dict[str, Any] = {}
        self.plugins: dict[str, dict[str, Any]] = {}
        self.data: dict[str, Any] = {}
        self.not_converted: list[Remark] = []
        self.differences: list[Remark] = []
        self.max_steps: int | None = None  # the run's optimizer steps, when the arguments fix them

    # ------------------------------------------------------------------------------------ reading fields

    def raw(self, name: str) -> Any:
        self.used.add(name)
        return self.args.get(name, self.defaults.get(name))

    def given(self, name: str) -> bool:
        """Whether ``name`` is in the arguments with a value other than its default."""
        return name in self.args and not _is_default(self.args[name], self.defaults.get(name))

    def get(self, name: str, check: Callable[[Any], bool], expected: str) -> Any:
        value = self.raw(name)
        if not check(value):
            raise ConfigError(
                f"training arguments {self.source!r}: field {name!r} = {value!r} ({type(value).__name__}); "
                f"expected {expected}"
            )
        return value

    def int_(self, name: str, minimum: int | None = None, optional: bool = False) -> Any:
        expected = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or null" if optional else "")
        return self.get(
            name,
            lambda v: (optional and v is None) or (_is_int(v) and (minimum is None or v >= minimum)),
            expected,
        )

    def number(self, name: str, minimum: float | None = None, optional: bool = False) -> Any:
        expected = "a number" + (f" >= {minimum}" if minimum is not None else "") + (" or null" if optional else "")
        return self.get(
            name,
            lambda v: (optional and v is None) or (_is_number(v) and (minimum is None or v >= minimum)),
            expected,
        )

    def bool_(self, name: str, optional: bool = False) -> Any:
        return self.get(
            name, lambda v: isinstance(v, bool) or (optional and v is None), "true or false" + (" or null" * optional)
        )

    def str_(self, name: str, choices: tuple[str, ...] | None = None, optional: bool = False) -> Any:
        expected = "a string" if choices is None else f"one of {', '.join(map(repr, choices))}"
        if optional:
            expected += " or null"
        return self.get(
            name,
            lambda v: (optional and v is None) or (isinstance(v, str) and (choices is None or v in choices)),
            expected,
        )

    def skip(self, name: str, value: Any, reason: str) -> None:
        self.used.add(name)
        self.not_converted.append(Remark(name, value, reason))

    def differ(self, name: str, value: Any, reason: str) -> None:
        self.differences.append(Remark(name, value, reason))

    def steps(self, name: str, value: Any, setting: str) -> int | None:
        """An interval the Trainer reads as a step count (>= 1) or as a fraction of the run's optimizer steps
        (< 1, rounded up): the step count, or ``None`` (reported) when the run's length is not in the arguments."""
        if not _is_number(value) or value <= 0:
            raise ConfigError(
                f"training arguments {self.source!r}: field {name!r} = {value!r}; expected a number > 0 (an integer "
                "step count, or a fraction in (0, 1) of the run's optimizer steps)"
            )
        if value >= 1:
            if value != int(value):
                raise ConfigError(
                    f"training arguments {self.source!r}: field {name!r} = {value!r}; a value >= 1 is a step count "
                    "and must be an integer"
                )
            return int(value)
        if self.max_steps is None:
            self.skip(
                name,
                value,
                f"a fraction of the run's optimizer steps, which depend on the data: set {setting} to "
                f"ceil({value} x the run's optimizer steps)",
            )
            return None
        steps = math.ceil(value * self.max_steps)
        self.differ(name, value, f"{value} of max_steps {self.max_steps}: {setting} = {steps}")
        return steps

    # ------------------------------------------------------------------------------------------ the map

    def run(self, transformers_version: str) -> HFArgsConversion:
        self.length()
        self.batches()
        self.accumulation()
        self.precision()
        self.activation_checkpointing()
        self.compile()
        self.optimizer()
        self.clipping()
        self.evaluation()
        self.logging()
        self.saving()
        self.trackers()
        self.progress()
        self.rest(transformers_version)
        return HFArgsConversion(
            engine=self.engine,
            plugins=self.plugins,
            data=self.data,
            not_converted=self.not_converted,
            differences=self.differences,
            source=self.source,
            transformers_version=transformers_version,
        )

    def length(self) -> None:
        """num_train_epochs, max_steps (which overrides the epochs in the Trainer), seed, output_dir."""
        epochs = self.number("num_train_epochs")
        max_steps = self.int_("max_steps")
        if max_steps > 0:
            self.max_steps = max_steps
            # The Trainer trains for max_steps whatever the epochs; torchloom stops at whichever limit comes first,
            # and every epoch has at least one optimizer step, so max_epochs = max_steps never comes first.
            self.engine["max_epochs"] = max_steps
            self.engine["max_steps"] = max_steps
        elif epochs <= 0:
            raise ConfigError(
                f"training arguments {self.source!r}: num_train_epochs = {epochs!r} with max_steps = {max_steps!r} "
                "trains nothing; expected num_train_epochs > 0 or max_steps > 0"
            )
        else:
            self.engine["max_epochs"] = math.ceil(epochs)
            if epochs != int(epochs):
                self.differ(
                    "num_train_epochs",
                    epochs,
                    f"torchloom trains whole epochs: max_epochs = {math.ceil(epochs)}; to stop part-way through "
                    "the last one set the engine's max_steps (the Trainer's schedule spans the fractional length)",
                )
        self.engine["seed"] = self.int_("seed")
        output_dir = self.str_("output_dir", optional=True)
        if output_dir:
            self.engine["output_dir"] = output_dir

    def batches(self) -> None:
        train = self.int_("per_device_train_batch_size", minimum=1)
        evaluation = self.int_("per_device_eval_batch_size", minimum=1)
        workers = self.int_("dataloader_num_workers", minimum=0)
        self.data["batch_size"] = train
        if evaluation != train:
            self.data["eval_batch_size"] = evaluation
        if workers:
            self.data["num_workers"] = workers
        for old in ("per_gpu_train_batch_size", "per_gpu_eval_batch_size"):
            if self.given(old):
                new = old.replace("gpu", "device")
                self.skip(old, self.raw(old), f"deprecated and ignored by the Trainer; {new} counts")

    def accumulation(self) -> None:
        steps = self.int_("gradient_accumulation_steps", minimum=1)
        if steps > 1:
            self.plugins["grad_accum"] = {"steps": steps}

    def precision(self) -> None:
        bf16, fp16 = self.bool_("bf16"), self.bool_("fp16")
        if bf16 and fp16:
            raise ConfigError(
                f"training arguments {self.source!r}: bf16 and fp16 are both true; the Trainer accepts one of them"
            )
        if bf16 or fp16:
            self.plugins["mixed_precision"] = {"dtype": "bf16" if bf16 else "fp16"}

    def activation_checkpointing(self) -> None:
        # transformers 5 calls it activation_checkpointing and mirrors it into gradient_checkpointing.
        name = "activation_checkpointing" if "activation_checkpointing" in self.args else "gradient_checkpointing"
        if not self.bool_(name, optional=True):
            kwargs_name = f"{name}_kwargs"
            if self.given(kwargs_name):
                self.skip(kwargs_name, self.raw(kwargs_name), f"{name} is off")
            self.used.add(kwargs_name)
            return
        settings: dict[str, Any] = {}
        kwargs_name = f"{name}_kwargs"
        kwargs = self.get(kwargs_name, lambda v: v is None or isinstance(v, dict), "a mapping or null") or {}
        kwargs = dict(kwargs)
        if "use_reentrant" in kwargs:
            settings["use_reentrant"] = kwargs.pop("use_reentrant")
        if kwargs:
            self.skip(
                kwargs_name,
                kwargs,
                "grad_checkpoint checkpoints every layer (modules: hf) or the modules you name (class names or "
                "patterns); it takes use_reentrant only",
            )
        self.plugins["grad_checkpoint"] = settings

    def compile(self) -> None:
        backend = self.str_("torch_compile_backend", optional=True)
        mode = self.str_("torch_compile_mode", optional=True)
        # The Trainer turns compiling on when a backend or a mode is set.
        if not (self.bool_("torch_compile") or backend or mode):
            return
        settings: dict[str, Any] = {}
        if backend:
            settings["backend"] = backend
        if mode in COMPILE_MODES:
            settings["mode"] = mode
        elif mode:
            self.skip(
                "torch_compile_mode", mode, f"the compile plugin takes mode {', '.join(COMPILE_MODES)}; default used"
            )
        self.plugins["compile"] = settings

    def optimizer(self) -> None:
        optim = self.str_("optim")
        lr = self.number("learning_rate", minimum=0.0)
        weight_decay = self.number("weight_decay", minimum=0.0)
        betas = [self.number("adam_beta1"), self.number("adam_beta2")]
        eps = self.number("adam_epsilon", minimum=0.0)
        optim_args = self.str_("optim_args", optional=True)
        if optim not in OPTIMIZERS:
            self.skip(
                "optim",
                optim,
                f"the optimizer plugin builds {', '.join(PLUGIN_OPTIMIZERS)}; for another optimizer return it from "
                "your task's configure_optimizers (with its learning-rate schedule)",
            )
            self.used.update(("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio"))
            return
        name, remark = OPTIMIZERS[optim]
        if remark is not None:
            self.differ("optim", optim, remark)
        settings: dict[str, Any] = {"name": name, "lr": lr, "weight_decay": weight_decay}
        if name in ("adamw", "adamw8bit", "paged_adamw8bit"):
            settings["betas"] = betas
            settings["eps"] = eps
        elif name == "adafactor":
            # The Trainer builds Adafactor(lr=learning_rate, scale_parameter=False, relative_step=False) and passes
            # none of the adam_* arguments.
            settings["scale_parameter"] = False
        if optim_args:
            pairs = dict(p.split("=", 1) if "=" in p else (p, "") for p in optim_args.replace(" ", "").split(","))
            if name == "sgd" and "momentum" in pairs:
                settings["momentum"] = _float(self.source, "optim_args", pairs.pop("momentum"))
            if pairs:
                self.skip(
                    "optim_args",
                    optim_args,
                    f"the optimizer plugin takes no {', '.join(sorted(pairs))} for {name!r}"
                    + (" (it takes momentum)" if name == "sgd" else ""),
                )
        self.schedule(settings)
        self.plugins["optimizer"] = settings

    def schedule(self, settings: dict[str, Any]) -> None:
        scheduler = self.str_("lr_scheduler_type")
        kwargs = self.get("lr_scheduler_kwargs", lambda v: v is None or isinstance(v, dict), "a mapping or null")
        warmup_steps = self.number("warmup_steps", minimum=0.0)
        warmup_ratio = self.number("warmup_ratio", minimum=0.0) if "warmup_ratio" in self.args else 0.0
        if scheduler in UNSUPPORTED_SCHEDULES:
            self.skip(
                "lr_scheduler_type",
                scheduler,
                "the engine steps the scheduler without a metric; for a schedule that reads one, step it in a plugin "
                "(on_validation_end) and return the optimizer alone from configure_optimizers; constant lr used",
            )
            return
        settings["scheduler"] = scheduler
        if kwargs:
            settings["scheduler_kwargs"] = dict(kwargs)
        # transformers 5: warmup_steps >= 1 is a step count, below 1 a ratio; transformers 4: warmup_ratio, which
        # warmup_steps > 0 overrides.
        if warmup_steps >= 1:
            if warmup_steps != int(warmup_steps):
                raise ConfigError(
                    f"training arguments {self.source!r}: field 'warmup_steps' = {warmup_steps!r}; a value >= 1 is "
                    "a step count and must be an integer"
                )
            warmup: tuple[str, Any] | None = ("warmup_steps", int(warmup_steps))
        elif warmup_steps > 0:
            warmup = ("warmup_ratio", warmup_steps)
        elif warmup_ratio > 0:
            warmup = ("warmup_ratio", warmup_ratio)
        else:
            warmup = None
        if warmup is not None and scheduler == "constant":
            # get_scheduler("constant") ignores the warm-up; the optimizer plugin rejects the combination.
            field = "warmup_steps" if warmup_steps else "warmup_ratio"
            self.differ(
                field,
                self.args.get(field),
                "ignored, as the Trainer ignores a warm-up with lr_scheduler_type 'constant' (use "
                "'constant_with_warmup')",
            )
        elif warmup is not None:
            settings[warmup[0]] = warmup[1]

    def clipping(self) -> None:
        max_norm = self.number("max_grad_norm", optional=True)
        if max_norm is not None and max_norm > 0:  # the Trainer clips only when max_grad_norm > 0
            self.plugins["grad_clip"] = {"max_norm": max_norm}

    def evaluation(self) -> None:
        name = "eval_strategy" if "eval_strategy" in self.args else "evaluation_strategy"
        strategy = self.str_(name, STRATEGIES)
        self.used.update(("eval_strategy", "evaluation_strategy"))
        if strategy == "steps":
            eval_steps = self.raw("eval_steps")
            if eval_steps is None or eval_steps == 0:  # the Trainer falls back to logging_steps
                eval_steps = self.raw("logging_steps")
            interval = self.steps("eval_steps", eval_steps, "the engine's val_check_interval")
            if interval is not None:
                self.engine["val_check_interval"] = interval
        elif strategy == "no":
            self.differ(
                name,
                strategy,
                "torchloom validates at the end of every epoch whenever the run has validation data and a "
                "validation_step; give it no validation data to never validate",
            )
        # "epoch": val_check_interval null, the engine's default: validation at the end of every epoch.
        self.used.add("eval_steps")

    def logging(self) -> None:
        strategy = self.str_("logging_strategy", STRATEGIES)
        steps = self.raw("logging_steps")
        if strategy == "steps":
            interval = self.steps("logging_steps", steps, "the engine's log_every_n_steps")
            if interval is not None:
                self.engine["log_every_n_steps"] = interval
        else:
            self.skip(
                "logging_strategy",
                strategy,
                "torchloom logs training values every log_every_n_steps optimizer steps, and validation values after "
                "each validation; set log_every_n_steps (e.g. to the optimizer steps of an epoch)",
            )

    def saving(self) -> None:
        strategy = self.str_("save_strategy", SAVE_STRATEGIES)
        limit = self.int_("save_total_limit", optional=True)
        load_best = self.bool_("load_best_model_at_end")
        metric = self.str_("metric_for_best_model", optional=True)
        greater = self.bool_("greater_is_better", optional=True)
        on_signal = self.bool_("enable_jit_checkpoint") if "enable_jit_checkpoint" in self.args else False
        settings: dict[str, Any] = {}
        if strategy == "steps":
            every = self.steps("save_steps", self.raw("save_steps"), "the checkpoint plugin's every_n_steps")
            if every is not None:
                settings = {"every_n_steps": every, "every_n_epochs": None}
        elif strategy == "epoch":
            settings = {"every_n_steps": None, "every_n_epochs": 1}
        elif strategy == "best":
            self.skip(
                "save_strategy",
                strategy,
                "the checkpoint plugin saves on a schedule of steps or epochs and keeps the keep_best best by "
                "monitor: save at the validation interval (every_n_steps) with monitor set",
            )
        self.used.add("save_steps")
        if not settings:
            if on_signal:  # checkpoints only when the job is stopped (SIGTERM)
                settings = {"every_n_steps": None, "every_n_epochs": None}
            else:
                if load_best:
                    self.skip("load_best_model_at_end", load_best, "no checkpoints are saved")
                return
        settings["keep_last"] = limit if limit is not None and limit > 0 else None  # the Trainer: <= 0 keeps all
        if metric is not None:
            settings["monitor"] = "val/" + metric.removeprefix("eval_")
            if greater is None:  # the Trainer's default
                greater = not metric.endswith("loss")
            settings["mode"] = "max" if greater else "min"
            settings["keep_best"] = 1
            self.differ(
                "metric_for_best_model",
                metric,
                f"monitor {settings['monitor']!r}: your task's validation_step or the eval_metrics plugin must log "
                "it under that name",
            )
        if load_best:
            self.differ(
                "load_best_model_at_end",
                load_best,
                "the best checkpoint is kept (monitor, keep_best: 1) but not loaded at the end: the fit ends with the "
                "last weights; use the best one with torchloom predict --ckpt_path CHECKPOINT",
            )
        settings["save_on_interrupt"] = on_signal
        if not on_signal:
            self.used.add("enable_jit_checkpoint")
        self.plugins["checkpoint"] = settings

    def trackers(self) -> None:
        value = self.get(
            "report_to",
            lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
            "a tracker name or a list of them",
        )
        names = [] if value is None else [value] if isinstance(value, str) else list(value)
        names = [n for n in names if n != "none"]
        if "all" in names:
            self.skip(
                "report_to",
                value,
                "'all' means every integration installed where the Trainer ran: list the trackers (trackers plugin, "
                f"log_with: {', '.join(TRACKERS)})",
            )
            return
        log_with = [n for n in names if n in TRACKERS]
        others = [n for n in names if n not in TRACKERS]
        if others:
            self.skip(
                "report_to",
                others,
                f"the trackers plugin writes to Accelerate's trackers ({', '.join(TRACKERS)}); for another, write a "
                "plugin with an on_log hook",
            )
        if not log_with:
            return
        settings: dict[str, Any] = {"log_with": log_with}
        project = self.raw("project")
        if isinstance(project, str) and self.given("project"):
            settings["project_name"] = project
        self.plugins["trackers"] = settings

    def progress(self) -> None:
        if self.bool_("disable_tqdm", optional=True):
            self.plugins["progress"] = {"enabled": False}

    def rest(self, transformers_version: str) -> None:
        """Report every argument not read above that differs from its default."""
        for name, value in self.args.items():
            if name in self.used or (name not in self.defaults and _empty(value)):
                continue
            if (name in self.defaults and _is_default(value, self.defaults[name])) or self.derived(name, value):
                continue
            if name == "accelerator_config" and isinstance(value, dict):
                default = self.defaults.get(name) or {}
                value = {k: v for k, v in value.items() if k not in default or v != default[k]}
                if not value:
                    continue
            if name == "fsdp_config" and self.given("fsdp"):
                reason = "the FSDP settings: see fsdp"
            elif name in REASONS:
                reason = REASONS[name]
            elif name in self.defaults:
                reason = "no equivalent in torchloom's engine or built-in plugins"
            else:
                reason = f"not a TrainingArguments field in transformers {transformers_version} (another version?)"
            self.not_converted.append(Remark(name, value, reason))

    def derived(self, name: str, value: Any) -> bool:
        """Whether the Trainer set this field itself from another one that is reported or converted."""
        if name == "dataloader_pin_memory":  # use_cpu turns it off
            return value is False and self.args.get("use_cpu") is True
        if name == "do_eval":  # an evaluation strategy turns it on
            strategy = self.args.get("eval_strategy", self.args.get("evaluation_strategy"))
            return value is True and strategy not in (None, "no")
        return False


def _float(source: str, field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"training arguments {source!r}: field {field!r}: {text!r} is not a number") from None


def _empty(value: Any) -> bool:
    return value is None or value is False or value in ("", "none", "no") or value == [] or value == {}


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default or (_empty(value) and _empty(default))
    return value == default or (_empty(value) and _empty(default))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
