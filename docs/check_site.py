"""Check the built site's API reference: no Type column shows raw docstring markup (backticks, asterisks).

Run by the ``docs`` nox session after ``mkdocs build``: ``python docs/check_site.py [SITE_DIR]`` (default ``site``).
A type written the way Griffe's parser does not read (see ``docs/griffe_rst.py``) reaches the page as text such as
`` `int`, *optional* ``; this lists every such cell with its page and exits with 1.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path

MARKUP = ("`", "*")


class TypeCells(HTMLParser):
    """The text of every cell in a column headed ``Type``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[str] = []
        self._headers: list[str] = []
        self._in_head = self._in_th = False
        self._column = -1
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._headers = []
        elif tag == "thead":
            self._in_head = True
        elif tag == "th" and self._in_head:
            self._in_th = True
            self._headers.append("")
        elif tag == "tr" and not self._in_head:
            self._column = -1
        elif tag == "td":
            self._column += 1
            is_type = self._column < len(self._headers) and self._headers[self._column] == "Type"
            self._cell = [] if is_type else None

    def handle_endtag(self, tag: str) -> None:
        if tag == "thead":
            self._in_head = False
        elif tag == "th":
            self._in_th = False
        elif tag == "td" and self._cell is not None:
            self.cells.append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._in_th:
            self._headers[-1] += data.strip()
        elif self._cell is not None:
            self._cell.append(data)


def raw_markup(site: Path) -> list[str]:
    """``page: cell`` for every Type cell of the site's pages that shows a backtick or an asterisk."""
    found = []
    for page in sorted(site.rglob("*.html")):
        parser = TypeCells()
        parser.feed(page.read_text(encoding="utf-8"))
        found += [f"{page.relative_to(site)}: {cell}" for cell in parser.cells if any(m in cell for m in MARKUP)]
    return found


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site")
    found = raw_markup(site)
    for line in found:
        print(f"raw docstring markup in a Type column: {line}", file=sys.stderr)
    if not any(site.rglob("*.html")):
        print(f"no site in {site}: build it first (mkdocs build)", file=sys.stderr)
        return 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
