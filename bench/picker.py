"""``inferlb bench picker``: what the ext_proc picker costs, on real Envoy, measured with wrk.

One run sets up, as plain processes on this machine:
- the control plane (``inferlb serve``; no Prometheus, so weights stay neutral) with one service
  whose only endpoint is a "real upstream": an Envoy listener answering with ``direct_response``;
- the picker alone (``inferlb ext-proc --xds``), the process whose CPU is measured (psutil, all
  its threads; with ``--workers`` all worker processes);
- Envoy (``--concurrency N``) with four listeners: the control plane's listener (picker +
  route to the upstream cluster), a copy without the picker, and a ``direct_response`` route
  with and without the picker (the picker listeners also log completions to the picker).

wrk (1 thread, fixed ``x-session-id`` and ``model-version`` headers, so every request is pinned)
runs each route kind at 16 connections and at 1 connection, ``runs`` times, alternating without
and with the picker; medians are reported. Added latency = p50/p99 with the picker minus without,
at 1 connection, per run, then the median.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.progress import Progress
from bench.sessions import bytes_per_session
from inferlb.devstack import stack
from xds_server.resources.bootstrap import render_bootstrap

T = "type.googleapis.com/"
HEADERS = {"x-session-id": "bench-session-1", "model-version": "v1"}
TARGETS = {"python_cpu_us_per_decision": 30.0, "python_cpu_us_per_decision_1conn": 100.0,
           "added_p50_ms": 0.3, "added_p99_ms": 0.5, "rps_with_picker_direct_response": 10_000.0}


def _hcm(name: str, route: dict, ext_proc_cluster: str | None, cfg_headers: dict) -> dict:
    filters = []
    access_log = []
    if ext_proc_cluster is not None:
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": ext_proc_cluster}, "timeout": "0.25s"},
            "failure_mode_allow": True, "message_timeout": "0.25s",
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                                "request_body_mode": "NONE", "response_body_mode": "NONE",
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}})
        access_log.append({
            "name": "envoy.access_loggers.http_grpc",
            "filter": {"header_filter": {"header": {"name": cfg_headers["cluster"], "present_match": True}}},
            "typed_config": {
                "@type": T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                "common_config": {"log_name": "bench",
                                  "grpc_service": {"envoy_grpc": {"cluster_name": ext_proc_cluster}},
                                  "transport_api_version": "V3", "buffer_flush_interval": "0.005s"},
                "additional_request_headers_to_log": [cfg_headers["cluster"], cfg_headers["override_host"]]}})
    filters.append({"name": "envoy.filters.http.router",
                    "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}})
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name, "access_log": access_log, "http_filters": filters,
        "route_config": {"name": name, "validate_clusters": False, "virtual_hosts": [
            {"name": name, "domains": ["*"], "routes": [{"match": {"prefix": "/"}, **route}]}]}}}


def _listener(name: str, port: int, route: dict, ext_proc_cluster: str | None = None) -> dict:
    headers = {"cluster": "x-inferlb-cluster", "override_host": "x-gateway-destination-endpoint"}
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [_hcm(name, route, ext_proc_cluster, headers)]}]}


def envoy_bootstrap(xds_port: int, admin_port: int, picker_port: int, ports: dict[str, int]) -> str:
    """The ADS bootstrap plus the bench's static listeners and a static cluster for the picker."""
    doc = yaml.safe_load(render_bootstrap(xds_address=f"127.0.0.1:{xds_port}", node_id="bench-envoy",
                                          admin_port=admin_port))
    direct = {"direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
    doc["static_resources"]["clusters"].append({
        "name": "bench_picker", "type": "STATIC", "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "bench_picker", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": picker_port}}}}]}]}})
    doc["static_resources"]["listeners"] = [
        _listener("upstream", ports["upstream"], direct),
        _listener("direct_without", ports["direct_without"], direct),
        _listener("direct_with", ports["direct_with"], direct, "bench_picker"),
        _listener("upstream_without", ports["upstream_without"], {"route": {"cluster": "bench-v1"}}),
    ]
    return yaml.safe_dump(doc, sort_keys=False)


def control_plane_config(ports: dict[str, int], picker_port: int) -> dict:
    return {
        "listen": {"xds": f"127.0.0.1:{ports['xds']}", "ext_proc": "127.0.0.1:0",
                   "admin": f"127.0.0.1:{ports['admin']}"},
        "envoy": {"listener": f"127.0.0.1:{ports['upstream_with']}", "ext_proc_address": f"127.0.0.1:{picker_port}"},
        "loop": {"interval_s": 5, "timeout_s": 0.2},
        "prometheus": {"url": f"http://127.0.0.1:{ports['dead']}"},
        "picker": {"admission": False},
        "services": [{"name": "bench", "versions": [
            {"name": "v1", "endpoints": [{"address": f"127.0.0.1:{ports['upstream']}"}]}]}],
    }


