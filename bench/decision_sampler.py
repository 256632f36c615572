"""What the decision sampler costs per request: ``ExtProcServicer.decide`` with and without it.

Each variant decides the same request-headers message (a session header, 3 healthy endpoints) in
rounds of N calls, the variants interleaved so machine load hits all alike; the result is each
variant's median and minimum µs per call over the rounds and their ratios to "no sampler" in the
same run (the minimum is the least disturbed by other load on the machine). Prints a Markdown
section (append it to BENCHMARKS.md).

    python3 -m bench.decision_sampler [--calls 5000] [--rounds 60]   (from the repository root)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.sampler import DecisionSampler
from ext_proc.server import ExtProcServicer
from ext_proc.view import RoutingTable, ServiceRoute, ViewHolder


def holder() -> ViewHolder:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="llm-v1")
    locality = cla.endpoints.add()
    for i in range(3):
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = f"10.0.0.{i}"
        lb.endpoint.address.socket_address.port_value = 8000
    h = ViewHolder()
    h.update({"llm-v1": cla}, RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}),)))
    return h


def message() -> pb.HttpHeaders:
    values = {":authority": b"api", ":method": b"POST", ":path": b"/v1/chat/completions",
              "model-version": b"v1", "x-session-id": b"chat-42", "content-type": b"application/json"}
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]))


def per_call_us(servicer: ExtProcServicer, msg: pb.HttpHeaders, calls: int) -> float:
    decide = servicer.decide
    start = time.perf_counter()
    for _ in range(calls):
        decide(msg)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    msg = message()
    variants = {
        "no sampler": ExtProcServicer(holder()),
        "sampler, every 64th (default)": ExtProcServicer(holder(), sampler=DecisionSampler(every=64)),
        "sampler, every decision (every=1)": ExtProcServicer(holder(), sampler=DecisionSampler(every=1)),
    }
    for s in variants.values():
        per_call_us(s, msg, 2000)  # warm up
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, s in variants.items():
            results[name].append(per_call_us(s, msg, args.calls))
    base = statistics.median(results["no sampler"])
    base_min = min(results["no sampler"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print("## Decision sampler cost per request (`ExtProcServicer.decide`)\n")
    print(f"Command: `python3 -m bench.decision_sampler --calls {args.calls} --rounds {args.rounds}` · "
          f"{datetime.date.today()} · {cpu}, {os.cpu_count()} cores · Python {sys.version.split()[0]}\n")
    print("| variant | median µs / call | ratio | min µs / call | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for name, xs in results.items():
        m, lo = statistics.median(xs), min(xs)
        print(f"| {name} | {m:.2f} | {m / base:.3f} | {lo:.2f} | {lo / base_min:.3f} |")


if __name__ == "__main__":
    main()
