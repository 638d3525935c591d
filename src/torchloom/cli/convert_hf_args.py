"""``torchloom convert-hf-args FILE [-o OUT]``: a saved HF ``TrainingArguments`` JSON as a run config."""

from __future__ import annotations

import sys
from typing import Any

import torchloom
from torchloom import ConfigError

__all__ = ["HELP", "parser", "run"]

HELP = "convert HF TrainingArguments JSON to a run config"


def parser() -> Any:
    from jsonargparse import ArgumentParser

    sub = ArgumentParser(description="Turn a saved HF TrainingArguments JSON into a run config (engine, plugins)")
    sub.add_argument("file", type=str, help="a JSON file written by TrainingArguments.to_json_string()")
    sub.add_argument("-o", "--output", type=str | None, default=None, help="write the YAML here, not to stdout")
    return sub


def run(parser: Any, cfg: Any) -> int:
    """``torchloom convert-hf-args FILE [-o OUT]``: the run config `torchloom.convert_hf_args` makes, on stdout or in
    OUT; on stderr, what was not converted (all of it with ``-o``) and whether the config loads here."""
    conversion = torchloom.convert_hf_args(cfg.file)
    text, problem = conversion.to_yaml(), conversion.check()
    skipped, differ = conversion.not_converted, conversion.differences
    counts = f"{len(skipped)} argument{'s' * (len(skipped) != 1)} not converted, {len(differ)} with a difference"
    if cfg.output is None:
        sys.stdout.write(text)
        print(f"torchloom convert-hf-args: {counts} (listed in the comments at the top)", file=sys.stderr)
    else:
        try:
            with open(cfg.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise ConfigError(f"-o {cfg.output!r}: cannot write it: {exc.strerror or exc}") from None
        print(f"torchloom convert-hf-args: wrote {cfg.output}; {counts}", file=sys.stderr)
        for title, remarks in (("not converted", skipped), ("converted with a difference", differ)):
            for remark in remarks:
                print(f"  {title}: {remark.line()}", file=sys.stderr)
    if problem is not None:
        print(f"torchloom convert-hf-args: warning: the config does not load here: {problem}", file=sys.stderr)
    return 0
