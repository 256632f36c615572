"""``inferlb demo`` stopped by SIGINT or SIGTERM: the traffic stops, the summary of what was measured
is written, the exit code is 128 + the signal, and the signal handlers before are back."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from inferlb import demo
from inferlb.devstack.loadgen import Result, Session, Traffic
from tests.support.factories import config

SIGNALS = [signal.SIGINT, signal.SIGTERM]


async def _drive_until_signalled(sig: int, *_, traffic: Traffic, **__) -> Traffic:
    """A ``drive`` that records one answered request, then sends ``sig`` to this process and waits."""
    traffic.results.append(Result(session=Session(key="s", version=None), status=200, latency_ms=5.0,
                                  served_by="127.0.0.1:1", backend_version="v1", at=0.0))
    os.kill(os.getpid(), sig)
    await asyncio.sleep(3600)
    return traffic


@pytest.mark.parametrize("sig", SIGNALS)
def test_traffic_stops_on_the_signal_and_keeps_what_was_measured(monkeypatch, sig):
    monkeypatch.setattr(demo, "drive", lambda *a, **k: _drive_until_signalled(sig, *a, **k))
    before = {s: signal.getsignal(s) for s in SIGNALS}
    traffic = Traffic()
    assert asyncio.run(demo._traffic(60, 1, "http://127.0.0.1:1", False, traffic)) == sig
    assert len(traffic.results) == 1
    assert {s: signal.getsignal(s) for s in SIGNALS} == before


@pytest.mark.parametrize("sig", SIGNALS)
def test_run_demo_writes_the_summary_and_exits_128_plus_the_signal(monkeypatch, tmp_path, capsys, sig):
    cfg = config()
    monkeypatch.setattr(demo, "drive", lambda *a, **k: _drive_until_signalled(sig, *a, **k))
    monkeypatch.setattr(demo, "start_stack", lambda work, *_: demo.DemoStack({}, [], work / "inferlb.yaml", cfg))
    monkeypatch.setattr(demo, "_get_json", lambda url: {"metrics_source": {"name": "scrape", "ok": True},
                                                           "nodes": []})
    monkeypatch.setattr(demo.stack, "envoy_version", lambda: "1.0")
    monkeypatch.setattr(demo, "_settled_weights", lambda *_: {})
    monkeypatch.setattr(demo, "weights_table", lambda _doc, **_: "")
    monkeypatch.setattr(demo, "plot_history", lambda *_, **__: 0)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "summary.json"
    code = demo.run_demo(duration=60, json_path=str(out), workdir=str(tmp_path / "w"), concurrency=1, live=False,
                         metrics_source="scrape")
    assert code == 128 + sig
    summary = json.loads(out.read_text())
    assert summary["stopped_by"] == signal.Signals(sig).name
    assert summary["requests"]["total"] == 1 and summary["traffic_s"] < 60
    assert f"inferlb demo: {signal.Signals(sig).name}; traffic stopped" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before
