"""Generation at validation: a causal LM generates from each validation prompt; text metrics score the decoded text.

Method card
-----------
- **What:** at every ``every_n_validations``-th validation pass, each process generates from the prompts of its own
  shard of the validation data (the batch's ``generation`` entry: left-padded ``input_ids`` and
  ``attention_mask``, and the ``reference`` texts, as `PromptCompletionData` / `ChatData` with
  ``generation=True`` make them), greedy by default, up to ``max_new_tokens`` new tokens or EOS. Only the new
  tokens are decoded (special tokens skipped), and the text is cut at the first of ``stop_strings``. The metrics
  (``exact_match``, ``answer_accuracy`` with ``answer_pattern``, or a dotted path to a function
  ``(predictions, references) -> float``) are logged as ``val/<name>``, so that ``early_stopping``, the
  checkpoint's keep-best and the trackers can use them.
- **Each sample once:** the engine cuts the copies Accelerate pads the last batch with before
  ``on_validation_batch_end``; at the end of the pass the texts of all processes are gathered
  (``gather_object``, in process order) and every process computes the same values over the whole set.
- **Model:** ``accelerator.unwrap_model(model).generate(...)`` (a DDP wrapper has no ``generate``), in eval mode
  under ``torch.no_grad``; every module gets its own mode back. Under FSDP (FSDP2 on several processes) every
  forward gathers the sharded parameters, a collective, so generation runs with transformers' ``synced_gpus=True``:
  a process whose sequences have ended keeps running forwards until every process's have (the engine gives every
  process the same number of validation batches); ``generate_kwargs`` ``synced_gpus: false`` is refused there.
- **Predict:** ``Engine.predict`` / ``torchloom predict`` write each sample's prompt, generation and reference to
  ``predictions.jsonl`` (``run_predict_step``), unless the task defines its own ``predict_step`` (it then runs, as
  it would without the plugin) or ``predict`` is false.
- **Hooks:** ``configure_model`` (checks: a model with ``generate``, a tokenizer; FSDP: synced generation),
  ``on_validation_start``, ``on_validation_batch_end``, ``on_validation_end``, ``run_predict_step``.
- **Cost:** one ``generate`` call per validation batch (up to ``max_new_tokens`` forward passes) and one gather
  of the texts per pass; nothing during training.
- **Sources:** transformers' ``GenerationMixin.generate`` (left padding for decoder-only models, ``pad_token_id``);
  HF ``Seq2SeqTrainer``'s ``predict_with_generate``; TRL's generation callbacks.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import DistributedType, gather_object

import torchloom

__all__ = [
    "METRICS",
    "Generate",
    "GenerateConfig",
    "answer_accuracy",
    "exact_match",
    "generate_texts",
    "predict_generations",
]


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The share of predictions equal to their reference, both stripped of surrounding whitespace."""
    return _mean([p.strip() == r.strip() for p, r in zip(predictions, references, strict=True)])


