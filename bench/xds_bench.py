"""xDS push benchmark: one weight round to 100 ADS streams, SotW vs delta vs a re-send-everything baseline.

Fleet: 10 000 endpoints in 200 clusters (20 services x 10 versions x 50 endpoints), one locality
each. 100 simulated ADS clients (grpc.aio streams in this process, behaving like Envoy: CDS and LDS
wildcard, EDS for every cluster, RDS for the route, every response ACKed) connect to the control
plane, which runs in a child process (so its CPU and memory are its own). Once every stream has ACKed
the first snapshot, one round changes 5 % of the weights and the control plane measures:

- CPU: its process CPU time (all threads, gRPC included) from building the new snapshot until every
  stream has ACKed the new EDS version;
- time until the last stream has the update (the same window, wall clock);
- bytes sent in the round (serialized responses, all streams);
- peak RSS of the control-plane process;
- minor page faults in the round (``minor_faults``, in each run's JSON line, not in the table):
  fresh allocations of the response buffers show here.

Modes: ``baseline`` re-sends every resource of every type on every change (SotW without per-resource
versions), ``sotw`` and ``delta`` are the real servers. Two change patterns: ``random`` (5 % of the
endpoints anywhere: ~92 % of the clusters get a new assignment) and ``clustered`` (every endpoint of
5 % of the clusters). Debounce is off (``debounce_s=0``): the round is measured, not the wait.

Run from the repository root: ``python3 -m bench.xds_bench [--write]`` (``--write`` updates the
section in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from bench.markdown import write_run_section
from xds_server.ads.cache import SnapshotCache
from xds_server.ads.push import Push
from xds_server.ads.server import MAX_MESSAGE_BYTES, AdsServicer, start_ads_server
from xds_server.ads.sotw import SotwStream
from xds_server.config import Config, parse_config
from xds_server.control import endpoint_specs
from xds_server.engine.types import HEALTHY, EndpointWeight
from xds_server.engine.verdicts import Verdicts
from xds_server.metrics.stats import EndpointStats
from xds_server.resources.build import BuildMemo, build_snapshot
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, TYPE_ORDER, Snapshot

SERVICES, VERSIONS, PER_CLUSTER = 20, 10, 50
STREAMS = 100
CHANGE_SHARE = 0.05
EXT_PROC = "127.0.0.1:18080"
MODES = ("baseline", "sotw", "delta")
CHANGES = ("random", "clustered")
ROOT = Path(__file__).resolve().parent.parent


# --- the fleet ------------------------------------------------------------------------------------


def fleet_config() -> Config:
    """20 services x 10 versions x 50 endpoints = 200 clusters, 10 000 endpoints."""
    n = 0
    services = []
    for s in range(SERVICES):
        versions = []
        for v in range(VERSIONS):
            eps = []
            for _ in range(PER_CLUSTER):
                eps.append({"address": f"10.{n // 65536}.{n // 256 % 256}.{n % 256}:8000"})
                n += 1
            versions.append({"name": f"v{v}", "endpoints": eps})
        services.append({"name": f"svc{s}", "hosts": [f"svc{s}.example"], "versions": versions})
    return parse_config(yaml.safe_dump({"services": services}))


def initial_weights(cfg: Config, rng: random.Random) -> list[EndpointWeight]:
    stats = EndpointStats()
    return [EndpointWeight(s.cluster, s.address, rng.randint(1, 100), HEALTHY, None, stats, {}, ())
            for s in endpoint_specs(cfg)]


def changed_weights(weights: list[EndpointWeight], change: str, rng: random.Random) -> list[EndpointWeight]:
    """5 % of the weights changed: anywhere (``random``) or whole clusters (``clustered``)."""
    k = int(len(weights) * CHANGE_SHARE)
    idx = rng.sample(range(len(weights)), k) if change == "random" else range(k)
    out = list(weights)
    for i in idx:
        out[i] = out[i]._replace(weight=out[i].weight % 100 + 1)
    return out


# --- the baseline: a SotW server without per-resource versions ------------------------------------


class FullResendStream(SotwStream):
    """Re-sends every resource of every requested type whenever the snapshot changes (the baseline)."""

    protocol = "baseline"

    def __init__(self) -> None:
        super().__init__()
        self._sent_for: dict[str, str] = {}

    def plan(self, snap: Snapshot | None) -> list[Push]:
        if snap is None:
            return []
        out = []
        for type_url in TYPE_ORDER:
            st = self.types.get(type_url)
            if st is None or not st.requested:
                continue
            names = set(snap.of(type_url)) if st.wildcard else set(st.subscribed)
            key = f"{snap.version}/{sorted(names)}"
            if self._sent_for.get(type_url) == key:
                continue
            self._sent_for[type_url] = key
            version = snap.versions[type_url]
            st.sent_type_version = version
            out.append(self._response(type_url, version, tuple(r for n, r in snap.of(type_url).items()
                                                               if n in names), st))
        return out


class BaselineServicer(AdsServicer):
    """AggregatedDiscoveryService whose SotW streams use :class:`FullResendStream`."""

    async def StreamAggregatedResources(self, request_iterator, context):  # noqa: N802 (gRPC name)
        async for resp in self._serve(FullResendStream(), request_iterator, context):
            yield resp


# --- the control plane (child process) ------------------------------------------------------------


async def control_plane(mode: str, change: str, port_file: Path) -> dict:
    rng = random.Random(7)
    cfg = fleet_config()
    weights = initial_weights(cfg, rng)
    memo = BuildMemo()
    cache = SnapshotCache(debounce_s=0, debounce_max_s=0)
    first = build_snapshot(cfg, Verdicts.of(weights), EXT_PROC, memo)
    await cache.set(first)
    server, servicer, port = await start_ads_server(
        cache, "127.0.0.1:0", BaselineServicer if mode == "baseline" else AdsServicer)
    port_file.write_text(str(port))

    def all_acked(snap: Snapshot) -> bool:
        nodes = list(servicer.nodes.values())
        return len(nodes) == STREAMS and all(
            n.state.types.get(t) is not None and n.state.types[t].acked == snap.versions[t]
            for n in nodes for t in TYPE_ORDER)

    t_connect = time.monotonic()
    while not all_acked(first):
        await asyncio.sleep(0.05)
        if time.monotonic() - t_connect > 120:
            raise RuntimeError("clients did not sync the first snapshot within 120 s")
    sync_s = time.monotonic() - t_connect
    await asyncio.sleep(1.0)
    bytes_before = sum(n.sent_bytes for n in servicer.nodes.values())

    new_weights = Verdicts.of(changed_weights(weights, change, rng))  # columns, as the engine hands them
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu0, t0 = time.process_time(), time.monotonic()
    snap = build_snapshot(cfg, new_weights, EXT_PROC, memo)
    cpu_build = time.process_time() - cpu0
    await cache.set(snap)
    while not all(n.state.types[ENDPOINT_TYPE].acked == snap.versions[ENDPOINT_TYPE]
                  for n in servicer.nodes.values()):
        await asyncio.sleep(0.002)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    sent = sum(n.sent_bytes for n in servicer.nodes.values()) - bytes_before
    changed = sum(1 for n, r in snap.of(ENDPOINT_TYPE).items() if first.of(ENDPOINT_TYPE)[n].version != r.version)
    await server.stop(0)
    return {
        "mode": mode, "change": change, "streams": STREAMS, "clusters_changed": changed,
        "round_cpu_ms": round(cpu * 1000, 1), "build_cpu_ms": round(cpu_build * 1000, 1),
        "last_stream_ms": round(wall * 1000, 1), "bytes_sent": sent,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "initial_sync_s": round(sync_s, 2), "minor_faults": faults,
    }


# --- the simulated Envoys (this process) ----------------------------------------------------------


async def sotw_client(stub, stop: asyncio.Event) -> None:
    out: asyncio.Queue = asyncio.Queue()
    for t in (CLUSTER_TYPE, LISTENER_TYPE):
        req = discovery_pb2.DiscoveryRequest(type_url=t)
        req.node.id = "bench"
        await out.put(req)

    async def requests():
        while True:
            req = await out.get()
            if req is None:
                return
            yield req

    call = stub.StreamAggregatedResources(requests())
    eds_names: list[str] = []
    eds_nonce = ""
    rds_asked = False
    async for resp in call:
        names: list[str] = []
        if resp.type_url == CLUSTER_TYPE:
            for any_msg in resp.resources:
                c = cluster_pb2.Cluster()
                any_msg.Unpack(c)
                if c.type == cluster_pb2.Cluster.EDS:
                    names.append(c.name)
        await out.put(discovery_pb2.DiscoveryRequest(
            type_url=resp.type_url, version_info=resp.version_info, response_nonce=resp.nonce,
            resource_names=eds_names if resp.type_url == ENDPOINT_TYPE else
            (["inferlb"] if resp.type_url == ROUTE_TYPE else [])))
        if resp.type_url == ENDPOINT_TYPE:
            eds_nonce = resp.nonce
        if resp.type_url == CLUSTER_TYPE and sorted(names) != eds_names:
            eds_names = sorted(names)
            await out.put(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT_TYPE, resource_names=eds_names,
                                                         response_nonce=eds_nonce))
        if resp.type_url == LISTENER_TYPE and not rds_asked:
            rds_asked = True
            await out.put(discovery_pb2.DiscoveryRequest(type_url=ROUTE_TYPE, resource_names=["inferlb"]))
        if stop.is_set():
            break


async def delta_client(stub, stop: asyncio.Event) -> None:
    out: asyncio.Queue = asyncio.Queue()
    for t in (CLUSTER_TYPE, LISTENER_TYPE):
        req = discovery_pb2.DeltaDiscoveryRequest(type_url=t)
        req.node.id = "bench"
        await out.put(req)

    async def requests():
        while True:
            req = await out.get()
            if req is None:
                return
            yield req

    call = stub.DeltaAggregatedResources(requests())
    eds: set[str] = set()
    rds_asked = False
    async for resp in call:
        await out.put(discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce))
        if resp.type_url == CLUSTER_TYPE:
            added = {r.name for r in resp.resources if r.name != "inferlb_ext_proc"} - eds
            gone = set(resp.removed_resources) & eds
            eds = (eds | added) - gone
            if added or gone:
                await out.put(discovery_pb2.DeltaDiscoveryRequest(
                    type_url=ENDPOINT_TYPE, resource_names_subscribe=sorted(added),
                    resource_names_unsubscribe=sorted(gone)))
        if resp.type_url == LISTENER_TYPE and not rds_asked:
            rds_asked = True
            await out.put(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE,
                                                              resource_names_subscribe=["inferlb"]))
        if stop.is_set():
            break


async def run_clients(port: int, protocol: str, server: subprocess.Popen) -> None:
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        client = delta_client if protocol == "delta" else sotw_client
        tasks = [asyncio.create_task(client(stub, stop)) for _ in range(STREAMS)]
        while server.poll() is None:
            await asyncio.sleep(0.05)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_one(mode: str, change: str, workdir: Path) -> dict:
    port_file = workdir / f"port-{mode}-{change}"
    port_file.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, "-m", "bench.xds_bench", "--control-plane", mode, change,
                               str(port_file)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"control plane for {mode} did not start")
        time.sleep(0.05)
    asyncio.run(run_clients(int(port_file.read_text()), "delta" if mode == "delta" else "sotw", server))
    out, err = server.communicate(timeout=60)  # stderr: gRPC logs the streams cancelled at shutdown
    if server.returncode != 0:
        raise RuntimeError(f"control plane for {mode}/{change} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


# --- report ---------------------------------------------------------------------------------------


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} vCPU ({cpu}), {mem_gb:.0f} GiB RAM, Python {platform.python_version()}, " \
           f"grpcio {grpc.__version__}"


def median_run(runs: list[dict]) -> dict:
    """Per-metric medians of repeated runs of one case; ``round_cpu_range`` keeps min and max."""
    out = dict(runs[0])
    for key in ("round_cpu_ms", "build_cpu_ms", "last_stream_ms", "bytes_sent", "peak_rss_mb"):
        out[key] = statistics.median(r[key] for r in runs)
    cpus = [r["round_cpu_ms"] for r in runs]
    out["round_cpu_range"] = f"{min(cpus)}–{max(cpus)}"
    return out


def report(results: list[dict]) -> str:
    by = {(r["mode"], r["change"]): r for r in results}
    lines = [
        "| change | mode | clusters re-sent | round CPU (ms), median (min–max) | of which build (ms) "
        "| last stream has it (ms) "
        "| bytes sent | vs baseline | peak RSS (MB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for change in CHANGES:
        base = by[("baseline", change)]["bytes_sent"]
        for mode in MODES:
            r = by[(mode, change)]
            lines.append(f"| {change} | {mode} | {r['clusters_changed']} "
                         f"| {r['round_cpu_ms']} ({r['round_cpu_range']}) "
                         f"| {r['build_cpu_ms']} | {r['last_stream_ms']} | {r['bytes_sent']:,} "
                         f"| {r['bytes_sent'] / base:.1%} | {r['peak_rss_mb']} |")
    return "\n".join(lines)


def write_benchmarks(table: str, command: str) -> None:
    write_run_section(ROOT / "BENCHMARKS.md", "xds_bench", "## xDS push: one weight round to 100 ADS streams",
                      table, command, machine())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-plane", nargs=3, metavar=("MODE", "CHANGE", "PORT_FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the table shows medians")
    args = parser.parse_args()
    if args.control_plane:
        mode, change, port_file = args.control_plane
        print(json.dumps(asyncio.run(control_plane(mode, change, Path(port_file)))), flush=True)
        return
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for change in CHANGES:
            for mode in MODES:
                runs = []
                for _ in range(args.repeat):
                    runs.append(run_one(mode, change, Path(tmp)))
                    print(json.dumps(runs[-1]), flush=True)
                results.append(median_run(runs))
    table = report(results)
    print(table)
    if args.write:
        write_benchmarks(table, f"python3 -m bench.xds_bench --repeat {args.repeat} --write")


if __name__ == "__main__":
    main()
