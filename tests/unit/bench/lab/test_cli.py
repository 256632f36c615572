"""``inferlb bench lab`` end to end on a small subset (the whole ``--quick`` run is in CI's command)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from bench.lab.cli import lab


def test_quick_lab_on_a_subset_writes_the_json_the_issue_names(tmp_path) -> None:
    out = tmp_path / "lab.json"
    md = tmp_path / "BENCHMARKS.md"
    result = CliRunner().invoke(lab, ["--quick", "--scenario", "shared_prefix", "--policy", "round_robin",
                                      "--policy", "llm_d", "--policy", "inferlb", "--engines", "2", "--duration", "20",
                                      "--json", str(out), "--markdown", str(md), "--plots", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    sc = doc["scenarios"]["shared_prefix"]
    assert set(sc["policies"]) == {"round_robin", "llm_d", "inferlb"}
    for policy in sc["policies"].values():
        assert [p["qps"] for p in policy["points"]] == [1.0, 3.0, 6.0]  # 0.5, 1.5, 3 per engine, 2 engines
        for p in policy["points"]:
            for key in ("ttft_p90_ms", "ttft_p50_ms", "itl_p90_ms", "e2e_p95_ms", "output_tokens_per_s",
                        "prefix_hit_rate", "error_rate", "oom_rate"):
                assert key in p
        assert "max_qps_within_slo" in policy
    assert doc["seed"] == 1 and "commit" in doc
    text = md.read_text()
    assert "<!-- lab:start -->" in text and "### shared_prefix" in text and "**inferlb** (max QPS within SLO" in text
    assert (tmp_path / "plots" / "shared_prefix-ttft.png").stat().st_size > 1000
