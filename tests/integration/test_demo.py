"""`inferlb demo` end to end, as a user runs it: its exit code and its summary contract."""

from __future__ import annotations

import fcntl
import json
import subprocess
from pathlib import Path

import pytest

from inferlb.devstack.stack import inferlb_argv

pytestmark = pytest.mark.integration


def test_demo_runs_and_its_summary_holds(tmp_path):
    out = tmp_path / "summary.json"
    # The demo binds fixed ports: one demo at a time on this machine.
    with open("/tmp/inferlb-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = subprocess.run(inferlb_argv("demo", "--duration", "15", "--json", str(out), "--quiet",
                                          "--workdir", str(tmp_path / "work")),
                             capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(out.read_text())

    assert s["duration_s"] == 15
    assert s["metrics_source"] == "prometheus"
    assert s["envoy_version"].startswith("1.40")
    req = s["requests"]
    assert req["total"] > 100 and req["ok"] + req["errors"] == req["total"]
    assert req["errors"] < 0.01 * req["total"]
    # Soft affinity (issue 13): a turn whose endpoint is over its load bound or short of memory
    # spills (its pin stays); "sticky" = every turn on one backend: 43 and 36 of 48 in two runs on
    # the shared machine (more spills when the machine is busier and requests last longer).
    assert s["sessions"]["total"] > 10 and s["sessions"]["sticky"] >= 0.6 * s["sessions"]["total"]
    assert set(s["versions"]) == {"v1", "v2"}
    assert all(v["requests"] > 0 and v["correct"] == v["requests"] for v in s["versions"].values())
    lat = s["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]

    for cluster, endpoints in s["weights"].items():
        for address, w in endpoints.items():
            assert w["control_plane"] == w["envoy"], (cluster, address, w)
    assert Path(s["history_plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every A10-class backend ends below every A100-class one of its version.
    for b in s["backends"]:
        if b["gpu_class"] != "a10":
            continue
        cluster = s["weights"][f"chat-{b['version']}"]
        a100 = [cluster[o["address"]]["control_plane"] for o in s["backends"]
                if o["version"] == b["version"] and o["gpu_class"] == "a100"]
        assert a100 and cluster[b["address"]]["control_plane"] < min(a100), cluster
