"""A reload the picker's routing table refuses is a refusal: the last good config keeps serving, the file
watcher and the admin API get an answer, not an exception."""

from __future__ import annotations

import pytest

import inferlb.serve
from inferlb.serve import RELOAD_OK, InferLB
from xds_server.config import load_config

CONFIG = """\
listen: {{xds: "127.0.0.1:0", ext_proc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
history: {{path: ":memory:"}}
services:
  - name: llm
    hosts: [{host}]
    versions:
      - name: v1
        endpoints: [{{address: "127.0.0.1:9"}}]
"""


async def test_a_config_the_routing_table_refuses_leaves_the_last_good_one(tmp_path, monkeypatch):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(host="a.example"))
    app = InferLB(load_config(path), path)
    good = app.cfg
    path.write_text(CONFIG.format(host="b.example"))

    def refuse(cfg):
        raise ValueError("service 'llm': hosts must be non-empty names")

    monkeypatch.setattr(inferlb.serve, "routing_table", refuse)
    applied, message = await app.reload()
    assert not applied and "hosts must be non-empty names" in message and "last good config" in message
    assert app.cfg is good and RELOAD_OK._value.get() == 0
    assert app.last_reload_error == message


async def test_an_error_while_applying_is_a_refusal_not_an_exception(tmp_path, monkeypatch):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(host="a.example"))
    app = InferLB(load_config(path), path)
    path.write_text(CONFIG.format(host="b.example"))

    async def broken(new, what=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(app, "apply_config", broken)
    applied, message = await app.reload()
    assert not applied and "RuntimeError('boom')" in message


@pytest.mark.parametrize("host", ["''", "'.'"])
def test_validate_refuses_what_serve_could_not_route(tmp_path, host):
    from click.testing import CliRunner

    from inferlb.cli import main

    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(host=host))
    result = CliRunner().invoke(main, ["validate", "-c", str(path)])
    assert result.exit_code == 2 and "services[0].hosts" in result.output, result.output