_LATENCY = re.compile(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def run_wrk(url: str, connections: int, duration_s: float) -> dict[str, float]:
    """One wrk run: requests, req/s, p50/p99 (ms), non-2xx and socket errors."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--latency"]
    for k, v in HEADERS.items():
        argv += ["-H", f"{k}: {v}"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, timeout=duration_s + 30).stdout
    lat = {int(p): float(v) * _UNIT[u] for p, v, u in _LATENCY.findall(out)}
    m = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if not (m and rps and 50 in lat and 99 in lat):
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    return {"requests": int(m.group(1)), "rps": float(rps.group(1)), "p50_ms": lat[50], "p99_ms": lat[99],
            "non_2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": sum(int(x) for x in errors.groups()) if errors else 0}


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _picker_procs(root: psutil.Process) -> list[psutil.Process]:
    kids = root.children(recursive=True)
    return kids or [root]


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout} s")


def _envoy_stats(admin: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{admin}/stats?filter=ext_proc", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if value.strip().isdigit() and any(k in key for k in ("failure_mode_allowed", "streams_failed",
                                                              "message_timeouts", "streams_started")):
            out[key] = int(value)
    return out


def run(duration_s: float = 5.0, runs: int = 3, transport: str = "fast", workers: int = 1,
        envoy_concurrency: int = 1, workdir: Path | None = None) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON document (see module docstring)."""
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian package `wrk`; scripts/setup.sh installs it)")
    work = workdir or Path(tempfile.mkdtemp(prefix="inferlb-bench-"))
    names = ["xds", "admin", "dead", "upstream", "upstream_with", "upstream_without", "direct_with",
             "direct_without", "envoy_admin", "picker"]
    ports = {n: stack.free_port() for n in names}
    procs: list[stack.Proc] = []
    try:
        cfg_path = work / "inferlb.yaml"
        cfg_path.write_text(yaml.safe_dump(control_plane_config(ports, ports["picker"])))
        procs.append(stack.start_control_plane(cfg_path, work, ports["admin"]))
        picker = stack.spawn("picker", stack.inferlb_argv(
            "ext-proc", "--xds", f"127.0.0.1:{ports['xds']}", "--listen", f"127.0.0.1:{ports['picker']}",
            "--transport", transport, "--workers", str(workers), "--log-level", "warning"), work)
        procs.append(picker)
        _wait_port(ports["picker"])
        envoy = stack.start_envoy(envoy_bootstrap(ports["xds"], ports["envoy_admin"], ports["picker"], ports), work,
                                  ports["envoy_admin"], concurrency=envoy_concurrency)
        procs.append(envoy)
        _wait_port(ports["upstream_with"])
        picker_procs = _picker_procs(psutil.Process(picker.popen.pid))
        kinds = {"direct_response": ("direct_with", "direct_without"),
                 "upstream": ("upstream_with", "upstream_without")}
        for with_, without in kinds.values():  # warm-up: connections, HPACK tables, caches
            run_wrk(f"http://127.0.0.1:{ports[with_]}/v1/chat/completions", 16, 1)
            run_wrk(f"http://127.0.0.1:{ports[without]}/v1/chat/completions", 16, 1)
        result: dict[str, Any] = {}
        with Progress(len(kinds) * 2 * runs, 2 * duration_s, "bench picker") as progress:
            for kind, (with_, without) in kinds.items():
                raw: dict[str, list[dict]] = {}
                for conns in (16, 1):
                    for i in range(runs):
                        progress.step(f"{kind}, {conns} connection(s), run {i + 1}/{runs}")
                        base = run_wrk(f"http://127.0.0.1:{ports[without]}/v1/chat/completions", conns, duration_s)
                        before = _cpu_s(picker_procs)
                        picked = run_wrk(f"http://127.0.0.1:{ports[with_]}/v1/chat/completions", conns, duration_s)
                        cpu = _cpu_s(picker_procs) - before
                        picked["python_cpu_us_per_decision"] = cpu / max(1, picked["requests"]) * 1e6
                        raw.setdefault(f"{conns}conn", []).append({"run": i + 1, "without": base, "with": picked})
                sixteen, one = raw["16conn"], raw["1conn"]
                result[kind] = {
                    "rps_with_picker": statistics.median(r["with"]["rps"] for r in sixteen),
                    "rps_without_picker": statistics.median(r["without"]["rps"] for r in sixteen),
                    "python_cpu_us_per_decision": statistics.median(r["with"]["python_cpu_us_per_decision"]
                                                                    for r in sixteen),
                    "python_cpu_us_per_decision_1conn": statistics.median(r["with"]["python_cpu_us_per_decision"]
                                                                          for r in one),
                    "added_p50_ms": statistics.median(r["with"]["p50_ms"] - r["without"]["p50_ms"] for r in one),
                    "added_p99_ms": statistics.median(r["with"]["p99_ms"] - r["without"]["p99_ms"] for r in one),
                    "p50_ms_with_picker_1conn": statistics.median(r["with"]["p50_ms"] for r in one),
                    "p50_ms_without_picker_1conn": statistics.median(r["without"]["p50_ms"] for r in one),
                    "errors": sum(r[w]["non_2xx"] + r[w]["socket_errors"] for rs in raw.values() for r in rs
                                  for w in ("with", "without")),
                    "runs": raw,
                }
        stats = _envoy_stats(f"http://127.0.0.1:{ports['envoy_admin']}")
    finally:
        for p in reversed(procs):
            p.stop()
    direct = result["direct_response"]
    checks = {
        "python_cpu_us_per_decision": max(direct["python_cpu_us_per_decision"],
                                          result["upstream"]["python_cpu_us_per_decision"]),
        "python_cpu_us_per_decision_1conn": max(direct["python_cpu_us_per_decision_1conn"],
                                                result["upstream"]["python_cpu_us_per_decision_1conn"]),
        "added_p50_ms": direct["added_p50_ms"],
        "added_p99_ms": direct["added_p99_ms"],
        "rps_with_picker_direct_response": direct["rps_with_picker"],
    }
    targets = {k: {"target": TARGETS[k], "measured": v,
                   "met": v >= TARGETS[k] if k.startswith("rps") else v <= TARGETS[k]} for k, v in checks.items()}
    return {
        "benchmark": "picker",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "envoy": stack.envoy_version(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "transport": transport, "workers": workers, "envoy_concurrency": envoy_concurrency,
        "duration_s": duration_s, "runs": runs, "wrk": "1 thread, fixed session and version headers",
        "route_kinds": result,
        "targets": targets,
        "envoy_ext_proc_stats": stats,
        "session_table_bytes_per_session": round(bytes_per_session(200_000), 1),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def markdown(doc: dict[str, Any], command: str) -> str:
    """The BENCHMARKS.md section for one result document."""
    m = doc["machine"]
    lines = [
        f"### Picker, `{doc['transport']}` transport, {doc['workers']} picker process(es), "
        f"Envoy --concurrency {doc['envoy_concurrency']}",
        "",
        f"`{command}` — {doc['date']}, {m['cores']} × {m['cpu']}, Python {m['python']}, Envoy {m['envoy']}; "
        f"wrk {doc['wrk']}, {doc['duration_s']:g} s per run, medians of {doc['runs']} runs; "
        f"1-minute load average at the end: {m['load_average_1m_at_end']} (other work shared the 2 cores).",
        "",
        "| route kind | req/s with picker (16 conn) | req/s without | Python µs / decision (16 conn) "
        "| Python µs / decision (1 conn) | added p50 / p99, 1 conn (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, r in doc["route_kinds"].items():
        lines.append(f"| {kind} | {r['rps_with_picker']:,.0f} | {r['rps_without_picker']:,.0f} | "
                     f"{r['python_cpu_us_per_decision']:.1f} | {r['python_cpu_us_per_decision_1conn']:.1f} | "
                     f"{r['added_p50_ms']:.3f} / {r['added_p99_ms']:.3f} |")
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    for name, t in doc["targets"].items():
        lines.append(f"| {name} {'≥' if name.startswith('rps') else '≤'} {t['target']:g} | {t['measured']:.3f} | "
                     f"{'yes' if t['met'] else 'NO'} |")
    lines += ["", f"Envoy ext_proc stats after the run: `{json.dumps(doc['envoy_ext_proc_stats'])}`; "
              f"session table: {doc['session_table_bytes_per_session']} bytes per session.", ""]
    return "\n".join(lines)


def write_markdown(path: Path, section: str, key: str) -> None:
    """Replace (or append) the section between ``<!-- bench:KEY -->`` markers in ``path``."""
    begin, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nWritten by `inferlb bench ...`.\n"
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
