"""C13 and friends: a backend that accepts and never answers, crashes, or comes back looping on OOM.

What degrades: requests that reach the broken backend cost one per-try timeout (hang) or nothing
visible (refused connection, 500 OOM): Envoy retries them on another host. Envoy's outlier
detection ejects the backend within about a second; the control plane excludes a crashed one
when its metrics go stale. Nothing is lost: every client request gets a 200, and the backend takes
traffic again once it is healthy.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from inferlb.devstack import stack as stk
from tests.faults.conftest import Background, Stack, all_healthy, sessions, wait_until
from tests.integration.conftest import JOB_TIME_SCALE, LLM_TIME_SCALE
from tests.support.envoy import envoy_stat

pytestmark = pytest.mark.integration


def outlier_ejected(s: Stack, cluster: str, address: str) -> bool:
    """Envoy's view: the host carries the failed_outlier_check flag."""
    with urllib.request.urlopen(f"{s.envoy_admin}/clusters?format=json", timeout=5) as r:
        doc = json.load(r)
    for c in doc.get("cluster_statuses", []):
        if c["name"] != cluster:
            continue
        for h in c.get("host_statuses", []):
            sa = h["address"]["socket_address"]
            if f"{sa['address']}:{sa['port_value']}" == address:
                return bool(h.get("health_status", {}).get("failed_outlier_check"))
    raise AssertionError(f"{address} not in Envoy's {cluster}")


def health(s: Stack, address: str) -> str:
    return next(eps[address]["health"] for eps in s.weights().values() if address in eps)


def served_by(s: Stack, address: str, tries: int = 40) -> bool:
    return any(s.send({"model-version": "v1"}).headers.get("x-served-by") == address for _ in range(tries))


def test_a_backend_that_never_answers_times_out_and_is_ejected(fault_stack: Stack):
    s = fault_stack
    per_try = s.cfg.envoy.per_try_timeout_s
    wait_until(lambda: all_healthy(s), 20, 0.2, "every endpoint HEALTHY")
    target = s.backends[0]
    timeouts_before = envoy_stat(s.envoy_admin, "cluster.chat-v1.upstream_rq_per_try_timeout") or 0
    bg = Background(s.listener, sessions(3), duration_s=9, concurrency=6)
    time.sleep(1.5)
    hung_at = time.time()
    target.fault(hang=True)
    wait_until(lambda: outlier_ejected(s, "chat-v1", target.address), 3, 0.05, "Envoy to eject the hung backend")
    ejected_after = time.time() - hung_at
    time.sleep(3.5)
    target.fault(reset=True)
    healed_at = time.time()
    results = bg.join()

    assert ejected_after < per_try * 2 + 1.0
    timeouts = (envoy_stat(s.envoy_admin, "cluster.chat-v1.upstream_rq_per_try_timeout") or 0) - timeouts_before
    assert timeouts >= 1, "the hung backend's requests should time out per try"
    assert results and all(r.status == 200 for r in results), sorted({r.status for r in results})
    during = [r for r in results if hung_at < r.at < healed_at]
    assert during and not [r for r in during if r.served_by == target.address and r.at > hung_at + per_try + 0.5]
    # Requests that never met the hung backend are unaffected: no per-try timeout in their latency.
    fast = [r for r in during if r.latency_ms < per_try * 1000]
    assert len(fast) >= 0.5 * len(during), "most requests should not wait for the hung backend"
    assert max(r.latency_ms for r in during) < per_try * 1000 * 2 + 500, "one timeout at most, then a retry"
    # Back in rotation once the ejection ends (max_ejection_time_s caps it).
    wait_until(lambda: not outlier_ejected(s, "chat-v1", target.address), 8, 0.2, "the ejection to end")
    # Its weight ramps back (slow start after the recovery), so its share starts small: keep asking.
    wait_until(lambda: served_by(s, target.address), 15, 0.2, "the backend to take traffic again")


def _oom_count(b) -> int:
    """Requests backend ``b`` refused for GPU memory since it started (its ``/sim/state``)."""
    with urllib.request.urlopen(f"http://{b.address}/sim/state", timeout=5) as r:
        return int(json.load(r)["counters"]["oom"])


def test_a_backend_that_crashes_then_loops_on_oom_then_recovers(fault_stack: Stack):
    s = fault_stack
    wait_until(lambda: all_healthy(s), 20, 0.2, "every endpoint HEALTHY")
    target = s.backends[1]
    bg = Background(s.listener, sessions(4), duration_s=16, concurrency=4)
    time.sleep(1.0)

    crashed_at, crashed_wall = time.monotonic(), time.time()
    target.proc.kill()
    wait_until(lambda: health(s, target.address) == "UNHEALTHY", s.cfg.engine.stale_after_s + 4, 0.2,
               "the control plane to exclude the crashed backend (stale metrics)")
    assert "stale" in s.weights()["chat-v1"][target.address]["reasons"][0]
    excluded_after = time.monotonic() - crashed_at

    # It comes back broken, as a per-request server whose every request needs more GPU memory than is
    # free (CUDA OOM, HTTP 500).
    target.proc = stk.start_sim(target.port, s.workdir, gpu_class=target.gpu_class, version=target.version,
                                name=f"sim-{target.port}-oom",
                                extra=["--time-scale", JOB_TIME_SCALE, "--engine", "job", "--gpu-memory-mib", "14340"])
    # Its version is one of vLLM engines (gpu_memory: preallocated, the vllm preset's): a request needs
    # no GPU memory of its own there, so the picker places requests on it (a few while it warms up: slow
    # start), each a 500 that Envoy retries on another host; none reaches a client (checked below). The
    # background's sessions keep their endpoints (strict affinity) and its prompts' prefixes are cached
    # elsewhere, so new sessions are what the picker places: one more each poll.
    def new_session_then_ooms() -> bool:
        s.send({"model-version": "v1", "x-session-id": f"new-{time.monotonic_ns()}"})
        return _oom_count(target) >= 2

    wait_until(new_session_then_ooms, 15, 0.2, "the broken backend to refuse requests for memory")

    target.proc.kill()
    target.proc = stk.start_sim(target.port, s.workdir, gpu_class=target.gpu_class, version=target.version,
                                name=f"sim-{target.port}-ok", extra=["--time-scale", LLM_TIME_SCALE])
    s.procs.append(target.proc)   # stopped with the stack
    wait_until(lambda: health(s, target.address) == "HEALTHY", 10, 0.2, "the healthy backend to be back")
    back_after = time.monotonic() - crashed_at
    results = bg.join()

    assert excluded_after < s.cfg.engine.stale_after_s + 3
    assert back_after < 30
    failed = [(r.status, r.error, r.served_by, round(r.at - crashed_wall, 1)) for r in results if r.status != 200]
    assert results and not failed, (failed, target.address)
    # Retries are bounded by a budget, not by Envoy's default of 3 at once (which overflowed into 503s).
    assert envoy_stat(s.envoy_admin, "cluster.chat-v1.upstream_rq_retry_overflow") == 0
    assert (envoy_stat(s.envoy_admin, "cluster.chat-v1.upstream_rq_retry_success") or 0) >= 1
    wait_until(lambda: not outlier_ejected(s, "chat-v1", target.address), 8, 0.2, "the ejection to end")
    # Back in rotation within a bound: the picker skips an endpoint for 5 s after its last failed
    # connection (failure_hold_s) and its weight ramps back (slow start), so keep asking for a while.
    wait_until(lambda: served_by(s, target.address), 15, 0.2, "the recovered backend to take traffic again")
