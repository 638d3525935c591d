"""The epoch loop only loops (issue 40): every function of ``src/torchloom/_loop.py`` is at most 40 lines, from its
``def`` line to its last line, docstring included. Restoring the data position lives in
`torchloom.checkpoint.data_position.DataPosition`, the checkpoint's entries in the checkpoint package."""

from __future__ import annotations

import ast
from pathlib import Path

LOOP = Path(__file__).resolve().parents[1] / "src" / "torchloom" / "_loop.py"
LIMIT = 40


def test_every_function_of_the_loop_is_at_most_40_lines():
    tree = ast.parse(LOOP.read_text(encoding="utf-8"), str(LOOP))
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert functions  # the scan sees the module's functions
    long = {
        f"{node.name} (line {node.lineno})": node.end_lineno - node.lineno + 1
        for node in functions
        if node.end_lineno is not None and node.end_lineno - node.lineno + 1 > LIMIT
    }
    assert not long, f"functions of {LOOP.name} over {LIMIT} lines: {long}"
