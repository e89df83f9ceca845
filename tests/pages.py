"""The README and the docs site's pages, as the tests that run their snippets read them.

A test names a page (its path under docs/, or "README") and, where the page holds several, the
section its snippets are under; the tests never hold the pages' paths themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """The text of the README (name "README") or of the page docs/NAME."""
    return (ROOT / "README.md" if name == "README" else DOCS / name).read_text()


def section(name: str, heading: str) -> str:
    """The section of page `name` under `heading` (a whole heading line, '## ...'), up to the
    next heading of the same level or above."""
    text = page(name)
    level = len(heading) - len(heading.lstrip("#"))
    start = re.search(rf"^{re.escape(heading)}$", text, re.M)
    assert start, f"{name} has no heading {heading!r}"
    end = re.search(rf"^#{{1,{level}}} ", text[start.end() :], re.M)
    return text[start.end() : start.end() + end.start()] if end else text[start.end() :]


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks in `language` of a page or section, in order."""
    return re.findall(rf"^```{re.escape(language)}\n(.*?)^```", text, re.M | re.S)
