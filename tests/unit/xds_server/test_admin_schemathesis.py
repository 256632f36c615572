"""The admin API fuzzed from its own OpenAPI document with Schemathesis (every check, a bounded number
of generated cases): every schema-valid request is accepted, every schema-invalid one refused with a
4xx, no 5xx, every answer matches its documented schema, status and content type (issue 15 item 10).

A real aiohttp server on a loopback port and the ``st`` command line, as an operator would run it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.history_rows import admin_app, row, verdict
from xds_server.engine.types import DRAINING
from xds_server.loadview.table import ClusterLoad, Load, LoadTable, Report

ROOT = Path(__file__).resolve().parents[3]
#: Cases per operation and phase; 9 operations, coverage + fuzzing phases: a few seconds in all.
MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def admin_url():
    now = time.time()
    rows = [row(now - 7200, "10.0.0.1:8000", 10), row(now - 300, "10.0.0.1:8000", 25),
            row(now - 200, "10.0.0.2:8000", 30, DRAINING)]
    pickers = LoadTable(expiry_s=3600.0)  # two pickers' reports, kept for the whole run
    for name, n in (("gw-1", 3), ("gw-2", 1)):
        pickers.record(Report(name, 1, {("chat-v1", "10.0.0.1:8000"): Load(n, n, 8192.0 * n, 400.0 * n, n)},
                              {"chat-v1": ClusterLoad(n, n)}), time.monotonic())
    app, store = admin_app(rows, [verdict("10.0.0.1:8000", 25), verdict("10.0.0.2:8000", 30, DRAINING)],
                           ready=True, load_view=pickers)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    store.close()


HISTORY = ["--include-path", "/api/v1/history"]


@pytest.mark.parametrize("phases,extra", [
    ("examples,fuzzing", []),
    ("coverage", ["--exclude-path", "/api/v1/history"]),
    # The coverage phase ignores filter hooks, so it would count a step too small for the range (a
    # documented cross-parameter rule) as "schema-valid request rejected"; every other check runs.
    ("coverage", [*HISTORY, "--exclude-checks", "positive_data_acceptance"]),
], ids=["fuzzing", "coverage", "coverage-history"])
def test_admin_api_conforms_to_its_openapi_document_under_fuzzing(admin_url, tmp_path, phases, extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks"}
    st = Path(sys.executable).with_name("st")
    cmd = [str(st) if st.exists() else "st", "run", f"{admin_url}/openapi.json", "--checks", "all",
           "--max-examples", str(MAX_EXAMPLES), "--workers", "1", "--phases", phases, "--seed", "15",
           "--no-color", *extra]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "generated" in done.stdout and " 0 generated" not in done.stdout, done.stdout[-2000:]
