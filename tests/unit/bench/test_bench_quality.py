"""The quality benchmark's pure parts: trace, figures, policy configs, report."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from bench.quality import figures, report
from bench.quality.figures import RunWindow
from bench.quality.policies import BASELINES, POLICIES, baseline_bootstrap, eds_document, inferlb_config
from bench.quality.scenarios import SCENARIOS, Traffic
from bench.quality.trace import MEMORY_HEADER, TraceRequest, build_trace, session_key, to_planned
from inferlb.devstack.loadgen import Result, Session, error_kind
from inferlb.devstack.stack import envoy_binary
from xds_server.config import parse_config

# --- trace ----------------------------------------------------------------------------------------


def test_same_seed_same_trace_other_seed_other_trace():
    t = Traffic(rps=40, anon_share=0.3)
    assert build_trace(t, 20, 7) == build_trace(t, 20, 7)
    assert build_trace(t, 20, 7) != build_trace(t, 20, 8)


def test_trace_is_sorted_in_range_with_the_mean_rate_and_anonymous_share():
    t = Traffic(rps=50, anon_share=0.25, turns=(3, 7), think_s=0.4)
    tr = build_trace(t, 200, 3)
    assert [r.at_s for r in tr] == sorted(r.at_s for r in tr)
    assert all(0 <= r.at_s < 200 for r in tr)
    assert 0.85 * 50 * 200 < len(tr) < 1.15 * 50 * 200
    anon = sum(1 for r in tr if r.session is None)
    assert 0.2 < anon / len(tr) < 0.3


def test_a_session_keeps_its_version_and_its_turns_come_in_order():
    t = Traffic(rps=30, versions=(("v1", 0.5), ("v2", 0.3), (None, 0.2)), turns=(2, 9))
    tr = build_trace(t, 60, 5)
    by_session: dict[int, list[TraceRequest]] = {}
    for r in tr:
        if r.session is not None:
            by_session.setdefault(r.session, []).append(r)
    assert len(by_session) > 50
    for reqs in by_session.values():
        assert len({r.version for r in reqs}) == 1
        turns = [r.turn for r in reqs]
        assert turns == sorted(turns) and turns == list(range(turns[0], turns[0] + len(turns)))
        assert len(reqs) <= 9
    assert {r.version for r in tr} == {"v1", "v2", None}


def test_bursts_concentrate_arrivals_and_keep_the_mean():
    t = Traffic(rps=40, anon_share=1.0, burst=(4.0, 1.0, 3.0))
    tr = build_trace(t, 400, 11)
    inside = sum(1 for r in tr if r.at_s % 4.0 < 1.0)
    outside = len(tr) - inside
    # per second: inside 3x the rate outside
    assert 2.5 < (inside / 1.0) / (outside / 3.0) < 3.5
    assert 0.9 * 40 * 400 < len(tr) < 1.1 * 40 * 400


def test_memory_classes_follow_their_shares():
    t = Traffic(rps=40, memory_mib=((8192.0, 0.7), (18432.0, 0.3)))
    tr = build_trace(t, 100, 2)
    large = sum(1 for r in tr if r.memory_mib == 18432.0) / len(tr)
    assert 0.25 < large < 0.35 and all(r.memory_mib in (8192.0, 18432.0) for r in tr)


@pytest.mark.parametrize("bad", [dict(rps=0), dict(rps=10, turns=(0, 3)), dict(rps=10, turns=(5, 3))])
def test_bad_traffic_is_refused(bad):
    with pytest.raises(ValueError):
        build_trace(Traffic(**bad), 10, 1)


def test_planned_requests_carry_prefixed_session_keys_and_the_memory_header():
    tr = [TraceRequest(0.5, 3, 0, "v2", 8192.0), TraceRequest(0.7, None, 0, None, None)]
    p = to_planned(tr, "ring_hash-9", Traffic(rps=1, max_tokens=32))
    assert p[0].session == Session(session_key("ring_hash-9", 3), "v2") and p[0].session.key == "ring_hash-9-s00003"
    assert p[0].headers == {MEMORY_HEADER: "8192"} and p[0].max_tokens == 32 and p[0].at_s == 0.5
    assert p[1].session == Session(None, None) and p[1].headers == {}
    assert p[0].messages[0]["role"] == "system" and p[0].messages[0]["content"].startswith("[ring_hash-9] system")
    assert not to_planned(tr, "x", Traffic(rps=1, session_header=False))[0].session.key


def test_resent_conversations_grow_by_whole_turns_and_share_their_prefix_text():
    from sim.protocol import render_prompt
    from sim.tokens import tokenize

    t = Traffic(rps=1, system_tokens=100, user_tokens=20, max_tokens=8)
    turns = [TraceRequest(float(k), 4, k, None, None, stream=True) for k in range(3)]
    planned = to_planned(turns, "run-a", t)
    assert [len(p.messages) for p in planned] == [2, 4, 6] and all(p.stream for p in planned)
    texts = [render_prompt("chat", {"messages": p.messages}) for p in planned]
    for a, b in zip(texts, texts[1:], strict=False):
        assert b.startswith(a[: -len("<|assistant|>\n")])
    assert len(tokenize(texts[0])) == pytest.approx(100 + 20 + 8, abs=4)
    other = render_prompt("chat", {"messages": to_planned(turns[:1], "run-b", t)[0].messages})
    assert tokenize(other)[:16] != tokenize(texts[0])[:16]  # another run: another first block


def test_a_conversation_opens_with_its_own_context_which_every_later_turn_resends():
    from sim.protocol import render_prompt
    from sim.tokens import tokenize

    t = Traffic(rps=1, system_tokens=50, opening_tokens=300, user_tokens=20, max_tokens=8)
    turns = [TraceRequest(float(k), s, k, None, None) for s in (1, 2) for k in range(3)]
    planned = to_planned(turns, "run", t)
    sizes = [[len(tokenize(m["content"])) for m in p.messages] for p in planned]
    assert sizes[2] == [50, 300, 8, 20, 8, 20]  # the opening message, then turns of user_tokens
    first_1, first_2 = (render_prompt("chat", {"messages": planned[i].messages}) for i in (0, 3))
    shared = len(render_prompt("chat", {"messages": planned[0].messages[:1]}))
    assert first_1[:shared] == first_2[:shared] and first_1[shared:] != first_2[shared:]  # the app's prompt only
    single = to_planned([TraceRequest(0.0, None, 0, None, None)], "run", t)[0]
    assert len(tokenize(single.messages[1]["content"])) == 300  # a single request is a one-turn conversation


def test_tenants_share_one_system_prompt_and_streams_follow_the_share():
    t = Traffic(rps=40, anon_share=1.0, tenants=5, system_tokens=50, resend=False, stream_share=0.8)
    tr = build_trace(t, 50, 3)
    assert {r.tenant for r in tr} == set(range(5))
    assert 0.75 < sum(r.stream for r in tr) / len(tr) < 0.85
    planned = to_planned(tr, "k", t)
    by_tenant = {}
    for r, p in zip(tr, planned, strict=True):
        by_tenant.setdefault(r.tenant, set()).add(p.messages[0]["content"])
    assert all(len(v) == 1 for v in by_tenant.values()) and len({next(iter(v)) for v in by_tenant.values()}) == 5


# --- figures --------------------------------------------------------------------------------------


def res(i: int, status: int = 200, latency: float = 10.0, node: str | None = "a", version: str | None = "v1",
        session: Session | None = None, at: float = 100.0, error: str | None = None) -> Result:
    ok = status == 200
    return Result(session or Session("k", "v1"), status, latency, node if ok else None, version if ok else None,
                  at, error, i)


W = RunWindow(started=90.0, warmup_s=1.0, default_version="v1", multi_version=True)


def test_latency_errors_ooms_timeouts_over_measured_requests_only():
    trace = [TraceRequest(0.5, None, 0, None, None)] + [TraceRequest(1.0 + i, None, 0, None, None) for i in range(10)]
    results = [res(0, latency=9999.0, at=91.0)]  # warm-up: ignored
    results += [res(i + 1, latency=float(10 * (i + 1)), at=92.0 + i) for i in range(7)]
    results += [res(8, 500, error="oom"), res(9, 0, error="timeout"), res(10, 503, error="http_503", at=101.0)]
    f = figures.compute(trace, results, W)
    assert f["requests"] == 10
    assert f["p50_ms"] == 40.0 and f["p99_ms"] == 70.0 and f["mean_ms"] == 40.0
    assert f["error_rate"] == pytest.approx(0.3)
    assert f["oom_rate"] == pytest.approx(0.1) and f["timeout_rate"] == pytest.approx(0.1)
    # 7 ok answers between the end of warm-up (t = 91) and the last answer (t = 98)
    assert f["throughput_rps"] == pytest.approx(7 / 7.0)
    assert f["sessions_moved"] is None


def test_wrong_version_counts_answers_from_another_version_and_no_header_means_default():
    trace = [TraceRequest(2.0, None, 0, v, None) for v in ("v1", "v2", None, "v2")]
    results = [res(0, version="v1", session=Session(None, "v1")), res(1, version="v1", session=Session(None, "v2")),
               res(2, version="v2", session=Session(None, None)), res(3, version="v2", session=Session(None, "v2"))]
    assert figures.compute(trace, results, W)["wrong_version"] == pytest.approx(0.5)
    single = RunWindow(started=90.0, warmup_s=1.0, default_version="v1", multi_version=False)
    assert figures.compute(trace, results, single)["wrong_version"] is None


def test_session_hit_means_a_node_that_served_the_session_before():
    # session 1: a, a, b, a -> turns 2..4 counted: hit, miss, hit; session 2: only one turn -> not counted.
    trace = [TraceRequest(1.0 + t, 1, t, "v1", None) for t in range(4)] + [TraceRequest(2.5, 2, 0, "v1", None)]
    results = [res(i, node=n) for i, n in enumerate("aaba")] + [res(4, node="c")]
    assert figures.session_hit_rate(trace, results, warmup_s=0.0) == pytest.approx(2 / 3)
    # failed turns build no history and are not counted
    results[1] = res(1, 500, error="oom")
    assert figures.session_hit_rate(trace, results, warmup_s=0.0) == pytest.approx(1 / 2)
    # warm-up turns build history but are not counted: only turn 3 (a, seen) counts
    assert figures.session_hit_rate(trace, results, warmup_s=3.5) == 1.0
    assert figures.session_hit_rate(trace[4:], [res(0, node="c")], warmup_s=0.0) is None


def test_sessions_moved_compares_the_last_node_before_and_after_the_scale_up():
    trace, results = [], []

    def turn(session: int, at: float, node: str) -> None:
        trace.append(TraceRequest(at, session, len([t for t in trace if t.session == session]), "v1", None))
        results.append(res(len(trace) - 1, node=node))

    for s, (before, after) in enumerate([("a", "a"), ("b", "e"), ("c", "c"), ("d", "d")]):
        turn(s, 1.0, "x")
        turn(s, 4.0, before)  # last before the scale-up at 5
        turn(s, 6.0, after)
        turn(s, 20.0, "z")  # after the next event at 10: not looked at
    turn(9, 7.0, "a")  # only after: not counted
    assert figures.sessions_moved(trace, results, 5.0, 10.0) == pytest.approx(1 / 4)
    w = RunWindow(started=0.0, warmup_s=0.0, default_version="v1", multi_version=False, scale_up_s=5.0,
                  next_event_s=10.0)
    assert figures.compute(trace, results, w)["sessions_moved"] == pytest.approx(1 / 4)


def test_results_need_their_trace_index():
    with pytest.raises(ValueError, match="index"):
        figures.compute([TraceRequest(0, None, 0, None, None)], [Result(Session(None, None), 200, 1, "a", "v1", 0)], W)


@pytest.mark.parametrize(("status", "body", "kind"), [
    (200, b"{}", None), (500, b'{"error": {"type": "oom", "message": "CUDA out of memory"}}', "oom"),
    (400, b'{"error": "unknown model version"}', "http_400"), (503, b"no healthy upstream", "http_503"),
    (503, b'{"error": {"message": "no healthy upstream", "type": "server_error", "param": null, '
          b'"code": "no_healthy_upstream"}}', "no_healthy_upstream"),
    (502, b"[1, 2]", "http_502"),
])
def test_error_kind(status, body, kind):
    assert error_kind(status, body) == kind


# --- policies -------------------------------------------------------------------------------------


def boot(policy: str, tmp_path) -> dict:
    return baseline_bootstrap(policy, listener_port=10555, admin_port=10556, eds_path=str(tmp_path / "eds" / "c.json"),
                              eds_dir=str(tmp_path / "eds"), route_timeout_s=3.0)


@pytest.mark.parametrize(("policy", "lb"), [("round_robin", "ROUND_ROBIN"), ("least_request", "LEAST_REQUEST"),
                                            ("ring_hash", "RING_HASH"), ("ring_hash_bounded", "RING_HASH")])
def test_baselines_are_one_file_eds_cluster_with_their_lb_policy(policy, lb, tmp_path):
    b = boot(policy, tmp_path)
    [cluster] = b["static_resources"]["clusters"]
    assert cluster["lb_policy"] == lb and cluster["type"] == "EDS"
    assert cluster["eds_cluster_config"]["eds_config"]["path_config_source"]["path"].endswith("c.json")
    [listener] = b["static_resources"]["listeners"]
    [route] = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["cluster"] == cluster["name"] and route["route"]["timeout"] == "3.000s"
    assert ("hash_policy" in route["route"]) == policy.startswith("ring_hash")
    if policy.startswith("ring_hash"):
        assert route["route"]["hash_policy"] == [{"header": {"header_name": "x-session-id"}}]
    bounded = cluster.get("common_lb_config", {}).get("consistent_hashing_lb_config", {})
    assert bounded.get("hash_balance_factor") == (150 if policy == "ring_hash_bounded" else None)


def test_eds_document_lists_the_endpoints():
    doc = eds_document(["127.0.0.1:1", "127.0.0.1:2"])
    [cla] = doc["resources"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in cla["endpoints"][0]["lb_endpoints"]] \
        == [1, 2]
    assert doc["version_info"] != eds_document(["127.0.0.1:1"])["version_info"]


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("picker", [True, False])
def test_inferlb_config_of_every_scenario_is_valid(name, picker):
    sc = SCENARIOS[name]
    addresses = [f"127.0.0.1:{20000 + i}" for i in range(len(sc.nodes))]
    cfg = parse_config(yaml.safe_dump(inferlb_config(sc, addresses, picker=picker, prometheus_url="http://127.0.0.1:9",
                                                     xds_port=1, admin_port=2, listener_port=3, route_timeout_s=4)))
    assert cfg.envoy.picker is picker
    [svc] = cfg.services
    listed = {e.address: (v.name, e.gpu_class) for v in svc.versions for e in v.endpoints}
    assert listed == {a: (n.version, n.gpu_class) for a, n in zip(addresses, sc.nodes, strict=True)}
    assert svc.default == sc.default_version
    for k, v in sc.engine.items():
        assert getattr(cfg.engine, k) == v


@pytest.mark.integration
@pytest.mark.parametrize("policy", BASELINES)
def test_real_envoy_accepts_every_baseline_bootstrap(policy, tmp_path):
    (tmp_path / "eds").mkdir()
    (tmp_path / "eds" / "c.json").write_text(yaml.safe_dump(eds_document(["127.0.0.1:1"])))
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(boot(policy, tmp_path)))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# --- report ---------------------------------------------------------------------------------------


def _figs(**kw) -> dict:
    base = {k: 0.0 for k in figures.FIGURES} | {"p95_ms": 100.0, "throughput_rps": 50.0, "wrong_version": None,
                                                 "sessions_moved": None, "session_hit_rate": 0.5}
    return base | kw


def test_targets_say_met_missed_and_by_how_much():
    store = {"scenarios": {
        "uneven": {"inferlb_full": _figs(oom_rate=0.1), "round_robin": _figs()},
        "versions": {"inferlb_full": _figs(wrong_version=0.0), "round_robin": _figs(throughput_rps=60.0)},
        "long_tail": {"inferlb_full": _figs(p95_ms=50.0), "least_request": _figs(p95_ms=100.0)},
        "sessions": {"inferlb_full": _figs(session_hit_rate=0.995)},
        "scaling": {"inferlb_full": _figs(sessions_moved=0.5)},
    }}
    rows = {t: (m, v) for t, m, v in report.targets(store)}
    assert rows["0 OOMs"][1] == "missed (worst 10.0 % in uneven)"
    assert rows["0 wrong-version responses"][1] == "met"
    assert rows["p95 ≤ 0.6 × least_request (long_tail)"] == ("50.0 ms vs 100 ms = 0.50 ×", "met")
    assert rows["p95 ≤ 0.6 × least_request (heterogeneous)"][1] == "not measured"
    assert rows["session hit rate ≥ 99 % (sessions)"] == ("99.50 %", "met")
    just_under = {"scenarios": {"sessions": {"inferlb_full": _figs(session_hit_rate=0.9896)}}}
    assert dict((t, (m, v)) for t, m, v in report.targets(just_under))["session hit rate ≥ 99 % (sessions)"] == (
        "98.96 %", "missed (by 0.04 points)")
    moved = next(k for k in rows if k.startswith("sessions moved"))
    assert rows[moved][1] == "missed (by 25.0 points)"
    assert rows["throughput within 5 % of the best baseline"][1] == "missed (versions: 11.7 points short)"


def test_merge_replaces_one_scenario_and_keeps_the_canonical_order():
    s = report.merge(None, "versions", {"round_robin": _figs()}, {"command": "a"})
    s = report.merge(s, "uneven", {"round_robin": _figs()}, {"command": "b"})
    s = report.merge(s, "versions", {"ring_hash": _figs()}, {"command": "c"})
    assert list(s["scenarios"]) == ["uneven", "versions"]
    assert list(s["scenarios"]["versions"]) == ["ring_hash"] and s["runs"]["versions"] == {"command": "c"}
    assert report.json_document(s, ["versions"]) == {"scenarios": {"versions": {"ring_hash": _figs()}},
                                                     "runs": {"versions": {"command": "c"}}}


def test_section_is_replaced_between_markers_and_text_around_it_is_kept(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Picker\nkeep me\n")
    report.write_section(md, f"{report.BEGIN}\nfirst\n{report.END}\n")
    md.write_text(md.read_text() + "\n## Notes\nkeep me too\n")
    report.write_section(md, f"{report.BEGIN}\nsecond\n{report.END}\n")
    text = md.read_text()
    assert "first" not in text and "second" in text and text.count(report.BEGIN) == 1
    assert "## Picker\nkeep me" in text and "## Notes\nkeep me too" in text
    new = tmp_path / "new.md"
    report.write_section(new, f"{report.BEGIN}\nx\n{report.END}\n")
    assert new.read_text().startswith("# Benchmarks\n")


def test_scenario_table_has_a_row_per_policy_in_order_and_dashes_for_null():
    table = report.scenario_table({p: _figs(requests=10) for p in reversed(POLICIES)})
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == list(POLICIES)
    assert "| – |" in rows[0]  # wrong_version null


# --- rounds, spreads, streamed figures ------------------------------------------------------------


def test_rounds_run_every_policy_once_with_the_order_rotated():
    from bench.quality.runner import round_orders

    orders = round_orders(["a", "b", "c"], 4)
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(sorted(o) == ["a", "b", "c"] for o in orders) and round_orders([], 2) == []


def test_figures_are_medians_over_rounds_with_their_spread():
    assert report.median([3.0, None, 1.0, 2.0]) == 2.0 and report.median([1.0, 4.0]) == 2.5
    assert report.median([None]) is None
    agg = report.aggregate([_figs(p95_ms=100.0), _figs(p95_ms=140.0), _figs(p95_ms=90.0)])
    assert agg["p95_ms"] == 100.0 and agg["rounds"] == 3 and agg["by_round"]["p95_ms"] == [100.0, 140.0, 90.0]
    assert report.spread(agg, "p95_ms") == (90.0, 140.0)
    assert report.overlap((90.0, 140.0), (130.0, 200.0)) and not report.overlap((90.0, 120.0), (130.0, 200.0))
    table = report.scenario_table({"round_robin": agg})
    assert "| round_robin |" in table and "100<br><small>90.0–140</small>" in table


def test_comparison_targets_count_only_differences_beyond_the_spreads():
    both = report.aggregate
    store = {"scenarios": {
        "uneven": {"inferlb_full": both([_figs(p95_ms=200.0), _figs(p95_ms=210.0)]),
                   "round_robin": both([_figs(p95_ms=100.0), _figs(p95_ms=120.0)]),
                   "least_request": both([_figs(p95_ms=190.0), _figs(p95_ms=205.0)]),
                   "inferlb_eds": both([_figs(p95_ms=150.0), _figs(p95_ms=195.0)])},
        "shared_prefix": {"inferlb_full": _figs(prefix_hit_rate=0.8, ttft_p90_ms=40.0),
                          "least_request": _figs(prefix_hit_rate=0.3, ttft_p90_ms=100.0)},
    }}
    rows = {t: (m, v) for t, m, v in report.targets(store)}
    measured, verdict = rows["as good as the best baseline on p95, TTFT p90 and errors, every scenario"]
    assert verdict == "missed" and "uneven p95 (205 ms vs 110 ms round_robin)" in measured
    assert rows["inferlb_eds never worse than least_request (p95, TTFT p90, errors)"][1] == "met"  # overlap
    assert rows["prefix hits ≥ 2 × least_request (shared_prefix)"] == ("80.0 % vs 30.0 % = 2.67 ×", "met")
    assert rows["TTFT p90 ≤ 0.5 × least_request (shared_prefix)"] == ("40.0 ms vs 100 ms = 0.40 ×", "met")
    assert rows["prefix hits ≥ 2 × least_request (chat_resend)"][1] == "not measured"
    assert rows["p95 ≤ least_request's (sessions)"][1] == "not measured"


def test_a_ratio_is_not_claimed_when_the_spreads_overlap():
    full = report.aggregate([_figs(p95_ms=50.0), _figs(p95_ms=120.0)])
    lr = report.aggregate([_figs(p95_ms=100.0), _figs(p95_ms=110.0)])
    rows = {t: (m, v) for t, m, v in report.targets({"scenarios": {"long_tail": {"inferlb_full": full,
                                                                                 "least_request": lr}}})}
    assert rows["p95 ≤ 0.6 × least_request (long_tail)"][1] == "not claimed (the spreads over rounds overlap)"


def test_streamed_figures_ttft_tpot_tokens_and_backend_counters():
    trace = [TraceRequest(1.0 + i, None, 0, None, None, stream=i < 4) for i in range(6)]
    results = [Result(Session(None, None), 200, 100.0 + i, "a", "v1", 95.0 + i, None, i, stream=i < 4,
                      ttft_ms=10.0 * (i + 1) if i < 4 else None, tpot_ms=2.0 if i < 4 else None,
                      completion_tokens=16) for i in range(6)]
    f = figures.compute(trace, results, W, figures.BackendCounters(1000, 250, 3))
    assert (f["ttft_p50_ms"], f["ttft_p90_ms"], f["ttft_p99_ms"]) == (20.0, 40.0, 40.0)
    assert f["tpot_p50_ms"] == 2.0 and f["streamed"] == 4
    assert f["prefix_hit_rate"] == 0.25 and f["preemptions"] == 3
    assert f["output_tokens_per_s"] == pytest.approx(16 * f["throughput_rps"])
    assert figures.compute(trace, results, W)["prefix_hit_rate"] is None


def test_the_multi_gateway_targets_compare_with_one_gateway_and_claim_the_1_over_n_effect_only_apart():
    from bench.quality.report import gateway_targets

    def fig(peaks, ooms):
        return {"peak_in_flight": sorted(peaks)[len(peaks) // 2], "oom_rate": sorted(ooms)[len(ooms) // 2],
                "rounds": len(peaks), "by_round": {"peak_in_flight": peaks, "oom_rate": ooms}}

    store = {"scenarios": {"multi_gateway": {
        "inferlb_one_gateway": fig([10, 10], [0.0, 0.0]),
        "inferlb_shared_view": fig([11, 11], [0.0, 0.0]),
        "inferlb_no_shared_view": fig([10, 11], [0.01, 0.03]),
    }}}
    rows = gateway_targets(store)
    assert [v for _, _, v in rows] == ["met", "met", "shows"]
    store["scenarios"]["multi_gateway"]["inferlb_no_shared_view"] = fig([10, 11], [0.0, 0.01])
    store["scenarios"]["multi_gateway"]["inferlb_shared_view"] = fig([12, 13], [0.0, 0.02])
    assert [v for _, _, v in gateway_targets(store)] == ["missed", "missed", "does not show"]
    assert gateway_targets({"scenarios": {}}) == []
