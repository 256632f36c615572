"""A listener of ``inferlb serve`` whose address is taken: one error line naming the field and the
address, exit code 2 (as for a bad config), no traceback, nothing left running."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inferlb.listeners import BindError, binding
from inferlb.serve import serve
from xds_server.config import parse_config

ROOT = Path(__file__).resolve().parents[3]


def _config(field: str, address: str, transport: str = "fast") -> dict:
    """A config whose listener ``field`` binds ``address``, every other one any free port."""
    listen = {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0", field: address}
    return {"listen": listen, "picker": {"transport": transport}, "history": {"path": ":memory:"},
            "metrics": {"sources": ["scrape"]},
            "services": [{"name": "chat", "versions": [{"name": "v1", "endpoints": [{"address": "127.0.0.1:9"}]}]}]}


@pytest.fixture(params=["plain", "reuse_port"])
def taken(request):
    """``127.0.0.1:PORT`` of a listening socket (held for the test); ``reuse_port``: it set
    SO_REUSEPORT, as a gRPC server does by default (another ``inferlb serve``)."""
    with socket.create_server(("127.0.0.1", 0), reuse_port=request.param == "reuse_port") as holder:
        yield f"127.0.0.1:{holder.getsockname()[1]}"


@pytest.mark.parametrize(("field", "transport"), [("xds", "fast"), ("ext_proc", "fast"), ("ext_proc", "grpcio"),
                                                  ("admin", "fast")])
async def test_a_taken_address_names_its_listener(taken, field, transport):
    cfg = parse_config(yaml.safe_dump(_config(field, taken, transport)))
    with pytest.raises(BindError) as err:
        await asyncio.wait_for(serve(cfg), 20)  # a port shared silently would serve on (a timeout)
    assert str(err.value) == f"listen.{field} {taken}: address already in use"


async def test_the_push_listener_is_not_shared_either(taken):
    data = _config("xds", "127.0.0.1:0")
    data["metrics"] = {"sources": ["push"], "push": {"listen": taken}}
    with pytest.raises(BindError) as err:
        await asyncio.wait_for(serve(parse_config(yaml.safe_dump(data))), 20)
    assert str(err.value) == f"metrics.push.listen {taken}: address already in use"


def test_a_listener_that_sets_so_reuseport_shares_a_port_that_allows_it():
    # ``inferlb ext-proc --reuse-port`` / ``--workers N``: every process binds the one port
    with socket.create_server(("127.0.0.1", 0), reuse_port=True) as holder:
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        with binding("--listen", address, reuse_port=True):
            pass
        with pytest.raises(BindError, match="address already in use"), binding("--listen", address):
            pytest.fail("the block runs only once the address was found bindable")


@pytest.mark.parametrize(("field", "transport"), [("xds", "fast"), ("ext_proc", "grpcio"), ("admin", "fast")])
@pytest.mark.parametrize("taken", ["plain"], indirect=True)
def test_serve_exits_2_with_one_line(taken, tmp_path, field, transport):
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump(_config(field, taken, transport)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "inferlb", "serve", "-c", str(path), "--log-level", "error"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    # only our line: not gRPC's own before it ("E... add_port.cc:83] Failed to add port to server ...")
    assert lines == [f"inferlb serve: listen.{field} {taken}: address already in use"], run.stderr

