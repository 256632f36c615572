"""What one per-request decision costs: :func:`ext_proc.picker.pick` alone, in µs, on 4 and 64 endpoints.

No I/O, no handler, no transport: the view, the live load (an :class:`~ext_proc.inflight.InFlight`
with requests in flight and a free-memory sample per endpoint, so memory admission runs), the
session table (64 pinned sessions) and the requests are built once; then each kind of request is
decided ``calls`` times in a row and timed with :func:`time.process_time` (this process's CPU time:
on a shared machine other jobs inflate wall time, not CPU time):

- ``session``: an ``x-session-id`` of a pinned session (the pin lookup and the pin's bound);
- ``prefix``: a body's prefix key (the ring walk from the key's position);
- ``none``: no key, an ``x-request-id`` (the scan for the lowest load per share on 4 and 64
  endpoints; the power of two choices above 64).

Printed: one JSON object, ``{"<n>/<kind>": µs per decision, ...}``, the fastest of ``rounds``
rounds (the least disturbed by other jobs). Only the picker's public functions are used, so one copy
of this file times two versions of ``ext_proc`` (run it from each checkout's root, interleaved, to
compare them):

    python3 -m bench.decision_cost [--calls 20000] [--rounds 5]

(from the repository root).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from ext_proc.body import BodyFields
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.picker import pick
from ext_proc.ring import key_hash
from ext_proc.sessions import SessionTable, session_slot
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute

#: Pool sizes timed.
SIZES = (4, 64)
KINDS = ("session", "prefix", "none")


def _view(n: int, rng: random.Random) -> EndpointView:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="c")
    locality = cla.endpoints.add()
    for i in range(n):
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = f"10.0.{i // 250}.{i % 250}"
        lb.endpoint.address.socket_address.port_value = 8000
        lb.load_balancing_weight.value = rng.choice((50, 100, 160))
    routing = RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, affinity="soft"),))
    return EndpointView.build({"c": cla}, routing)


def setup(n: int, seed: int = 0) -> tuple[EndpointView, InFlight, SessionTable, dict[str, list[tuple[Any, Any]]]]:
    """The world of one pool size: its view, live load, sessions and ``{kind: [(headers, body), ...]}``."""
    rng = random.Random(seed)
    view = _view(n, rng)
    pool = view.clusters["c"]
    now = [0.0]
    loads = InFlight(1e9, clock=lambda: now[0])
    for i in range(3 * n):
        loads.picked("c", rng.choice(pool.endpoints), 1.0, 2048.0, request_id=f"warm-{i}".encode())
    loads.set_samples(MemorySamples.of({e: (rng.uniform(4096, 40960), -1.0) for e in pool.endpoints}))
    sessions = SessionTable(1e9, 1 << 16, clock=lambda: now[0])
    requests: dict[str, list[tuple[Any, Any]]] = {kind: [] for kind in KINDS}
    for i in range(64):
        key = f"chat-{i}".encode()
        sessions.touch(session_slot(key_hash(key), pool.salt), rng.choice(pool.endpoints))
        requests["session"].append(({":authority": b"api", "x-session-id": key}, None))
        requests["prefix"].append(({":authority": b"api"}, BodyFields(prefix=rng.getrandbits(64))))
        requests["none"].append(({":authority": b"api", "x-request-id": f"r-{i}".encode()}, None))
    return view, loads, sessions, requests


def per_decision_us(n: int, kind: str, calls: int, world: Any) -> float:
    """µs per :func:`pick` of ``kind`` on the ``n``-endpoint world (``calls`` decisions, cycled)."""
    view, loads, sessions, requests = world
    batch = requests[kind]
    rounds = max(1, calls // len(batch))
    start = time.process_time()
    for _ in range(rounds):
        for headers, body in batch:
            if body is None:
                pick(headers, view, loads, sessions)
            else:
                pick(headers, view, loads, sessions, body)
    return (time.process_time() - start) / (rounds * len(batch)) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="decisions per kind and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (the fastest is printed)")
    args = ap.parse_args(argv)
    worlds = {n: setup(n) for n in SIZES}
    times: dict[str, list[float]] = {f"{n}/{k}": [] for n in SIZES for k in KINDS}
    for _ in range(args.rounds):
        for n in SIZES:
            for kind in KINDS:
                times[f"{n}/{kind}"].append(per_decision_us(n, kind, args.calls, worlds[n]))
    print(json.dumps({k: round(min(v), 3) for k, v in times.items()}))


if __name__ == "__main__":
    main()
