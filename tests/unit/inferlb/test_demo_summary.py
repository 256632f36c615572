"""What ``inferlb demo`` prints and writes at the end, and what it prints on a non-terminal while it runs."""

from __future__ import annotations

import asyncio

from inferlb import demo
from inferlb.devstack.loadgen import Traffic
from inferlb.output import demo_summary_text

HISTORY = {"series": [
    {"cluster": "chat-v1", "endpoint": "a:1", "points": [
        {"t": 10.0, "health": "HEALTHY", "reasons": []},
        {"t": 20.0, "health": "UNHEALTHY", "reasons": ["latency_outlier: latency outlier: ...; ejected for 30 s"]},
        {"t": 50.0, "health": "HEALTHY", "reasons": ["slow start"]}]},
    {"cluster": "chat-v2", "endpoint": "b:1", "points": [
        {"t": 5.0, "health": "HEALTHY", "reasons": []}, {"t": 6.0, "health": "HEALTHY", "reasons": []}]},
]}
SUMMARY = {
    "metrics_source": "prometheus", "requests": {"total": 10, "ok": 9, "errors": 1, "streamed": 7},
    "sessions": {"total": 4, "sticky": 3}, "session_affinity": "strict",
    "versions": {"v1": {"requests": 5, "correct": 5}},
    "latency_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0}, "ttft_ms": {"p50": 2.0, "p90": 4.0, "p99": 5.0},
    "weights": {"chat-v1": {"a:1": {"control_plane": 80, "envoy": 80}, "b:1": {"control_plane": 40, "envoy": 40}}},
}


def test_health_changes_are_every_change_of_an_endpoints_health():
    changes = demo.health_changes(HISTORY)
    assert [(c["t"], c["endpoint"], c["health"]) for c in changes] == [(20.0, "a:1", "UNHEALTHY"),
                                                                        (50.0, "a:1", "HEALTHY")]
    assert changes[0]["reason"].startswith("latency_outlier")
    assert demo.health_changes({"series": []}) == []


def test_the_printed_summary_says_what_sticky_means_the_weight_check_and_the_metrics_source():
    changes = demo.health_changes(HISTORY)
    text = demo_summary_text({**SUMMARY, "health_changes": changes, "ejections": 1})
    assert "metrics source: prometheus" in text
    assert "3 of 4 sticky (every turn of the session answered by one backend" in text
    assert "session affinity strict (a session moves only when its backend is unhealthy" in text
    assert "session affinity soft (a turn spills" in demo_summary_text({**SUMMARY, "session_affinity": "soft"})
    assert "Envoy's weights equal the control plane's: yes, all 2 endpoints" in text
    assert "health changes: 2 (1 ejections)" in text and "chat-v1 a:1 -> UNHEALTHY: latency_outlier" in text
    apart = {**SUMMARY, "weights": {"chat-v1": {"a:1": {"control_plane": 80, "envoy": 70}}}}
    assert "Envoy's weights differ from the control plane's: chat-v1 a:1: control plane 80, Envoy 70" in \
        demo_summary_text(apart)


def test_on_a_non_terminal_the_live_view_is_one_progress_line_per_interval(monkeypatch, capsys):
    """Not the table every 2 s (345 lines for 60 s in issue 39): one line, then the next only after
    :data:`demo.PROGRESS_EVERY_S` (here the traffic ends first)."""
    doc = {"clusters": [{"name": "chat-v1", "endpoints": [{"address": "a:1", "health": "UNHEALTHY"},
                                                          {"address": "b:1", "health": "HEALTHY"}]}]}
    assert demo.PROGRESS_EVERY_S >= 10

    async def run() -> None:
        stop = asyncio.Event()

        def weights(url: str) -> dict:
            stop.set()  # the traffic ends while the first line is printed
            return doc

        monkeypatch.setattr(demo, "_get_json", weights)
        await demo._live("http://x", stop, Traffic(), 0.0)

    asyncio.run(run())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("inferlb demo  t=") and lines[0].endswith("not healthy: a:1")


def test_the_weights_table_ends_with_the_warnings():
    from inferlb.output import weights_table

    doc = {"clusters": [], "metrics_source": {"name": "prometheus", "ok": True}, "snapshot_version": "v",
           "warnings": [{"cluster": "chat-v1", "code": "no_healthy_endpoint",
                         "message": "cluster chat-v1 has no healthy endpoint (every endpoint is draining): ..."}]}
    assert weights_table(doc).splitlines()[-1] == \
        "WARNING: cluster chat-v1 has no healthy endpoint (every endpoint is draining): ..."
