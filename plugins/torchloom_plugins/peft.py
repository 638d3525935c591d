"""LoRA and QLoRA (and the other ``peft`` tuners): train a small adapter on a frozen, optionally 4-bit, base.

Method card
-----------
- **What:** LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685) freezes
  every weight ``W`` of the base and trains, for each target layer, ``W x + (lora_alpha / r) * B A x`` with
  ``A`` of shape ``(r, in_features)`` (Kaiming-uniform), ``B`` of shape ``(out_features, r)`` (zeros, so training
  starts from the base exactly) and dropout ``lora_dropout`` on ``x`` before ``A``. QLoRA (Dettmers et al. 2023,
  "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314) stores the frozen base's ``nn.Linear``
  weights in 4 bits (NF4, double quantisation of the block scales) and computes in ``compute_dtype``; on a 4-bit
  base peft creates the adapter in ``compute_dtype`` too (bf16 by default), on any other base in the base
  layer's dtype. Gradients and optimizer state exist for the adapter only.
- **Mechanism:** `peft.inject_adapter_in_model` in ``configure_model``, in place (the model object, and the names
  of its base parameters, stay what the task built), before ``accelerator.prepare``; with ``load_in_4bit`` /
  ``load_in_8bit`` the base's ``nn.Linear`` layers (not the output head, not ``modules_to_save``) are first
  replaced by ``bitsandbytes.nn.Linear4bit`` / ``Linear8bitLt`` holding the same weights quantised. Any ``peft``
  tuner that injects in place can be chosen with ``method`` (``lora``, ``loha``, ``lokr``, ``ia3``, ...); its
  other keywords go in ``options``.
- **Hooks:** ``setup`` (``merge`` needs ``save_model: true``), ``configure_model``, ``on_save_model`` (``merge``).
- **Composition:** the ``optimizer`` plugin builds its groups from trainable parameters only, so it sees the
  adapter alone; a task's own optimizer over ``self.model.parameters()`` holds the frozen base too but never
  steps it (no gradient: no state, no update). ``grad_clip`` clips the norm of the gradients that exist (the
  adapter's). ``grad_checkpoint`` works in both its modes, reentrant too: the frozen embeddings' output does
  not require grad, and reentrant checkpointing back-propagates only into inputs that do; the grad_checkpoint
  plugin (and transformers' own checkpointing) make the inputs require grad, and the plugin also calls
  ``enable_input_require_grads`` on a transformers model, as peft's ``prepare_model_for_kbit_training`` does, for
  checkpointing a task applies itself.
  ``mixed_precision``, ``grad_accum``, ``compile``, ``local_sgd`` and DDP see an ordinary model.
- **Checkpoints and export (the core does this for any model with an adapter injected in place):** a checkpoint
  stores the trainable parameters only (the adapter, ``modules_to_save``) with the optimizer, scheduler, random
  states and data position, and records the adapter (method, rank, alpha, adapted modules, quantisation, the
  class and SHA-256 of the frozen base); resuming onto another base, rank or target set is one
  `torchloom.CheckpointError` naming the difference. The run's ``model/`` folder holds the adapter in peft's own
  format (``adapter_config.json``, ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, folder)``
  loads it); ``merge: true`` also writes ``model/merged/``, the base with the adapter merged in, as an ordinary
  transformers folder.
- **Sources:** huggingface/peft (``LoraConfig``, ``inject_adapter_in_model``, ``get_peft_model_state_dict``);
  bitsandbytes ``Linear4bit`` / ``Params4bit``; transformers' ``enable_input_require_grads``.

Run: ``plugins: {peft: {r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}}``; QLoRA: add
``load_in_4bit: true``.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

import torchloom
from torchloom import ConfigError
from torchloom.utils import closest_name

__all__ = [
    "Peft",
    "PeftPluginConfig",
    "apply_adapter",
    "is_sharded",
    "merged_copy",
    "quantize_linear_layers",
    "whole_copy",
]

BIASES = ("none", "all", "lora_only")
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_PATTERN = re.compile(r"[*?\[]")


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("plugin 'peft' needs the peft library: pip install 'torchloom[peft]' (peft>=0.13)") from None
    return peft


def methods() -> dict[str, type]:
    """The ``method`` names this plugin accepts, each with its `peft.PeftConfig` class: every peft tuner that is
    injected in place into a model (prompt-learning methods, which wrap the model, are not)."""
    peft = _peft()
    from peft.config import PromptLearningConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    from peft.tuners.tuners_utils import BaseTuner

    del peft
    found = {}
    for peft_type, config_cls in PEFT_TYPE_TO_CONFIG_MAPPING.items():
        tuner = PEFT_TYPE_TO_TUNER_MAPPING.get(peft_type)
        in_place = isinstance(tuner, type) and issubclass(tuner, BaseTuner)
        if issubclass(config_cls, PromptLearningConfig) or not in_place:
            continue
        found[str(getattr(peft_type, "value", peft_type)).lower()] = config_cls
    return dict(sorted(found.items()))


@dataclass
class PeftPluginConfig:
    """Settings of the ``peft`` plugin.

    Args:
        method (`str`, defaults to ``"lora"``): the peft tuner (`methods`: ``lora``, ``loha``, ``lokr``, ``ia3``,
            ``vera``, ...). Settings its config class has no field for (``lora_alpha`` for ``ia3``) are not passed.
        r (`int`, defaults to 8): the rank of the update ``B A``; ``>= 1``.
        lora_alpha (`float`, defaults to 16): the update is scaled by ``lora_alpha / r``; ``> 0``.
        lora_dropout (`float`, defaults to 0.0): dropout on the adapter's input, in ``[0, 1)``.
        target_modules (`str` or `list[str]`, *optional*): which layers get the adapter. A list: each entry is a
            module name or the end of one after a dot (``q_proj`` matches ``model.layers.0.self_attn.q_proj``), or
            an ``fnmatch`` pattern on the full name (``model.layers.1.*``); ``"all-linear"``: every linear layer but
            the output head; any other string: a regular expression that must match a full module name. ``None``:
            peft's default for the model type (``q_proj``, ``v_proj`` for Llama).
        modules_to_save (`list[str]`, *optional*): modules trained in full beside the adapter (a new
            classification head: ``[classifier]``); saved with the adapter.
        bias (`str`, defaults to ``"none"``): which biases train: ``"none"``, ``"all"`` or ``"lora_only"``.
        options (`dict`, defaults to ``{}``): any other keyword of the method's peft config
            (``use_rslora``, ``use_dora``, ``init_lora_weights``, ``rank_pattern``, ...), passed through.
        load_in_4bit (`bool`, defaults to False): QLoRA: quantise the base's ``nn.Linear`` layers to 4 bits with
            bitsandbytes (``Linear4bit``) before injecting the adapter.
        load_in_8bit (`bool`, defaults to False): the same with ``Linear8bitLt`` (LLM.int8()).
        quant_type (`str`, defaults to ``"nf4"``): the 4-bit data type, ``"nf4"`` or ``"fp4"``.
        compute_dtype (`str`, defaults to ``"bfloat16"``): the dtype 4-bit layers compute in: ``"bfloat16"``,
            ``"float16"`` or ``"float32"``.
        double_quant (`bool`, defaults to True): quantise the 4-bit block scales too (QLoRA's double quantisation).
        merge (`bool`, defaults to False): the saved model (``save_model: true``) also gets ``merged/``: the base
            with the adapter merged into its weights, an ordinary transformers folder. Not with a quantised base.

    Raises:
        ConfigError: an unknown method (with the closest name), a bad value, 4-bit and 8-bit together, ``merge``
            with a quantised base, an unknown ``options`` key, or peft / bitsandbytes not installed.
    """

    method: str = "lora"  # the peft tuner: lora, loha, lokr, ia3, ...
    r: int = 8  # rank of the update B A (>= 1)
    lora_alpha: float = 16.0  # the update is scaled by lora_alpha / r
    lora_dropout: float = 0.0  # dropout on the adapter's input, in [0, 1)
    # module names (or their last parts), fnmatch patterns, "all-linear", or a regex; None: peft's default
    target_modules: str | list[str] | None = None
    modules_to_save: list[str] | None = None  # modules trained in full beside the adapter (a new head)
    bias: str = "none"  # biases that train: none, all, lora_only
    options: dict[str, Any] = field(default_factory=dict)  # any other keyword of the method's peft config
    load_in_4bit: bool = False  # QLoRA: the base's nn.Linear layers in 4 bits (bitsandbytes Linear4bit)
    load_in_8bit: bool = False  # the base's nn.Linear layers in 8 bits (bitsandbytes Linear8bitLt)
    quant_type: str = "nf4"  # 4-bit data type: nf4 or fp4
    compute_dtype: str = "bfloat16"  # dtype the 4-bit layers compute in: bfloat16, float16, float32
    double_quant: bool = True  # quantise the 4-bit block scales too
    merge: bool = False  # also save model/merged/: the adapter merged into the base (not with 4 / 8 bits)

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> ConfigError:
            return ConfigError(f"setting {name!r} = {getattr(self, name)!r}; expected {valid}")

        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise bad("r", "an integer >= 1")
        if not self.lora_alpha > 0:
            raise bad("lora_alpha", "a number > 0")
        if not 0 <= self.lora_dropout < 1:
            raise bad("lora_dropout", "a number in [0, 1)")
        for name, valid in (("bias", BIASES), ("quant_type", QUANT_TYPES), ("compute_dtype", COMPUTE_DTYPES)):
            value = getattr(self, name)
            if value not in valid:
                hint = closest_name(str(value), valid)
                raise ConfigError(
                    f"setting {name!r} = {value!r}; {f'did you mean {hint!r}? ' if hint else ''}valid: "
                    + ", ".join(valid)
                )
        if isinstance(self.target_modules, list) and (
            not self.target_modules or any(not isinstance(t, str) or not t.strip() for t in self.target_modules)
        ):
            raise bad("target_modules", "a non-empty list of module names or patterns, 'all-linear', or a regex")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            try:
                re.compile(self.target_modules)
            except re.error as exc:
                raise bad("target_modules", f"'all-linear', a list of module names, or a valid regex ({exc})") from None
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("settings 'load_in_4bit' = True and 'load_in_8bit' = True; expected at most one of them")
        if self.merge and (self.load_in_4bit or self.load_in_8bit):
            raise ConfigError(
                f"setting 'merge' = True with {'load_in_4bit' if self.load_in_4bit else 'load_in_8bit'} = True; "
                "expected merge: false with a quantised base (merging into quantised weights would round the "
                "update away): merge the saved adapter into the full-precision base instead"
            )
        known = methods()
        if self.method not in known:
            hint = closest_name(self.method, known)
            raise ConfigError(
                f"setting 'method' = {self.method!r}; {f'did you mean {hint!r}? ' if hint else ''}valid (peft "
                f"tuners injected in place): {', '.join(known)}"
            )
        fields = {f.name for f in dataclasses.fields(known[self.method])}
        for key in self.options:
            if key not in fields:
                hint = closest_name(key, fields)
                raise ConfigError(
                    f"setting 'options' key {key!r} is not a field of peft's {known[self.method].__name__}; "
                    f"{f'did you mean {hint!r}? ' if hint else ''}valid: {', '.join(sorted(fields))}"
                )


# ------------------------------------------------------------------------------------------ functional core


def _module_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def resolve_targets(model: torch.nn.Module, target_modules: str | list[str] | None) -> str | list[str] | None:
    """Check ``target_modules`` against ``model`` and return what to give peft (patterns expanded to full names).

    Raises:
        ConfigError: an entry (or the regex) that matches no module; the message names it, suggests the closest
            module name and lists the names of the layers peft can adapt.
    """
    if target_modules is None or target_modules == "all-linear":
        return target_modules
    names = _module_names(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not list(m.children())})

    def no_match(entry: str) -> ConfigError:
        hint = closest_name(entry.rsplit(".", 1)[-1], leaves)
        shown = ", ".join(leaves[:16]) + (", ..." if len(leaves) > 16 else "")
        return ConfigError(
            f"plugin 'peft': setting 'target_modules' entry {entry!r} matches no module of {type(model).__name__}; "
            f"{f'did you mean {hint!r}? ' if hint else ''}valid: 'all-linear', a list of module names or patterns "
            f"(layer names: {shown}), or a regex"
        )

    if isinstance(target_modules, str):
        if not any(re.fullmatch(target_modules, n) for n in names):
            raise no_match(target_modules)
        return target_modules
    resolved: list[str] = []
    for entry in target_modules:
        if _PATTERN.search(entry):
            matched = [n for n in names if fnmatch.fnmatchcase(n, entry)]
            if not matched:
                raise no_match(entry)
            resolved += [n for n in matched if n not in resolved]
        elif any(n == entry or n.endswith(f".{entry}") for n in names):
            resolved.append(entry) if entry not in resolved else None
        else:
            raise no_match(entry)
    return resolved


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def quantize_linear_layers(
    model: torch.nn.Module,
    bits: int,
    *,
    quant_type: str = "nf4",
    compute_dtype: torch.dtype = torch.bfloat16,
    double_quant: bool = True,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Replace ``model``'s ``torch.nn.Linear`` layers by bitsandbytes' quantised ones holding the same weights, in
    place; return the qualified names replaced. Every parameter of ``model`` is frozen (``requires_grad=False``).

    Args:
        model (`torch.nn.Module`): the unprepared model, on the CPU (or the device it trains on).
        bits (`int`): 4 (``bitsandbytes.nn.Linear4bit``, weights as packed ``uint8``) or 8
            (``bitsandbytes.nn.Linear8bitLt``, ``int8`` weights with per-row scales).
        quant_type (`str`, defaults to ``"nf4"``): ``"nf4"`` or ``"fp4"`` (4 bits only).
        compute_dtype (`torch.dtype`, defaults to ``torch.bfloat16``): the dtype 4-bit layers compute in.
        double_quant (`bool`, defaults to True): quantise the block scales too (4 bits).
        skip (`tuple[str, ...]`): names (or last name parts) of modules left as they are, with everything inside
            them; the output head (``get_output_embeddings()``) is always left.

    Raises:
        ConfigError: bitsandbytes is not installed, or ``model`` has no ``torch.nn.Linear`` layer to quantise.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(
            f"plugin 'peft': setting 'load_in_{bits}bit' = True needs bitsandbytes: pip install 'torchloom[8bit]'"
        ) from None
    head = _output_head(model)

    def skipped(name: str) -> bool:
        parts = name.split(".")
        return any(s in parts or name == s or name.startswith(f"{s}.") for s in skip)

    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not head and not skipped(name)
    ]
    if not chosen:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"plugin 'peft': setting 'load_in_{bits}bit' = True but {type(model).__name__} has no torch.nn.Linear "
            f"layer to quantise (besides the output head and modules_to_save; its layers: {', '.join(classes[:12])}); "
            f"valid for this model: load_in_{bits}bit: false"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in chosen:
        device = linear.weight.device
        weight = linear.weight.data.to(torch.float32)
        layer: torch.nn.Module
        if bits == 4:
            layer = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=double_quant,
                quant_type=quant_type,
                quant_storage=torch.uint8,
                device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, compress_statistics=double_quant, quant_type=quant_type
            )
        else:
            layer = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, bias=linear.bias is not None, has_fp16_weights=False
            )
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        layer = layer.to(device)  # quantises the weight
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            # bitsandbytes 0.50 repacks a 4-bit weight in place for its CPU inference kernel at the first forward in
            # eval mode (a validation pass) and keeps it so: the training forwards after it run gemv_4bit, which has
            # no autograd kernel ("silently incorrect" gradients), and the base's bytes change. Kept off.
            layer.support_avx512bf16_for_cpu = False  # type: ignore[assignment]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    setattr(model, f"is_loaded_in_{bits}bit", True)  # peft's dispatch picks its bitsandbytes LoRA layers
    return [name for name, _ in chosen]


def peft_config_for(settings: PeftPluginConfig, target_modules: str | list[str] | None) -> Any:
    """The `peft.PeftConfig` of ``settings`` (a fresh object; peft resolves ``all-linear`` into it)."""
    config_cls = methods()[settings.method]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    given = {
        "r": settings.r,
        "lora_alpha": settings.lora_alpha,
        "lora_dropout": settings.lora_dropout,
        "bias": settings.bias,
        "target_modules": target_modules,
        "modules_to_save": list(settings.modules_to_save) if settings.modules_to_save else None,
    }
    kwargs = {k: v for k, v in given.items() if k in fields}
    if "lora_alpha" in kwargs and float(settings.lora_alpha).is_integer():
        kwargs["lora_alpha"] = int(settings.lora_alpha)  # peft types it as int (adapter_config.json shows 16)
    kwargs.update(copy.deepcopy(settings.options))
    try:
        return config_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"plugin 'peft': peft's {config_cls.__name__} refuses these settings: {exc}") from None


def apply_adapter(model: torch.nn.Module, settings: PeftPluginConfig) -> list[str]:
    """Quantise (``load_in_4bit`` / ``load_in_8bit``) and inject the adapter ``settings`` describe into ``model``, in
    place; return the qualified names of the adapted modules. Afterwards only the adapter (and ``modules_to_save``,
    and the biases ``bias`` names) has ``requires_grad=True``.

    Raises:
        ConfigError: a target that matches nothing, a model that cannot be quantised, a model that carries an
            adapter already, or peft refusing the model (its message).
    """
    peft = _peft()
    existing = getattr(model, "peft_config", None)
    if isinstance(existing, dict) and existing:
        raise ConfigError(
            f"plugin 'peft': {type(model).__name__} carries an adapter already ({', '.join(existing)}); "
            "build the base without one"
        )
    targets = resolve_targets(model, settings.target_modules)
    for entry in settings.modules_to_save or []:
        if not any(n == entry or n.endswith(f".{entry}") for n in _module_names(model)):
            hint = closest_name(entry, sorted({n.rsplit(".", 1)[-1] for n in _module_names(model)}))
            raise ConfigError(
                f"plugin 'peft': setting 'modules_to_save' entry {entry!r} matches no module of "
                f"{type(model).__name__}; {f'did you mean {hint!r}? ' if hint else ''}valid: module names"
            )
    config = peft_config_for(settings, targets)
    bits = 4 if settings.load_in_4bit else 8 if settings.load_in_8bit else 0
    if bits:
        quantize_linear_layers(
            model,
            bits,
            quant_type=settings.quant_type,
            compute_dtype=getattr(torch, settings.compute_dtype),
            double_quant=settings.double_quant,
            skip=tuple(settings.modules_to_save or ()),
        )
    try:
        peft.inject_adapter_in_model(config, model, adapter_name="default")
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"plugin 'peft': setting 'method' = {settings.method!r} cannot adapt {type(model).__name__}: "
            f"{' '.join(str(exc).split())}"
        ) from None
    enable: Any = getattr(model, "enable_input_require_grads", None)
    get_embeddings: Any = getattr(model, "get_input_embeddings", None)
    if callable(enable) and callable(get_embeddings):
        embeddings = get_embeddings()
        if embeddings is not None and not any(p.requires_grad for p in embeddings.parameters()):
            enable()  # reentrant checkpointing back-propagates only into such inputs
    return [
        name for name, module in model.named_modules() if hasattr(module, "base_layer") and hasattr(module, "merge")
    ]


def merged_copy(model: torch.nn.Module, *, in_place: bool = False) -> torch.nn.Module:
    """A copy of ``model`` with its adapter merged into the base weights (``W + (alpha / r) B A``) and every peft
    layer replaced by its base layer: an ordinary model of the base's class. ``model`` is not changed, unless
    ``in_place`` (then it is the one merged and returned: for a copy made to be merged, `whole_copy`'s)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    merged = model if in_place else copy.deepcopy(model)
    layers = [
        (name, module)
        for name, module in merged.named_modules()
        if name and isinstance(module, BaseTunerLayer | ModulesToSaveWrapper)
    ]
    done: list[str] = []
    for name, module in layers:
        if any(name.startswith(f"{outer}.") for outer in done):
            continue  # inside a layer already replaced
        done.append(name)
        parent_name, _, child = name.rpartition(".")
        parent = merged.get_submodule(parent_name) if parent_name else merged
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=True)
            setattr(parent, child, module.get_base_layer())
        elif isinstance(module, ModulesToSaveWrapper):
            setattr(parent, child, module.modules_to_save["default"])
    merged.__dict__.pop("peft_config", None)
    merged.requires_grad_(True)
    return merged


def is_sharded(accelerator: Any) -> bool:
    """Whether the run shards the model (Accelerate's distributed type ``FSDP``: its parameters are DTensor shards);
    ``False`` without an accelerator (``None``: the memory estimate's model, never prepared)."""
    kind = getattr(accelerator, "distributed_type", None)
    return getattr(kind, "value", kind) == "FSDP"


def _task_class(model: torch.nn.Module) -> type:
    """The class the task built ``model`` as: FSDP2's ``fully_shard`` gives it a subclass of its own (``FSDP<Name>``,
    which refuses ``deepcopy``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def whole_copy(model: torch.nn.Module, is_main_process: bool) -> torch.nn.Module | None:
    """An unsharded copy of a sharded (FSDP) adapted transformers ``model``, on the main process (the others get
    ``None``): the task's class built from ``model.config`` on the meta device, the same adapter injected, and every
    ``state_dict`` value's whole value (`torchloom.utils.full_tensor`) assigned to it. A collective: every process
    calls it at the same point; the whole model is gathered on the main process (what a merged model holds anyway).

    Args:
        model (`torch.nn.Module`): the unwrapped, sharded model with its adapter (a transformers ``PreTrainedModel``).
        is_main_process (`bool`): whether this process keeps the whole values and builds the copy.
    """
    from peft import inject_adapter_in_model

    from torchloom.utils import full_tensor

    state = {}
    for name, value in model.state_dict().items():  # the same order on every process: one gather each
        whole = full_tensor(value)
        if is_main_process:
            state[name] = whole.detach().cpu()
    if not is_main_process:
        return None
    configs: Any = model.peft_config
    with torch.device("meta"):
        plain = _task_class(model)(model.config)
    inject_adapter_in_model(copy.deepcopy(configs["default"]), plain, adapter_name="default")
    plain.load_state_dict(state, strict=True, assign=True)
    return plain


# ------------------------------------------------------------------------------------------------- plugin


class Peft(torchloom.Plugin):
    """Injects a LoRA (or other peft) adapter, on an optionally 4-bit / 8-bit base, before the model is prepared.

    Args:
        config (`PeftPluginConfig`, *optional*): ready-made settings, or pass them as keywords.

    Raises:
        ConfigError: bad settings (when the plugin is built); at ``setup``, ``merge`` without ``save_model``; at
            ``configure_model``, a target that matches no module, a model without ``nn.Linear`` layers to quantise.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"peft": {"r": 8, "target_modules": ["q_proj", "v_proj"]}})

    Attributes:
        adapted (`list[str]`): qualified names of the modules adapted in the last run.
    """

    name = "peft"
    Config = PeftPluginConfig
    # configure_model injects an adapter in place, from the settings alone; `merge` writes the merged model too
    capabilities = frozenset({"adapter"})
    requires = ()  # nothing: it works alone
    conflicts = ()  # combines with every built-in plugin (see the composition notes)

    def __init__(self, config: PeftPluginConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.adapted: list[str] = []

    @torchloom.hookimpl
    def setup(self, config: Any, stage: str) -> None:
        if stage == "fit" and self.config.merge and not getattr(config, "save_model", False):
            raise ConfigError(
                "plugin 'peft': setting 'merge' = True writes model/merged/ next to the saved adapter, but engine "
                "setting 'save_model' is false; expected save_model: true, or merge: false"
            )

    @torchloom.hookimpl
    def configure_model(self, model: torch.nn.Module, accelerator: Any) -> None:
        self.check_sharding(model, accelerator)
        self.adapted = apply_adapter(model, self.config)

    def check_sharding(self, model: torch.nn.Module, accelerator: Any) -> None:
        """Refuse, before anything is changed, what this plugin does not do under FSDP.

        Raises:
            ConfigError: a 4-bit or 8-bit base under FSDP on CPU processes (bitsandbytes' quantised weights are
                not sharded there: Accelerate leaves them out of FSDP2's sharding); ``merge`` under FSDP with a
                model that is not a transformers model (the merged copy is built from its ``config``).
        """
        if not is_sharded(accelerator):
            return
        bits = "load_in_4bit" if self.config.load_in_4bit else "load_in_8bit" if self.config.load_in_8bit else None
        if bits and getattr(accelerator.device, "type", None) == "cpu":
            raise ConfigError(
                f"plugin 'peft': setting {bits!r} = True under FSDP (plugin 'fsdp') on CPU processes: bitsandbytes' "
                "quantised weights are sharded by FSDP only on GPUs (QLoRA with FSDP stores them in a floating "
                "quant_storage); on CPU processes Accelerate leaves them out of the sharding, and this torchloom "
                f"does not run it. Expected {bits}: false under fsdp on CPU (LoRA on the full-precision base), or "
                "no fsdp plugin (data parallelism)"
            )
        if self.config.merge and not callable(getattr(model, "save_pretrained", None)):
            raise ConfigError(
                f"plugin 'peft': setting 'merge' = True under FSDP (plugin 'fsdp') needs a transformers model (the "
                f"merged copy of a sharded model is built from its config); {type(model).__name__} is not one. "
                "Expected merge: false (export the checkpoint with torchloom export --merge on one process instead)"
            )

    @torchloom.hookimpl
    def on_save_model(self, directory: str, model: torch.nn.Module, accelerator: Any) -> None:
        if not self.config.merge:
            return
        unwrapped = accelerator.unwrap_model(model)
        main = accelerator.is_main_process
        if is_sharded(accelerator):  # the whole values gathered (every process), merged on the main process
            whole = whole_copy(unwrapped, main)
            merged = merged_copy(whole, in_place=True) if whole is not None else None
        else:
            merged = merged_copy(unwrapped) if main else None
        if merged is not None:
            target = os.path.join(directory, "merged")
            save_pretrained: Any = getattr(merged, "save_pretrained", None)
            if callable(save_pretrained):
                save_pretrained(target)
            else:
                from safetensors.torch import save_model

                os.makedirs(target, exist_ok=True)
                save_model(merged, os.path.join(target, "model.safetensors"))