def parse_answer(text: str, pattern: str) -> str | None:
    """The last match of ``pattern`` in ``text`` (its first group, when it has one), stripped, commas removed;
    ``None`` without a match."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip().replace(",", "")


def answer_accuracy(
    predictions: Sequence[str], references: Sequence[str], pattern: str = r"-?\d[\d,]*(?:\.\d+)?"
) -> float:
    """The share of predictions whose parsed answer (`parse_answer`) is the reference's; a prediction without one
    is wrong (a reference without one is compared whole)."""
    hits = []
    for prediction, reference in zip(predictions, references, strict=True):
        answer = parse_answer(prediction, pattern)
        expected = parse_answer(reference, pattern)
        hits.append(answer is not None and answer == (expected if expected is not None else reference.strip()))
    return _mean(hits)


def _mean(hits: Sequence[bool]) -> float:
    return sum(hits) / len(hits) if hits else float("nan")


#: The metrics known by name; any other entry is a dotted path to a function ``(predictions, references) -> float``.
METRICS: dict[str, str] = {
    "exact_match": "the stripped prediction equals the stripped reference",
    "answer_accuracy": "the last match of answer_pattern is the same in both",
}


def _load_callable(path: str) -> Callable[..., Any]:
    """The function at ``path`` (``package.module.function`` or ``package.module:function``)."""
    module_name, sep, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attribute:
        raise torchloom.ConfigError(f"generate: setting 'metrics': {path!r} is no metric name nor a dotted path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise torchloom.ConfigError(
            f"generate: setting 'metrics': cannot import {module_name!r} for metric {path!r}: {exc}"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise torchloom.ConfigError(
            f"generate: setting 'metrics': {module_name!r} has no function {attribute!r} (metric {path!r})"
        )
    return function


@dataclass
class GenerateConfig:
    """Settings of the ``generate`` plugin.

    Args:
        max_new_tokens (`int`, defaults to 32): the most tokens generated after each prompt.
        do_sample (`bool`, defaults to False): sample instead of greedy decoding (then ``generate_kwargs`` may set
            ``temperature``, ``top_p`` ...; the run's seed makes it repeatable).
        stop_strings (`list[str]`, defaults to ``[]``): the decoded text is cut before the first of these.
        metrics (`list[str]`, defaults to ``["exact_match"]``): ``exact_match``, ``answer_accuracy`` or a dotted
            path (``my_pkg.metrics.bleu`` or ``my_pkg.metrics:bleu``) to a function ``(predictions: list[str],
            references: list[str]) -> float``; each is logged as ``<prefix><name>`` (a path by its last part).
        answer_pattern (`str`, defaults to a number): the regular expression ``answer_accuracy`` finds the answer
            with (its last match; its first group when it has one), e.g. ``"#### (.+)"``.
        every_n_validations (`int`, defaults to 1): generate at every n-th validation pass only (generation costs
            up to ``max_new_tokens`` forward passes per batch).
        generate_kwargs (`dict`, defaults to ``{}``): more keyword arguments of ``model.generate``: generation
            settings (``transformers.GenerationConfig``'s: ``temperature``, ``num_beams``, ``use_cache`` ...) or
            the model's own; checked against the model before training (an unknown one is a `ConfigError`).
        batch_key (`str`, defaults to ``"generation"``): the batch entry with the prompts and references.
        tokenizer (`str`, *optional*): a tokenizer directory to decode with; default the task's ``tokenizer``
            attribute (a tokenizer or its path).
        prefix (`str`, defaults to ``"val/"``): put before every metric name when logged.
        predict (`bool`, defaults to True): ``Engine.predict`` (``torchloom predict``) generates from every batch's
            ``batch_key`` entry and writes ``{"prompt", "generation", "reference"}`` per sample to
            ``predictions.jsonl`` (`predict_generations`), unless the task defines its own ``predict_step``, which
            then runs instead.

    Raises:
        ConfigError: a bad value, an unknown metric name (with the closest one), a path that does not import, a
            pattern that does not compile.
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    stop_strings: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=lambda: ["exact_match"])
    answer_pattern: str = r"-?\d[\d,]*(?:\.\d+)?"
    every_n_validations: int = 1
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_key: str = "generation"
    tokenizer: str | None = None
    prefix: str = "val/"
    predict: bool = True

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "every_n_validations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise torchloom.ConfigError(f"generate: setting {name!r} = {value!r}; expected an integer >= 1")
        for name in ("do_sample", "predict"):
            if not isinstance(value := getattr(self, name), bool):
                raise torchloom.ConfigError(f"generate: setting {name!r} = {value!r}; expected true or false")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise torchloom.ConfigError(
                f"generate: setting 'stop_strings' = {self.stop_strings!r}; expected non-empty strings"
            )
        try:
            re.compile(self.answer_pattern)
        except re.error as exc:
            raise torchloom.ConfigError(
                f"generate: setting 'answer_pattern' = {self.answer_pattern!r} does not compile: {exc}"
            ) from None
        if not self.batch_key:
            raise torchloom.ConfigError("generate: setting 'batch_key' = ''; expected the name of a batch entry")
        if not self.metrics:
            raise torchloom.ConfigError("generate: setting 'metrics' = []; expected at least one metric")
        self.functions()  # an unknown name or a path that does not import fails now, before training

    def functions(self) -> dict[str, Callable[[list[str], list[str]], Any]]:
        """Logged name (without the prefix) -> metric function."""
        functions: dict[str, Callable[[list[str], list[str]], Any]] = {}
        for entry in self.metrics:
            if not isinstance(entry, str) or not entry:
                raise torchloom.ConfigError(f"generate: setting 'metrics': {entry!r}; expected a name or a path")
            if entry == "exact_match":
                functions[entry] = exact_match
            elif entry == "answer_accuracy":
                functions[entry] = functools.partial(answer_accuracy, pattern=self.answer_pattern)
            elif "." in entry or ":" in entry:
                functions[re.split(r"[.:]", entry)[-1]] = _load_callable(entry)
            else:
                close = torchloom.utils.closest_name(entry, METRICS)
                hint = f"; did you mean {close!r}?" if close else "."
                raise torchloom.ConfigError(
                    f"generate: setting 'metrics': unknown metric {entry!r}{hint} Valid: {', '.join(METRICS)}, or a "
                    "dotted path to a function (predictions, references) -> float"
                )
        return functions


def check_generate_kwargs(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse, before training, a ``generate_kwargs`` key that ``model.generate`` would refuse at the first validation
    pass: one that is neither an argument of ``generate``, nor a `transformers.GenerationConfig` setting, nor a
    keyword the model takes (transformers' own check of ``generate``, run on each remaining key alone).

    Raises:
        ConfigError: naming the key, with the closest generation setting.
    """
    import copy
    import inspect

    from transformers import GenerationConfig

    named = set(inspect.signature(model.generate).parameters) - {"kwargs", "inputs"}
    config = copy.deepcopy(getattr(model, "generation_config", None) or GenerationConfig())
    model_kwargs = config.update(**{k: v for k, v in kwargs.items() if k not in named})  # what it does not know
    validate = getattr(model, "_validate_model_kwargs", None)  # what generate() checks them with (transformers)
    if not model_kwargs or validate is None:
        return
    for key, value in model_kwargs.items():
        try:
            validate({key: value})
        except ValueError:
            settings = sorted(set(GenerationConfig().to_dict()) | named)
            close = torchloom.utils.closest_name(key, settings)
            hint = f"; did you mean {close!r}?" if close else ""
            raise torchloom.ConfigError(
                f"generate: setting 'generate_kwargs' has {key!r}, which {type(model).__name__}.generate does not "
                f"take{hint} Expected a generation setting (transformers.GenerationConfig: temperature, top_p, "
                "num_beams, use_cache, ...) or an argument of the model's forward"
            ) from None


def generate_texts(
    model: torch.nn.Module,
    prompts: Mapping[str, Any],
    tokenizer: Any,
    *,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    stop_strings: Sequence[str] = (),
    **generate_kwargs: Any,
) -> list[str]:
    """Generate after each of a batch of left-padded prompts and return the decoded new text of each.

    The model is put in eval mode (every module gets its own mode back) and runs under ``torch.no_grad``; only the
    tokens after the prompt are decoded, up to the first EOS, special tokens skipped, and cut before the first of
    ``stop_strings``.

    Args:
        model (`torch.nn.Module`): a causal LM with ``generate`` (unwrap a DDP model first).
        prompts (`Mapping`): ``input_ids`` and ``attention_mask``, left-padded (``generation`` of a batch).
        tokenizer: decodes the tokens; its pad token (else EOS) pads finished sequences.

    Raises:
        ConfigError: the prompts are right-padded (generated tokens would follow padding).
    """
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    if bool((mask[:, -1] == 0).any()):
        raise torchloom.ConfigError(
            "generate: the prompts are right-padded (the attention mask ends in 0); generation needs left padding "
            "(tokenizer.padding_side = 'left')"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            output = model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                pad_token_id=pad,
                **({"num_beams": 1} | dict(generate_kwargs)),
            )
    finally:
        for module, training in modes:
            module.train(training)
    texts = []
    eos = tokenizer.eos_token_id
    for row in output[:, ids.shape[1] :].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        texts.append(cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stop_strings))
    return texts


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest of ``stop_strings``."""
    at = min((i for s in stop_strings if (i := text.find(s)) >= 0), default=len(text))
    return text[:at]


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object, or a path or Hub id loaded with ``AutoTokenizer`` (offline: a local directory)."""
    if tokenizer is None or hasattr(tokenizer, "decode"):
        return tokenizer
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokenizer))


class Generate(torchloom.Plugin):
    """Generate from the validation prompts; log text metrics of the generations as ``val/<name>``.

    See the module docstring and ``docs/plugins/generate.md``.

    Example:

    .. code-block:: python

        data = PromptCompletionData(train, validation, tokenizer="my-tokenizer", generation=True)
        engine = torchloom.Engine(plugins={"generate": {"max_new_tokens": 16, "metrics": ["exact_match"]}})
        engine.fit(task, datamodule=data)  # engine.logged_metrics["val/exact_match"]

    Attributes:
        predictions (`list[str]`), references (`list[str]`): the last pass's texts, over all processes.
    """

    name = "generate"
    Config = GenerateConfig

    def __init__(self, config: GenerateConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.functions = self.config.functions()
        self.tokenizer: Any = None
        self._synced = False  # FSDP on several processes: generate with synced_gpus=True
        self.predictions: list[str] = []
        self.references: list[str] = []
        self._model: Any = None
        self._active = False
        self._passes = 0
        self._local: list[tuple[str, str]] = []

    @torchloom.hookimpl
    def configure_model(self, model: torch.nn.Module, task: torchloom.TaskModule, accelerator) -> None:
        if not callable(getattr(model, "generate", None)):
            raise torchloom.ConfigError(
                f"generate: the model ({type(model).__name__}) has no generate(); the plugin needs a causal LM such "
                "as a transformers *ForCausalLM model"
            )
        # FSDP2: each forward gathers the sharded parameters, a collective, so every process must run each forward
        # of a generation, also after its own sequences have ended (transformers' synced_gpus, which it sets by
        # itself only for the models it shards itself)
        self._synced = accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1
        if self._synced and self.config.generate_kwargs.get("synced_gpus", True) is not True:
            raise torchloom.ConfigError(
                "generate: generate_kwargs synced_gpus = false under FSDP: the sharded parameters are gathered in "
                "every forward, a collective, so a process that stopped generating would leave the others waiting "
                "forever; remove the setting"
            )
        source = self.config.tokenizer if self.config.tokenizer is not None else getattr(task, "tokenizer", None)
        if source is None:
            raise torchloom.ConfigError(
                f"generate: no tokenizer to decode with; set the plugin's 'tokenizer' or give {type(task).__name__} "
                "a 'tokenizer' attribute"
            )
        self.tokenizer = load_tokenizer(source)
        self._passes = 0
        check_generate_kwargs(model, self.config.generate_kwargs)

    @torchloom.hookimpl
    def on_validation_start(self, model: torch.nn.Module, accelerator) -> None:
        self._passes += 1
        self._active = (self._passes - 1) % self.config.every_n_validations == 0
        self._model = accelerator.unwrap_model(model)
        self._local = []

    def _prompts(self, batch: Any, stage: str) -> Mapping[str, Any]:
        """The batch's ``batch_key`` entry, refusing a batch without one."""
        key = self.config.batch_key
        prompts = batch.get(key) if isinstance(batch, Mapping) else None
        if not isinstance(prompts, Mapping) or "input_ids" not in prompts or "reference" not in prompts:
            keys = sorted(map(str, batch)) if isinstance(batch, Mapping) else type(batch).__name__
            raise torchloom.ConfigError(
                f"generate: the {stage} batch has no {key!r} entry with input_ids, attention_mask and reference "
                f"(it has {keys}); use PromptCompletionData or ChatData with generation=True, or set 'batch_key'"
            )
        return prompts

    def _settings(self) -> dict[str, Any]:
        config = self.config
        return {
            "max_new_tokens": config.max_new_tokens,
            "do_sample": config.do_sample,
            "stop_strings": config.stop_strings,
            **({"synced_gpus": True} if self._synced else {}),
            **config.generate_kwargs,
        }

    @torchloom.hookimpl
    def on_validation_batch_end(self, batch: Any, accelerator) -> None:
        if not self._active:
            return
        prompts = self._prompts(batch, "validation")
        texts = generate_texts(self._model, prompts, self.tokenizer, **self._settings())
        self._local.extend(zip(texts, list(prompts["reference"]), strict=True))

    @torchloom.hookimpl
    def run_predict_step(self, task: torchloom.TaskModule, model: torch.nn.Module, batch: Any, accelerator) -> Any:
        """Generations for ``predictions.jsonl`` (`predict_generations`), unless the task has its own
        ``predict_step`` or ``predict`` is off (``None``: the task's ``predict_step`` runs)."""
        if not self.config.predict or type(task).predict_step is not torchloom.TaskModule.predict_step:
            return None
        self._prompts(batch, "prediction")
        return predict_generations(
            accelerator.unwrap_model(model), batch, self.tokenizer, batch_key=self.config.batch_key, **self._settings()
        )

    @torchloom.hookimpl
    def on_validation_end(self, log, accelerator) -> None:
        if not self._active:
            return
        pairs = self._local
        if accelerator.num_processes > 1:  # process order; each sample once (the engine cut the padding copies)
            pairs = [pair for shard in gather_object([self._local]) for pair in shard]
        self.predictions = [p for p, _ in pairs]
        self.references = [r for _, r in pairs]
        self._local, self._model = [], None  # no reference to the model kept between passes
        for name, function in self.functions.items():
            value = function(list(self.predictions), list(self.references))
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise torchloom.TaskError(
                    f"generate: metric {name!r} returned {type(value).__name__} {value!r}; expected a number"
                ) from None
            log(self.config.prefix + name, number)


def predict_generations(
    model: torch.nn.Module, batch: Mapping[str, Any], tokenizer: Any, *, batch_key: str = "generation", **settings: Any
) -> dict[str, list[str]]:
    """What a ``predict_step`` returns to write generations: ``{"prompt", "generation", "reference"}``, one text
    per sample (``predictions.jsonl`` then has one line per sample with these keys).

    Args:
        model (`torch.nn.Module`): the task's model (a DDP wrapper is unwrapped).
        batch (`Mapping`): a batch with the ``batch_key`` entry (`PromptCompletionData` / `ChatData` with
            ``generation=True``).
        tokenizer: a tokenizer or its path.
        **settings: those of `generate_texts` (``max_new_tokens``, ``do_sample``, ``stop_strings`` ...).

    Example:

    .. code-block:: python

        def predict_step(self, batch, batch_idx):
            return predict_generations(self.model, batch, self.tokenizer, max_new_tokens=64)
    """
    tokenizer = load_tokenizer(tokenizer)
    prompts = batch[batch_key]
    inner = getattr(model, "module", model) if not callable(getattr(model, "generate", None)) else model
    generations = generate_texts(inner, prompts, tokenizer, **settings)
    shown = [
        tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
        for ids, mask in zip(prompts["input_ids"].tolist(), prompts["attention_mask"].tolist(), strict=True)
    ]
    return {"prompt": shown, "generation": generations, "reference": list(prompts["reference"])}
