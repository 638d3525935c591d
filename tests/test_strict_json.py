"""Strict JSON (`torchloom._strict_json`, public as `torchloom.utils.json_dumps`): one spelling of non-finite floats in
every JSON file torchloom writes, and no writer of a JSON file that goes around it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

import torchloom
from torchloom import _strict_json

ROOT = Path(__file__).resolve().parents[1]


def test_non_finite_floats_are_their_names_at_any_depth():
    value = {"a": math.nan, "b": [math.inf, (-math.inf, 1.5)], 3: {"c": np.float64("nan")}, "d": "NaN", "e": None}
    text = torchloom.utils.json_dumps(value, sort_keys=True)
    assert json.loads(text, parse_constant=pytest.fail) == {
        "3": {"c": "NaN"},
        "a": "NaN",
        "b": ["Infinity", ["-Infinity", 1.5]],
        "d": "NaN",
        "e": None,
    }


def test_read_number_reads_the_names_back():
    assert [_strict_json.read_number(v) for v in ("Infinity", "-Infinity", 2, "x")] == [math.inf, -math.inf, 2, "x"]
    assert math.isnan(_strict_json.read_number("NaN"))


def test_default_cannot_smuggle_a_nan_literal_in():
    with pytest.raises(ValueError):
        torchloom.utils.json_dumps({"x": object()}, default=lambda o: math.nan)


def test_the_tag_round_trips_and_names_what_is_valid():
    for x in (math.inf, -math.inf):
        assert _strict_json.untag(_strict_json.tag(x)) == x
    assert _strict_json.tag(math.nan) == {"__float__": "NaN"} and _strict_json.is_tag({"__float__": "NaN"})
    with pytest.raises(ValueError, match="expected 'NaN', 'Infinity' or '-Infinity'"):
        _strict_json.untag({"__float__": "nan"})


def test_no_json_file_is_written_around_the_strict_writer():
    """Outside `_strict_json`, src/ and plugins/ write no JSON text with `json.dump(s)`, except where the text is a
    cache key or a value that cannot hold a float (each listed here, with why)."""
    allowed = {
        # a cache key and the cache's own record: settings (the data modules' files, outside these writers)
        "src/torchloom/data/",
        # printed on stdout by the CLI: values already encoded (inspect), or integers and strings only
        "src/torchloom/cli.py",
        "src/torchloom/cli/",
        # a list flattened to one tracker hyper-parameter string, not a file
        "plugins/torchloom_plugins/trackers.py",
    }
    found = []
    for path in [*ROOT.glob("src/torchloom/**/*.py"), *ROOT.glob("plugins/torchloom_plugins/**/*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "src/torchloom/_strict_json.py" or any(rel.startswith(a) for a in allowed):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bjson\.dumps?\(", line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "write JSON with torchloom._strict_json.json_dumps:\n" + "\n".join(found)
