"""What the decision sampler costs per request: ``PickerHandler.process`` with and without it, and
whole ext_proc streams through the real grpc.aio server (client in the same process, 8 at a time).

Each variant decides the same request-headers message (a session header, 3 healthy endpoints) in
rounds of N calls, the variants interleaved so machine load hits all alike. Reported per variant:
the median µs per call over the rounds, and the median over rounds of its time divided by the
"no sampler" time of the same round (paired, so load that drifts between rounds cancels out).
Prints a Markdown section (append it to BENCHMARKS.md).

    python3 -m bench.decision_sampler [--calls N] [--rounds N] [--stream-rounds N] [--streams N]

(from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time

import grpc
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from ext_proc.handler import PickerHandler, StreamState
from ext_proc.sampler import DecisionSampler
from ext_proc.transport.grpcio import start_ext_proc_server
from ext_proc.view import RoutingTable, ServiceRoute, ViewHolder


def holder() -> ViewHolder:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="llm-v1")
    locality = cla.endpoints.add()
    for i in range(3):
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = f"10.0.0.{i}"
        lb.endpoint.address.socket_address.port_value = 8000
    h = ViewHolder()
    service = ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}, affinity="soft")
    h.update({"llm-v1": cla}, RoutingTable(services=(service,)))
    return h


def message() -> pb.HttpHeaders:
    values = {":authority": b"api", ":method": b"POST", ":path": b"/v1/chat/completions",
              "model-version": b"v1", "x-session-id": b"chat-42", "content-type": b"application/json"}
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]))


def per_call_us(picker: PickerHandler, msg: pb.HttpHeaders, calls: int) -> float:
    process = picker.process
    data = pb.ProcessingRequest(request_headers=msg).SerializeToString()
    start = time.perf_counter()
    for _ in range(calls):
        process(StreamState(), data)
    return (time.perf_counter() - start) / calls * 1e6


async def streams_us(stub: pb_grpc.ExternalProcessorStub, req: pb.ProcessingRequest, n: int,
                     concurrency: int = 8) -> float:
    """Wall µs per ext_proc stream (request headers in, decision out) over ``n`` streams."""

    async def worker(count: int) -> None:
        for _ in range(count):
            async for _ in stub.Process(iter([req]), timeout=5):
                pass

    start = time.perf_counter()
    await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return (time.perf_counter() - start) / (n // concurrency * concurrency) * 1e6


async def transport(rounds: int, streams: int) -> dict[str, list[float]]:
    variants = {"no sampler": None, "sampler, every 64th (default)": DecisionSampler(every=64)}
    stubs, servers, channels = {}, [], []
    for name, sampler in variants.items():
        server, port = await start_ext_proc_server(PickerHandler(holder(), sampler=sampler), "127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append(server)
        channels.append(channel)
        stubs[name] = pb_grpc.ExternalProcessorStub(channel)
    req = pb.ProcessingRequest(request_headers=message())
    out: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for stub in stubs.values():
            await streams_us(stub, req, 200)  # warm up
        for _ in range(rounds):
            for name, stub in stubs.items():
                out[name].append(await streams_us(stub, req, streams))
    finally:
        for c in channels:
            await c.close()
        for srv in servers:
            await srv.stop(None)
    return out


def table(results: dict[str, list[float]], unit: str) -> None:
    base = results["no sampler"]
    print(f"| variant | median {unit} | median paired ratio to no sampler |")
    print("| --- | --- | --- |")
    for name, xs in results.items():
        ratio = statistics.median(x / b for x, b in zip(xs, base, strict=True))
        print(f"| {name} | {statistics.median(xs):.2f} | {ratio:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--stream-rounds", type=int, default=20)
    ap.add_argument("--streams", type=int, default=1000)
    args = ap.parse_args()
    msg = message()
    variants = {
        "no sampler": PickerHandler(holder()),
        "sampler, every 64th (default)": PickerHandler(holder(), sampler=DecisionSampler(every=64)),
        "sampler, every decision (every=1)": PickerHandler(holder(), sampler=DecisionSampler(every=1)),
    }
    for s in variants.values():
        per_call_us(s, msg, 2000)  # warm up
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, s in variants.items():
            results[name].append(per_call_us(s, msg, args.calls))
    streams = asyncio.run(transport(args.stream_rounds, args.streams))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print("## Decision sampler cost per request (`PickerHandler.process`)\n")
    print(f"Command: `python3 -m bench.decision_sampler --calls {args.calls} --rounds {args.rounds} "
          f"--stream-rounds {args.stream_rounds} --streams {args.streams}` · {datetime.date.today()} · {cpu}, "
          f"{os.cpu_count()} cores · Python {sys.version.split()[0]} · load average at the end "
          f"{os.getloadavg()[0]:.1f}\n")
    print("`process()` alone (headers parsed, decision made, answer encoded):\n")
    table(results, "µs / call")
    print("\nWhole ext_proc streams through the grpc.aio server:\n")
    table(streams, "µs / stream")


if __name__ == "__main__":
    main()
