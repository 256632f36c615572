"""Writing one benchmark's section into BENCHMARKS.md: the text between its two marker lines."""

from __future__ import annotations

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
