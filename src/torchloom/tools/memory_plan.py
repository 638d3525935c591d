"""Training memory of a model before training: weights, gradients, optimizer state and activations
(`estimate_memory`, and the ``torchloom estimate-memory`` command).

Method
------
- **Weights:** the bytes of every parameter and buffer (tied parameters once), as
  `accelerate.utils.calculate_maximum_sizes` counts them, and the quantisation state of bitsandbytes weights
  (`torchloom.tools.memory_source.quantization_state_bytes`). Parameters are float32: with ``bf16`` / ``fp16`` the
  ``mixed_precision`` plugin (``Accelerator(mixed_precision=...)``) keeps float32 master weights and computes in
  the low-precision type under `torch.autocast`.
- **With an adapter** (the ``peft`` plugin's settings): the plugin's ``configure_model`` runs on a ``meta`` copy
  of the model, as at run set-up, so the base is quantised as the plugin quantises it (a 4-bit / 8-bit weight is
  quantised on fake tensors by bitsandbytes' own fake kernels: its packed data and quantisation state at their
  real sizes) and only the adapter and ``modules_to_save`` are trainable.
- **Gradients:** one gradient per trainable parameter (``requires_grad=True``), the parameter's size.
- **Optimizer state:** `torchloom.estimate_optimizer_memory`, unchanged: the plugin that builds the optimizer
  answers, and its answer equals the state it logs after the first step.
- **Activations:** measured, not modelled: one forward and backward of the model runs on fake tensors
  (`torch._subclasses.fake_tensor.FakeTensorMode`: tensors with shapes, dtypes and storages of the right size
  but no data, so nothing is allocated and any model that runs in PyTorch can be traced) and a
  `torch.utils._python_dispatch.TorchDispatchMode` adds the ``nbytes`` of every new storage an operation returns
  and subtracts it when the storage is freed; the activation figure is the peak of that sum. The forward runs as
  the training step runs it: under ``torch.autocast("cpu", dtype)`` with float32 outputs
  (`accelerate.utils.convert_outputs_to_fp32`) for mixed precision, with the ``grad_checkpoint`` plugin applied
  (through its ``configure_model`` hook, as at run set-up) for the checkpointed rows, in training mode (dropout
  masks count), with the gradients already allocated (so the figure is what a micro-batch adds on top of
  weights, gradients and optimizer state, as in every micro-batch of a gradient-accumulation window).
  What it counts: tensors saved for backward, temporaries alive at the peak, the recomputation of a checkpointed
  block during backward, the low-precision copies autocast makes of the weights, the loss. What it does not: the
  batch itself, the weights, gradients and optimizer state (their own columns). It is the counting of
  ``bench/activation_memory.py``'s ``peak_bytes``, with the gradients allocated before the step.

The total is weights + gradients + optimizer state + activations. The model comes from `torchloom.tools.memory_source`
(a fake-tensor prototype and how to run one micro-batch of it), the activations from `torchloom.tools.memory_trace`.

Limits (what the figures leave out)
-----------------------------------
- The CUDA context and library workspaces (cuBLAS, cuDNN; their size depends on the GPU, driver and
  libraries), kernels' internal scratch memory (not returned as tensors), and the caching allocator's
  reserved-but-unused blocks and fragmentation (``torch.cuda.max_memory_reserved`` minus
  ``max_memory_allocated``): leave headroom.
- Temporaries of the optimizer step (torch's ``foreach`` implementations allocate parameter-sized buffers
  during ``step``, after the activations are freed): with a small batch the step, not the backward, can be the
  peak.
- Kernel choice: the trace runs the CPU's kernels. ``fused_attention=True`` (the default) runs
  ``scaled_dot_product_attention`` without dropout, so the CPU's fused kernel is used, which like CUDA's flash /
  memory-efficient kernels keeps no ``seq_len x seq_len`` attention matrix; with ``fused_attention=False`` the
  attention runs as the CPU runs it (with dropout: the math path, which keeps the attention probabilities and
  the dropout mask). Other CUDA-only kernels (fused optimizers, fp8) are not modelled.
- transformers builds an explicit ``batch x 1 x seq_len x seq_len`` attention mask (bool and float: 5 bytes
  per element) when it sees fake tensors and no KV cache, where a real batch without padding needs none: the
  estimate can be high by up to that (measured: the checkpointed GPT-2 rows of the tests).
- One process of data parallelism holds a full copy (DDP's gradient buckets are not counted); with
  ``dp_shard_size`` one process of FSDP2 (`torchloom.tools.memory_shard`: its shards, its gathered layers and, in
  an accumulation window, its full gradients). Tensor and pipeline parallelism and DeepSpeed's ZeRO are not
  modelled. The micro-batch suggestion is per process.
- A task whose ``configure_model`` loads pretrained weights (``from_pretrained``) reads them into host memory
  once; point the estimate at the model directory instead to read only its config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchloom._bytes import format_bytes, parse_bytes
from torchloom.errors import ConfigError
from torchloom.tools.memory_shard import Sharding, as_shards, plan_units
from torchloom.tools.memory_source import ForwardFn, load_source, quantization_state_bytes
from torchloom.tools.memory_trace import trace_activations
from torchloom.tools.optimizer_memory import _installed_estimators, estimate_optimizer_memory

__all__ = ["MemoryEstimate", "MemoryRow", "Suggestion", "estimate_memory"]

#: ``precision`` -> the autocast dtype (``None``: float32 throughout). ``"no"`` is the mixed_precision plugin's name.
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Suggestion:
    """The largest micro-batch size that fits the budget, with the accumulation that reaches the effective batch.

    Attributes:
        micro_batch_size (`int`): samples per forward / backward, a divisor of the effective batch size.
        gradient_accumulation_steps (`int`): ``effective_batch_size // micro_batch_size``.
        total (`int`): bytes at that micro-batch size (weights + gradients + optimizer state + activations).
        next_total (`int`, *optional*): bytes at the next larger divisor, which does not fit; ``None`` when the
            micro-batch is already the whole effective batch.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    total: int
    next_total: int | None


