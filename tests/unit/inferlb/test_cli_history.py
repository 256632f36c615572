"""`inferlb history` against a real admin server: the table, the PNG plot, and a bad parameter."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from click.testing import CliRunner
from matplotlib import image

from inferlb.cli import main
from inferlb.output import plot_history
from tests.integration.conftest import LoopThread
from tests.support.history_rows import admin_app, pin_history_clock, row, verdict
from xds_server.engine.types import UNHEALTHY

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
NOW = time.time()
ROWS = [row(NOW - 500, A, 10), row(NOW - 400, B, 20), row(NOW - 300, A, 15), row(NOW - 200, B, 20, UNHEALTHY),
        row(NOW - 100, "10.0.1.1:8000", 99, cluster="chat-v2")]


@pytest.fixture(autouse=True)
def _history_clock(monkeypatch):
    pin_history_clock(monkeypatch, NOW)


@pytest.fixture(scope="module")
def admin() -> Iterator[str]:
    loop = LoopThread()
    app, store = admin_app(ROWS, [verdict(A, 15), verdict(B, 20, UNHEALTHY)])
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    port = loop.run(start())
    yield f"http://127.0.0.1:{port}"
    loop.run(runner.cleanup())
    loop.close()
    store.close()


def test_history_table(admin):
    result = CliRunner().invoke(main, ["history", "--admin", admin, "--cluster", "chat-v1", "--since", "10m"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:7] == ["time", "(UTC)", "cluster", "endpoint", "weight", "health", "score"]
    body = [line.split() for line in lines[2:-1]]
    assert [(r[3], r[4], r[5]) for r in body] == [(A, "10", "HEALTHY"), (B, "20", "HEALTHY"),
                                                  (A, "15", "HEALTHY"), (B, "20", "UNHEALTHY")]
    assert lines[-1] == "4 points in 2 series"
    one = CliRunner().invoke(main, ["history", "--admin", admin, "--cluster", "chat-v1", "--endpoint", B,
                                    "--since", "10m"])
    assert one.exit_code == 0 and one.output.splitlines()[-1] == "2 points in 1 series"


def test_history_plot_writes_a_png(admin, tmp_path):
    out = tmp_path / "weights.png"
    result = CliRunner().invoke(main, ["history", "--admin", admin, "--cluster", "chat-v1", "--since", "10m",
                                       "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{out}: 2 endpoints"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(out).shape
    assert width == 1100 and height > 300


def test_history_plot_into_a_missing_folder_names_the_option(admin, tmp_path):
    out = tmp_path / "missing" / "weights.png"
    result = CliRunner().invoke(main, ["history", "--admin", admin, "--cluster", "chat-v1", "--since", "10m",
                                       "--plot", str(out)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"Invalid value for '--plot': cannot write {out}: No such file or directory" in result.output


def test_plot_draws_one_line_per_endpoint_and_a_panel_per_cluster(tmp_path):
    doc = {"until": NOW, "series": [
        {"cluster": "chat-v1", "endpoint": A, "points": [{"t": NOW - 60, "weight": 5, "health": "HEALTHY"}]},
        {"cluster": "chat-v1", "endpoint": B, "points": [{"t": NOW - 50, "weight": 6, "health": "DRAINING"}]},
        {"cluster": "chat-v2", "endpoint": "x", "points": []},
    ]}
    assert plot_history(doc, tmp_path / "p.png") == 2
    empty = {"until": NOW, "series": []}
    assert plot_history(empty, tmp_path / "e.png") == 0 and (tmp_path / "e.png").stat().st_size > 0


def test_bad_since_is_reported_with_its_name(admin):
    result = CliRunner().invoke(main, ["history", "--admin", admin, "--cluster", "chat-v1", "--since", "lately"])
    assert result.exit_code == 2
    assert "since: expected a duration ago" in result.output


def test_an_unknown_cluster_is_a_usage_error_that_names_it(admin):
    result = CliRunner().invoke(main, ["history", "--admin", admin, "--cluster", "nope", "--since", "10m"])
    assert result.exit_code == 2
    assert "no cluster 'nope' in the config or in the history" in result.output


def test_without_a_cluster_it_says_what_to_pass_and_lists_the_clusters(admin):
    """Issue 39: `inferlb history --since 2m` failed with click's "Missing option '--cluster'" alone."""
    result = CliRunner().invoke(main, ["history", "--admin", admin, "--since", "2m"])
    assert result.exit_code == 2
    assert "pass --cluster, one of: chat-v1" in result.output
    down = CliRunner().invoke(main, ["history", "--admin", "http://127.0.0.1:9", "--since", "2m"])
    assert down.exit_code == 2 and "pass --cluster (the clusters could not be read from" in down.output
