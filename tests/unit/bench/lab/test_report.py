"""The lab's stored results: a run of some rows replaces only those (``merge_results``)."""

from __future__ import annotations

from bench.lab.report import lab_section, merge_results


def _doc(rows: dict[str, dict[str, float]], commit: str, command: str = "inferlb bench lab") -> dict:
    """A lab document with one point per (scenario, policy): ``{scenario: {policy: ttft_p90_ms}}``."""
    return {"scenarios": {name: {"title": name, "engines": 4, "duration_s": 60.0, "warmup_s": 10.0,
                                 "policies": {pol: {"points": [{"qps": 8.0, "ttft_p90_ms": v, "ttft_mean_ms": v,
                                                                "output_tokens_per_s": 100.0, "prefix_hit_rate": 0.5,
                                                                "error_rate": 0.0, "oom_rate": 0.0}],
                                                    "max_qps_within_slo": 8.0}
                                              for pol, v in pols.items()}}
                          for name, pols in rows.items()},
            "seed": 1, "commit": commit, "command": command, "date": "2026-12-06 10:00 UTC",
            "slo_ttft_p90_ms": 2000.0, "wall_s": 60.0}


def _ttft(doc: dict, name: str, pol: str) -> float:
    return doc["scenarios"][name]["policies"][pol]["points"][0]["ttft_p90_ms"]


def test_a_partial_run_replaces_its_rows_and_keeps_the_rest() -> None:
    stored = _doc({"long_tail": {"round_robin": 150.0, "inferlb": 50.0}, "versions": {"inferlb": 49.0}}, "aaa")
    run = _doc({"long_tail": {"inferlb": 40.0}}, "bbb", "inferlb bench lab --policy inferlb --scenario long_tail")
    page = merge_results(stored, run)
    assert _ttft(page, "long_tail", "inferlb") == 40.0
    assert _ttft(page, "long_tail", "round_robin") == 150.0 and _ttft(page, "versions", "inferlb") == 49.0
    assert page["commit"] == "aaa"
    assert page["reruns"] == [{"command": run["command"], "commit": "bbb", "date": run["date"], "wall_s": 60.0,
                               "rows": {"long_tail": ["inferlb"]}}]
    assert _ttft(stored, "long_tail", "inferlb") == 50.0  # the stored document is not changed
    assert "Rows from later runs: `inferlb bench lab --policy inferlb --scenario long_tail` (commit bbb" \
        in lab_section(page, "plots")


def test_a_row_re_run_again_is_named_by_its_latest_run_only() -> None:
    stored = _doc({"long_tail": {"round_robin": 150.0, "inferlb": 50.0, "oracle": 45.0}}, "aaa")
    once = merge_results(stored, _doc({"long_tail": {"inferlb": 40.0, "oracle": 44.0}}, "bbb"))
    twice = merge_results(once, _doc({"long_tail": {"inferlb": 39.0}}, "ccc"))
    assert [(r["commit"], r["rows"]) for r in twice["reruns"]] == [("bbb", {"long_tail": ["oracle"]}),
                                                                  ("ccc", {"long_tail": ["inferlb"]})]
    assert _ttft(twice, "long_tail", "inferlb") == 39.0 and _ttft(twice, "long_tail", "oracle") == 44.0


def test_a_run_of_every_stored_row_or_nothing_stored_is_the_page() -> None:
    stored = _doc({"long_tail": {"inferlb": 50.0}}, "aaa")
    full = _doc({"long_tail": {"inferlb": 41.0, "oracle": 40.0}, "versions": {"inferlb": 49.0}}, "bbb")
    assert merge_results(stored, full) == full
    assert merge_results(None, stored) == stored
    assert "Rows from later runs" not in lab_section(full, "plots")
