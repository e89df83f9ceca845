"""A clone named `expbuf` in Python's path shadows the installed expbuf: `expbuf` is a namespace,
so `expbuf.client` comes from the first portion that has it, the clone's sources. The import
says so, once, naming the directory and what to do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pages import DOCS, ROOT, page

IMPORT = "import expbuf.client; print(expbuf.client.__file__)"


def python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=os.environ, capture_output=True, text=True, timeout=120, check=False
    )


def test_a_clone_in_the_current_directory_that_shadows_the_install_is_named_with_the_fix(tmp_path: Path) -> None:
    """As the docs' install line left a user: `git clone ... expbuf && pip install ./expbuf`, then
    Python in the clone's parent imported the clone's client, the compiled codec silently off."""
    clone = tmp_path / "expbuf"
    (clone / "client").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", clone)
    shutil.copy(ROOT / "client" / "__init__.py", clone / "client")
    done = python(IMPORT, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(clone / "client" / "__init__.py")  # the trap itself
    assert done.stderr.count("UserWarning") == 1
    assert f"expbuf.client is imported from {clone}, a source tree" in done.stderr
    assert "not the installed expbuf" in done.stderr and "expbuf-src" in done.stderr


def test_the_installed_expbuf_imports_without_a_word(tmp_path: Path) -> None:
    for cwd in (tmp_path, ROOT):
        done = python("import warnings; warnings.simplefilter('error'); " + IMPORT, cwd)
        assert done.returncode == 0 and done.stderr == "", done.stderr


def test_no_page_installs_from_a_clone_named_expbuf() -> None:
    """A page's `pip install ./expbuf` is run from the clone's parent, where the clone shadows what
    it installs: the pages clone into, and install from, `expbuf-src`."""
    pages = ["README", *(str(path.relative_to(DOCS)) for path in sorted(DOCS.rglob("*.md")))]
    shadowing = re.compile(r"\./expbuf(?![-\w])|git clone \S+ expbuf(?![-\w])")
    found = [f"{name}: {match.group(0)!r}" for name in pages for match in shadowing.finditer(page(name))]
    assert not found, found
    clone = 'git clone URL-OF-THIS-REPOSITORY expbuf-src && pip install "./expbuf-src[trl]"'
    assert clone in page("getting-started.md")
