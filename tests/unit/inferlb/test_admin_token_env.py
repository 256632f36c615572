"""``INFERLB_ADMIN_TOKEN`` follows ``admin.token``'s rule (at least 16 characters): ``inferlb serve``
with a shorter one refuses with one line naming the variable and the length, exit code 2."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from inferlb.cli import main
from inferlb.serve import TOKEN_ENV, admin_token
from xds_server.config import ConfigError, parse_config

SERVICES = [{"name": "chat", "versions": [{"name": "v1", "endpoints": [{"address": "127.0.0.1:9"}]}]}]


def _cfg(**admin):
    return parse_config(yaml.safe_dump({"admin": admin, "services": SERVICES}))


def test_a_short_env_token_is_refused(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ConfigError) as err:
        admin_token(_cfg())
    assert str(err.value) == "INFERLB_ADMIN_TOKEN must be at least 16 characters, like admin.token (it has 5)"
    assert "short" not in str(err.value)   # tokens are never logged


def test_a_long_env_token_is_used_and_the_config_token_wins(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "x" * 16)
    assert admin_token(_cfg()) == "x" * 16
    assert admin_token(_cfg(token="c" * 20)) == "c" * 20
    monkeypatch.setenv(TOKEN_ENV, "")
    assert admin_token(_cfg()) is None   # empty: unset


def test_serve_exits_2_with_one_line(monkeypatch, tmp_path):
    import inferlb.cli

    monkeypatch.setattr(inferlb.cli, "_setup_logging", lambda *_: None)   # the root logger stays pytest's
    monkeypatch.setenv(TOKEN_ENV, "short")
    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "history": {"path": ":memory:"}, "metrics": {"sources": ["scrape"]}, "services": SERVICES}))
    result = CliRunner().invoke(main, ["serve", "-c", str(path), "--watch-config", "0"])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        "inferlb serve: INFERLB_ADMIN_TOKEN must be at least 16 characters, like admin.token (it has 5)"]
