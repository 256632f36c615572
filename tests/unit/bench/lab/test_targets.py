"""inferlb's lab targets judged on hand-made documents: each rule's edge, met and missed."""

from __future__ import annotations

from bench.lab.report import lab_section
from bench.lab.targets import targets


def _pt(qps: float, ttft: float, e2e: float = 300.0, tok: float = 100.0, err: float = 0.0, oom: float = 0.0,
        errors: dict | None = None) -> dict:
    return {"qps": qps, "ttft_p90_ms": ttft, "ttft_mean_ms": ttft, "e2e_p95_ms": e2e, "output_tokens_per_s": tok,
            "prefix_hit_rate": 0.5, "error_rate": err, "oom_rate": oom, "errors": errors or {}}


def _doc(scenarios: dict[str, dict[str, tuple[float, list[dict]]]]) -> dict:
    """``{scenario: {policy: (max_qps_within_slo, points)}}`` as a lab document."""
    return {"scenarios": {name: {"title": name, "engines": 4, "duration_s": 60.0, "warmup_s": 10.0,
                                 "policies": {pol: {"points": pts, "max_qps_within_slo": mq}
                                              for pol, (mq, pts) in pols.items()}}
                          for name, pols in scenarios.items()},
            "seed": 1, "commit": "abc", "command": "inferlb bench lab", "date": "2026-12-07 04:00 UTC",
            "slo_ttft_p90_ms": 2000.0, "wall_s": 1.0}



def _sweep(inferlb_ttft: tuple[float, float], inferlb_max: float) -> dict:
    return {"round_robin": (4.0, [_pt(4, 100), _pt(8, 40_000)]),
            "llm_d": (8.0, [_pt(4, 100), _pt(8, 200)]), "sglang_cache_aware": (4.0, [_pt(4, 90), _pt(8, 3000)]),
            "dynamo_kv": (4.0, [_pt(4, 120), _pt(8, 5000)]), "oracle": (8.0, [_pt(4, 80), _pt(8, 150)]),
            "inferlb": (inferlb_max, [_pt(4, inferlb_ttft[0]), _pt(8, inferlb_ttft[1])])}


def test_a_prefix_sweep_is_judged_against_the_best_peer_at_each_point_and_round_robin_at_the_top() -> None:
    met = targets(_doc({"shared_prefix": _sweep((94.0, 210.0), 8.0)}))
    assert [t.met for t in met] == [True, True, True]  # 94 <= 1.05 x 90 (sglang at 4); 210 <= 1.05 x 200 (llm_d at 8)
    missed = targets(_doc({"shared_prefix": _sweep((95.0, 4100.0), 4.0)}))
    assert [t.met for t in missed] == [False, False, False]  # 4 < 8; 95 > 94.5; 40 s / 4.1 s < 10
    assert "1.06 x at 4 QPS" not in missed[1].measured and "at 8 QPS" in missed[1].measured


def test_uniform_allows_3_percent_worse_and_any_better() -> None:
    def doc(ttft: float, tok: float) -> dict:
        return _doc({"uniform": {"least_request": (8.0, [_pt(8, 100, tok=1000)]),
                                 "inferlb": (8.0, [_pt(8, ttft, tok=tok)])}})
    assert targets(doc(103.0, 970.0))[0].met and targets(doc(50.0, 2000.0))[0].met
    assert not targets(doc(103.5, 1000.0))[0].met and not targets(doc(100.0, 960.0))[0].met


def test_heterogeneous_needs_1_2_x_least_request_and_the_best_peer_but_not_the_oracle() -> None:
    def doc(mine: float) -> dict:
        return _doc({"heterogeneous": {"least_request": (64.0, [_pt(64, 100)]), "llm_d": (304.0, [_pt(64, 100)]),
                                       "oracle": (400.0, [_pt(64, 50)]), "inferlb": (mine, [_pt(64, 90)])}})
    assert targets(doc(320.0))[0].met and targets(doc(304.0))[0].met and not targets(doc(256.0))[0].met


def test_the_traps_uneven_versions_and_several_gateways() -> None:
    doc = _doc({"uneven": {"round_robin": (48.0, [_pt(48, 180, e2e=350, oom=0.09, err=0.09)]),
                           "inferlb": (48.0, [_pt(48, 197, e2e=346, err=0.0003)])},
                "versions": {"inferlb": (64.0, [_pt(64, 49)])},
                "multi_gateway": {"inferlb": (48.0, [_pt(48, 197, e2e=346, err=0.0007)])}})
    assert [t.met for t in targets(doc)] == [True, True, True]  # errors 0.07 % within 0.05 points of 0.03 %
    doc["scenarios"]["multi_gateway"]["policies"]["inferlb"]["points"] = [_pt(48, 197, e2e=384, err=0.0071)]
    doc["scenarios"]["versions"]["policies"]["inferlb"]["points"] = [_pt(64, 49, errors={"wrong-version": 1})]
    doc["scenarios"]["uneven"]["policies"]["inferlb"]["points"] = [_pt(48, 197, e2e=351, err=0.0003)]
    verdicts = targets(doc)
    assert [t.met for t in verdicts] == [False, False, False]
    assert "e2e p95 384 ms against 351 ms" in verdicts[2].measured and "errors 0.71%" in verdicts[2].measured


def test_a_document_without_the_scenarios_judges_nothing_and_the_page_says_so() -> None:
    assert targets(_doc({"long_tail": {"inferlb": (8.0, [_pt(8, 50)])}})) == []
    page = lab_section(_doc({"versions": {"inferlb": (64.0, [_pt(64, 49)])}}), "plots")
    assert "| versions: no wrong-version answer | 0 wrong-version answers | met |" in page


def test_scaling_sessions_moved_is_judged_against_one_over_n_plus_five_points() -> None:
    def moved(share: float | None) -> list:
        point = {**_pt(64, 50), "sessions_moved": share}
        return targets(_doc({"scaling": {"inferlb": (64.0, [point])}}))

    [met] = moved(0.25)   # N = 4 engines + the one that joins: 1/5 + 5 % = 25 %
    assert met.met and met.what == "scaling: sessions moved on the scale-up <= 1/N + 5 %"
    assert met.measured == "25.0% against 25.0% (N = 5)"
    [missed] = moved(0.2501)
    assert not missed.met
    assert moved(None) == []   # no session answered on both sides: nothing to judge
