"""Smoke test of ``inferlb bench picker``: one short round through real Envoy and wrk, with the
py-spy profile. Checks that every figure is produced and sane (keys, ranges, no errors, the
profile finds the picker's own files), not the performance numbers."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.picker import TARGETS, VARIANTS
from inferlb.devstack.stack import inferlb_argv

pytestmark = pytest.mark.integration


def test_one_round_writes_every_figure_the_profile_and_the_markdown_section(tmp_path):
    out, md = tmp_path / "out.json", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Other benchmark\nstays\n")
    proc = subprocess.run(
        inferlb_argv("bench", "picker", "--json", str(out), "--markdown", str(md), "--runs", "1",
                     "--duration", "1", "--profile", "2"),
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    doc = json.loads(out.read_text())
    assert set(doc["targets"]) == set(TARGETS)
    for kind in ("direct_response", "upstream"):
        r = doc["route_kinds"][kind]
        assert r["errors"] == 0, kind
        assert all(r["spread"]["rps_16conn"][v]["median"] > 0 for v in VARIANTS), kind
        assert 0 < r["rps_ratio_to_null"] < 3 and r["python_cpu_us_per_decision"] > 0, kind
        assert set(r["envoy_cpu_us_per_request"]) == set(VARIANTS), kind
        for key in ("added_p50_ms", "added_p99_ms", "null_added_p99_ms", "null_routed_added_p99_ms"):
            assert isinstance(r[key], float), (kind, key)
    # Envoy called the picker and the null servers (their streams started, none failed).
    stats = doc["envoy_ext_proc_stats"]
    for listener in ("direct_with", "direct_null", "direct_null_routed", "inferlb"):
        assert stats[f"http.{listener}.ext_proc.streams_started"] > 0, listener
        assert stats[f"http.{listener}.ext_proc.streams_failed"] == 0, listener

    prof = doc["profile"]
    assert prof["rps_while_profiled"] > 0 and prof["samples"] > 0
    parts = {p["part"]: p for p in prof["parts"]}
    assert "ext_proc/handler.py" in parts and "ext_proc/transport/h2/conn.py" in parts, sorted(parts)
    shares = [p["share"] for p in prof["parts"] if p["share"] is not None]
    assert sum(shares) == pytest.approx(1.0)

    text = md.read_text()
    assert "## Other benchmark\nstays" in text and "<!-- bench:picker-fast-w1-c1 -->" in text
    assert "Live profile (py-spy" in text and "| ext_proc/handler.py |" in text
