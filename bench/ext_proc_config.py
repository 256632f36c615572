"""``inferlb bench ext-proc-config``: what each part of our ext_proc config costs Envoy per request.

The picker's Envoy config (``xds_server/resources/listener.py``, ``clusters.py``) is taken apart
into variants (:data:`VARIANTS`), each an Envoy listener answering with ``direct_response`` whose
ext_proc filter calls a :mod:`bench.null_ext_proc` server (no decision work, so Envoy's CPU is
what differs). One Envoy (``--concurrency 1``) holds every listener; wrk (1 thread, 16
connections, the picker bench's mixed Lua script) runs each variant once per round, interleaved.
Per variant: req/s, Envoy CPU µs per request (``/proc/PID/stat`` utime+stime over a run / its
requests) and the null servers' CPU µs per request; medians over rounds with min/max.

The null servers: ``plain`` answers with no change; ``routed`` answers in the picker's shape (the
cluster header set, ``clear_route_cache``); ``mutation_only`` sets the header without
``clear_route_cache``; ``held`` (body runs) asks for the buffered body first, then answers the
body in the routed shape.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.picker import (
    T,
    _cpu_model,
    _cpu_s,
    _h2_cluster,
    _proc_cpu_s,
    _wait_port,
    run_wrk,
    wrk_script,
)
from bench.progress import Progress
from inferlb.devstack import stack
from xds_server.config.model import Picker
from xds_server.resources.bootstrap import render_bootstrap

CLUSTER_HEADER = "x-inferlb-cluster"

# name -> (server, ext_proc filter overrides, access log (None: none), ext_proc cluster h2 options,
#          what it shows)
_PICKER = Picker()
#: The completion log as ``inferlb serve`` configures it by default.
_LOG = {"flush": f"{_PICKER.access_log_flush_s:g}s", "buffer": _PICKER.access_log_buffer_bytes}
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"server": None, "about": "no ext_proc filter"},
    "null": {"server": "plain", "log": None, "about": "ext_proc call, no-change answer, no access log"},
    "mutation_only": {"server": "mutation_only", "log": None,
                      "about": "+ cluster-header mutation without clear_route_cache (the route is NOT redone)"},
    "routed": {"server": "routed", "log": None, "about": "+ header mutation + clear_route_cache, no access log"},
    "ours": {"server": "routed", "log": _LOG,
             "about": "our config: routed + completion access log (flush 5 ms, buffer 64 KiB)"},
    "log_flush_50ms": {"server": "routed", "log": {**_LOG, "flush": "0.05s"},
                       "about": "ours, access-log flush 50 ms"},
    "log_buffer_16k": {"server": "routed", "log": {**_LOG, "buffer": 16384},
                       "about": "ours, access-log buffer 16 KiB (the default until 2026-12-04)"},
    "log_flush_1s_buffer_1k": {"server": "routed", "log": {"flush": "1s", "buffer": 1024},
                               "about": "ours, access-log buffer 1 KiB (a message every few entries)"},
    "mode_override": {"server": "routed", "log": _LOG, "filter": {"allow_mode_override": True},
                      "about": "ours + allow_mode_override (body routing configured, not used)"},
    "no_message_timeout": {"server": "routed", "log": _LOG, "filter": {"message_timeout": None},
                           "about": "ours without message_timeout (Envoy's 200 ms default)"},
    "h2_small_windows": {"server": "routed", "log": _LOG,
                         "h2": {"initial_stream_window_size": 65536, "initial_connection_window_size": 1048576},
                         "about": "ours, ext_proc cluster windows 64 KiB / 1 MiB (defaults 256 MiB / 1 GiB)"},
    "h2_4_streams_per_conn": {"server": "routed", "log": _LOG, "h2": {"max_concurrent_streams": 4},
                              "about": "ours, max 4 streams per ext_proc connection (more connections)"},
    "google_grpc": {"server": "routed", "log": _LOG, "google_grpc": True,
                    "about": "ours with google_grpc instead of envoy_grpc (Envoy's gRPC client)"},
}
BODY_VARIANTS: dict[str, dict[str, Any]] = {
    "none": VARIANTS["none"],
    "ours_headers_only": {"server": "routed", "log": _LOG, "filter": {"allow_mode_override": True},
                          "about": "our config with body routing on; the body is not asked for"},
    "ours_buffered": {"server": "held", "log": _LOG, "filter": {"allow_mode_override": True},
                      "about": "the body asked for with mode_override BUFFERED, answered in the routed shape"},
    "config_buffered": {"server": "held", "log": _LOG,
                        "filter": {"allow_mode_override": True, "request_body_mode": "BUFFERED"},
                        "about": "request_body_mode BUFFERED in the filter config (every request sends its body)"},
}


def _filter(cluster: str, variant: dict[str, Any], port: int) -> dict:
    over = dict(variant.get("filter", {}))
    body_mode = over.pop("request_body_mode", "NONE")
    if variant.get("google_grpc"):
        service = {"google_grpc": {"target_uri": f"127.0.0.1:{port}", "stat_prefix": "bench"}, "timeout": "0.25s"}
    else:
        service = {"envoy_grpc": {"cluster_name": cluster}, "timeout": "0.25s"}
    cfg = {"@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
           "grpc_service": service, "failure_mode_allow": True, "message_timeout": "0.25s",
           "allow_mode_override": False,
           "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                               "request_body_mode": body_mode, "response_body_mode": "NONE",
                               "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}
    for key, value in over.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return {"name": "envoy.filters.http.ext_proc", "typed_config": cfg}


def _access_log(cluster: str, log: dict[str, Any]) -> dict:
    return {"name": "envoy.access_loggers.http_grpc",
            "filter": {"header_filter": {"header": {"name": CLUSTER_HEADER, "present_match": True}}},
            "typed_config": {
                "@type": T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                "common_config": {"log_name": "bench", "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                                  "transport_api_version": "V3", "buffer_flush_interval": log["flush"],
                                  "buffer_size_bytes": log["buffer"]},
                "additional_request_headers_to_log": [CLUSTER_HEADER, "x-gateway-destination-endpoint"]}}


def envoy_bootstrap(variants: dict[str, dict[str, Any]], ports: dict[str, int], server_ports: dict[str, int],
                    admin_port: int) -> str:
    """One listener per variant (``ports[name]``) answering ``direct_response`` and one static HTTP/2
    cluster per variant with ext_proc (to ``server_ports[variant["server"]]``, h2 options merged)."""
    doc = yaml.safe_load(render_bootstrap(xds_address="127.0.0.1:1", node_id="bench-envoy", admin_port=admin_port))
    doc.pop("dynamic_resources", None)
    doc["static_resources"]["clusters"] = []
    listeners = []
    for name, variant in variants.items():
        filters, access_log = [], []
        if variant["server"] is not None:
            cluster = f"ext_proc_{name}"
            port = server_ports[variant["server"]]
            c = _h2_cluster(cluster, port)
            opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            opts["explicit_http_config"]["http2_protocol_options"].update(variant.get("h2", {}))
            doc["static_resources"]["clusters"].append(c)
            filters.append(_filter(cluster, variant, port))
            if variant.get("log"):
                access_log.append(_access_log(cluster, variant["log"]))
        filters.append({"name": "envoy.filters.http.router",
                        "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}})
        route = {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
        hcm = {"@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
               "stat_prefix": name, "access_log": access_log, "http_filters": filters,
               "route_config": {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [route]}]}}
        listeners.append({"name": name, "address": {"socket_address": {"address": "127.0.0.1",
                                                                       "port_value": ports[name]}},
                          "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                          "typed_config": hcm}]}]})
    doc["static_resources"]["listeners"] = listeners
    return yaml.safe_dump(doc, sort_keys=False)


def _server_argv(kind: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "bench.null_ext_proc", "--listen", f"127.0.0.1:{port}"]
    if kind in ("routed", "held", "mutation_only"):
        argv += ["--set-header", f"{CLUSTER_HEADER}=bench-v1"]
    if kind == "mutation_only":
        argv.append("--no-clear-route-cache")
    if kind == "held":
        argv.append("--hold-body")
    return argv


def run(duration_s: float = 3.0, runs: int = 5, connections: int = 16, body_kb: int = 0,
        only: list[str] | None = None) -> dict[str, Any]:
    """Run the variants (``BODY_VARIANTS`` with ``body_kb`` > 0; ``only``: a subset by name, plus
    ``none``); returns the result document (see the module docstring)."""
    variants = BODY_VARIANTS if body_kb else VARIANTS
    if only:
        unknown = set(only) - set(variants)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {sorted(variants)}")
        variants = {k: v for k, v in variants.items() if k == "none" or k in only}
    work = Path(tempfile.mkdtemp(prefix="inferlb-bench-extproc-"))
    kinds = sorted({v["server"] for v in variants.values() if v["server"] is not None})
    server_ports = {k: stack.free_port() for k in kinds}
    ports = {name: stack.free_port() for name in variants}
    admin = stack.free_port()
    script = wrk_script(work / "mixed.lua", body_kb)
    procs: list[stack.Proc] = []
    try:
        servers = {k: stack.spawn(f"null-{k}", _server_argv(k, server_ports[k]), work) for k in kinds}
        procs += servers.values()
        for k in kinds:
            _wait_port(server_ports[k])
        envoy = stack.start_envoy(envoy_bootstrap(variants, ports, server_ports, admin), work, admin)
        procs.append(envoy)
        for name in variants:
            _wait_port(ports[name])
        measured = {k: [psutil.Process(p.popen.pid)] for k, p in servers.items()}

        def url(name: str) -> str:
            return f"http://127.0.0.1:{ports[name]}/v1/chat/completions"

        for name in variants:  # warm-up
            run_wrk(url(name), connections, 1, script)
        rounds: list[dict[str, dict]] = []
        with Progress(runs, len(variants) * duration_s, "bench ext-proc-config") as progress:
            for i in range(runs):
                progress.step(f"round {i + 1}/{runs}")
                round_: dict[str, dict] = {}
                for name, variant in variants.items():
                    procs_ = measured.get(variant["server"], [])
                    before, envoy_before = _cpu_s(procs_), _proc_cpu_s(envoy.popen.pid)
                    r = run_wrk(url(name), connections, duration_s, script)
                    n = max(1, r["requests"])
                    r["envoy_cpu_us_per_request"] = (_proc_cpu_s(envoy.popen.pid) - envoy_before) / n * 1e6
                    r["server_cpu_us_per_request"] = (_cpu_s(procs_) - before) / n * 1e6
                    round_[name] = r
                rounds.append(round_)
    finally:
        stack.stop_all(procs)

    def col(name: str, key: str) -> list[float]:
        return [r[name][key] for r in rounds]

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "benchmark": "ext_proc_config",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "envoy": stack.envoy_version(),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "duration_s": duration_s, "runs": runs, "connections": connections, "body_kb": body_kb,
        "variants": {name: {
            "about": v["about"],
            "rps": spread(col(name, "rps")),
            "envoy_cpu_us_per_request": spread(col(name, "envoy_cpu_us_per_request")),
            "server_cpu_us_per_request": statistics.median(col(name, "server_cpu_us_per_request")),
            "errors": sum(r[name]["non_2xx"] + r[name]["socket_errors"] for r in rounds),
        } for name, v in variants.items()},
        "rounds": rounds,
    }


def markdown(doc: dict[str, Any], command: str) -> str:
    """The BENCHMARKS.md section for one result document."""
    m = doc["machine"]
    body = f", POST with a {doc['body_kb']} KiB JSON body" if doc["body_kb"] else ""
    lines = [
        f"### Envoy's cost per ext_proc config part{body}", "",
        f"`{command}` — {doc['date']}, {m['cores']} × {m['cpu']}, Envoy {m['envoy']} --concurrency 1, "
        f"`direct_response`, wrk 1 thread, {doc['connections']} connections, {doc['duration_s']:g} s per run, "
        f"variants interleaved, medians of {doc['runs']} rounds (min–max); 1-minute load average at the end: "
        f"{m['load_average_1m_at_end']} (the 2 cores were shared with other work).", "",
        "| variant | what | req/s | Envoy µs / request | null server µs / request | errors |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, v in doc["variants"].items():
        rps, cpu = v["rps"], v["envoy_cpu_us_per_request"]
        lines.append(f"| `{name}` | {v['about']} | {rps['median']:,.0f} [{rps['min']:,.0f}–{rps['max']:,.0f}] | "
                     f"{cpu['median']:.1f} [{cpu['min']:.1f}–{cpu['max']:.1f}] | "
                     f"{v['server_cpu_us_per_request']:.1f} | {v['errors']} |")
    return "\n".join(lines) + "\n"
