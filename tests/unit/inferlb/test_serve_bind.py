"""A listener of ``inferlb serve`` whose address is taken: one error line naming the field and the
address, exit code 2 (as for a bad config), no traceback, nothing left running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inferlb.listeners import BindError
from inferlb.serve import serve
from xds_server.config import parse_config

ROOT = Path(__file__).resolve().parents[3]


def _config(field: str, address: str, transport: str = "fast") -> dict:
    """A config whose listener ``field`` binds ``address``, every other one any free port."""
    listen = {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0", field: address}
    return {"listen": listen, "picker": {"transport": transport}, "history": {"path": ":memory:"},
            "metrics": {"sources": ["scrape"]},
            "services": [{"name": "chat", "versions": [{"name": "v1", "endpoints": [{"address": "127.0.0.1:9"}]}]}]}


@pytest.fixture
def taken():
    """``127.0.0.1:PORT`` of a listening socket (held for the test)."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        yield f"127.0.0.1:{holder.getsockname()[1]}"


@pytest.mark.parametrize(("field", "transport"), [("xds", "fast"), ("ext_proc", "fast"), ("ext_proc", "grpcio"),
                                                  ("admin", "fast")])
async def test_a_taken_address_names_its_listener(taken, field, transport):
    cfg = parse_config(yaml.safe_dump(_config(field, taken, transport)))
    with pytest.raises(BindError) as err:
        await serve(cfg)
    assert str(err.value) == f"listen.{field} {taken}: address already in use"


@pytest.mark.parametrize("field", ["xds", "admin"])
def test_serve_exits_2_with_one_line(taken, tmp_path, field):
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(_config(field, taken)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "inferlb", "serve", "-c", str(path), "--log-level", "error"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert lines[-1] == f"inferlb serve: listen.{field} {taken}: address already in use"
    # before it, at most grpc's own log line about the xDS port ("E... add_port.cc ... Address already in use")
    assert len(lines) == (2 if field == "xds" else 1), run.stderr

