"""``discovery.kubernetes`` without the ``kubernetes`` package (no ``[k8s]`` extra): ``inferlb
validate`` and ``inferlb serve`` refuse with one line naming the field and the fix, exit code 2
(before, serve ran with /readyz at 503 forever and validate said OK)."""

from __future__ import annotations

import sys

import pytest
import yaml
from click.testing import CliRunner

from inferlb.cli import main

MESSAGE = "discovery.kubernetes needs the kubernetes package, which cannot be imported"
FIX = "pip install 'inferlb[k8s]'"


@pytest.fixture
def k8s_config(tmp_path):
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "history": {"path": ":memory:"}, "metrics": {"sources": ["scrape"]},
        "discovery": {"kubernetes": {"namespace": "inference", "services": [{"name": "chat", "service": "chat"}]}},
        "services": []}))
    return path


@pytest.fixture
def no_kubernetes(monkeypatch):
    for name in [m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kubernetes", None)   # `import kubernetes` raises ImportError


def test_validate_refuses(k8s_config, no_kubernetes):
    result = CliRunner().invoke(main, ["validate", "-c", str(k8s_config)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[0] == "invalid config:"
    [line] = result.output.splitlines()[1:]
    assert line.startswith(f"{k8s_config}: {MESSAGE}") and line.endswith(FIX)


def test_serve_refuses(k8s_config, no_kubernetes, monkeypatch):
    import inferlb.cli

    monkeypatch.setattr(inferlb.cli, "_setup_logging", lambda *_: None)   # the root logger stays pytest's
    result = CliRunner().invoke(main, ["serve", "-c", str(k8s_config), "--watch-config", "0"])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line.startswith(f"inferlb serve: {MESSAGE}") and line.endswith(FIX)


def test_validate_passes_with_the_package(k8s_config):
    pytest.importorskip("kubernetes")
    result = CliRunner().invoke(main, ["validate", "-c", str(k8s_config)])
    assert result.exit_code == 0, result.output
    assert "plus discovery from kubernetes" in result.output
