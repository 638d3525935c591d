"""Setting a run up: the data, the model, the optimizer and ``accelerator.prepare``, with the checks that make a
bad task or data fail here, before the first step, rather than half-way through a fit."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import get_sampler
from accelerate.utils import DistributedType, set_seed

from torchloom._accelerator import settle_deepspeed_clipping
from torchloom._agreement import RankAgreement
from torchloom._batch_limits import Limit, overfit_loader, resolve, train_limit, val_limit
from torchloom._guards import (
    check_model,
    check_optimizer_parameters,
    check_same_length,
    eval_mode,
    split_optimizers,
    stop_iteration,
    train_mode_unless_chosen,
)
from torchloom.config import EngineConfig
from torchloom.errors import ConfigError, PluginError, TaskError
from torchloom.module import TaskModule
from torchloom.plugins import HookRelay
from torchloom.rundir.adapter_format import remember_base
from torchloom.rundir.runfiles import start_run_files

__all__ = ["Run", "check_validation_step", "engine_relay", "prepare_run", "reuse_run", "sanity_check"]


@dataclass
class Run:
    """What one fit / validate / predict call built (prepared by Accelerate)."""

    accelerator: Accelerator
    relay: HookRelay
    model: torch.nn.Module
    optimizer: Any = None
    scheduler: Any = None
    train_dataloader: Any = None
    val_dataloader: Any = None
    predict_dataloader: Any = None
    run_dir: str = ""  # this call's directory, <output_dir>/version_N
    datamodule: Any = None  # the call's data module, when it has one
    agreement: RankAgreement = field(default_factory=lambda: RankAgreement(1))  # how the processes decide alike
    train_batches: int | None = None  # training batches per epoch and process under a limit (None: every one)
    val_limit: Limit | None = None  # the setting that limits every validation pass (torchloom._batch_limits)
    val_batches: int | None = None  # ... and the validation batches per process it comes to (None: every one)


def prepare_run(
    task: TaskModule,
    stage: str,
    config: EngineConfig,
    relay: HookRelay,
    accelerator: Accelerator,
    datamodule: Any,
    loaders: Mapping[str, Any],
    run_config: Mapping[str, Any],
    run_dir: str,
) -> Run:
    """Data, model, optimizer and ``accelerator.prepare``; then ``config.yaml`` in ``run_dir``.

    Args:
        loaders: the dataloaders passed explicitly (``train_dataloader``, ``val_dataloader``,
            ``predict_dataloader``); the others come from the datamodule, then the task.
        run_config: what ``config.yaml`` records.

    Raises:
        ConfigError: missing or empty training data, validation data without ``validation_step``, a
            ``val_check_interval`` the fit never reaches.
        TaskError: ``configure_model`` / ``configure_optimizers`` returned something that cannot be trained (``fit``:
            a model with no trainable parameter, checked before the optimizer is built).
        PluginError: two plugins answered ``configure_optimizers``.
    """
    if config.seed is not None:
        set_seed(config.seed)
    if datamodule is not None:
        if accelerator.is_local_main_process:  # once per machine (a download, a tokenisation), others wait
            datamodule.prepare_data()
        accelerator.wait_for_everyone()
        datamodule.setup(stage)
    train_dl, val_dl, predict_dl = _dataloaders(task, stage, datamodule, loaders)
    if stage == "fit" and config.overfit_batches is not None:
        # The same first batches every epoch, in order; the validation on those batches (its own copy: a
        # validation inside an epoch must not iterate the training loader itself).
        train_dl = overfit_loader(train_dl)
        has_validation = type(task).validation_step is not TaskModule.validation_step
        val_dl = overfit_loader(train_dl) if has_validation else None
    if val_dl is not None:
        check_validation_step(task)
    model = check_model(task.configure_model(), task)
    if datamodule is not None and callable(getattr(datamodule, "check_model", None)):
        datamodule.check_model(model)  # e.g. packed data and an attention that would mix its sequences
    task.model, task.accelerator = model, accelerator
    relay.call("configure_model", model=model, task=task, accelerator=accelerator)
    settle_deepspeed_clipping(accelerator)  # after the plugins that clip set DeepSpeed's clipping
    if accelerator.distributed_type in _SHARDED:
        # An adapter's frozen base is hashed (the checkpoints' record of the base it needs) while it is whole: once
        # sharded, each process holds only its shards. The same hash as an unsharded run's.
        remember_base(model)

    optimizer = scheduler = None
    if stage == "fit":
        _check_trainable(model, task)
        train_mode_unless_chosen(model)
        per_process = _batches_per_process(train_dl, accelerator)
        train_batches = resolve(train_limit(config), per_process, "training")
        task.num_training_steps = steps = _num_training_steps(config, per_process, train_batches, accelerator)
        interval = config.val_check_interval
        if val_dl is not None and interval and steps and interval > steps:
            raise ConfigError(
                f"engine setting 'val_check_interval': got {interval}, but this fit takes only {steps} optimizer "
                f"steps, so validation would never run; use a value <= {steps}, or null to validate at the end of "
                "each epoch"
            )
        optimizer, scheduler = _configure_optimizers(task, model, relay, accelerator)
        check_loss_scaling(optimizer, accelerator)
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
        _seed_sampler(train_dl, config.seed)
        # The scheduler is stepped by the default step once per real optimizer step, so it is not prepared
        # (Accelerate would step it num_processes times per call). Checkpoints keep its state as JSON
        # (torchloom.checkpoint.store), not as a custom object of Accelerate's, which would be unpickled on load.
    else:
        model = _prepare_for_evaluation(accelerator, model)
    val_dl = accelerator.prepare(val_dl) if val_dl is not None else None
    predict_dl = accelerator.prepare(predict_dl) if predict_dl is not None else None
    task.model = model
    if accelerator.is_main_process:
        start_run_files(run_dir, run_config)
    agreement = RankAgreement(accelerator.num_processes)
    run = Run(
        accelerator, relay, model, optimizer, scheduler, train_dl, val_dl, predict_dl, run_dir, datamodule, agreement
    )
    if stage == "fit":
        run.train_batches = train_batches
    run.val_limit = val_limit(config, stage)
    run.val_batches = resolve(run.val_limit, _length(val_dl), "validation") if val_dl is not None else None
    return run


def _seed_sampler(loader: Any, seed: int | None) -> None:
    """Give a sampler that asks for it (``engine_seeded``: `torchloom.data.LengthGroupedSampler`) the engine's
    ``seed``, which Accelerate gives only the `RandomSampler` it replaces with its seedable one, so that epoch ``e``
    is drawn from ``seed + e`` as a shuffle is; and record it where ``get_sampler`` finds it on several processes
    (Accelerate does so only for that sampler), for the checkpoint's `DataOrder` and a resume's seed."""
    sampler = get_sampler(loader)
    if sampler is None:  # several processes: the sampler is that of the batch sampler BatchSamplerShard wraps
        sampler = getattr(getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None), "sampler", None)
    if not getattr(sampler, "engine_seeded", False):
        return
    if get_sampler(loader) is not sampler:
        loader.set_sampler(sampler)
    if seed is not None:
        sampler.initial_seed = seed


#: Set-ups whose wrapper holds (shards) the weights: ``validate`` / ``predict`` prepare the model in full there.
_SHARDED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)


def _prepare_for_evaluation(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``validate`` / ``predict``: the model on its device, with the run's mixed precision and ``torch.compile``,
    and no ``DistributedDataParallel`` wrapper, which only all-reduces gradients (none are computed here) and
    refuses a model with no trainable parameter (a frozen model, as loaded for evaluation). Where the wrapper holds
    the weights (FSDP, DeepSpeed, Megatron-LM, XLA, tensor or context parallelism, fp8 conversion) the model is
    prepared in full, as for a fit."""
    config = getattr(accelerator, "parallelism_config", None)
    parallel = config is not None and (config.tp_enabled or config.cp_enabled)
    if accelerator.distributed_type in _SHARDED or parallel or accelerator.mixed_precision == "fp8":
        return accelerator.prepare(model)
    return accelerator.prepare_model(model, evaluation_mode=True)


