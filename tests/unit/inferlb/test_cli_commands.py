"""Every ``inferlb`` command the README and docs/ mention exists (its ``--help`` exits 0)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import click
import pytest
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


def test_version_is_the_package_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"inferlb, version {importlib.metadata.version('inferlb')}\n"


@pytest.mark.parametrize(("args", "error"), [
    (["bootstrap", "--node-id", "x", "--admin-port", "99999"],
     "Invalid value for '--admin-port': 99999 is not in the range 1<=x<=65535."),
    (["bootstrap", "--node-id", "x", "--admin-port", "0"], "Invalid value for '--admin-port': 0 is not in the range"),
    (["bootstrap", "--node-id", ""], "Invalid value for '--node-id': must not be empty"),
    (["bootstrap", "--node-id", "x", "--node-cluster", " "], "Invalid value for '--node-cluster': must not be empty"),
    (["bootstrap", "--node-id", "x", "--xds-address", "nonsense"],
     "Invalid value for '--xds-address': expected HOST:PORT with a port 0-65535, got 'nonsense'"),
    (["bootstrap", "--node-id", "x", "--xds-address", "10.0.0.1:0"], "Invalid value for '--xds-address': port 0"),
    (["bootstrap", "--node-id", "x", "--xds-address", "bad host:1"], "Invalid value for '--xds-address': "),
    (["ext-proc", "--xds", "nonsense"],
     "Invalid value for '--xds': expected HOST:PORT with a port 0-65535, got 'nonsense'"),
    (["ext-proc", "--xds", "127.0.0.1:0"], "Invalid value for '--xds': port 0 cannot be dialled"),
    (["ext-proc", "--xds", "127.0.0.1:18000", "--listen", "127.0.0.1:99999"], "Invalid value for '--listen': "),
    (["ext-proc", "--xds", "127.0.0.1:18000", "--listen", "bad host:1"], "Invalid value for '--listen': "),
    (["ext-proc", "--xds", "127.0.0.1:18000", "--node-id", ""], "Invalid value for '--node-id': must not be empty"),
    (["ext-proc", "--xds", "127.0.0.1:18000", "--listen", "127.0.0.1:0", "--workers", "2"],
     "--workers above 1 share one port"),
    (["demo", "--duration", "-5"], "Invalid value for '--duration': -5.0 is not in the range x>0."),
    (["demo", "--duration", "0"], "Invalid value for '--duration': 0.0 is not in the range x>0."),
    (["demo", "--concurrency", "0"], "Invalid value for '--concurrency': 0 is not in the range x>=1."),
    (["weights", "--admin", "nonsense"], "Invalid value for '--admin': expected a URL such as http://127.0.0.1:18090"),
    (["history", "--admin", "127.0.0.1:18090", "--cluster", "c"], "Invalid value for '--admin': expected a URL"),
    (["history", "--admin", "http://", "--cluster", "c"], "Invalid value for '--admin': expected a URL"),
])
def test_bad_options_are_refused_before_anything_runs(args, error):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert error in result.output
    assert isinstance(result.exception, SystemExit)   # click's usage error, not a traceback


def test_ext_proc_takes_host_names_and_ipv6(monkeypatch):
    import inferlb.cli
    import inferlb.picker_process

    seen = []
    monkeypatch.setattr(inferlb.cli, "_setup_logging", lambda *_: None)   # the root logger stays pytest's

    async def run_picker(xds, listen, **_):
        seen.append((xds, listen))

    monkeypatch.setattr(inferlb.picker_process, "run_picker", run_picker)
    result = CliRunner().invoke(main, ["ext-proc", "--xds", "inferlb.example:18000", "--listen", "[::1]:0"])
    assert result.exit_code == 0, result.output
    assert seen == [("inferlb.example:18000", "[::1]:0")]


def test_validate_refuses_what_serve_refuses_for_the_kv_event_feed(tmp_path):
    """A tokenizer the picker cannot load is refused by ``validate`` as by ``serve``, naming the setting."""
    from click.testing import CliRunner

    from inferlb.cli import main

    path = tmp_path / "kv.yaml"
    services = ("services:\n  - name: chat\n    versions:\n      - name: v1\n"
                "        endpoints: [{address: '127.0.0.1:8000'}]\n")
    picker = "picker:\n  prefix_source: kv_events\n  prefix_cache_tokens: 64000\n"
    path.write_text(picker + f"  kv_events: {{tokenizer: {tmp_path / 'nowhere'}}}\n" + services)
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 2, result.output
    assert "picker.kv_events.tokenizer:" in result.output and "nowhere/tokenizer.json" in result.output
    path.write_text(picker + services)
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 0, result.output
    # keys: vllm loads the tokenizer with transformers, as serve does: a directory it cannot read is refused
    path.write_text(picker + f"  kv_events: {{keys: vllm, tokenizer: {tmp_path}}}\n" + services)
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 2, result.output
    assert "picker.kv_events.tokenizer:" in result.output and "not a Hugging Face tokenizer directory" in result.output
    path.write_text(picker + "  kv_events: {keys: vllm}\n" + services)
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 2 and "keys: vllm needs tokenizer" in result.output, result.output


def test_every_kv_event_batch_outcome_is_a_series_from_the_start():
    """An alert on the applied batches' rate sees 0, not no series, when no engine publishes."""
    from prometheus_client import REGISTRY

    from ext_proc import kv_events  # noqa: F401  (registers the counter)

    for outcome in ("applied", "malformed", "stale", "lost", "restarted"):
        assert REGISTRY.get_sample_value("inferlb_ext_proc_kv_event_batches_total", {"outcome": outcome}) is not None


def test_serve_refuses_a_tokenizer_it_cannot_load_before_it_binds_anything(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import inferlb.cli
    import inferlb.serve
    from inferlb.cli import main

    async def never(*_a, **_k):
        raise AssertionError("serve bound a listener before refusing the config")

    monkeypatch.setattr(inferlb.cli, "_setup_logging", lambda *_: None)   # the root logger stays pytest's
    monkeypatch.setattr(inferlb.serve, "start_ads_server", never)
    path = tmp_path / "kv.yaml"
    path.write_text("listen: {xds: '127.0.0.1:0', ext_proc: '127.0.0.1:0', admin: '127.0.0.1:0'}\n"
                    "history: {path: ':memory:'}\n"
                    f"picker:\n  prefix_source: kv_events\n  kv_events: {{tokenizer: {tmp_path / 'nowhere'}}}\n"
                    "services:\n  - name: chat\n    versions:\n      - name: v1\n"
                    "        endpoints: [{address: '127.0.0.1:8000'}]\n")
    result = CliRunner().invoke(main, ["serve", "-c", str(path), "--watch-config", "0"])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line.startswith("inferlb serve: picker.kv_events.tokenizer:") and "nowhere/tokenizer.json" in line


def test_validate_refuses_a_history_path_serve_could_not_open(tmp_path):
    """A ``history.path`` under a file is refused by ``validate`` (as ``serve`` refuses it), naming the setting."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = tmp_path / "h.yaml"
    services = ("services:\n  - name: chat\n    versions:\n      - name: v1\n"
                "        endpoints: [{address: '127.0.0.1:8000'}]\n")
    path.write_text(f"history: {{path: {blocker / 'h.sqlite3'}}}\n" + services)
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 2, result.output
    assert "history.path" in result.output and "is not a folder" in result.output
    path.write_text(f"history: {{path: {tmp_path / 'state' / 'h.sqlite3'}}}\n" + services)
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 0, result.output
