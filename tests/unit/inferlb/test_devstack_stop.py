"""Stopping a stack: every process at once, not one timeout after another."""

from __future__ import annotations

import sys
import time

from inferlb.devstack import stack

#: A process that ignores SIGTERM (a stuck one: only SIGKILL ends it).
STUCK = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def test_stop_all_ends_every_process_within_one_timeout(tmp_path):
    procs = [stack.spawn(f"stuck-{i}", [sys.executable, "-c", STUCK], tmp_path) for i in range(3)]
    procs.append(stack.spawn("polite", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path))
    deadline = time.monotonic() + 10
    while not all("up" in p.log_path.read_text() for p in procs[:3]) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    stack.stop_all(procs, timeout=1.0)
    took = time.monotonic() - started
    assert all(not p.alive() for p in procs)
    assert took < 2.5, took  # one 1 s timeout for all three stuck ones, not 3 s one after another
    stack.stop_all(procs)  # idempotent
