"""The docs site as a reader gets it, built into a temporary directory as `make test` builds it:
every page that holds a diagram carries mermaid's script from the site itself (a relative path to
the copy `make docs-js` fetched and checked), so the diagrams draw without the network, and no
page loads anything from a CDN."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pages import DOCS, ROOT

SCRIPT = "javascripts/mermaid.min.js"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_every_page_with_a_diagram_draws_it_with_the_sites_own_mermaid(site: Path) -> None:
    drawn = [page for page in site.rglob("*.html") if 'class="mermaid"' in page.read_text()]
    sources = [page for page in DOCS.rglob("*.md") if "```mermaid" in page.read_text()]
    assert len(drawn) == len(sources) >= 2  # every diagram written is drawn
    shipped = site / SCRIPT
    fetched = ROOT / "build" / "docs-js" / "mermaid.min.js"
    assert hashlib.sha256(shipped.read_bytes()).digest() == hashlib.sha256(fetched.read_bytes()).digest()
    assert b"mermaid" in shipped.read_bytes()[:4096] and shipped.stat().st_size > 1_000_000
    for page in drawn:
        scripts = re.findall(r'<script src="([^"]+)"', page.read_text())
        mine = [src for src in scripts if src.endswith(SCRIPT)]
        assert mine, page
        assert not mine[0].startswith(("http:", "https:", "//", "/")), page  # relative: the site's own copy
        assert (page.parent / mine[0]).resolve() == shipped.resolve(), page


def test_no_page_loads_a_script_or_a_stylesheet_from_another_host(site: Path) -> None:
    for page in site.rglob("*.html"):
        html = page.read_text()
        loaded = re.findall(r'<(?:script|link)[^>]+(?:src|href)="((?:https?:)?//[^"]+)"', html)
        assert [url for url in loaded if "127.0.0.1" not in url] == [], page
