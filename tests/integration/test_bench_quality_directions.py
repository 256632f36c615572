"""``inferlb bench quality --quick`` checks the directions of the scheduler's targets (issue 13).

Quick runs are short (about 3 s of measured traffic per policy) and the machine is shared, so only
the directions that hold by a wide margin in such a run are asserted — the effect of a rule, not
its size (the sizes are measured in full mode, BENCHMARKS.md):

- ``uneven``: memory admission: inferlb_full runs out of GPU memory far less often than any
  memory-blind baseline;
- ``shared_prefix``: the prefix key sends a tenant's requests where its system prompt is cached;
- ``chat_resend``: without a session header, the prefix key still follows the conversation (soft
  affinity: its turns stay on the node with their KV cache; the ``sessions`` scenario, with a session
  header, is left to full mode to keep CI short: pinning by header is tested on real Envoy in
  tests/integration/test_picker_envoy.py).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.quality.policies import BASELINES
from inferlb.devstack.stack import inferlb_argv

pytestmark = pytest.mark.integration

SCENARIOS = ("uneven", "shared_prefix", "chat_resend")


def test_quick_runs_show_the_scheduler_targets_directions(tmp_path):
    out = tmp_path / "out.json"
    argv = ["bench", "quality", "--quick", "--json", str(out), "--markdown", str(tmp_path / "B.md"),
            "--plots", str(tmp_path / "plots"), "--workdir", str(tmp_path / "work")]
    for name in SCENARIOS:
        argv += ["--scenario", name]
    proc = subprocess.run(inferlb_argv(*argv), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_directions(json.loads(out.read_text())["scenarios"])


def check_directions(figures: dict) -> None:
    """The directions above, on ``{scenario: {policy: figures}}`` of one run."""
    uneven = figures["uneven"]
    worst_blind = min(uneven[p]["oom_rate"] for p in BASELINES)
    assert worst_blind > 0.05, uneven  # the trap is there: blind policies run out of memory
    # A quick run has 126 requests, so one OOM is 0.8 %: six quick runs on this machine (2026-12-01,
    # nothing else running) gave inferlb_full 0-6.3 % against the blind policies' best 20.6-21.4 %.
    # The direction is "at most half" (the full-mode target is 0).
    assert uneven["inferlb_full"]["oom_rate"] <= 0.5 * worst_blind, uneven

    # The target is 2x (met in full mode); a 3 s quick run has given 1.93x, so the direction is 1.5x.
    shared = figures["shared_prefix"]
    assert shared["inferlb_full"]["prefix_hit_rate"] >= 1.5 * shared["least_request"]["prefix_hit_rate"], shared

    chat = figures["chat_resend"]
    assert chat["inferlb_full"]["prefix_hit_rate"] > chat["least_request"]["prefix_hit_rate"] + 0.05, chat
    assert chat["inferlb_full"]["session_hit_rate"] > chat["least_request"]["session_hit_rate"] + 0.15, chat
    for name in SCENARIOS[1:]:
        assert figures[name]["inferlb_full"]["error_rate"] <= 0.02, (name, figures[name]["inferlb_full"])
