"""bench/RESULTS.md holds the current figures, one section per measure, each benchmark writing its
own through bench/results.py; the sessions' history is in bench/HISTORY.md."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pages import ROOT

BENCH = ROOT / "bench"


def write_section(path: Path, heading: str, section: str) -> None:
    spec = importlib.util.spec_from_file_location("bench_results", BENCH / "results.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_section(path, heading, section)


def headings_written() -> set[str]:
    """The heading each benchmark passes to write_section (or bench_service.main_on_a_server), as a
    literal or its HEADING."""
    found = set()
    for script in BENCH.glob("*.py"):
        source = script.read_text()
        constant = re.search(r'^HEADING = "(## [^"]+)"', source, re.M)
        for argument in re.findall(r"(?:write_section|main_on_a_server)\([^,]+, (\"## [^\"]+\"|HEADING)", source):
            found.add(constant.group(1) if argument == "HEADING" else argument.strip('"'))
    return found


def test_every_benchmark_replaces_a_section_of_the_current_results() -> None:
    """No benchmark appends: each heading it writes heads a section of RESULTS.md, outside the history."""
    results = (BENCH / "RESULTS.md").read_text()
    headings = headings_written()
    assert len(headings) >= 17
    for heading in headings:
        assert re.search(rf"^{re.escape(heading)}", results, re.M), heading
    assert "reading the figures" not in results
    assert "reading the figures" in (BENCH / "HISTORY.md").read_text()


def test_write_section_replaces_its_own_section_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text((BENCH / "RESULTS.md").read_text())
    before = path.read_text()
    heading = "## Off-policy control (issue 11)"
    start = before.index(heading)
    end = before.index("\n## ", start) + 1
    write_section(path, "## Off-policy control", f"{heading}\n\nCommand: `new`\n\n")
    assert path.read_text() == before[:start] + f"{heading}\n\nCommand: `new`\n\n" + before[end:]
    write_section(path, "## A new measure", "## A new measure\n\nCommand: `bench`\n")
    assert path.read_text().endswith("\n\n## A new measure\n\nCommand: `bench`\n")
