"""`convert_hf_args`: a saved Hugging Face ``TrainingArguments`` JSON as a torchloom run config.

``torchloom convert-hf-args FILE.json [-o OUT.yaml]`` calls it. The input is what
``TrainingArguments.to_json_string()`` writes (transformers 4.46 or later; the fields transformers 5 renamed or
folded, ``evaluation_strategy`` and ``warmup_ratio``, are read too). The output is the ``engine`` and ``plugins``
sections of a run config, in the format ``torchloom fit --config`` reads, naming the built-in plugins by their
user-facing names (this module imports none of them), plus the batch sizes for the ``data`` section, which belong
to the user's `DataModule` and are written as comments. Every argument that differs from its default and has no
equivalent is listed with the reason, and so is every one that is converted with a difference.

The mapping follows what the HF Trainer does with each argument, read from transformers' ``trainer.py`` and
``trainer_optimizer.py``; docs/migrate-hf-trainer.md is the same table for people.

This module reads the input; `torchloom.tools.hf_args.mapping` holds the tables (optimizer names, trackers, the reasons
fields have no equivalent, older versions' defaults), `torchloom.tools.hf_args.fields` the conversion field by field,
and `torchloom.tools.hf_args.conversion` what it returns (`HFArgsConversion`, its YAML and its check).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from torchloom.errors import ConfigError
from torchloom.tools.hf_args.conversion import HFArgsConversion, Remark
from torchloom.tools.hf_args.fields import Converter
from torchloom.tools.hf_args.mapping import LEGACY_DEFAULTS

__all__ = ["HFArgsConversion", "Remark", "convert_hf_args"]


def convert_hf_args(training_args: str | os.PathLike[str] | Mapping[str, Any]) -> HFArgsConversion:
    """Convert Hugging Face ``TrainingArguments`` (a JSON file from ``to_json_string()``, or its dict) to torchloom
    engine and plugin settings.

    Arguments missing from the input take the default of the installed transformers. What each argument becomes
    is listed in docs/migrate-hf-trainer.md.

    Args:
        training_args (`str`, `os.PathLike` or `Mapping`): the path of the JSON file, or the parsed dict.

    Returns:
        `HFArgsConversion`: the settings, and the remarks on what was not converted or differs.

    Raises:
        ConfigError: a file that cannot be read or is not JSON, a JSON value that is not a ``TrainingArguments``
            dict, or a field with a value of the wrong type or out of range.
    """
    if isinstance(training_args, Mapping):
        source, args = "<dict>", dict(training_args)
    else:
        source = os.fspath(training_args)
        args = _read(source)
    import transformers

    return Converter(args, source, _defaults()).run(transformers.__version__)


# ------------------------------------------------------------------------------------------------- reading


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"training arguments {path!r}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"training arguments {path!r}: not a UTF-8 text file ({exc.reason})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"training arguments {path!r}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); expected "
            "what TrainingArguments.to_json_string() writes"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"training arguments {path!r}: the JSON holds a {type(value).__name__}; expected an object of "
            "TrainingArguments fields, as TrainingArguments.to_json_string() writes"
        )
    return value


def _defaults() -> dict[str, Any]:
    """Field -> default of the installed transformers' ``TrainingArguments``, then of older versions."""
    from transformers import TrainingArguments

    defaults = dict(LEGACY_DEFAULTS)
    for field in dataclasses.fields(TrainingArguments):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    try:
        from transformers.trainer_pt_utils import AcceleratorConfig

        defaults["accelerator_config"] = dataclasses.asdict(AcceleratorConfig())
    except ImportError:  # pragma: no cover - present in every supported transformers
        pass
    return defaults
