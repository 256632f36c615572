"""``inferlb bench picker``'s pure parts: the Envoy config of its variants, the wrk script, the summary."""

from __future__ import annotations

import copy
import json

import yaml

from bench import picker as bp

PORTS = {name: 20000 + i for i, name in enumerate([
    "upstream", "upstream_with", "upstream_without", "upstream_null", "upstream_null_routed", "direct_with",
    "direct_without", "direct_null", "direct_null_routed"])}


def _listeners(body_kb: int = 0) -> dict[str, dict]:
    doc = yaml.safe_load(bp.envoy_bootstrap(18000, 18001, 18002, PORTS, 18003, body_kb, 18004))
    return {lst["name"]: lst["filter_chains"][0]["filters"][0]["typed_config"]
            for lst in doc["static_resources"]["listeners"]}


def _without_cluster(hcm: dict) -> dict:
    hcm = copy.deepcopy(hcm)
    hcm.pop("stat_prefix")
    hcm.pop("route_config")
    hcm["http_filters"][0]["typed_config"]["grpc_service"]["envoy_grpc"].pop("cluster_name")
    hcm["access_log"][0]["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"].pop("cluster_name")
    return hcm


def test_null_listeners_copy_the_picker_listeners_filter_config():
    for body_kb in (0, 20):
        hcms = _listeners(body_kb)
        picker = _without_cluster(hcms["direct_with"])
        assert picker["http_filters"][0]["typed_config"]["allow_mode_override"] is bool(body_kb)
        for name in ("direct_null", "direct_null_routed", "upstream_null", "upstream_null_routed"):
            assert _without_cluster(hcms[name]) == picker, name
        assert hcms["direct_null"]["http_filters"][0]["typed_config"]["grpc_service"]["envoy_grpc"][
            "cluster_name"] == "bench_null"
        assert len(hcms["direct_without"]["http_filters"]) == 1  # the router only


def test_wrk_script_alternates_session_and_plain_requests(tmp_path):
    text = bp.wrk_script(tmp_path / "s.lua", sessions=8).read_text()
    assert "k % 2 == 0" in text and '"bench-session-" .. (k % 8)' in text and "for k = 1, 16 do" in text
    body = bp.wrk_script(tmp_path / "b.lua", body_kb=20)
    doc = json.loads(body.with_suffix(".body.json").read_text())
    assert 19 * 1024 < len(json.dumps(doc)) <= 20 * 1024 + 200 and doc["model"] == "bench"
    assert '"POST"' in body.read_text() and '[==[{"model": "bench"' in body.read_text()


def _run(rps: float, p50: float, cpu: float = 10.0, envoy: float = 20.0) -> dict:
    return {"requests": int(rps * 5), "rps": rps, "p50_ms": p50, "p99_ms": 2 * p50, "non_2xx": 0,
            "socket_errors": 0, "python_cpu_us_per_request": cpu, "envoy_cpu_us_per_request": envoy}


def test_summary_takes_per_round_ratios_then_medians():
    rounds = []
    for i, (null, picker) in enumerate([(1000, 800), (2000, 1000), (1000, 900)]):
        conns = {v: _run(r, 0.1 * (j + 1)) for j, (v, r) in
                 enumerate(zip(bp.VARIANTS, (5000, null, null, picker), strict=True))}
        rounds.append({"round": i + 1, "16conn": conns, "1conn": copy.deepcopy(conns)})
    s = bp._summary(rounds)
    assert s["rps_ratio_to_null"] == 0.8  # ratios 0.8, 0.5, 0.9: median of the ratios
    assert s["rps_null_ext_proc"] == 1000 and s["rps_with_picker"] == 900
    assert s["spread"]["rps_ratio_to_null"] == {"median": 0.8, "min": 0.5, "max": 0.9}
    assert abs(s["added_p50_ms"] - 0.3) < 1e-9  # picker (4th) 0.4 minus without (1st) 0.1
    assert abs(s["null_added_p99_ms"] - 0.2) < 1e-9  # null (2nd) p99 0.4 minus without 0.2
    assert abs(s["null_routed_added_p99_ms"] - 0.4) < 1e-9 and abs(s["added_p99_ms"] - 0.6) < 1e-9
    assert set(s["envoy_cpu_us_per_request"]) == set(bp.VARIANTS) and s["errors"] == 0
    doc = {"transport": "fast", "workers": 1, "envoy_concurrency": 1, "date": "d", "wrk": "w", "duration_s": 5,
           "runs": 3, "machine": {"cores": 2, "cpu": "x", "python": "3", "envoy": "1", "load_average_1m_at_end": 1},
           "route_kinds": {"direct_response": s}, "targets": {}, "envoy_ext_proc_stats": {},
           "session_table_bytes_per_session": 1}
    assert "| direct_response | 5,000 [5,000–5,000] | 1,000 [1,000–2,000] |" in bp.markdown(doc, "cmd")


def test_summary_with_a_before_picker_compares_it_in_each_round():
    variants = (*bp.VARIANTS, bp.BEFORE)
    rounds = []
    for i, (picker, before) in enumerate([(900, 600), (1000, 800), (800, 800)]):
        conns = {v: _run(r, 0.1 * (j + 1), cpu=50.0 if v == bp.BEFORE else 30.0) for j, (v, r) in
                 enumerate(zip(variants, (5000, 1000, 1000, picker, before), strict=True))}
        rounds.append({"round": i + 1, "16conn": conns, "1conn": copy.deepcopy(conns)})
    s = bp._summary(rounds, variants)
    b = s["before"]
    assert b["rps_with_picker"] == 800 and b["rps_ratio_to_null"] == 0.8
    assert b["rps_after_over_before"] == 1.25  # ratios 1.5, 1.25, 1.0
    assert b["python_cpu_us_per_decision"] == 50.0 and s["python_cpu_us_per_decision"] == 30.0
    assert abs(b["added_p50_ms"] - 0.4) < 1e-9  # picker_before (5th) 0.5 minus without 0.1
    assert "before" not in bp._summary(rounds)  # without the variant: the plain summary
