"""Every ``inferlb`` command the README and docs/ mention exists (its ``--help`` exits 0)."""

from __future__ import annotations

import re
from pathlib import Path

import click
from click.testing import CliRunner

from inferlb.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _code(text: str) -> list[str]:
    """The code in a Markdown text: fenced blocks and inline code spans."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def _documented() -> set[tuple[str, ...]]:
    """Word runs after ``inferlb`` in the docs' code (``("bench", "picker", "--json")`` -> words only)."""
    found = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in _code(doc.read_text()):
            code = re.sub(r"(^|\s)#.*", "", code, flags=re.M)   # comments are prose
            for match in re.finditer(r"(?:^|[\s(;&|])inferlb((?: [a-z][a-z-]*)+)", code):
                found.add(tuple(match.group(1).split()))
    return found


def _command_path(words: tuple[str, ...]) -> tuple[str, ...]:
    """The longest prefix of ``words`` that names commands (the rest are arguments or prose)."""
    ctx = click.Context(main)
    command: click.Command = main
    path: list[str] = []
    for word in words:
        if not isinstance(command, click.Group):
            break
        sub = command.get_command(ctx, word)
        if sub is None:
            break
        path.append(word)
        command = sub
    return tuple(path)


def test_documented_commands_answer_help():
    documented = _documented()
    unknown = sorted(" ".join(w) for w in documented if not _command_path(w))
    assert unknown == [], f"documented commands the CLI does not have: {unknown}"
    paths = {_command_path(words) for words in documented}
    assert {("demo",), ("serve",), ("bootstrap",), ("bench", "picker"), ("bench", "quality")} <= paths
    runner = CliRunner()
    for path in sorted(paths):
        result = runner.invoke(main, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)


def test_every_command_group_lists_its_commands():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    assert "picker" in result.output and "quality" in result.output
    top = CliRunner().invoke(main, ["--help"]).output
    for name in ("serve", "demo", "validate", "bootstrap", "weights", "history", "ext-proc", "sim-backend", "bench"):
        assert name in top


def test_validate_names_the_discovery_sources(tmp_path):
    from click.testing import CliRunner

    from inferlb.cli import main

    path = tmp_path / "etcd.yaml"
    path.write_text("discovery:\n  etcd:\n    services: [{name: chat}]\nservices: []\n")
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 0, result.output
    assert "OK (0 services, 0 endpoints, plus discovery from etcd)" in result.output
