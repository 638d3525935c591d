"""MkDocs hooks for the site (mkdocs.yml: ``hooks:``).

The pages are written to read on GitHub too, so they link to files of the repository outside docs/
(``../examples/fine_foods.py``). The site holds only docs/, so such a link would be broken there (and a
warning, which fails the strict build). This hook turns each one into the file's path in the repository,
as inline code, keeping the link text: ``[the example](../examples/fine_foods.py)`` becomes
``the example (`examples/fine_foods.py`)``. Links inside code are left alone.
"""

from __future__ import annotations

import posixpath
import re

FENCE = re.compile(r"^(```+|~~~+)[^\n]*\n.*?^\1\s*$", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"(?<!!)\[((?:[^\]\[]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?\s*\)")


def outside_docs(target: str, page_path: str) -> str | None:
    """The repository path of ``target`` (a link on the page ``page_path``, relative to docs/) when it points
    outside docs/, else None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
        return None
    path = target.split("#")[0]
    resolved = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_path), path))
    if resolved == "docs" or resolved.startswith("docs/"):
        return None
    return resolved.rstrip("/") + ("/" if path.endswith("/") else "")


def rewrite(markdown: str, page_path: str) -> str:
    """``markdown`` with every link to a file outside docs/ replaced by the file's repository path."""

    def link(match: re.Match[str]) -> str:
        repo_path = outside_docs(match.group(2), page_path)
        if repo_path is None:
            return match.group(0)
        text = match.group(1)
        if text.strip("`") in (repo_path, repo_path.rstrip("/"), posixpath.basename(repo_path.rstrip("/"))):
            return f"`{repo_path}`"
        return f"{text} (`{repo_path}`)"

    def prose(part: str) -> str:
        pieces, last = [], 0
        for span in CODE_SPAN.finditer(part):
            pieces.append(LINK.sub(link, part[last : span.start()]))
            pieces.append(span.group(0))
            last = span.end()
        pieces.append(LINK.sub(link, part[last:]))
        return "".join(pieces)

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out.append(prose(markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(prose(markdown[last:]))
    return "".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return rewrite(markdown, page.file.src_uri)