def _check_trainable(model: torch.nn.Module, task: TaskModule) -> None:
    """Raise before anything is prepared if ``fit`` has nothing to train.

    Raises:
        TaskError: every parameter of ``model`` has ``requires_grad=False`` (or it has none).
    """
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return
    frozen = (
        f"all {sum(p.numel() for p in params):,} of its parameters have requires_grad=False"
        if params
        else ("it has no parameters")
    )
    raise TaskError(
        f"fit: the model of {type(task).__name__}.configure_model() ({type(model).__name__}) has nothing to train: "
        f"{frozen}; unfreeze what should train (requires_grad_(True)), or evaluate the model with validate or "
        "predict, which need no trainable parameter"
    )


def reuse_run(
    run: Run, task: TaskModule, stage: str, loaders: Mapping[str, Any], run_dir: str, run_config: Mapping[str, Any]
) -> Run:
    """``validate`` / ``predict`` with the model of the last fit, in their own ``run_dir``: prepare only the data
    they were given (a ``predict`` without data uses the task's ``predict_dataloader``; a ``validate`` without, the
    fit's)."""
    if stage == "predict":
        loader = loaders.get("predict_dataloader")
        loader = task.predict_dataloader() if loader is None else loader
        run.predict_dataloader = run.accelerator.prepare(loader) if loader is not None else None
    elif loaders.get("val_dataloader") is not None:
        run.val_dataloader = run.accelerator.prepare(loaders["val_dataloader"])
        run.val_batches = resolve(run.val_limit, _length(run.val_dataloader), "validation")
    _check_stage_data(stage, run.val_dataloader, run.predict_dataloader)
    if stage == "validate":
        check_validation_step(task)
    run.run_dir = run_dir
    if run.accelerator.is_main_process:
        start_run_files(run_dir, run_config)
    return run


