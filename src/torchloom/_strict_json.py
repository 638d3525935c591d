"""Strict JSON: the one encoding of non-finite floats in every JSON file torchloom writes.

JSON (RFC 8259) has no NaN or infinity; Python's `json` writes the JavaScript literals ``NaN`` / ``Infinity``,
which most other readers refuse. torchloom writes a non-finite float as the *string* ``"NaN"``, ``"Infinity"``
or ``"-Infinity"`` instead (what ``float()`` reads back), in every file a user reads: ``metrics.jsonl``,
``summary.json``, ``predictions.jsonl``, the model card, a checkpoint's ``manifest.json`` and what
``torchloom inspect --json`` prints. `json_dumps` is the public writer (plugins write their files with it);
`encode` is the same conversion on a tree, for a caller that serialises it itself.

The plugin-state format (`torchloom.checkpoint.plugin_state`) must tell a float NaN from a state's string ``"NaN"`` when
it loads, so it wraps the same name in a one-key tag, ``{"__float__": "NaN"}``: `tag` and `untag`, here, are the only
code that writes or reads that tag's name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["FLOAT_TAG", "NONFINITE", "encode", "is_tag", "json_dumps", "nonfinite_name", "read_number", "tag", "untag"]

#: The name of each non-finite float, as torchloom writes it (the string), and the float it stands for.
NONFINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
#: The key of the one-key dict that stands for a non-finite float where a bare string would be ambiguous.
FLOAT_TAG = "__float__"


def nonfinite_name(value: float) -> str:
    """``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` for a non-finite ``value`` (its sign of NaN is not kept)."""
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def encode(value: Any) -> Any:
    """``value`` with every non-finite float (a ``numpy.float64`` too) replaced by its name; mapping keys become
    ``str`` and tuples lists, as `json` writes them; every other value is returned as it is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else nonfinite_name(value)
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    return value


def json_dumps(value: Any, **kwargs: Any) -> str:
    """The strict JSON text of ``value``: a non-finite float is the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"`` (as in ``metrics.jsonl``; ``float()`` reads it back), never the invalid literal ``NaN``.

    Keyword arguments go to `json.dumps` (``indent``, ``sort_keys``, ``default``, ...); ``allow_nan`` is always
    ``False``, so a non-finite number that ``default`` returns is a `ValueError`, not invalid JSON.

    Example: ``torchloom.utils.json_dumps({"loss": float("nan")})`` is ``'{"loss": "NaN"}'``; a plugin writes its own
    file with ``torchloom.utils.write_atomically(path, torchloom.utils.json_dumps(data, indent=2) + "\\n")``.
    """
    kwargs["allow_nan"] = False
    return json.dumps(encode(value), **kwargs)


def read_number(value: Any) -> Any:
    """What `encode` wrote, read back for one value: a non-finite float's name becomes the float again; any other
    value is returned as it is (so a logged string that happens to be ``"NaN"`` reads as a float: a file that
    must keep the two apart tags its floats, `tag`)."""
    return NONFINITE[value] if isinstance(value, str) and value in NONFINITE else value


def tag(value: float) -> dict[str, str]:
    """The tagged form of a non-finite float, ``{"__float__": "NaN" | "Infinity" | "-Infinity"}``."""
    return {FLOAT_TAG: nonfinite_name(value)}


def untag(node: Mapping[str, Any], names: Mapping[str, float] = NONFINITE) -> float:
    """The float a `tag` stands for; ``names`` maps each accepted name to its float (an older format's spelling).

    Raises:
        ValueError: the tag names no non-finite float; the message lists the accepted names.
    """
    name = node[FLOAT_TAG]
    if not isinstance(name, str) or name not in names:
        raise ValueError(
            f"the float {name!r}; expected {', '.join(map(repr, list(names)[:-1]))} or {list(names)[-1]!r}"
        )
    return names[name]


def is_tag(node: Any) -> bool:
    """Whether ``node`` is a dict of the one key of `tag` (what a plugin state may not hold itself)."""
    return isinstance(node, dict) and len(node) == 1 and FLOAT_TAG in node
