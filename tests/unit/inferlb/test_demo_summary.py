"""What ``inferlb demo`` prints and writes at the end, and what it prints on a non-terminal while it runs."""

from __future__ import annotations

import asyncio

from inferlb import demo
from inferlb.devstack.loadgen import Result, Session, Traffic
from inferlb.output import demo_summary_text
from tests.support.factories import config

HISTORY = {"series": [
    {"cluster": "chat-v1", "endpoint": "a:1", "points": [
        {"t": 10.0, "health": "HEALTHY", "reasons": []},
        {"t": 20.0, "health": "UNHEALTHY", "reasons": ["latency_outlier: latency outlier: ...; ejected for 30 s"]},
        {"t": 50.0, "health": "HEALTHY", "reasons": ["slow start"]}]},
    {"cluster": "chat-v2", "endpoint": "b:1", "points": [
        {"t": 5.0, "health": "HEALTHY", "reasons": []}, {"t": 6.0, "health": "HEALTHY", "reasons": []}]},
]}
SUMMARY = {
    "metrics_source": "prometheus", "metrics_source_ok": True,
    "requests": {"total": 10, "ok": 9, "errors": 1, "streamed": 7},
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
    assert "metrics source: prometheus (Prometheus scraping the backends every 1 s)" in text
    assert "FAILING" not in text and "FAILING at the end of the run" in \
        demo_summary_text({**SUMMARY, "metrics_source_ok": False})
    assert "requests completed: 10 (9 ok, 1 errors, 7 streamed)" in text
    assert "3 of 4 sticky (every turn of the session answered by one backend" in text
    assert "session affinity strict (a session moves only when its backend is unhealthy" in text
    assert "session affinity soft (a turn spills" in demo_summary_text({**SUMMARY, "session_affinity": "soft"})
    assert "Envoy's weights equal the control plane's: yes, all 2 endpoints" in text
    assert "health changes: 2 (1 ejections)" in text and "chat-v1 a:1 -> UNHEALTHY: latency_outlier" in text
    apart = {**SUMMARY, "weights": {"chat-v1": {"a:1": {"control_plane": 80, "envoy": 70}}}}
    assert "Envoy's weights differ from the control plane's: chat-v1 a:1: control plane 80, Envoy 70" in \
        demo_summary_text(apart)


def _answered(traffic: Traffic, status: int = 200) -> None:
    traffic.results.append(Result(session=Session(key="s", version=None), status=status, latency_ms=5.0,
                                  served_by="127.0.0.1:1", backend_version="v1", at=0.0))


def test_on_a_non_terminal_the_live_view_is_one_progress_line_per_interval(monkeypatch, capsys):
    """Not the table every 2 s (345 lines for 60 s in issue 39): one line, then the next only after
    :data:`demo.PROGRESS_EVERY_S`; here the traffic ends first, so the next is the final one, with
    the requests completed since (the summary's count, not the first line's: a new user read the
    two apart as a contradiction)."""
    doc = {"clusters": [{"name": "chat-v1", "endpoints": [{"address": "a:1", "health": "UNHEALTHY"},
                                                          {"address": "b:1", "health": "HEALTHY"}]}]}
    assert demo.PROGRESS_EVERY_S >= 10
    traffic = Traffic()

    async def run() -> None:
        stop = asyncio.Event()

        def weights(url: str) -> dict:
            if not stop.is_set():  # the traffic ends while the first line is printed, two requests later
                _answered(traffic)
                _answered(traffic, status=503)
                stop.set()
            return doc

        monkeypatch.setattr(demo, "_get_json", weights)
        await demo._live("http://x", stop, traffic, 0.0)

    asyncio.run(run())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(x.startswith("inferlb demo  t=") for x in lines)
    assert "completed=0  errors=0" in lines[0] and lines[0].endswith("not healthy: a:1")
    assert "completed=2  errors=1  traffic done" in lines[1]
    assert traffic.summary("v1")["requests"]["total"] == 2


def test_the_demo_prints_one_metrics_source_line_the_column_legend_and_agreeing_counts(monkeypatch, tmp_path,
                                                                                       capsys):
    """``run_demo`` end to end on stand-ins for the stack: the weights table without its metrics-source
    line (the summary has the one), each weight column explained under it, and the last progress
    line's count the summary's."""
    weights = {"snapshot_version": "v", "metrics_source": {"name": "scrape", "ok": True}, "nodes": [],
               "clusters": [{"name": "chat-v1", "endpoints": [
                   {"address": "127.0.0.1:1", "weight": 72, "health": "HEALTHY", "score": 0.72,
                    "factors": {"capacity": 1.0}, "inputs": {}, "reasons": []},
                   {"address": "127.0.0.1:2", "weight": 15, "health": "HEALTHY", "score": 0.75,
                    "factors": {"capacity": 0.19}, "inputs": {}, "reasons": []}]}]}

    async def drive(*_, traffic: Traffic, **__) -> Traffic:
        for _ in range(3):
            _answered(traffic)
        return traffic

    monkeypatch.setattr(demo, "drive", drive)
    monkeypatch.setattr(demo, "start_stack", lambda work, *_: demo.DemoStack({}, [], work / "inferlb.yaml", config()))
    monkeypatch.setattr(demo, "_get_json", lambda url: weights)
    monkeypatch.setattr(demo.stack, "envoy_version", lambda: "1.0")
    monkeypatch.setattr(demo, "_settled_weights", lambda *_: {})
    monkeypatch.setattr(demo, "plot_history", lambda *_, **__: 0)
    assert demo.run_demo(duration=60, json_path=None, workdir=str(tmp_path), concurrency=1, live=True,
                         metrics_source="scrape") == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if "metrics source:" in x] == \
        ["metrics source: scrape (the control plane scraping the backends' /metrics itself)"]
    progress = [x for x in out if x.startswith("inferlb demo  t=")]
    assert progress[-1].endswith("completed=3  errors=0  traffic done")
    assert "requests completed: 3 (3 ok, 0 errors, 0 streamed)" in out
    head = next(x for x in out if x.startswith("cluster "))
    assert head.split()[:6] == ["cluster", "endpoint", "weight", "health", "score", "capacity"]
    assert next(x for x in out if "127.0.0.1:2" in x).split()[2:6] == ["15", "HEALTHY", "0.75", "0.19"]
    assert [x.split(":")[0] for x in out if x.startswith(("weight:", "score:", "capacity:"))] == \
        ["weight", "score", "capacity"]


def test_the_weights_table_ends_with_the_warnings():
    from inferlb.output import weights_table

    doc = {"clusters": [], "metrics_source": {"name": "prometheus", "ok": True}, "snapshot_version": "v",
           "warnings": [{"cluster": "chat-v1", "code": "no_healthy_endpoint",
                         "message": "cluster chat-v1 has no healthy endpoint (every endpoint is draining): ..."}]}
    assert weights_table(doc).splitlines()[-1] == \
        "WARNING: cluster chat-v1 has no healthy endpoint (every endpoint is draining): ..."
