"""The files of saved weights, read without loading them: which files a saved model has (`weight_files`), what
their safetensors headers say (`header_entries`, `safetensors_summary`), and a check that each is whole
(`check_weight_files`). Only headers are read (8 bytes of length, then JSON): no tensor data, nothing that can run
code."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torchloom.errors import ConfigError

__all__ = ["WEIGHTS_INDEX", "check_weight_files", "header_entries", "safetensors_summary", "weight_files"]

#: The index of a sharded save: which shard holds each tensor.
WEIGHTS_INDEX = "model.safetensors.index.json"
#: Bytes per element of each safetensors dtype, and its torch name.
_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "C64": ("complex64", 8),
}


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a saved model: the shards its ``model.safetensors.index.json`` lists, else every
    ``*.safetensors`` file in it (sorted).

    Raises:
        ConfigError: an index that cannot be read.
    """
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot read {str(index)!r}: {exc}") from None
        return [directory / shard for shard in shards]
    return sorted(directory.glob("*.safetensors"))


def safetensors_summary(files: Iterable[Path], root: Path) -> dict[str, Any]:
    """What the headers of safetensors files say: tensors, elements and bytes, in all and per dtype.

    Only each file's header (8 bytes of length, then JSON) is read: no tensor data, nothing that can run code.
    A tensor that several names share is stored, and so counted, once.

    Raises:
        ConfigError: a file that is missing, truncated, or not safetensors.
    """
    summary: dict[str, Any] = {"files": [], "tensors": 0, "elements": 0, "bytes": 0, "dtypes": {}}
    for file in files:
        for code, shape, nbytes in header_entries(file):
            name = _DTYPES.get(code, (code.lower(), 0))[0]
            elements = math.prod(shape)
            row = summary["dtypes"].setdefault(name, {"tensors": 0, "elements": 0, "bytes": 0})
            for entry in (summary, row):
                entry["tensors"] += 1
                entry["elements"] += elements
                entry["bytes"] += nbytes
        summary["files"].append(file.relative_to(root).as_posix() if file.is_relative_to(root) else str(file))
    return summary


#: What a safetensors file is, for the messages about a file that is not one.
SAFETENSORS_LAYOUT = "a safetensors file is an 8-byte header length, a JSON header ({...}), then the tensor data"


def header_entries(file: Path) -> list[tuple[str, list[int], int]]:
    """``(dtype code, shape, bytes)`` of every tensor in a safetensors file, from its header only.

    The file's form is checked in the order it is laid out: the 8-byte header length, a JSON header after it (a
    file that is no safetensors at all, such as a text or a pickle, fails here, whatever its first 8 bytes say
    as a length), the header's length against the file's, the header's entries, and where the tensors end.

    Raises:
        ConfigError: a file that is missing, unreadable, not safetensors, with a damaged header, or truncated;
            one line naming the file and what is wrong.
    """
    shown = str(file)
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(9)
            if len(head) < 9:
                raise ConfigError(
                    f"{shown!r} is not a safetensors file: it holds {size} bytes, too few for a header "
                    f"({SAFETENSORS_LAYOUT})"
                )
            if head[8:9] != b"{":
                start = head + f.read(7)
                raise ConfigError(
                    f"{shown!r} is not a safetensors file: it starts with {start!r}, not with a header length and a "
                    f"JSON header ({SAFETENSORS_LAYOUT})"
                )
            (length,) = struct.unpack("<Q", head[:8])
            if length > size - 8:
                raise ConfigError(
                    f"{shown!r} is truncated or its header is damaged: the header length says {length} bytes, but "
                    f"the file holds {size - 8} after it"
                )
            text = head[8:] + f.read(length - 1) if length else b""
    except FileNotFoundError:
        raise ConfigError(f"weights file {shown!r} is missing") from None
    except OSError as exc:
        raise ConfigError(f"weights file {shown!r} cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(text)
    except ValueError as exc:
        problem = f"{exc.msg} at byte {8 + exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ConfigError(
            f"{shown!r} has a damaged safetensors header: its {length}-byte JSON header does not parse ({problem})"
        ) from None
    if not isinstance(header, dict):
        raise ConfigError(f"{shown!r} has a damaged safetensors header: it holds {header!r:.60}, not a JSON object")
    entries, end = [], 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, stop = (int(n) for n in entry["data_offsets"])
            entries.append((str(entry["dtype"]), [int(n) for n in entry["shape"]], stop - begin))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{shown!r} has a damaged safetensors header: tensor {key!r} is {entry!r:.80}; expected "
                '{"dtype": ..., "shape": [...], "data_offsets": [start, end]}'
            ) from None
        end = max(end, stop)
    if 8 + length + end > size:
        raise ConfigError(f"{shown!r} is truncated: its tensors end at byte {8 + length + end}, the file at {size}")
    return entries


def check_weight_files(path: Path) -> None:
    """Read the header of every weight file of an exported model (a directory, or one ``.safetensors`` file),
    so that a damaged file is reported as such before a loader reads it (`header_entries`).

    Raises:
        ConfigError: see `header_entries`; an index that cannot be read.
    """
    for file in weight_files(path) if path.is_dir() else [path]:
        header_entries(file)
