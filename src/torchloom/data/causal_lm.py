"""Causal-LM data on `CachedDataModule`: plain text, prompt / completion pairs and chat, with loss masks,
explicit truncation and optional packing.

Three data modules share one pipeline (`CausalLMData`): a subclass turns each raw row into ``input_ids`` and
``labels`` (``-100`` where no loss is taken), the base fits the rows to ``max_length`` (``truncation``: refuse,
drop or cut them, counted and logged once), packs them when ``packing=True`` (`pack_best_fit`) and stores them in
the processed-dataset cache; batches come from `CausalLMCollator` with ``num_items``, the number of tokens the
loss averages over (``labels[:, 1:] != -100``, after transformers' shift by one):

- `LanguageModelingData`: a text column, one sequence per document, or (``concatenate=True``) every document
  joined and cut into blocks of ``max_length``; every token but a sequence's first is a loss token;
- `PromptCompletionData`: a prompt and a completion column; ``completion_only=True`` (default) takes the loss on
  the completion only;
- `ChatData`: a column of messages (``role``, ``content``) rendered with the tokenizer's chat template (or
  ``chat_template``); ``assistant_only=True`` (default) takes the loss on the assistant messages only, found by
  rendering the conversation prefix by prefix.

A training step passes the batch without ``num_items`` to the model and returns the count, which the engine's
logging and the ``grad_accum`` plugin's ``tokens`` normalisation use:

.. code-block:: python

    def training_step(self, batch, batch_idx):
        num_items = batch.pop("num_items")
        return {"loss": self.model(**batch).loss, "num_items": num_items}
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import datasets

from torchloom._settings import invalid
from torchloom.data.packing import IGNORE_INDEX, CausalLMCollator, check_packed_attention, pack_best_fit
from torchloom.data.tables import require_column
from torchloom.data.text import TextData, tokenizer_fingerprint
from torchloom.errors import ConfigError

__all__ = ["CausalLMData", "LanguageModelingData", "PromptCompletionData"]

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "drop", "truncate_end", "truncate_prompt")


def excerpt(text: str, size: int = 40) -> str:
    """``repr`` of ``text``, cut to ``size`` characters (ending in ``...``), for error messages."""
    return repr(text if len(text) <= size else text[: size - 3] + "...")


class CausalLMData(TextData):
    """The pipeline of the causal-LM data modules: rows to token sequences, ``max_length``, packing, batches.

    A subclass implements ``encode(row, index, name)``, returning ``(input_ids, labels, prompt_length)`` for one
    raw row (``prompt_length``: how many leading tokens are prompt, which ``truncation="truncate_prompt"`` may
    cut), and ``format_settings()``, its settings for the cache key.

    Args:
        train: the training table, as for `TextData` (a path, a `pandas.DataFrame`, a `datasets.Dataset`).
        validation (*optional*): the validation table, same kinds.
        tokenizer (`str` or `os.PathLike`): a local model/tokenizer directory or a Hub id.
        max_length (`int`, defaults to 512): the most tokens in a row (a packed row holds several sequences).
        truncation (`str`, defaults to ``"error"``): a sequence longer than ``max_length``: ``"error"`` refuses it
            (before training, naming the row), ``"drop"`` leaves it out, ``"truncate_end"`` cuts its end (never into
            a prompt), ``"truncate_prompt"`` cuts the start of its prompt (prompt / completion data only). Dropped and
            cut rows are counted and logged once per split, when the split is processed.
        packing (`bool`, defaults to False): pack sequences into rows of ``max_length``, best-fit decreasing, with
            ``position_ids`` restarting at every sequence; see `check_packed_attention` for the model side.
        append_eos (`bool`, defaults to True): end every sequence (a document, a completion) with the tokenizer's
            EOS token, where it has one (chat sequences end as the template renders them).
        add_bos (`bool`, defaults to True): start every sequence (a document, a prompt) with the tokenizer's BOS
            token, where it has one (Llama's and Mistral's do; chat sequences start as the template renders them).
        pad_to_multiple_of (`int`, *optional*): pad each batch's length up to a multiple of this.
        generation (`bool`, defaults to False): prompt / completion and chat data only: also store each validation
            row's prompt alone and its reference completion text, and give every validation (and predict) batch a
            ``generation`` entry, ``{"input_ids", "attention_mask"}`` (the prompts, left-padded) and
            ``"reference"`` (the texts), for the ``generate`` plugin. A ``validation_step`` pops it, as it pops
            ``num_items``. With ``packing``, only the training split is packed (a packed row would hold several
            prompts): the validation rows stay one sequence each, and ``packing_efficiency`` has no validation entry.
        **settings: the settings of `TextData` and `CachedDataModule` (``batch_size``, ``shuffle``, ``cache_dir``
            ...). ``group_by_length`` (defaults to False) batches training sequences of similar length together
            (the HF Trainer's setting; see `TextData`); it is refused with ``packing=True`` (and
            ``concatenate=True``), whose rows all have about ``max_length`` tokens.

    Attributes:
        overlong (`dict[str, int]`): after processing, by split: the rows longer than ``max_length``.
        packing_efficiency (`dict[str, float]`): after ``setup``, packed splits: real tokens / (rows x max_length).
    """

    kind: ClassVar[str] = "torchloom.data.causal_lm.CausalLMData"
    #: Whether the rows have a prompt that ``truncation="truncate_prompt"`` may cut.
    has_prompt: ClassVar[bool] = False
    #: Whether the rows have a prompt to generate after (``generation``; `prompt_and_reference`).
    can_generate: ClassVar[bool] = False

    def __init__(
        self,
        train: str | os.PathLike[str] | Any | None = None,
        validation: str | os.PathLike[str] | Any | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        max_length: int = 512,
        truncation: str = "error",
        packing: bool = False,
        append_eos: bool = True,
        add_bos: bool = True,
        pad_to_multiple_of: int | None = None,
        generation: bool = False,
        **settings: Any,
    ) -> None:
        owner = type(self).__name__
        self.check_count("max_length", max_length)
        if max_length < 2:
            raise invalid(
                "max_length", max_length, "an integer >= 2 (a loss token needs a token before it)", owner=owner
            )
        valid = TRUNCATIONS if self.has_prompt else TRUNCATIONS[:3]
        if truncation not in valid:
            raise invalid("truncation", truncation, f"one of {', '.join(map(repr, valid))}", owner=owner)
        for name, flag in (
            ("packing", packing), ("append_eos", append_eos), ("add_bos", add_bos), ("generation", generation)
        ):  # fmt: skip
            if not isinstance(flag, bool):
                raise invalid(name, flag, "true or false", owner=owner)
        if packing and settings.get("group_by_length"):
            raise invalid(
                "group_by_length", True, "false with packing=True (packed rows are all about max_length)", owner=owner
            )
        if generation and not self.can_generate:
            raise invalid("generation", True, "false: only prompt / completion and chat data have prompts", owner=owner)
        self.check_count("pad_to_multiple_of", pad_to_multiple_of, optional=True)
        super().__init__(train, validation, tokenizer=tokenizer, label_column=None, **settings)
        self.max_length, self.truncation, self.packing = max_length, truncation, packing
        self.append_eos, self.add_bos, self.pad_to_multiple_of = append_eos, add_bos, pad_to_multiple_of
        self.generation = generation
        self.overlong: dict[str, int] = {}
        self.packing_efficiency: dict[str, float] = {}

    # -------------------------------------------------------------------------------- what a subclass adds

    def encode(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], list[int], int]:
        """Return ``(input_ids, labels, prompt_length)`` for one raw row (``labels[0]`` is set to -100 after)."""
        raise NotImplementedError

    def format_settings(self) -> dict[str, Any]:
        """The subclass's settings for the cache key (columns, masks, template)."""
        return {}

    def required_columns(self) -> dict[str, str]:
        """The columns every split must have, by the setting that names them (while `predicting`, those that hold
        labels, a completion, are left out: rows to predict on may lack them)."""
        return {}

    def prompt_and_reference(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], str]:
        """``(prompt_ids, reference)`` of one raw row, for ``generation``: the tokens a model generates after, and
        the text it should generate (subclasses with ``can_generate``)."""
        raise NotImplementedError

    def sequences(self, split: str, table: datasets.Dataset) -> list[tuple[list[int], list[int], int]]:
        """The encoded rows of ``split`` (`encode`), one sequence each; `LanguageModelingData` overrides it (its
        blocks; while `predicting`, one sequence per document too)."""
        return [self.encode(row, i, self.split_name(split)) for i, row in enumerate(table)]

    # ----------------------------------------------------------------------------------------- the pipeline

    def eos(self) -> list[int]:
        """The EOS token to end a sequence with, as a list (empty without one or with ``append_eos=False``)."""
        eos = self.tokenizer.eos_token_id
        return [eos] if self.append_eos and eos is not None else []

    def bos(self) -> list[int]:
        """The BOS token to start a sequence with, as a list (empty without one or with ``add_bos=False``)."""
        bos = self.tokenizer.bos_token_id
        return [bos] if self.add_bos and bos is not None else []

    def cache_settings(self) -> dict[str, Any]:
        """The raw tables, the tokenizer (`tokenizer_fingerprint`), the format's settings (columns, masks, the chat
        template), ``max_length``, truncation, packing and the library versions; its `cache_key` names the entry."""
        return {
            "kind": self.kind,
            **self.source_settings(),
            "tokenizer": tokenizer_fingerprint(self.tokenizer, self.tokenizer_revision),
            **self.format_settings(),
            "max_length": self.max_length,
            "truncation": self.truncation,
            "packing": self.packing,
            "append_eos": self.append_eos,
            "add_bos": self.add_bos,
            "generation": self.generation,
            "versions": self.versions(),
        }

    def preprocess(self, split: str, table: datasets.Dataset) -> datasets.Dataset:
        """Encode, fit to ``max_length`` and (``packing``) pack the rows of ``split``."""
        name = self.split_name(split)
        for setting, column in self.required_columns().items():
            require_column(table, column, setting, name)
        fitted, overlong, longest, kept = [], 0, 0, []
        for index, (ids, labels, prompt) in enumerate(self.sequences(split, table)):
            if len(ids) > self.max_length:
                overlong, longest = overlong + 1, max(longest, len(ids))
            row = self.fit(ids, labels, prompt, index, name)
            if row is not None:
                fitted.append(row)
                kept.append(index)
        self.overlong[split] = overlong
        if overlong:
            action = {
                "drop": "dropped",
                "truncate_end": "cut at the end",
                "truncate_prompt": "cut at the prompt's start",
            }
            logger.warning(
                "%s: %d of %d rows were longer than max_length=%d (the longest: %d tokens): %s (truncation=%r)",
                name, overlong, len(table), self.max_length, longest, action[self.truncation], self.truncation,
            )  # fmt: skip
        if not fitted:  # every row was dropped for being longer than max_length (an empty table is refused before)
            raise ConfigError(
                f"{name}: no row is left: all {len(table)} rows are longer than max_length={self.max_length} (the "
                f"longest: {longest} tokens) and truncation='drop' leaves them out; raise max_length, or set "
                "truncation to 'truncate_end'"
            )
        if not self.packed(split):
            columns: dict[str, list[Any]] = {"input_ids": [r[0] for r in fitted], "labels": [r[1] for r in fitted]}
        else:
            columns = {"input_ids": [], "labels": [], "position_ids": []}
            for group in pack_best_fit([len(r[0]) for r in fitted], self.max_length):
                columns["input_ids"].append([t for i in group for t in fitted[i][0]])
                columns["labels"].append([t for i in group for t in fitted[i][1]])
                columns["position_ids"].append([p for i in group for p in range(len(fitted[i][0]))])
        columns["length"] = [len(ids) for ids in columns["input_ids"]]
        if self.generation and split == "validation":  # the prompt alone (not cut) and the reference text
            pairs = [self.prompt_and_reference(table[i], i, name) for i in kept]
            columns["prompt_ids"] = [p for p, _ in pairs]
            columns["reference"] = [r for _, r in pairs]
        return datasets.Dataset.from_dict(columns)

    def packed(self, split: str) -> bool:
        """Whether ``split``'s rows are packed: with ``packing``, every split but a generating validation split, and
        never rows to predict on (`predicting`: each row of the input is one prediction, in order)."""
        return self.packing and not self.predicting and not (self.generation and split == "validation")

    def fit(
        self, ids: list[int], labels: list[int], prompt: int, index: int, name: str
    ) -> tuple[list[int], list[int]] | None:
        """One sequence fitted to ``max_length`` by ``truncation`` (``None``: dropped), its first label -100.

        While `predicting`, a row may have no loss token (a prompt without a reply), and none is dropped: a row
        that ``truncation="drop"`` would leave out is refused, since every row of the input gets a prediction; and a
        prompt without a reply is never cut at its end (where the reply starts).

        Raises:
            ConfigError: ``truncation="error"`` and the row is too long; a prompt as long as ``max_length`` that
                cannot be cut; a completion longer than ``max_length`` under ``truncate_prompt``; no loss token left
                (but while `predicting`); an overlong row to predict on that would be dropped or cut at its end.
        """
        n, limit = len(ids), self.max_length
        if n > limit:
            if self.truncation == "error":
                options = "'drop', 'truncate_end'" + (" or 'truncate_prompt'" if self.has_prompt else "")
                if self.predicting:
                    options = "'truncate_end'" + (" or 'truncate_prompt'" if self.has_prompt else "")
                raise ConfigError(
                    f"{name}: row {index} has {n} tokens, more than max_length={limit}; raise max_length or set "
                    f"truncation to {options}"
                )
            if self.predicting and (self.truncation == "drop" or (prompt >= n and self.truncation == "truncate_end")):
                what = (
                    "truncation='drop' would leave it out, and every row to predict on gets a prediction"
                    if self.truncation == "drop"
                    else "it is a prompt without a reply, which truncation='truncate_end' would cut where the reply "
                    "starts"
                )
                other = "'truncate_prompt'" if self.has_prompt else "'truncate_end'"
                raise ConfigError(
                    f"{name}: row {index} has {n} tokens, more than max_length={limit}, and {what}; raise max_length"
                    + (f" or set truncation to {other}" if self.truncation == "drop" or self.has_prompt else "")
                )
            if self.truncation == "drop":
                return None
            if self.truncation == "truncate_end":
                if prompt >= limit:
                    raise ConfigError(
                        f"{name}: max_length={limit} is below the prompt of row {index} ({prompt} tokens), and "
                        "truncation='truncate_end' does not cut prompts, so its completion would be empty; raise "
                        "max_length, or set truncation='truncate_prompt' or 'drop'"
                    )
                ids, labels = ids[:limit], labels[:limit]
            else:  # truncate_prompt
                if n - prompt >= limit:
                    raise ConfigError(
                        f"{name}: the completion of row {index} has {n - prompt} tokens, leaving no room for a prompt "
                        f"token within max_length={limit}; raise max_length, or set truncation='drop' or "
                        "'truncate_end'"
                    )
                ids, labels = ids[n - limit :], labels[n - limit :]
        labels = [IGNORE_INDEX, *labels[1:]]
        if not self.predicting and all(label == IGNORE_INDEX for label in labels):
            if n > limit:  # its loss tokens were all past max_length: a longer one keeps them
                raise ConfigError(
                    f"{name}: row {index} has no loss token after truncation to max_length={limit} (its {n} tokens' "
                    "loss tokens were all cut off); raise max_length, or set truncation='drop'"
                )
            raise ConfigError(f"{name}: row {index} has no loss token (an empty completion or reply?)")
        return ids, labels

    def setup(self, stage: str) -> None:
        """Load the splits (`CachedDataModule.setup`); for packed splits, log the packing efficiency."""
        super().setup(stage)
        self._stage = stage
        for split, dataset in (("train", self.train_dataset), ("validation", self.val_dataset)):
            if self.packed(split) and dataset is not None and len(dataset):
                real = sum(dataset["length"])
                self.packing_efficiency[split] = efficiency = real / (len(dataset) * self.max_length)
                logger.info(
                    "%s: packing: %d tokens in %d rows of max_length=%d: efficiency %.1f%% (real / computed tokens)",
                    self.split_name(split), real, len(dataset), self.max_length, 100 * efficiency,
                )  # fmt: skip

    def fit_log_values(self) -> dict[str, float]:
        """``data/train_packing_efficiency`` (real tokens / (rows x max_length) of the packed training split, a
        fraction in (0, 1]) when the training split is packed; else nothing. Logged once per fit
        (`torchloom.DataModule.fit_log_values`)."""
        efficiency = self.packing_efficiency.get("train")
        return {} if efficiency is None else {"data/train_packing_efficiency": efficiency}

    def collator(self) -> CausalLMCollator:
        """The batch collator (`CausalLMCollator`), padding with the tokenizer's pad (else EOS, else 0) token."""
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return CausalLMCollator(pad if pad is not None else 0, self.pad_to_multiple_of)

    def collate_fn(self, split: str) -> CausalLMCollator:
        """`collator`, for training and validation alike; with ``generation``, the validation batches also get the
        ``generation`` entry (the left-padded prompts and the reference texts)."""
        collator = self.collator()
        collator.generation = self.generation and split == "validation"
        return collator

    def check_model(self, model: Any) -> None:
        """With ``packing=True``, refuse a model whose attention would mix packed sequences
        (`check_packed_attention`); the engine calls it after ``configure_model``. Does nothing without packing, or
        when the stage of the last ``setup`` serves no packed row: a validation or prediction whose validation split
        is not packed (``generation``), or a prediction on `set_predict_input`'s rows (never packed)."""
        stage = getattr(self, "_stage", "fit")
        if stage == "fit":
            packed = self.packing
        elif stage == "predict" and self.predict_input is not None:
            packed = False
        else:
            packed = self.packed("validation")
        if packed:
            check_packed_attention(model)

    def text(self, row: dict[str, Any], column: str, index: int, name: str, allow_empty: bool = False) -> str:
        """The string in ``row[column]``, refusing a missing, non-string or (unless ``allow_empty``) empty value."""
        value = row[column]
        if not isinstance(value, str) or (not value and not allow_empty):
            what = "empty" if value == "" else f"{type(value).__name__} {value!r}"
            raise ConfigError(f"{name}: column {column!r} in row {index} is {what}; expected a non-empty string")
        return value

    def tokens(self, text: str) -> list[int]:
        """``text`` tokenised without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def content_tokens(self, row: dict[str, Any], column: str, index: int, name: str) -> list[int]:
        """The tokens of the text a loss is taken on (a document, a completion): `text`, refusing one the tokenizer
        turns into no token at all (whitespace, characters it drops), which would leave only BOS / EOS to train on.
        """
        value = self.text(row, column, index, name)
        ids = self.tokens(value)
        if not ids:
            raise ConfigError(
                f"{name}: column {column!r} in row {index} is {excerpt(value)}, which the tokenizer turns into no "
                "token, so only the special tokens around it would be trained on; expected text with words"
            )
        return ids


class LanguageModelingData(CausalLMData):
    """Plain text for language modelling: every token of a document (but its first) is a loss token.

    Args:
        text_column (`str`, defaults to ``"text"``): the documents.
        concatenate (`bool`, defaults to False): join every document (each ended by EOS) and cut the stream into
            blocks of ``max_length`` tokens; the last, partial block is left out (logged). Without it, each document
            is a sequence, fitted by ``truncation``.
        **settings: those of `CausalLMData` and `CachedDataModule`.
    """

    kind = "torchloom.data.causal_lm.LanguageModelingData"

    def __init__(
        self,
        train: Any = None,
        validation: Any = None,
        *,
        text_column: str = "text",
        concatenate: bool = False,
        **settings: Any,
    ) -> None:
        self.check_column("text_column", text_column)
        if not isinstance(concatenate, bool):
            raise invalid("concatenate", concatenate, "true or false", owner=type(self).__name__)
        if concatenate and settings.get("packing"):
            raise invalid(
                "packing", True, "false with concatenate=True (blocks are full already)", owner=type(self).__name__
            )
        if concatenate and settings.get("group_by_length"):
            raise invalid(
                "group_by_length",
                True,
                "false with concatenate=True (every block has max_length tokens)",
                owner=type(self).__name__,
            )
        super().__init__(train, validation, **settings)
        self.text_column, self.concatenate = text_column, concatenate

    def required_columns(self) -> dict[str, str]:
        return {"text_column": self.text_column}

    def format_settings(self) -> dict[str, Any]:
        return {"text_column": self.text_column, "concatenate": self.concatenate}

    def encode(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], list[int], int]:
        ids = self.bos() + self.content_tokens(row, self.text_column, index, name) + self.eos()
        return ids, list(ids), 0

    def sequences(self, split: str, table: datasets.Dataset) -> list[tuple[list[int], list[int], int]]:
        """With ``concatenate``, the blocks of ``max_length`` tokens the documents make, joined (the last, partial
        block left out, logged); while `predicting`, one sequence per document (one prediction per row).

        Raises:
            ConfigError: ``concatenate`` and the split's tokens are fewer than one block (lower ``max_length``, or
                add data).
        """
        if not self.concatenate or self.predicting:
            return super().sequences(split, table)
        name = self.split_name(split)
        stream = [t for i, row in enumerate(table) for t in self.encode(row, i, name)[0]]
        size = self.max_length
        if len(stream) < size:
            raise ConfigError(
                f"{name}: concatenate=True: its {len(table)} rows make {len(stream)} tokens, fewer than one block of "
                f"max_length={size}, so no block is left; lower max_length to at most {len(stream)}, or add data"
            )
        if len(stream) % size:
            logger.warning(
                "%s: concatenate=True: the last %d tokens (less than a block of max_length=%d) are left out",
                self.split_name(split), len(stream) % size, size,
            )  # fmt: skip
        blocks = [stream[at : at + size] for at in range(0, len(stream) - size + 1, size)]
        return [(block, list(block), 0) for block in blocks]


class PromptCompletionData(CausalLMData):
    """Prompt / completion pairs: the sequence is (BOS and) the prompt's tokens, then the completion's (and EOS).

    Args:
        prompt_column (`str`, defaults to ``"prompt"``): the prompt texts.
        completion_column (`str`, defaults to ``"completion"``): the completion texts (none may be empty).
        completion_only (`bool`, defaults to True): take the loss on the completion only (the prompt's labels are
            -100); False: on every token.
        **settings: those of `CausalLMData` (``truncation="truncate_prompt"`` cuts the start of the prompt).
    """

    kind = "torchloom.data.causal_lm.PromptCompletionData"
    has_prompt = True
    can_generate = True

    def __init__(
        self,
        train: Any = None,
        validation: Any = None,
        *,
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        completion_only: bool = True,
        **settings: Any,
    ) -> None:
        self.check_column("prompt_column", prompt_column)
        self.check_column("completion_column", completion_column)
        if not isinstance(completion_only, bool):
            raise invalid("completion_only", completion_only, "true or false", owner=type(self).__name__)
        super().__init__(train, validation, **settings)
        self.prompt_column, self.completion_column = prompt_column, completion_column
        self.completion_only = completion_only

    def required_columns(self) -> dict[str, str]:
        if self.predicting:  # prompts without a completion are predicted on
            return {"prompt_column": self.prompt_column}
        return {"prompt_column": self.prompt_column, "completion_column": self.completion_column}

    def unanswered(self, row: dict[str, Any]) -> bool:
        """While `predicting`: whether ``row`` is a prompt alone (no completion column, or its value null or "")."""
        return self.predicting and row.get(self.completion_column) in (None, "")

    def format_settings(self) -> dict[str, Any]:
        return {"columns": [self.prompt_column, self.completion_column], "completion_only": self.completion_only}

    def encode(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], list[int], int]:
        """``(BOS, prompt, completion, EOS)``, the labels masked on the prompt with ``completion_only``. While
        `predicting`, a row without a completion is (BOS and) its prompt alone, with no loss token.

        Raises:
            ConfigError: the completion is missing, not a string, empty or makes no token; a prompt to predict on
                that makes no token.
        """
        prompt = self.bos() + self.tokens(self.text(row, self.prompt_column, index, name, allow_empty=True))
        if self.unanswered(row):
            if not prompt:
                raise ConfigError(
                    f"{name}: row {index} has an empty prompt and no completion, so there is nothing to predict on; "
                    f"expected a non-empty {self.prompt_column!r}"
                )
            return prompt, [IGNORE_INDEX] * len(prompt), len(prompt)
        completion = self.content_tokens(row, self.completion_column, index, name) + self.eos()
        masked = [IGNORE_INDEX] * len(prompt) if self.completion_only else list(prompt)
        return prompt + completion, masked + completion, len(prompt)

    def prompt_and_reference(self, row: dict[str, Any], index: int, name: str) -> tuple[list[int], str]:
        """The prompt's tokens, as in `encode` (BOS first), and the completion text ("" for a prompt to predict on
        without one)."""
        prompt = self.bos() + self.tokens(self.text(row, self.prompt_column, index, name, allow_empty=True))
        if self.unanswered(row):
            return prompt, ""
        return prompt, self.text(row, self.completion_column, index, name)
