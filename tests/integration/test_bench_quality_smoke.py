"""Smoke test of ``inferlb bench quality --quick``: one scenario, every policy, real Envoy and Prometheus.

Checks that the output is produced and sane (keys, ranges, counts), not the performance numbers.
It also checks what must hold whatever the load: inferlb (with and without the picker) never
answers from the wrong model version, while the version-blind baseline does (so the measurement
can see a wrong version at all).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.quality.figures import FIGURES
from bench.quality.policies import POLICIES
from bench.quality.report import BEGIN, END
from inferlb.devstack.stack import inferlb_argv

pytestmark = pytest.mark.integration

RATES = ("error_rate", "oom_rate", "wrong_version", "session_hit_rate", "sessions_moved", "prefix_hit_rate")


def test_quick_versions_scenario_writes_sane_json_markdown_and_plots(tmp_path):
    out, md, plots = tmp_path / "out.json", tmp_path / "BENCHMARKS.md", tmp_path / "plots"
    md.write_text("# Benchmarks\n\n## Other benchmark\nstays\n")
    proc = subprocess.run(
        inferlb_argv("bench", "quality", "--scenario", "versions", "--quick", "--json", str(out),
                     "--markdown", str(md), "--plots", str(plots), "--workdir", str(tmp_path / "work")),
        capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]

    doc = json.loads(out.read_text())
    assert list(doc["scenarios"]) == ["versions"]
    figures = doc["scenarios"]["versions"]
    assert sorted(figures) == sorted(POLICIES)
    for policy, f in figures.items():
        assert set(FIGURES) <= set(f), policy
        assert f["requests"] > 0 and f["throughput_rps"] > 0, (policy, f)
        for key in RATES:
            assert f[key] is None or 0.0 <= f[key] <= 1.0, (policy, key, f[key])
        assert f["error_rate"] < 0.5, (policy, f)
        assert 0 < f["p50_ms"] <= f["p95_ms"] <= f["p99_ms"], (policy, f)
        # Streamed chat traffic: TTFT before the end, per-token times, the backends' prefix-cache counters.
        assert 0 < f["ttft_p50_ms"] <= f["ttft_p90_ms"] <= f["ttft_p99_ms"], (policy, f)
        assert f["ttft_p50_ms"] < f["p50_ms"] and 0 < f["tpot_p50_ms"] <= f["tpot_p90_ms"], (policy, f)
        assert 0.5 * f["requests"] < f["streamed"] < f["requests"], (policy, f)
        assert 0 < f["prefix_hit_rate"] < 1 and f["preemptions"] == 0, (policy, f)
        assert f["output_tokens_per_s"] == pytest.approx(16 * f["throughput_rps"], rel=0.01), (policy, f)
        assert f["rounds"] == 1 and f["by_round"]["ttft_p90_ms"] == [f["ttft_p90_ms"]], (policy, f)
        assert f["sessions_moved"] is None and f["wrong_version"] is not None and f["session_hit_rate"] is not None
    assert figures["inferlb_eds"]["wrong_version"] == 0.0
    assert figures["inferlb_full"]["wrong_version"] == 0.0
    assert figures["round_robin"]["wrong_version"] > 0.0
    run = doc["runs"]["versions"]
    assert run["mode"] == "quick" and run["rounds"] == 1 and sorted(run["round_orders"][0]) == sorted(POLICIES)
    assert set(run["max_send_lag_ms"]) == set(POLICIES) and len(run["load_average"]["before"]) == 3

    for name in ("versions-latency.png", "versions-ttft.png", "versions-weights.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert json.loads((plots / "results.json").read_text())["scenarios"]["versions"] == figures
    text = md.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "## Other benchmark\nstays" in text
    assert "### versions: Model versions" in text and "| inferlb_full |" in text
    assert "--scenario versions --quick" in text and "| TTFT p90 ms |" in text and "ring_hash_bounded" in text