def engine_relay(plugins: list[Any], default_step: Any, metrics_file: Any) -> HookRelay:
    """The enabled plugins in the user's order, then the engine's own implementations (the default step, the
    ``metrics.jsonl`` writer), registered as every run registers them."""
    return HookRelay([*plugins, default_step, metrics_file])


def check_loss_scaling(optimizer: Any, accelerator: Any) -> None:
    """Refuse fp16 loss scaling with an optimizer that applies the scaler inside its own ``step()``.

    torch's fused optimizers (``AdamW(fused=True)``: ``_step_supports_amp_scaling``) take the scaler's overflow flag
    into their kernel and skip the update there, but ``step()`` is still called; Accelerate tells a skipped step by
    whether ``step()`` was called (``AcceleratedOptimizer.step_was_skipped``), so the engine would step the
    learning-rate schedule and count the step as if the update had happened.

    Raises:
        ConfigError: ``accelerator`` has a loss scaler (``mixed_precision: fp16``) and ``optimizer`` is fused.
    """
    if getattr(accelerator, "scaler", None) is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    raise ConfigError(
        f"mixed_precision fp16 with a fused {type(optimizer).__name__} (fused=True): a fused optimizer skips a step "
        "with an fp16 overflow inside its own step(), which Accelerate cannot see, so the learning-rate schedule and "
        "the step counts would go on as if it had stepped; build it with fused=False (foreach: the optimizer "
        "plugin's adamw under fp16, or implementation: foreach), or use bf16"
    )


def log_data_values(datamodule: Any, logs: Any) -> None:
    """Log the data module's `fit_log_values` (`torchloom.DataModule.fit_log_values`) with ``reduce="last"``,
    once per fit, after ``on_fit_start``; a data module without the method (duck-typed) logs nothing.

    Raises:
        TaskError: a value that is not a number, or a bad name (as `TaskModule.log` raises).
    """
    values = datamodule.fit_log_values() if callable(getattr(datamodule, "fit_log_values", None)) else {}
    for name, value in values.items():
        logs.log(name, value, reduce="last")


def sanity_check(task: TaskModule, run: Run, num_batches: int, logs: Any) -> None:
    """Run ``validation_step`` on ``num_batches`` validation batches before training: nothing logged, no hooks,
    module modes and random state as they were (so the run trains exactly as without it).

    Raises:
        TaskError: the processes have different numbers of validation batches.
    """
    loader, acc = run.val_dataloader, run.accelerator
    if run.val_batches is not None:  # limit_val_batches: no more than a validation pass runs
        num_batches = min(num_batches, run.val_batches)
    if num_batches == 0 or loader is None:
        return
    check_same_length(run.agreement, loader, "validation")
    devices = [acc.device.index or 0] if acc.device.type == "cuda" else []
    try:
        with logs.discarding(), eval_mode(run.model), torch.no_grad(), torch.random.fork_rng(devices):
            for batch_idx, batch in zip(range(num_batches), loader):
                task.validation_step(batch, batch_idx)
    finally:
        stop_iteration(loader)


