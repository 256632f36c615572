"""The built-in page in real headless Chromium (Debian's `chromium`): the live weights table, and a
chart (uPlot) with one series per endpoint holding exactly the stored points."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import time

import pytest
from aiohttp import web

from tests.integration.conftest import LoopThread
from tests.support.history_rows import admin_app, row, verdict
from xds_server.engine.types import DRAINING, UNHEALTHY

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000"
NOW = time.time()
ROWS = [row(NOW - 2000, A, 30),  # before the range: carried in at `since`
        row(NOW - 600, A, 40), row(NOW - 590, B, 20), row(NOW - 400, B, 22, UNHEALTHY), row(NOW - 300, A, 35),
        row(NOW - 200, C, 60, cluster="chat-v2"), row(NOW - 100, B, 22, DRAINING)]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_dom(url: str, profile, budget_ms: int = 8000) -> str:
    """The page's DOM after its scripts ran for ``budget_ms`` of virtual time (fetches included)."""
    binary = shutil.which("chromium")
    assert binary, "Debian's chromium is not installed: run scripts/setup.sh"
    done = subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def page_url():
    loop = LoopThread()
    app, store = admin_app(ROWS, [verdict(A, 35), verdict(B, 22, DRAINING), verdict(C, 60, cluster="chat-v2")])
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    yield f"http://127.0.0.1:{loop.run(start())}/"
    loop.run(runner.cleanup())
    loop.close()
    store.close()


def test_page_charts_one_series_per_endpoint_with_the_stored_points(page_url, tmp_path):
    dom = chromium_dom(f"{page_url}?since=30m", tmp_path / "profile")
    state = re.search(r'<script type="application/json" id="chart-state">(.*?)</script>', dom, re.S)
    assert state, dom[:2000]
    chart = json.loads(html.unescape(state.group(1)))
    assert chart is not None, "the chart was never drawn"
    assert chart["labels"] == [f"{A} (chat-v1)", f"{B} (chat-v1)", f"{C} (chat-v2)"]
    xs, *ys = chart["data"]
    assert xs == sorted(xs) and xs[-1] == chart["until"]
    since = chart["until"] - 1800
    expected = {
        A: [(since, 30), (NOW - 600, 40), (NOW - 300, 35)],
        B: [(NOW - 590, 20), (NOW - 400, 22), (NOW - 100, 22)],
        C: [(NOW - 200, 60)],
    }
    for (endpoint, points), y in zip(expected.items(), ys, strict=True):
        drawn = [(x, v) for x, v in zip(xs[:-1], y[:-1], strict=True) if v is not None]
        assert len(drawn) == len(points), (endpoint, drawn)
        for (x, v), (t, w) in zip(drawn, points, strict=True):
            assert v == w and x == pytest.approx(t, abs=2.0), (endpoint, x, v, t, w)
        assert y[-1] == points[-1][1]  # the step line reaches `until` at the last value

    table = re.search(r'<table id="weights">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows]
    assert [(c[0], c[1], c[2], c[3]) for c in cells] == [("chat-v1", A, "35", "HEALTHY"),
                                                         ("chat-v1", B, "22", "DRAINING"),
                                                         ("chat-v2", C, "60", "HEALTHY")]


def test_page_filters_the_chart_by_cluster(page_url, tmp_path):
    dom = chromium_dom(f"{page_url}?since=30m&cluster=chat-v2", tmp_path / "profile")
    chart = json.loads(html.unescape(re.search(r'id="chart-state">(.*?)</script>', dom, re.S).group(1)))
    assert chart["labels"] == [f"{C} (chat-v2)"]
