"""``inferlb bench soak`` for two minutes (the CI version of the 1-hour soak): one backend restart,
one Prometheus pause and one picker restart under steady streamed traffic, on the demo stack.

It asserts the soak's own targets from its JSON (memory growth after warm-up <= 5 % per process but
Prometheus, no failure outside the faults' windows, the picker's in-flight count back to 0 within
10 s of each fault), and that each fault really happened: the restarted processes have new pids,
and the failures the soak counted match the requests it sent.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.soak import BEGIN, END, FAULTS
from inferlb.devstack.stack import inferlb_argv

pytestmark = pytest.mark.integration


def test_two_minute_soak_meets_its_targets(tmp_path):
    out, md = tmp_path / "soak.json", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Other\nstays\n")
    run = subprocess.run(inferlb_argv("bench", "soak", "--duration", "120", "--warmup", "20", "--fault-every", "25",
                                      "--rate", "8", "--json", str(out), "--markdown", str(md),
                                      "--workdir", str(tmp_path / "work")),
                         capture_output=True, text=True, timeout=400)
    assert out.exists(), run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert sorted(f["kind"] for f in doc["faults"]) == sorted(FAULTS)
    for f in doc["faults"]:
        before, after = f["pids"]
        assert (before == after) == (f["kind"] == "prometheus-pause"), f
    assert doc["requests"]["total"] >= 0.8 * 8 * 120, doc["requests"]
    counted = sum(doc["errors"]["outside"].values()) + sum(n for c in doc["errors"]["by_fault"].values()
                                                          for n in c.values())
    assert counted == doc["requests"]["errors"]
    for name, target in doc["targets"].items():
        assert target["ok"], (name, target, doc["faults"], doc["probes"], doc["errors"])
    assert doc["ok"] and run.returncode == 0, run.stderr[-3000:]
    text = md.read_text()
    assert "## Other\nstays" in text and BEGIN in text and END in text and "## Soak" in text