def check_validation_step(task: TaskModule) -> None:
    """Raise if ``task`` has validation data to run but no ``validation_step``.

    Raises:
        ConfigError: ``validation_step`` is `TaskModule`'s own.
    """
    if type(task).validation_step is TaskModule.validation_step:
        raise ConfigError(
            f"{type(task).__name__} got validation data but defines no validation_step(batch, batch_idx); define "
            "it, or pass no validation data"
        )


def _dataloaders(task: TaskModule, stage: str, datamodule: Any, loaders: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """``(train, val, predict)``: the ones passed, else the datamodule's, else the task's (only what ``stage`` uses)."""
    sources = [s for s in (datamodule, task) if s is not None]

    def pick(name: str) -> Any:
        given = loaders.get(name)
        return given if given is not None else next((d for s in sources if (d := getattr(s, name)()) is not None), None)

    train = val = predict = None
    if stage == "fit":
        train = pick("train_dataloader")
        if train is None:
            raise ConfigError("fit: no training data (pass train_dataloader, a datamodule, or define train_dataloader)")
        if _length(train) == 0:
            raise ConfigError(
                "fit: the training dataloader has no batches (an empty dataset, or fewer samples than batch_size "
                "with drop_last=True); nothing would be trained"
            )
    if stage in ("fit", "validate"):
        val = pick("val_dataloader")
    if stage == "predict":
        predict = pick("predict_dataloader")
    _check_stage_data(stage, val, predict)
    return train, val, predict


def _check_stage_data(stage: str, val: Any, predict: Any) -> None:
    if stage == "validate" and val is None:
        raise ConfigError("validate: no validation data (pass a dataloader, a datamodule, or define val_dataloader)")
    if stage == "predict" and predict is None:
        raise ConfigError("predict: no data (pass a dataloader, a datamodule, or define predict_dataloader)")


def _configure_optimizers(
    task: TaskModule, model: torch.nn.Module, relay: HookRelay, accelerator: Accelerator
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and scheduler from the one plugin that answers ``configure_optimizers``, else the task.

    Raises:
        PluginError: two plugins answered (the first would silently win).
        TaskError: the answer is not an optimizer, ``(optimizer, scheduler)`` or a dict of them, or its optimizer
            holds none of the model's parameters (`check_optimizer_parameters`).
    """
    answers = [
        (name, spec)
        for name, spec in relay.call_each(
            "configure_optimizers",
            model=model,
            task=task,
            accelerator=accelerator,
            num_training_steps=task.num_training_steps,
        )
        if spec is not None
    ]
    if len(answers) > 1:
        raise PluginError(
            f"plugins {answers[0][0]!r} and {answers[1][0]!r} both answer configure_optimizers; enable one of them "
            "(each would build the optimizer)"
        )
    if answers:
        source, spec = f"plugin {answers[0][0]!r}: configure_optimizers", answers[0][1]
    else:
        source, spec = f"{type(task).__name__}.configure_optimizers()", task.configure_optimizers()
    optimizer, scheduler = split_optimizers(spec, source)
    check_optimizer_parameters(optimizer, model, source, task)
    return optimizer, scheduler


def _batches_per_process(train_dataloader: Any, accelerator: Accelerator) -> int | None:
    """Training batches per epoch on each process once prepared (``None``: an iterable dataset without a length)."""
    batches = _length(train_dataloader)
    if batches is not None and accelerator.num_processes > 1 and not accelerator.split_batches:  # rank 0's shard
        n = accelerator.num_processes
        batches = batches // n if getattr(train_dataloader, "drop_last", False) else math.ceil(batches / n)
    return batches


def _num_training_steps(
    config: EngineConfig, per_process: int | None, limited: int | None, accelerator: Accelerator
) -> int | None:
    """Optimizer steps the fit will take (see the ``configure_optimizers`` hook), before anything is prepared:
    ``per_process`` batches per epoch, or ``limited`` ones under a batch limit (``limit_train_batches``,
    ``overfit_batches``, ``fast_dev_run``), whose last accumulation window also ends with a step."""
    batches = limited if limited is not None else per_process
    if batches is None:  # an iterable dataset without a length, and no limit
        return config.max_steps
    total = math.ceil(batches / accelerator.gradient_accumulation_steps) * config.max_epochs
    return total if config.max_steps is None else min(total, config.max_steps)


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:  # an iterable dataset without a length
        return None
