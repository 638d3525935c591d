"""A Griffe extension (mkdocs.yml: mkdocstrings' ``extensions``) for what torchloom's docstrings write that Griffe's
Google parser does not read.

torchloom's docstrings are Google style with some reST, which also reads well with ``help()``:

- ``.. code-block:: python`` and a paragraph ending in ``::``, each followed by an indented block. Markdown knows
  neither, so the API reference would show the directive as text. Before the docstrings are parsed, this turns
  each such block into a fenced Markdown block of the same code (`rst_literals_to_markdown`).
- Types written as the transformers docstrings write them: ``name (`str` or ``None``, *optional*, defaults to
  4): ...`` in ``Args:`` and ``Attributes:``, `` `int`: ...`` in ``Returns:``. Griffe takes the text in the
  parentheses as the type, so the reference's Type column would show the backticks and asterisks. This rewrites
  each such type as the expression it names (``str | None``) and drops ``*optional*`` and ``defaults to ...``,
  which the Default column shows from the signature; a ``Returns:`` entry becomes ``(int): ...``, the form
  Griffe reads as a type with its default ``returns_named_value`` (`types_to_annotations`). mkdocs.yml sets
  ``returns_multiple_items: false``: a ``Returns:`` text of several lines is one entry, not one per line.

`tests/test_docs.py` runs both on every docstring of the API reference and fails on a type that would still show
markup; the ``docs`` nox session checks the built site's Type columns (``docs/check_site.py``).
"""

from __future__ import annotations

import re
from typing import Any

try:
    import griffe
except ImportError:  # the tests use the text functions without the site's dependencies
    griffe = None

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


#: The sections whose items are ``name (type): description``.
NAMED_SECTIONS = ("Args", "Arguments", "Parameters", "Attributes", "Keyword Args", "Keyword Arguments", "Other Args")
#: The sections whose items are ``type: description``.
TYPED_SECTIONS = ("Returns", "Yields")
_SECTION = re.compile(r"^(?P<indent>[ \t]*)(?P<title>[A-Z][A-Za-z ]*):[ \t]*$")
_NAMED_ITEM = re.compile(r"^(?P<head>[ \t]*\*{0,2}\w+) \(")
_MARKUP = re.compile(r"[`*]")


def annotation(text: str) -> str | None:
    """The type that a transformers-style type text names, as an expression; ``None`` when it names none.

    `` `str` or ``None``, *optional*, defaults to ``"x"`` `` gives ``str | None``; `` `list[str]` `` gives
    ``list[str]``; ``*optional*`` alone gives ``None``. Only the part before the first top-level comma is the type;
    ``or`` separates alternatives; backticks and asterisks go.
    """
    depth, cut = 0, len(text)
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            cut = i
            break
    spec = text[:cut].strip()
    if not spec or _MARKUP.sub("", spec).strip() in ("optional", ""):
        return None
    alternatives = [_MARKUP.sub("", a).strip() for a in re.split(r"\s+or\s+", spec)]
    return " | ".join(a for a in alternatives if a) or None


def _closing(line: str, start: int) -> int:
    """The index of the parenthesis that closes the one at ``start``, or -1."""
    depth = 0
    for i in range(start, len(line)):
        if line[i] == "(":
            depth += 1
        elif line[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _named_item(line: str) -> str:
    match = _NAMED_ITEM.match(line)
    if match is None:
        return line
    start = match.end() - 1
    end = _closing(line, start)
    if end < 0 or not line[end + 1 :].startswith(":"):
        return line
    kind = annotation(line[start + 1 : end])
    return match.group("head") + (f" ({kind})" if kind else "") + line[end + 1 :]


def _typed_item(line: str) -> str:
    body = line.lstrip()
    if not body.startswith("`"):
        return line
    depth, colon = 0, -1
    for i, char in enumerate(body):  # the first ": " outside brackets and backticks ends the type
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == ":" and depth == 0 and body[:i].count("`") % 2 == 0:
            colon = i
            break
    if colon < 0:
        return line
    kind = annotation(body[:colon])
    indent = line[: len(line) - len(body)]
    return f"{indent}({kind}){body[colon:]}" if kind else f"{indent}{body[colon + 1 :].lstrip()}"


def types_to_annotations(text: str) -> str:
    """``text`` with the transformers-style types of its ``Args:`` / ``Attributes:`` items and ``Returns:`` /
    ``Yields:`` entries rewritten as plain type expressions (see `annotation`; ``(type): ...`` in ``Returns:``);
    everything else as it is."""
    lines = text.split("\n")
    section, item_indent = None, -1
    for n, line in enumerate(lines):
        match = _SECTION.match(line)
        if match and match.group("title") in NAMED_SECTIONS + TYPED_SECTIONS:
            section, item_indent = match.group("title"), -1
            continue
        if section is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if item_indent < 0:
            item_indent = indent
        if indent < item_indent:  # dedented: the section ended
            section = None
            continue
        if indent == item_indent:
            lines[n] = _named_item(line) if section in NAMED_SECTIONS else _typed_item(line)
    return "\n".join(lines)


def section_types(text: str) -> list[str]:
    """The type text of every item in ``text``'s ``Args:`` / ``Attributes:`` / ``Returns:`` / ``Yields:`` sections,
    as Griffe's Google parser reads it (the parenthesised text after the name, or at the start of a ``Returns:``
    entry): what the reference shows in its Type column."""
    found: list[str] = []
    section, item_indent = None, -1
    for line in text.split("\n"):
        match = _SECTION.match(line)
        if match and match.group("title") in NAMED_SECTIONS + TYPED_SECTIONS:
            section, item_indent = match.group("title"), -1
            continue
        if section is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        item_indent = indent if item_indent < 0 else item_indent
        if indent < item_indent:
            section = None
        elif indent == item_indent:
            if section in NAMED_SECTIONS:
                named = _NAMED_ITEM.match(line)
                end = _closing(line, named.end() - 1) if named else -1
                if named and end > 0:
                    found.append(line[named.end() : end])
            elif line.lstrip().startswith("("):  # (type): description; other text is all description
                start = len(line) - len(line.lstrip())
                end = _closing(line, start)
                if end > 0 and line[end + 1 :].startswith(":"):
                    found.append(line[start + 1 : end])
    return found


if griffe is not None:

    class RstLiterals(griffe.Extension):
        """Rewrite each docstring's reST literal blocks as Markdown fences and its transformers-style types as type
        expressions, before it is parsed."""

        def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
            if obj.docstring is not None:
                obj.docstring.value = types_to_annotations(rst_literals_to_markdown(obj.docstring.value))
