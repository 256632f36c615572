"""`inferlb demo` end to end, as a user runs it: its exit code and its summary contract."""

from __future__ import annotations

import fcntl
import json
import subprocess

import pytest

from inferlb.devstack.stack import inferlb_argv
from tests.support.demo import check_demo_summary

pytestmark = pytest.mark.integration


def test_demo_runs_and_its_summary_holds(tmp_path):
    out = tmp_path / "summary.json"
    # The demo binds fixed ports: one demo at a time on this machine.
    with open("/tmp/inferlb-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = subprocess.run(inferlb_argv("demo", "--duration", "15", "--json", str(out), "--quiet",
                                          "--workdir", str(tmp_path / "work")),
                             capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    check_demo_summary(json.loads(out.read_text()), 15)
