"""Writes a benchmark's section into bench/RESULTS.md, replacing its previous figures."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace the section that starts with `heading` (up to the next '## ') or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(heading)
    if start >= 0:
        end = text.find("\n## ", start + 1)
        rest = text[end + 1 :] if end >= 0 else ""
        if rest:  # a blank line before the next section's heading
            section = section.rstrip("\n") + "\n\n"
        text = text[:start] + section + rest
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def section(heading: str, command: str, about: str, columns: list[str], rows: list[str]) -> str:
    """A benchmark's section: its heading, the command that made it, what was measured and how
    (`about`: machine, load, method), and its table of `columns` and rows (each a written line)."""
    align = " | ".join("---" if at == 0 else "---:" for at in range(len(columns)))
    head = [heading, "", f"Command: `{command.strip()}`  ", about, ""]
    return "\n".join([*head, f"| {' | '.join(columns)} |", f"| {align} |", *rows, ""])


def publish(text: str, heading: str, out: Path | None) -> None:
    """Print a section, and write it into `out` (RESULTS.md) in place of its previous figures."""
    print(text)
    if out:
        write_section(out, heading, text)
