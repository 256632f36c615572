"""C05: Prometheus killed, hung, answering 500, garbage or values that are not numbers.

What degrades: weights freeze at the last good ones (no new information), flagged at once in
``/api/v1/weights`` (``metrics_source.ok``), ``inferlb_metrics_source_up 0`` and one log line.
For how long: from the first failed round (within 3 x timeout + interval) until the first good one
after the fault ends. Nothing is lost: no endpoint is excluded or re-weighted during the outage
or while Prometheus catches up afterwards, Envoy holds the same weights, and every request
succeeds.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from inferlb.devstack import stack as stk
from tests.faults.conftest import (
    Background,
    PrometheusFront,
    Stack,
    all_healthy,
    metric_value,
    proc_named,
    sessions,
    wait_until,
)

pytestmark = pytest.mark.integration

#: fault -> how long it lasts once flagged (s). "killed" outlasts engine.stale_after_s (6 s): every
#: sample is old when Prometheus comes back, and the targets are scraped again one by one.
#: "strings": answers of the right shape whose values are not numbers (issue 15 item 3).
OUTAGE_S = {"killed": 7.0, "hung": 2.5, "500": 2.0, "garbage": 3.0, "strings": 3.0}


def inject(s: Stack, front: PrometheusFront, fault: str) -> None:
    prom = proc_named(s, "prometheus")
    if fault == "killed":
        prom.kill()
    elif fault == "hung":
        os.kill(prom.popen.pid, signal.SIGSTOP)
    else:
        front.set_mode(fault)


def heal(s: Stack, front: PrometheusFront, fault: str) -> None:
    prom = proc_named(s, "prometheus")
    if fault == "killed":
        s.procs[s.procs.index(prom)] = stk.start_prometheus([b.address for b in s.backends], s.workdir,
                                                            front.upstream_port, 1.0)
    elif fault == "hung":
        os.kill(prom.popen.pid, signal.SIGCONT)
    else:
        front.set_mode("relay")


@pytest.mark.parametrize("fault", list(OUTAGE_S))
def test_prometheus_fault_keeps_the_last_good_weights(fault_stack: Stack, front: PrometheusFront, fault: str,
                                                      caplog):
    from tests.faults.conftest import Sampler

    s = fault_stack
    control = s.app.control
    cfg = s.cfg.loop
    wait_until(lambda: control.metrics_ok and all_healthy(s), 20, 0.2, "a healthy, fresh baseline")
    sampler = Sampler(s)
    bg = Background(s.listener, sessions(), duration_s=OUTAGE_S[fault] + 9)
    time.sleep(1.0)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="xds_server.control"):
        queries_before = front.queries
        started = time.monotonic()
        inject(s, front, fault)
        wait_until(lambda: control.metrics_ok is False, cfg.timeout_s * 3 + cfg.interval_s + 1.5, 0.05,
                   "the metrics failure to be flagged")
        flagged = time.monotonic()
        frozen = {c: {a: (e["weight"], e["health"]) for a, e in eps.items()} for c, eps in s.weights().items()}
        assert metric_value(s, "inferlb_metrics_source_up") == 0
        time.sleep(OUTAGE_S[fault])
        healed = time.monotonic()
        heal(s, front, fault)
        wait_until(lambda: control.metrics_ok, 15, 0.05, "the metrics source to come back")
        recovered = time.monotonic()
        time.sleep(3.0)  # Prometheus catches up: scrapes resume target by target
    samples = sampler.stop()
    results = bg.join()

    failures = [r for r in caplog.records if "metrics source failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]   # flagged once, not every round
    assert metric_value(s, "inferlb_metrics_source_up") == 1
    if fault == "garbage":
        assert front.queries - queries_before >= 5, "every kind of garbage was served"
    assert recovered - healed < (8 if fault == "killed" else 4), "recovery took too long"

    during = [x for x in samples if flagged <= x.at <= healed]
    assert len(during) >= 5
    for x in during:
        assert x.cp == frozen, "the control plane changed weights without metrics"
        assert x.envoy == frozen, "Envoy's weights moved during the outage"
    for x in samples:
        bad = {a for c in x.cp.values() for a, (_, h) in c.items() if h != "HEALTHY"}
        bad |= {a for c in x.envoy.values() for a, (_, h) in c.items() if h != "HEALTHY"}
        assert not bad, (f"{bad} excluded at t={x.at - started:+.1f} s (fault at 0, healed at "
                         f"{healed - started:.1f}): {x.why}")

    assert results and all(r.status == 200 for r in results), \
        sorted({r.status for r in results if r.status != 200})
    after = [r for r in results if r.at >= time.time() - (time.monotonic() - flagged)]
    assert len(after) > 20, "traffic kept flowing through the outage"