@dataclass(frozen=True)
class MemoryRow:
    """One optimizer and checkpointing setting. Every size is in bytes.

    Attributes:
        optimizer (`str`): the optimizer name.
        grad_checkpoint (`bool`): whether the ``grad_checkpoint`` plugin is applied.
        weights (`int`): parameters and buffers.
        gradients (`int`): one gradient per trainable parameter.
        optimizer_state (`int`): `torchloom.estimate_optimizer_memory` for ``optimizer``.
        activations (`int`): the peak of tensors one micro-batch's forward and backward add (see the module
            docstring).
        suggestion (`Suggestion`, *optional*): only with a budget; ``None`` when not even a micro-batch of 1 fits.
        micro_batch_1_total (`int`, *optional*): only with a budget: the total at micro-batch size 1.
    """

    optimizer: str
    grad_checkpoint: bool
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    suggestion: Suggestion | None = None
    micro_batch_1_total: int | None = None

    @property
    def total(self) -> int:
        """Weights + gradients + optimizer state + activations, in bytes."""
        return self.weights + self.gradients + self.optimizer_state + self.activations


@dataclass(frozen=True)
class MemoryEstimate:
    """What `estimate_memory` found: the settings it estimated and one `MemoryRow` per optimizer and setting.

    Attributes:
        model (`str`): the model's class name.
        parameters (`int`): parameter count (tied parameters once).
        trainable_parameters (`int`): of which ``requires_grad=True``.
        batch_size (`int`): the micro-batch size the rows are for.
        seq_len (`int`, *optional*): tokens per sample (``None`` for a ``forward`` that takes none).
        precision (`str`): ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        fused_attention (`bool`): see `estimate_memory`.
        budget (`int`, *optional*): bytes the suggestions fit in.
        effective_batch_size (`int`, *optional*): samples per optimizer step the suggestions reach.
        rows (`tuple[MemoryRow, ...]`): for each optimizer, without and (if asked) with checkpointing.
        adapter (`str`, *optional*): the ``peft`` plugin's adapter, e.g. ``"lora r=8, base in 4 bits (nf4)"``;
            ``None`` without one.
        dp_shard_size (`int`, defaults to 1): processes FSDP2 shards over; above 1 every size is one process's
            (rank 0's, the largest).
    """

    model: str
    parameters: int
    trainable_parameters: int
    batch_size: int
    seq_len: int | None
    precision: str
    fused_attention: bool
    budget: int | None
    effective_batch_size: int | None
    rows: tuple[MemoryRow, ...]
    adapter: str | None = None
    dp_shard_size: int = 1

    def row(self, optimizer: str, grad_checkpoint: bool = False) -> MemoryRow:
        """The row of ``optimizer`` with or without checkpointing.

        Raises:
            KeyError: no such row.
        """
        for r in self.rows:
            if r.optimizer == optimizer and r.grad_checkpoint == grad_checkpoint:
                return r
        raise KeyError((optimizer, grad_checkpoint))

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON types (sizes in bytes; each row with its ``total``)."""
        out = dataclasses.asdict(self)
        out["rows"] = [{**dataclasses.asdict(r), "total": r.total} for r in self.rows]
        return out

    def table(self) -> str:
        """The rows side by side as text: one line per optimizer and setting, sizes in binary units."""
        tokens = f" x {self.seq_len} tokens" if self.seq_len is not None else ""
        mixed = " (fp32 master weights)" if self.precision != "fp32" else ""
        adapter = f"; adapter {self.adapter}" if self.adapter else ""
        sharded = f"; FSDP2 over {self.dp_shard_size} processes, sizes per process" if self.dp_shard_size > 1 else ""
        lines = [
            f"{self.model}: {self.parameters:,} parameters ({self.trainable_parameters:,} trainable){adapter}; "
            f"micro-batch {self.batch_size}{tokens}; precision {self.precision}{mixed}{sharded}"
        ]
        header = ["optimizer", "checkpointing", "weights", "gradients", "optimizer state", "activations", "total"]
        if self.budget is not None:
            header.append(f"fits {format_bytes(self.budget)}: micro-batch x accumulation")
        body = []
        for r in self.rows:
            cells = [r.optimizer, "on" if r.grad_checkpoint else "off"]
            cells += [format_bytes(v) for v in (r.weights, r.gradients, r.optimizer_state, r.activations, r.total)]
            if self.budget is not None:
                cells.append(_suggestion_cell(r))
            body.append(cells)
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        for line in [header, *body]:
            cells = [c.ljust(w) if i < 2 or i == 7 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
            lines.append("  ".join(cells).rstrip())
        if self.budget is not None:
            lines.append(
                f"effective batch size {self.effective_batch_size} = micro-batch x gradient_accumulation_steps"
            )
        return "\n".join(lines)


def _suggestion_cell(row: MemoryRow) -> str:
    s = row.suggestion
    if s is None:
        return f"none (micro-batch 1 needs {format_bytes(row.micro_batch_1_total or 0)})"
    return f"{s.micro_batch_size} x {s.gradient_accumulation_steps} ({format_bytes(s.total)})"


# ---------------------------------------------------------------------------------------------- the API


def estimate_memory(
    model: Any,
    *,
    batch_size: int = 8,
    seq_len: int | None = None,
    precision: str = "fp32",
    optimizers: str | Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
    grad_checkpoint: bool | Mapping[str, Any] = True,
    budget: int | str | None = None,
    effective_batch_size: int | None = None,
    architecture: str | None = None,
    forward: ForwardFn | None = None,
    fused_attention: bool = True,
    peft: Mapping[str, Any] | bool | None = None,
    dp_shard_size: int = 1,
    transformer_layer_cls_to_wrap: Sequence[str] | None = None,
) -> MemoryEstimate:
    """Estimate the memory one training process needs: weights, gradients, optimizer state and activations.

    Nothing is trained and nothing is allocated: the activations come from one forward and backward on fake
    tensors (`torch._subclasses.fake_tensor.FakeTensorMode`), counted by a dispatch mode that tracks every storage
    an operation creates and frees; the optimizer state is `torchloom.estimate_optimizer_memory`; weights are
    counted by `accelerate.utils.calculate_maximum_sizes`. The method, what it counts and its limits (CUDA
    context, allocator caching and fragmentation, kernel workspaces, optimizer-step temporaries, CPU kernel
    choice) are in ``docs/memory.md``. Stated tolerance, tested: the activations are within 1 % of the same
    counting on real tensors in a real torchloom training step on a CPU (GPT-2 and BERT from configs, with and
    without the ``grad_checkpoint`` plugin, fp32, bf16 and fp16; measured: 0.02-0.08 % low), except that for a
    causal LM with checkpointing they may be up to ``5 * batch_size * seq_len**2`` bytes higher (the attention
    mask transformers builds when it sees fake tensors; measured: +0.4 %). With the ``peft`` plugin (LoRA, and
    QLoRA on a 4-bit base) the same 1 % holds (measured: see ``docs/memory.md``, "With an adapter").

    Args:
        model: what to estimate, one of:
            a local Hugging Face model directory (its ``config.json`` is read; no weights);
            a transformers config file (``.json``) or `transformers.PretrainedConfig`;
            a torchloom run config (``.yaml`` / ``.yml``): its ``task`` (``class_path`` + ``init_args``) is
            built and its ``configure_model`` called on fake tensors, the settings of its ``grad_checkpoint``
            plugin, if it enables one, are used for the checkpointed rows, and its ``peft`` plugin, if it enables
            one, is applied (see ``peft``);
            a `torch.nn.Module` (any device, ``meta`` too; it is copied as fake tensors, never changed);
            or a callable that returns a `torch.nn.Module` (called on fake tensors).
        batch_size (`int`, defaults to 8): the micro-batch size (samples per forward), >= 1.
        seq_len (`int`, *optional*): tokens per sample; defaults to the model's ``max_position_embeddings``.
            Must not exceed it.
        precision (`str`, defaults to ``"fp32"``): ``"fp32"`` (or ``"no"``), ``"bf16"`` or ``"fp16"``: mixed
            precision as the ``mixed_precision`` plugin trains (float32 weights, gradients and optimizer state;
            forward under autocast).
        optimizers: optimizer names an installed plugin estimates (`torchloom.estimate_optimizer_memory`), as one
            name, a sequence, or a mapping ``{name: settings}`` (the plugin's settings); ``None``: the default
            optimizer of the one plugin that estimates.
        grad_checkpoint (`bool` or `Mapping`, defaults to True): also estimate with activation checkpointing:
            ``True`` applies the ``grad_checkpoint`` plugin with the run config's settings or its defaults
            (``modules: hf``: every layer of a transformers model), a mapping gives the plugin's settings
            (e.g. ``{"modules": ["Block"]}``); ``False``: rows without checkpointing only.
        budget (`int` or `str`, *optional*): memory per process, in bytes or as ``"8GiB"`` / ``"16GB"``: each row
            then suggests the largest micro-batch size that fits and the gradient_accumulation_steps that reach
            ``effective_batch_size``.
        effective_batch_size (`int`, *optional*): samples per optimizer step (per process) that the suggestion
            must reach; defaults to ``batch_size``. Suggested micro-batch sizes divide it.
        architecture (`str`, *optional*): the transformers class to build from a config (e.g.
            ``"BertForSequenceClassification"``); defaults to the config's ``architectures[0]``, else its causal LM,
            masked LM or base model class.
        forward (`Callable[[torch.nn.Module, int, int | None], torch.Tensor]`, *optional*): runs one micro-batch
            and returns the scalar loss: ``forward(model, batch_size, seq_len)``, building its inputs with torch
            functions (they run on fake tensors, and count as activations). Needed for a model that is not a
            transformers model; a transformers model gets ``input_ids`` of ``batch_size x seq_len`` and the labels
            its head takes (causal / masked / seq2seq LM and token classification: ``batch_size x seq_len``;
            sequence classification: ``batch_size``), and without a known head the loss is the sum of its first
            output.
        fused_attention (`bool`, defaults to True): run `torch.nn.functional.scaled_dot_product_attention` with
            ``dropout_p=0`` so that the CPU's fused kernel keeps no attention matrix, as CUDA's flash and
            memory-efficient kernels do; False: as the CPU runs it.
        peft (`Mapping` or `bool`, *optional*): the ``peft`` plugin's settings (e.g. ``{"r": 8, "target_modules":
            ["q_proj", "v_proj"], "load_in_4bit": True}``): its ``configure_model`` runs on a ``meta`` copy of the
            model, as at run set-up, so the base is frozen (and quantised: 4-bit / 8-bit weights and their
            quantisation state at their real bitsandbytes sizes), gradients and optimizer state are the adapter's
            (and ``modules_to_save``'s) only, and the activations are traced with the adapter in place. ``None``
            or ``True``: a run config's ``peft`` settings, if it enables the plugin; ``False``: no adapter.
        dp_shard_size (`int`, defaults to 1): the processes FSDP2 shards the model over (Accelerate's
            ``ParallelismConfig.dp_shard_size``; the process count of a run with the ``fsdp`` plugin); above 1
            every figure is one process's (`torchloom.tools.memory_shard`): parameters, gradients and optimizer
            state sharded, the gathered layers in the activations, and full gradients inside an accumulation
            window (``effective_batch_size`` above the micro-batch: FSDP2 reduces them only at the window's end).
            Stated tolerance, tested: the total is within 5 % of the per-process peak measured on 2 CPU
            processes (parameters and optimizer state exact); the peak of a loaded machine can be higher
            (``docs/memory.md``).
        transformer_layer_cls_to_wrap (`Sequence[str]`, *optional*): with ``dp_shard_size``, the classes sharded
            as units, as the ``fsdp`` plugin takes them; defaults to the model's ``_no_split_modules``.

    Returns:
        `MemoryEstimate`: sizes in bytes, one `MemoryRow` per optimizer without and with checkpointing;
        ``.table()`` prints them side by side.

    Raises:
        ConfigError: a path that does not exist or is no model, config or run config; a bad ``batch_size``,
            ``seq_len``, ``precision``, ``budget``, ``effective_batch_size``, ``architecture``,
            ``dp_shard_size`` or ``transformer_layer_cls_to_wrap`` (a class that matches no module; a quantised
            base, whose sharding is not modelled); a bad ``peft``
            setting (the plugin's message, as a run would give it); an unknown
            optimizer (the message suggests the closest name); a model without ``forward`` that is not a
            transformers model; a model whose forward and backward fail on fake tensors.
        PluginError: the ``grad_checkpoint`` or ``peft`` plugin (or the optimizer's plugin) is not installed or
            fails.

    Example:

    .. code-block:: python

        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256)
        >>> est = torchloom.estimate_memory(config, batch_size=4, seq_len=256, budget="64MiB", effective_batch_size=32)
        >>> print(est.table())
    """
    batch_size = _positive_int(batch_size, "batch_size")
    if seq_len is not None:
        seq_len = _positive_int(seq_len, "seq_len")
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision {precision!r} is not estimated; valid: fp32 (or 'no'), bf16, fp16 (mixed precision with "
            "float32 master weights)"
        )
    autocast_dtype = PRECISIONS[precision]
    budget_bytes = None if budget is None else parse_bytes(budget)
    if effective_batch_size is not None:
        effective_batch_size = _positive_int(effective_batch_size, "effective_batch_size")
    if budget_bytes is not None and effective_batch_size is None:
        effective_batch_size = batch_size
    shard_size = _positive_int(dp_shard_size, "dp_shard_size")
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    source = load_source(model, architecture, forward, mode, peft=peft)
    checkpoint = _checkpoint_settings(grad_checkpoint, source.checkpoint_settings)
    if source.max_len is not None:
        if seq_len is None:
            seq_len = source.max_len
        elif seq_len > source.max_len:
            raise ConfigError(
                f"seq_len {seq_len} is longer than {source.label} takes (max_position_embeddings = {source.max_len})"
            )
    if source.needs_seq_len and seq_len is None:
        raise ConfigError(f"seq_len: {source.label} has no max_position_embeddings; give seq_len")
    names = _optimizer_names(optimizers, source.prototype)

    trainable = [p for p in source.prototype.parameters() if p.requires_grad]
    layers = None if transformer_layer_cls_to_wrap is None else _class_names(transformer_layer_cls_to_wrap)
    if shard_size > 1:
        _check_shardable(source.prototype, source.label)
        plan = plan_units(source.prototype, layers, shard_size, accumulating=False)
        weights = plan.parameter_bytes(source.prototype)
        with as_shards(source.prototype, shard_size) as shards:
            states = {name: estimate_optimizer_memory(shards, name, **settings) for name, settings in names}
    else:
        weights = _weight_bytes(source.prototype) + quantization_state_bytes(source.prototype)
        states = {name: estimate_optimizer_memory(source.prototype, name, **settings) for name, settings in names}

    def accumulating(micro_batch: int) -> bool:
        """Whether a step of ``micro_batch`` samples is one micro-batch of several (gradient accumulation)."""
        return effective_batch_size is not None and effective_batch_size > micro_batch

    def gradients(micro_batch: int) -> int:
        if shard_size > 1:
            return dataclasses.replace(plan, accumulating=accumulating(micro_batch)).gradient_bytes()
        return sum(p.numel() * p.element_size() for p in trainable)

    cache: dict[tuple[int, bool], int] = {}

    def activations(micro_batch: int, checkpointed: bool) -> int:
        key = (micro_batch, checkpointed)
        if key not in cache:
            sharding = None if shard_size == 1 else Sharding(shard_size, layers, accumulating(micro_batch))
            cache[key] = trace_activations(
                source, mode, micro_batch, seq_len, autocast_dtype, checkpoint if checkpointed else None,
                fused_attention, sharding,
            )  # fmt: skip
        return cache[key]

    rows = []
    for name, _ in names:
        for checkpointed in [False, True] if checkpoint is not None else [False]:

            def total(micro_batch: int, name: str = name, checkpointed: bool = checkpointed) -> int:
                fixed = weights + gradients(micro_batch) + states[name]
                return fixed + activations(micro_batch, checkpointed)

            row = MemoryRow(
                name, checkpointed, weights, gradients(batch_size), states[name], activations(batch_size, checkpointed)
            )
            if budget_bytes is not None and effective_batch_size is not None:
                row = dataclasses.replace(
                    row,
                    suggestion=_suggest(budget_bytes, effective_batch_size, total),
                    micro_batch_1_total=total(1),
                )
            rows.append(row)
    return MemoryEstimate(
        model=source.label,
        parameters=sum(_element_count(p) for p in source.prototype.parameters()),
        trainable_parameters=sum(p.numel() for p in trainable),
        batch_size=batch_size,
        seq_len=seq_len,
        precision="fp32" if autocast_dtype is None else precision,
        fused_attention=fused_attention,
        budget=budget_bytes,
        effective_batch_size=effective_batch_size,
        rows=tuple(rows),
        adapter=_describe_adapter(source.prototype),
        dp_shard_size=shard_size,
    )


def _suggest(budget: int, effective: int, total: Callable[[int], int]) -> Suggestion | None:
    """Binary search over the divisors of ``effective`` for the largest micro-batch whose ``total`` (bytes) fits
    (memory grows with the micro-batch size; under FSDP2 the full gradients of accumulation fall away at the
    whole effective batch, which only lowers the last divisor's total)."""
    divisors = [d for d in range(1, effective + 1) if effective % d == 0]
    lo, hi = 0, len(divisors) - 1
    if total(divisors[0]) > budget:
        return None
    while lo < hi:  # divisors[lo] fits; find the last one that does
        mid = (lo + hi + 1) // 2
        if total(divisors[mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    best = divisors[lo]
    following = divisors[lo + 1] if lo + 1 < len(divisors) else None
    return Suggestion(
        micro_batch_size=best,
        gradient_accumulation_steps=effective // best,
        total=total(best),
        next_total=None if following is None else total(following),
    )


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} = {value!r}; expected an integer >= 1")
    return value


def _class_names(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else None
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise ConfigError(
            f"transformer_layer_cls_to_wrap = {value!r}; expected class names of the model's layers, e.g. "
            "['LlamaDecoderLayer']"
        )
    return names


def _check_shardable(model: torch.nn.Module, label: str) -> None:
    """Refuse a quantised base with ``dp_shard_size`` > 1: how FSDP2 shards bitsandbytes weights is not modelled."""
    if quantization_state_bytes(model) or any(hasattr(p, "SCB") for p in model.parameters()):
        raise ConfigError(
            f"dp_shard_size: {label} has a 4-bit / 8-bit quantised base, whose sharding under FSDP2 is not modelled; "
            "estimate it with dp_shard_size = 1 (one process's full copy)"
        )


def _element_count(p: torch.Tensor) -> int:
    """Elements of a parameter; of a 4-bit weight, those it was quantised from (its packed storage holds two a byte)."""
    state = getattr(p, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def _describe_adapter(model: torch.nn.Module) -> str | None:
    """``"lora r=8"`` and the base's quantisation, for the table's first line; ``None`` without an adapter."""
    from torchloom.rundir.adapter_format import adapter_config, has_adapter

    if not has_adapter(model):
        return None
    config = adapter_config(model)
    peft_type = getattr(config, "peft_type", None)
    text = str(getattr(peft_type, "value", peft_type)).lower()
    if isinstance(getattr(config, "r", None), int):
        text += f" r={config.r}"
    states = [getattr(p, "quant_state", None) for p in model.parameters()]
    quant_type = next((getattr(s, "quant_type", None) for s in states if s is not None), None)
    if quant_type is not None:
        text += f", base in 4 bits ({quant_type})"
    elif any(hasattr(p, "SCB") for p in model.parameters()):
        text += ", base in 8 bits"
    return text


def _weight_bytes(model: torch.nn.Module) -> int:
    from accelerate.utils import calculate_maximum_sizes

    return int(calculate_maximum_sizes(model)[0])


def _optimizer_names(
    optimizers: str | Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None, model: torch.nn.Module
) -> list[tuple[str, dict[str, Any]]]:
    if optimizers is None:
        candidates, _ = _installed_estimators()
        if len(candidates) != 1:
            estimate_optimizer_memory(model)  # raises the ConfigError that says why there is no default
        return [(candidates[0][1][0], {})]
    if isinstance(optimizers, str):
        optimizers = [optimizers]
    if isinstance(optimizers, Mapping):
        items = [(str(k), dict(v or {})) for k, v in optimizers.items()]
    else:
        items = [(n, {}) for n in optimizers]
    if not items or any(not isinstance(n, str) or not n for n, _ in items):
        raise ConfigError(f"optimizers = {optimizers!r}; expected optimizer names, e.g. the optimizer plugin's")
    return list(dict(items).items())


def _checkpoint_settings(grad_checkpoint: Any, from_config: dict[str, Any] | None) -> dict[str, Any] | None:
    if grad_checkpoint is False:
        return None
    if grad_checkpoint is True:
        return dict(from_config or {})
    if isinstance(grad_checkpoint, Mapping):
        return dict(grad_checkpoint)
    raise ConfigError(
        f"grad_checkpoint = {grad_checkpoint!r}; expected True, False or the grad_checkpoint plugin's "
        "settings (e.g. {'modules': ['Block']})"
    )
