"""Writing one benchmark's section into BENCHMARKS.md: the text between its two marker lines."""

from __future__ import annotations

from datetime import date
from pathlib import Path


def replace_marked(path: Path, begin: str, end: str, block: str, heading: str = "") -> None:
    """Put ``block`` (which starts with the ``begin`` marker and ends with the ``end`` one) in place of
    the old text from ``begin`` to ``end`` in the file at ``path``; without markers there yet, append
    ``heading`` (when given) and ``block``. The file is created (``# Benchmarks``) if missing."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, stop = text.find(begin), text.find(end)
    if start != -1 and stop > start:
        text = text[:start] + block.rstrip("\n") + text[stop + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + (f"{heading}\n\n" if heading else "") + block.rstrip("\n") + "\n"
    path.write_text(text if text.endswith("\n") else text + "\n")


def write_run_section(path: Path, name: str, heading: str, table: str, command: str, machine: str) -> None:
    """Write one run's ``table`` into the section of bench ``name`` (markers ``<!-- NAME:start -->`` /
    ``<!-- NAME:end -->``), headed by the command, the machine and today's date (see :func:`replace_marked`)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    body = f"{start}\nCommand: `{command}` · machine: {machine} · date: {date.today().isoformat()}\n\n{table}\n{end}"
    replace_marked(path, start, end, body, heading)
