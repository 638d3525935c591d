"""A Griffe extension (mkdocs.yml: mkdocstrings' ``extensions``) for the reST literal blocks in docstrings.

torchloom's docstrings are Google style with some reST, which also reads well with ``help()``:
``.. code-block:: python`` and a paragraph ending in ``::``, each followed by an indented block. Markdown knows
neither, so the API reference would show the directive as text. Before the docstrings are parsed, this turns
each such block into a fenced Markdown block of the same code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``.. code-block:: lang`` (or ``.. code::``), a blank line, then the block indented deeper than the directive.
BODY = r"(?P<body>(?:[ \t]*\n|(?P=indent)[ \t]+\S.*\n?)+)"
DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. code(?:-block)?::[ \t]*(?P<lang>[\w+-]*)[ \t]*\n" + BODY, re.MULTILINE)
#: A paragraph line ending in ``::`` (not a directive), a blank line, then the indented block.
LITERAL = re.compile(r"^(?P<indent>[ \t]*)(?P<text>(?!\.\. )\S.*?)::[ \t]*\n" + BODY, re.MULTILINE)


def _fence(indent: str, lang: str, body: str) -> str:
    lines = body.rstrip().split("\n")
    real = [line for line in lines if line.strip()]
    cut = min(len(line) - len(line.lstrip()) for line in real)
    code = "\n".join(line[cut:] if line.strip() else "" for line in lines).strip("\n")
    code = "\n".join(f"{indent}{line}" if line else "" for line in code.split("\n"))
    return f"\n{indent}```{lang}\n{code}\n{indent}```\n\n"


def rst_literals_to_markdown(text: str) -> str:
    """``text`` with reST code-block directives and ``::`` literal blocks as fenced Markdown blocks."""
    text = DIRECTIVE.sub(lambda m: _fence(m.group("indent"), m.group("lang") or "text", m.group("body")), text)

    def literal(m: re.Match[str]) -> str:
        intro = m.group("text").rstrip()
        intro = intro if intro.endswith(":") else f"{intro}:"  # "Example::" reads "Example:"
        return f"{m.group('indent')}{intro}\n" + _fence(m.group("indent"), "text", m.group("body"))

    return LITERAL.sub(literal, text)


class RstLiterals(griffe.Extension):
    """Rewrite each docstring's reST literal blocks as Markdown fences, before it is parsed."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_literals_to_markdown(obj.docstring.value)
