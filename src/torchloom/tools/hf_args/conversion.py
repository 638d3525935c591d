"""What `torchloom.convert_hf_args` returns: the converted settings (`HFArgsConversion`), each remark on an argument
(`Remark`), the run config as commented YAML and the check that it loads."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import yaml

from torchloom.errors import TorchloomError

__all__ = ["HFArgsConversion", "Remark"]


@dataclasses.dataclass(frozen=True)
class Remark:
    """One argument the conversion could not carry over, or carried over with a difference.

    Attributes:
        field (`str`): the ``TrainingArguments`` field.
        value (`Any`): its value in the JSON.
        reason (`str`): why, and what to do instead.
    """

    field: str
    value: Any
    reason: str

    def line(self) -> str:
        return f"{self.field} = {self.value!r}: {self.reason}"


@dataclasses.dataclass
class HFArgsConversion:
    """A ``TrainingArguments`` JSON converted to torchloom settings (see `convert_hf_args`).

    Attributes:
        engine (`dict`): `EngineConfig` fields.
        plugins (`dict`): plugin name -> settings, in the order to enable them.
        data (`dict`): settings of the built-in data modules (``batch_size``, ``eval_batch_size``,
            ``num_workers``), per process as the Trainer's ``per_device_*`` sizes are; a `DataModule` of your own
            takes them under its own names.
        not_converted (`list[Remark]`): arguments with no equivalent, and why.
        differences (`list[Remark]`): arguments converted, with how the result differs.
        source (`str`): where the arguments came from.
        transformers_version (`str`): the transformers that read them (its fields and defaults).
    """

    engine: dict[str, Any]
    plugins: dict[str, dict[str, Any]]
    data: dict[str, Any]
    not_converted: list[Remark]
    differences: list[Remark]
    source: str
    transformers_version: str

    def config(self) -> dict[str, Any]:
        """The run config: ``{"engine": ..., "plugins": ...}``."""
        return {"engine": dict(self.engine), "plugins": {k: dict(v) for k, v in self.plugins.items()}}

    def to_yaml(self) -> str:
        """The run config as YAML, after comments that say what was not converted, what differs, and where the
        batch sizes go."""
        lines = _comment(
            f"torchloom run config converted by `torchloom convert-hf-args` from {self.source} (TrainingArguments, "
            f"read with transformers {self.transformers_version}). Add your task and data: torchloom fit --config "
            "task.yaml --config THIS_FILE",
            indent="# ",
            more="# ",
        )
        for title, remarks in (
            ("Not converted: no torchloom setting does this", self.not_converted),
            ("Converted with a difference", self.differences),
        ):
            if remarks:
                lines += ["#", f"# {title} ({len(remarks)}):"]
                for remark in remarks:
                    lines += _comment(remark.line(), indent="#   ", more="#       ")
        if self.data:
            flow = ", ".join(f"{k}: {_scalar(v)}" for k, v in self.data.items())
            options = " ".join(f"--data.init_args.{k}={_scalar(v)}" for k, v in self.data.items())
            lines += [
                "#",
                "# Data: the Trainer's per_device_* batch sizes are per process, as a DataModule's are. Set them in",
                "# your data section (torchloom.data's TextClassificationData, ImageClassificationData and",
                "# AudioClassificationData take these names):",
                "#   data:",
                "#     class_path: ...",
                f"#     init_args: {{{flow}}}",
                f"# or on the command line: {options}",
            ]
        lines.append("engine:")
        lines += [f"  {key}: {_scalar(value)}" for key, value in self.engine.items()]
        lines.append("plugins:" if self.plugins else "plugins: {}")
        for name, settings in self.plugins.items():
            lines.append(f"  {name}:" if settings else f"  {name}: {{}}")
            lines += [f"    {key}: {_scalar(value)}" for key, value in settings.items()]
        return "\n".join(lines) + "\n"

    def check(self) -> str | None:
        """Load the config as ``torchloom fit`` does (engine settings checked, each plugin imported and its settings
        validated by its own settings class, the plugins composed); return the error, or ``None``."""
        from torchloom.config import EngineConfig
        from torchloom.engine import Engine

        try:
            Engine(EngineConfig.from_settings(dict(self.engine)), plugins=self.config()["plugins"]).hook_order()
        except TorchloomError as exc:
            return " ".join(str(exc).split())
        return None


# ------------------------------------------------------------------------------------------------ YAML


def _comment(text: str, indent: str, more: str) -> list[str]:
    return textwrap.wrap(text, width=116, initial_indent=indent, subsequent_indent=more, break_on_hyphens=False)


def _scalar(value: Any) -> str:
    """``value`` as YAML on one line (lists and mappings in flow style)."""
    return str(yaml.safe_dump(value, default_flow_style=True, width=10**9)).removesuffix("\n...\n").strip()
