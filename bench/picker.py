"""``inferlb bench picker``: what the ext_proc picker costs, on real Envoy, measured with wrk.

One run sets up, as plain processes on this machine:
- the control plane (``inferlb serve``; no Prometheus, so weights stay neutral) with one service
  whose only endpoint is a "real upstream": an Envoy listener answering with ``direct_response``;
- the picker alone (``inferlb ext-proc --xds``), the process whose CPU is measured (psutil, all
  its threads; with ``--workers`` all worker processes);
- the ``null`` ext_proc server (:mod:`bench.null_ext_proc`, as many processes as picker workers):
  a fixed no-change answer to every message on our HTTP/2 transport — Envoy's ext_proc ceiling;
- ``null_routed``: the same server answering in the picker's shape (a fixed cluster-header
  mutation with ``clear_route_cache``), so Envoy also re-routes and the completion log fires;
- Envoy (``--concurrency N``) with eight listeners, the four variants (see :data:`VARIANTS`) times
  two route kinds: ``direct_response`` and a route to the upstream cluster (the upstream one
  with the picker is the control plane's own listener; the null ones copy the picker
  listeners' filter config, access log included).

Traffic: wrk (1 thread) with a Lua script that alternates requests with and without an
``x-session-id`` (64 sessions), so the scheduler runs both its session path (pin lookup, pinned
bound) and its bounded-loads path; with ``body_kb`` a POST with a JSON body of that size that the
picker reads for routing (the null server asks for it too). Each route kind runs ``runs`` rounds;
a round runs each variant once at 16 connections, then once at 1 connection (interleaved, so
drift on the shared machine hits all variants alike). Medians over rounds are reported, with
min/max in ``spread``. Added latency = p50/p99 with the picker minus without, at 1 connection,
per round. Envoy CPU per request: utime+stime of the Envoy process from ``/proc/PID/stat`` over a
wrk run / its requests (10 ms tick resolution).
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
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench import picker_profile
from bench.markdown import replace_marked
from bench.progress import Progress
from bench.sessions import bytes_per_session
from inferlb.devstack import stack
from xds_server.config.model import Picker
from xds_server.resources.bootstrap import render_bootstrap

T = "type.googleapis.com/"
#: The picker config's defaults: the bench's completion log is configured as ``inferlb serve``'s.
_PICKER = Picker()
HEADERS = {"x-session-id": "bench-session-1", "model-version": "v1"}
TARGETS = {"rps_ratio_to_null": 0.85, "python_cpu_us_per_decision": 30.0, "python_cpu_us_per_decision_1conn": 100.0,
           "added_p50_ms": 0.3, "added_p99_ms": 0.5}
"""Issue 14's targets (direct_response route, 16 connections; CPU: the worse route kind)."""


def _hcm(name: str, route: dict, ext_proc_cluster: str | None, cfg_headers: dict, body: bool = False) -> dict:
    filters = []
    access_log = []
    if ext_proc_cluster is not None:
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": ext_proc_cluster}, "timeout": "0.25s"},
            "failure_mode_allow": True, "message_timeout": "0.25s", "allow_mode_override": body,
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
                                  "transport_api_version": "V3",
                                  "buffer_flush_interval": f"{_PICKER.access_log_flush_s:g}s",
                                  "buffer_size_bytes": _PICKER.access_log_buffer_bytes},
                "additional_request_headers_to_log": [cfg_headers["cluster"], cfg_headers["override_host"]]}})
    filters.append({"name": "envoy.filters.http.router",
                    "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}})
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name, "access_log": access_log, "http_filters": filters,
        "route_config": {"name": name, "validate_clusters": False, "virtual_hosts": [
            {"name": name, "domains": ["*"], "routes": [{"match": {"prefix": "/"}, **route}]}]}}}


def _listener(name: str, port: int, route: dict, ext_proc_cluster: str | None = None, body: bool = False) -> dict:
    headers = {"cluster": "x-inferlb-cluster", "override_host": "x-gateway-destination-endpoint"}
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [_hcm(name, route, ext_proc_cluster, headers, body)]}]}


def _h2_cluster(name: str, port: int) -> dict:
    return {
        "name": name, "type": "STATIC", "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def envoy_bootstrap(xds_port: int, admin_port: int, picker_port: int, ports: dict[str, int],
                    null_port: int | None = None, body_kb: int = 0, null_routed_port: int | None = None,
                    before_port: int | None = None) -> str:
    """The ADS bootstrap plus the bench's static listeners and static clusters for the picker and the
    null ext_proc server (the ``*_null`` listeners: the picker listeners' filter config, other cluster);
    with ``before_port`` also the ``*_before`` listeners for a second picker (``picker_before``)."""
    doc = yaml.safe_load(render_bootstrap(xds_address=f"127.0.0.1:{xds_port}", node_id="bench-envoy",
                                          admin_port=admin_port))
    direct = {"direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
    body = body_kb > 0
    doc["static_resources"]["clusters"].append(_h2_cluster("bench_picker", picker_port))
    doc["static_resources"]["listeners"] = [
        _listener("upstream", ports["upstream"], direct),
        _listener("direct_without", ports["direct_without"], direct),
        _listener("direct_with", ports["direct_with"], direct, "bench_picker", body),
        _listener("upstream_without", ports["upstream_without"], {"route": {"cluster": "bench-v1"}}),
    ]
    if null_port is not None:
        doc["static_resources"]["clusters"].append(_h2_cluster("bench_null", null_port))
        doc["static_resources"]["listeners"] += [
            _listener("direct_null", ports["direct_null"], direct, "bench_null", body),
            _listener("upstream_null", ports["upstream_null"], {"route": {"cluster": "bench-v1"}}, "bench_null", body),
        ]
    if null_routed_port is not None:
        doc["static_resources"]["clusters"].append(_h2_cluster("bench_null_routed", null_routed_port))
        doc["static_resources"]["listeners"] += [
            _listener("direct_null_routed", ports["direct_null_routed"], direct, "bench_null_routed", body),
            _listener("upstream_null_routed", ports["upstream_null_routed"], {"route": {"cluster": "bench-v1"}},
                      "bench_null_routed", body),
        ]
    if before_port is not None:
        doc["static_resources"]["clusters"].append(_h2_cluster("bench_picker_before", before_port))
        doc["static_resources"]["listeners"] += [
            _listener("direct_before", ports["direct_before"], direct, "bench_picker_before", body),
            _listener("upstream_before", ports["upstream_before"], {"route": {"cluster": "bench-v1"}},
                      "bench_picker_before", body),
        ]
    return yaml.safe_dump(doc, sort_keys=False)


def control_plane_config(ports: dict[str, int], picker_port: int, body_kb: int = 0) -> dict:
    """The control plane's config: one service, one endpoint (the ``upstream`` listener); the picker's
    body routing at its default (``picker.body_max_bytes`` 1 MiB, buffered), so ``body_kb`` > 0 (a
    POST with a JSON body) measures the default, up to bodies of 1 MiB."""
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


def run_wrk(url: str, connections: int, duration_s: float, script: Path | None = None) -> dict[str, float]:
    """One wrk run: requests, req/s, p50/p99 (ms), non-2xx and socket errors. With ``script`` (a wrk
    Lua script, see :func:`wrk_script`) the requests come from it; else fixed ``HEADERS``."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--latency"]
    if script is not None:
        argv += ["-s", str(script)]
    else:
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


_WRK_LUA = """
-- inferlb bench picker: alternate requests with and without a session header (%(sessions)d sessions),
-- pre-formatted once, so every request runs the full scheduler (pins, session lookups, bounded loads).
local reqs = {}
local i = 0
init = function(args)
  for k = 1, %(n)d do
    local h = {["model-version"] = "v1", ["content-type"] = "application/json"}
    if k %% 2 == 0 then h["x-session-id"] = "bench-session-" .. (k %% %(sessions)d) end
    reqs[k] = wrk.format(%(method)s, nil, h, %(body)s)
  end
end
request = function()
  i = i %% %(n)d + 1
  return reqs[i]
end
"""


def body_json(kb: int) -> str:
    """A chat-completions JSON body of about ``kb`` KiB (model, user, a system prompt and a user turn)."""
    filler = ("You are a careful assistant. " * (kb * 1024 // 29 + 1))[: max(0, kb * 1024 - 160)]
    return json.dumps({"model": "bench", "user": "u1", "max_tokens": 64, "messages": [
        {"role": "system", "content": filler}, {"role": "user", "content": "hello"}]})


def wrk_script(path: Path, body_kb: int = 0, sessions: int = 64) -> Path:
    """Write the wrk Lua script (see ``_WRK_LUA``) to ``path``; ``body_kb`` > 0 sends a POST JSON body."""
    body = "nil"
    method = "nil"
    if body_kb > 0:
        text = body_json(body_kb)
        path.with_suffix(".body.json").write_text(text)
        body = f"[==[{text}]==]"  # a Lua long string (wrk's init cannot read files)
        method = '"POST"'
    path.write_text(_WRK_LUA % {"sessions": sessions, "n": 2 * sessions, "body": body, "method": method})
    return path


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads) from /proc/PID/stat, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


VARIANTS = ("without", "null", "null_routed", "picker")
"""The variants run in each round, in this order: no ext_proc filter; the null ext_proc server
(no-change answer); the null server answering in the picker's shape (a fixed cluster-header
mutation with ``clear_route_cache``, so Envoy also re-routes and the completion access log fires);
the picker. With ``before`` (a checkout's path) a fifth, ``picker_before``: the picker run from
that checkout (``PYTHONPATH``), for a before/after comparison in the same run."""
BEFORE = "picker_before"


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summary(rounds: list[dict], variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Medians (and min/max) over rounds of one route kind; ``rounds[i][conns][variant]`` is one wrk run."""
    def col(conns: str, variant: str, key: str) -> list[float]:
        return [r[conns][variant][key] for r in rounds]

    ratio = [r["16conn"]["picker"]["rps"] / r["16conn"]["null"]["rps"] for r in rounds]
    ratio_routed = [r["16conn"]["picker"]["rps"] / r["16conn"]["null_routed"]["rps"] for r in rounds]
    ratio_1 = [r["1conn"]["picker"]["rps"] / r["1conn"]["null"]["rps"] for r in rounds]
    added50 = [r["1conn"]["picker"]["p50_ms"] - r["1conn"]["without"]["p50_ms"] for r in rounds]
    added99 = [r["1conn"]["picker"]["p99_ms"] - r["1conn"]["without"]["p99_ms"] for r in rounds]
    null50 = [r["1conn"]["null"]["p50_ms"] - r["1conn"]["without"]["p50_ms"] for r in rounds]
    null99 = [r["1conn"]["null"]["p99_ms"] - r["1conn"]["without"]["p99_ms"] for r in rounds]
    routed99 = [r["1conn"]["null_routed"]["p99_ms"] - r["1conn"]["without"]["p99_ms"] for r in rounds]
    return {
        "rps_with_picker": statistics.median(col("16conn", "picker", "rps")),
        "rps_without_picker": statistics.median(col("16conn", "without", "rps")),
        "rps_null_ext_proc": statistics.median(col("16conn", "null", "rps")),
        "rps_ratio_to_null": statistics.median(ratio),
        "rps_ratio_to_null_1conn": statistics.median(ratio_1),
        "rps_null_routed": statistics.median(col("16conn", "null_routed", "rps")),
        "rps_ratio_to_null_routed": statistics.median(ratio_routed),
        "python_cpu_us_per_decision": statistics.median(col("16conn", "picker", "python_cpu_us_per_request")),
        "python_cpu_us_per_decision_1conn": statistics.median(col("1conn", "picker", "python_cpu_us_per_request")),
        "null_cpu_us_per_request": statistics.median(col("16conn", "null", "python_cpu_us_per_request")),
        "added_p50_ms": statistics.median(added50),
        "added_p99_ms": statistics.median(added99),
        "null_added_p50_ms": statistics.median(null50),
        "null_added_p99_ms": statistics.median(null99),
        "null_routed_added_p99_ms": statistics.median(routed99),
        "p50_ms_with_picker_1conn": statistics.median(col("1conn", "picker", "p50_ms")),
        "p50_ms_without_picker_1conn": statistics.median(col("1conn", "without", "p50_ms")),
        "envoy_cpu_us_per_request": {v: statistics.median(col("16conn", v, "envoy_cpu_us_per_request"))
                                     for v in variants},
        "envoy_cpu_us_per_request_1conn": {v: statistics.median(col("1conn", v, "envoy_cpu_us_per_request"))
                                           for v in variants},
        "spread": {
            "rps_16conn": {v: _spread(col("16conn", v, "rps")) for v in variants},
            "rps_ratio_to_null": _spread(ratio),
            "rps_ratio_to_null_routed": _spread(ratio_routed),
            "python_cpu_us_per_decision": _spread(col("16conn", "picker", "python_cpu_us_per_request")),
            "python_cpu_us_per_decision_1conn": _spread(col("1conn", "picker", "python_cpu_us_per_request")),
            "added_p50_ms": _spread(added50), "added_p99_ms": _spread(added99),
            "null_added_p99_ms": _spread(null99), "null_routed_added_p99_ms": _spread(routed99),
            "envoy_cpu_us_per_request": {v: _spread(col("16conn", v, "envoy_cpu_us_per_request"))
                                         for v in variants},
        },
        "errors": sum(r[c][v]["non_2xx"] + r[c][v]["socket_errors"] for r in rounds for c in r if c != "round"
                      for v in variants),
        **(_before(rounds) if BEFORE in variants else {}),
        "rounds": rounds,
    }


def _before(rounds: list[dict]) -> dict[str, Any]:
    """The ``picker_before`` figures of one route kind (same keys as the picker's, ``_before`` added)."""
    def col(conns: str, key: str) -> list[float]:
        return [r[conns][BEFORE][key] for r in rounds]

    ratio = [r["16conn"][BEFORE]["rps"] / r["16conn"]["null"]["rps"] for r in rounds]
    gain = [r["16conn"]["picker"]["rps"] / r["16conn"][BEFORE]["rps"] for r in rounds]
    return {"before": {
        "rps_with_picker": statistics.median(col("16conn", "rps")),
        "rps_ratio_to_null": statistics.median(ratio),
        "rps_after_over_before": statistics.median(gain),
        "python_cpu_us_per_decision": statistics.median(col("16conn", "python_cpu_us_per_request")),
        "python_cpu_us_per_decision_1conn": statistics.median(col("1conn", "python_cpu_us_per_request")),
        "added_p50_ms": statistics.median([r["1conn"][BEFORE]["p50_ms"] - r["1conn"]["without"]["p50_ms"]
                                           for r in rounds]),
        "added_p99_ms": statistics.median([r["1conn"][BEFORE]["p99_ms"] - r["1conn"]["without"]["p99_ms"]
                                           for r in rounds]),
        "spread": {"rps_ratio_to_null": _spread(ratio), "rps_after_over_before": _spread(gain),
                   "python_cpu_us_per_decision": _spread(col("16conn", "python_cpu_us_per_request")),
                   "python_cpu_us_per_decision_1conn": _spread(col("1conn", "python_cpu_us_per_request"))},
    }}





def run(duration_s: float = 5.0, runs: int = 3, transport: str = "fast", workers: int = 1,
        envoy_concurrency: int = 1, workdir: Path | None = None, body_kb: int = 0,
        before: Path | None = None, profile_s: float = 0.0) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON document (see module docstring). ``before``: a
    checkout whose picker also runs (variant ``picker_before``, see :data:`VARIANTS`). ``profile_s``
    > 0: after the rounds, one more run at 16 connections through the picker's ``direct_response``
    listener with py-spy attached for that many seconds (:mod:`bench.picker_profile`); the parts are
    in ``profile``.

    Raises:
        RuntimeError: wrk (or, with ``profile_s``, py-spy) is missing, or a process did not start.
    """
    variants = (*VARIANTS, BEFORE) if before is not None else VARIANTS
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian package `wrk`; scripts/setup.sh installs it)")
    work = workdir or Path(tempfile.mkdtemp(prefix="inferlb-bench-"))
    names = ["xds", "admin", "dead", "upstream", "upstream_with", "upstream_without", "upstream_null",
             "upstream_null_routed", "direct_with", "direct_without", "direct_null", "direct_null_routed",
             "envoy_admin", "picker", "null", "null_routed", "picker_before", "direct_before", "upstream_before"]
    ports = {n: stack.free_port() for n in names}
    procs: list[stack.Proc] = []
    script = wrk_script(work / "mixed.lua", body_kb)
    try:
        cfg_path = work / "inferlb.yaml"
        cfg_path.write_text(yaml.safe_dump(control_plane_config(ports, ports["picker"], body_kb)))
        procs.append(stack.start_control_plane(cfg_path, work, ports["admin"]))
        picker = stack.spawn("picker", stack.inferlb_argv(
            "ext-proc", "--xds", f"127.0.0.1:{ports['xds']}", "--listen", f"127.0.0.1:{ports['picker']}",
            "--transport", transport, "--workers", str(workers), "--log-level", "warning"), work)
        procs.append(picker)
        picker_argv = stack.inferlb_argv(
            "ext-proc", "--xds", f"127.0.0.1:{ports['xds']}", "--listen", f"127.0.0.1:{ports['picker_before']}",
            "--transport", transport, "--workers", str(workers), "--log-level", "warning")
        # PYTHONSAFEPATH (-P, inherited by --workers children): without it ``python -m`` puts the working
        # directory (this checkout, when run from it) before PYTHONPATH, and "before" runs this code.
        picker_before = stack.spawn(BEFORE, picker_argv, work, env={"PYTHONPATH": str(before), "PYTHONSAFEPATH": "1"}) \
            if before is not None else None
        if picker_before is not None:
            procs.append(picker_before)
        null_argv = [sys.executable, "-m", "bench.null_ext_proc", "--reuse-port", *(["--hold-body"] if body_kb else [])]
        nulls = {"null": [stack.spawn(f"null-{i}", [*null_argv, "--listen", f"127.0.0.1:{ports['null']}"], work)
                          for i in range(workers)],
                 "null_routed": [stack.spawn(f"null-routed-{i}", [
                     *null_argv, "--listen", f"127.0.0.1:{ports['null_routed']}",
                     "--set-header", "x-inferlb-cluster=bench-v1"], work) for i in range(workers)]}
        procs += nulls["null"] + nulls["null_routed"]
        for name in ("picker", "null", "null_routed", *(["picker_before"] if before is not None else [])):
            _wait_port(ports[name])
        envoy = stack.start_envoy(envoy_bootstrap(ports["xds"], ports["envoy_admin"], ports["picker"], ports,
                                                  ports["null"], body_kb, ports["null_routed"],
                                                  ports["picker_before"] if before is not None else None), work,
                                  ports["envoy_admin"], concurrency=envoy_concurrency)
        procs.append(envoy)
        _wait_port(ports["upstream_with"])
        picker_procs = _picker_procs(psutil.Process(picker.popen.pid))
        measured_procs = {"picker": picker_procs, "without": [],
                          **{k: [psutil.Process(p.popen.pid) for p in v] for k, v in nulls.items()}}
        if picker_before is not None:
            measured_procs[BEFORE] = _picker_procs(psutil.Process(picker_before.popen.pid))
        kinds = {kind: {"without": f"{prefix}_without", "null": f"{prefix}_null",
                        "null_routed": f"{prefix}_null_routed", "picker": f"{prefix}_with",
                        BEFORE: f"{prefix}_before"}
                 for kind, prefix in (("direct_response", "direct"), ("upstream", "upstream"))}

        def url(listener: str) -> str:
            return f"http://127.0.0.1:{ports[listener]}/v1/chat/completions"

        for listeners in kinds.values():  # warm-up: connections, HPACK tables, caches
            for variant in variants:
                run_wrk(url(listeners[variant]), 16, 1, script)
        result: dict[str, Any] = {}
        with Progress(len(kinds) * 2 * runs, len(variants) * duration_s, "bench picker") as progress:
            for kind, listeners in kinds.items():
                rounds: list[dict] = []
                for i in range(runs):
                    round_: dict[str, Any] = {"round": i + 1}
                    for conns in (16, 1):
                        progress.step(f"{kind}, {conns} connection(s), round {i + 1}/{runs}")
                        runs_: dict[str, dict] = {}
                        for variant in variants:
                            measured = measured_procs[variant]
                            cpu_before, envoy_before = _cpu_s(measured), _proc_cpu_s(envoy.popen.pid)
                            r = run_wrk(url(listeners[variant]), conns, duration_s, script)
                            n = max(1, r["requests"])
                            r["python_cpu_us_per_request"] = (_cpu_s(measured) - cpu_before) / n * 1e6
                            r["envoy_cpu_us_per_request"] = (_proc_cpu_s(envoy.popen.pid) - envoy_before) / n * 1e6
                            runs_[variant] = r
                        round_[f"{conns}conn"] = runs_
                    rounds.append(round_)
                result[kind] = _summary(rounds, variants)
        profile = _profile(picker_procs, url(kinds["direct_response"]["picker"]), profile_s, script, work,
                           result["direct_response"]["python_cpu_us_per_decision"]) if profile_s > 0 else None
        stats = _envoy_stats(f"http://127.0.0.1:{ports['envoy_admin']}")
    finally:
        stack.stop_all(procs)
    direct = result["direct_response"]
    checks = {
        "rps_ratio_to_null": direct["rps_ratio_to_null"],
        "python_cpu_us_per_decision": max(direct["python_cpu_us_per_decision"],
                                          result["upstream"]["python_cpu_us_per_decision"]),
        "python_cpu_us_per_decision_1conn": max(direct["python_cpu_us_per_decision_1conn"],
                                                result["upstream"]["python_cpu_us_per_decision_1conn"]),
        "added_p50_ms": direct["added_p50_ms"],
        "added_p99_ms": direct["added_p99_ms"],
    }
    targets_ = dict(TARGETS)
    if body_kb:
        targets_.update(rps_ratio_to_null=0.7, added_p50_ms=0.5, added_p99_ms=float("inf"))
    targets = {k: {"target": targets_[k], "measured": v,
                   "met": v >= targets_[k] if k.startswith("rps") else v <= targets_[k]} for k, v in checks.items()}
    return {
        "benchmark": "picker",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "envoy": stack.envoy_version(), "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "transport": transport, "workers": workers, "envoy_concurrency": envoy_concurrency,
        "duration_s": duration_s, "runs": runs, "body_kb": body_kb,
        "wrk": "1 thread, Lua script alternating requests with and without x-session-id (64 sessions)"
               + (f", POST with a {body_kb} KiB JSON body" if body_kb else ""),
        "variants": {"without": "no ext_proc filter", "null": "bench.null_ext_proc (fixed no-change answer, "
                     "same filter config, our h2 transport)",
                     "null_routed": "bench.null_ext_proc --set-header x-inferlb-cluster=bench-v1 (the picker's "
                     "answer shape: header mutation + clear_route_cache; the completion access log fires)",
                     "picker": "inferlb ext-proc",
                     **({BEFORE: f"inferlb ext-proc from {before} (PYTHONPATH; its upstream listener routes "
                                 "to bench-v1 statically)"} if before is not None else {})},
        "route_kinds": result,
        **({"profile": profile} if profile is not None else {}),
        "targets": targets,
        "envoy_ext_proc_stats": stats,
        "session_table_bytes_per_session": round(bytes_per_session(200_000), 1),
    }


def _profile(procs: list[psutil.Process], url: str, seconds: float, script: Path, work: Path,
             us_per_decision: float) -> dict[str, Any]:
    """py-spy on the picker's processes during one wrk run at 16 connections (see :func:`run`)."""
    pids = [p.pid for p in procs]
    spies = picker_profile.record(pids, seconds, work)
    try:
        time.sleep(0.5)  # py-spy attaches
        cpu_before = _cpu_s(procs)
        r = run_wrk(url, 16, seconds, script)
        attached = (_cpu_s(procs) - cpu_before) / max(1, r["requests"]) * 1e6
    except BaseException:
        for spy in spies:  # no py-spy left attached to a picker when wrk failed
            spy.kill()
        raise
    samples = picker_profile.collect(spies, work, pids)
    return {"seconds": seconds, "rps_while_profiled": r["rps"], "python_cpu_us_per_decision_profiled": attached,
            "python_cpu_us_per_decision": us_per_decision, "samples": sum(samples.values()),
            "parts": picker_profile.table(samples, us_per_decision)}


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def markdown(doc: dict[str, Any], command: str) -> str:
    """The BENCHMARKS.md section for one result document."""
    m = doc["machine"]
    body = f", {doc['body_kb']} KiB JSON body read for routing" if doc.get("body_kb") else ""
    lines = [
        f"### Picker, `{doc['transport']}` transport, {doc['workers']} picker process(es), "
        f"Envoy --concurrency {doc['envoy_concurrency']}{body}",
        "",
        f"`{command}` — {doc['date']}, {m['cores']} × {m['cpu']}, Python {m['python']}, Envoy {m['envoy']}; "
        f"wrk {doc['wrk']}, {doc['duration_s']:g} s per run, variants interleaved, medians of {doc['runs']} "
        f"rounds (min–max in brackets); 1-minute load average at the end: {m['load_average_1m_at_end']} "
        "(other work shared the 2 cores).",
        "",
        "| route kind | req/s without ext_proc | req/s null | req/s null, routed | req/s picker | picker / null "
        "| picker / null routed | Python µs / request, picker (16 conn / 1 conn) | Python µs / request, null "
        "| Envoy µs / request: without / null / null routed / picker | added p50 / p99, 1 conn (ms) "
        "| added p99, 1 conn: null / null routed (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def rng(s: dict, fmt: str = ",.0f") -> str:
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}–{s['max']:{fmt}}]"

    for kind, r in doc["route_kinds"].items():
        sp = r["spread"]
        envoy = " / ".join(f"{r['envoy_cpu_us_per_request'][v]:.1f}" for v in VARIANTS)
        lines.append(
            f"| {kind} | {rng(sp['rps_16conn']['without'])} | {rng(sp['rps_16conn']['null'])} | "
            f"{rng(sp['rps_16conn']['null_routed'])} | "
            f"{rng(sp['rps_16conn']['picker'])} | {rng(sp['rps_ratio_to_null'], '.2f')} | "
            f"{rng(sp['rps_ratio_to_null_routed'], '.2f')} | "
            f"{rng(sp['python_cpu_us_per_decision'], '.1f')} / {rng(sp['python_cpu_us_per_decision_1conn'], '.1f')} | "
            f"{r['null_cpu_us_per_request']:.1f} | {envoy} | "
            f"{r['added_p50_ms']:.3f} / {r['added_p99_ms']:.3f} | "
            f"{r['null_added_p99_ms']:.3f} / {r['null_routed_added_p99_ms']:.3f} |")
    before = {kind: r["before"] for kind, r in doc["route_kinds"].items() if "before" in r}
    if before:
        lines += ["", f"Before → after in the same run (`picker_before`: {doc['variants'][BEFORE]}):", "",
                  "| route kind | req/s picker | after / before | picker / null | Python µs / decision, 16 conn "
                  "| Python µs / decision, 1 conn | added p50 / p99, 1 conn (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for kind, b in before.items():
            a = doc["route_kinds"][kind]
            sp = b["spread"]
            lines.append(
                f"| {kind} | {b['rps_with_picker']:,.0f} → {a['rps_with_picker']:,.0f} | "
                f"{rng(sp['rps_after_over_before'], '.2f')} | "
                f"{b['rps_ratio_to_null']:.2f} → {a['rps_ratio_to_null']:.2f} | "
                f"{rng(sp['python_cpu_us_per_decision'], '.1f')} → "
                f"{rng(a['spread']['python_cpu_us_per_decision'], '.1f')} | "
                f"{rng(sp['python_cpu_us_per_decision_1conn'], '.1f')} → "
                f"{rng(a['spread']['python_cpu_us_per_decision_1conn'], '.1f')} | "
                f"{b['added_p50_ms']:.3f} / {b['added_p99_ms']:.3f} → "
                f"{a['added_p50_ms']:.3f} / {a['added_p99_ms']:.3f} |")
    if "profile" in doc:
        prof = doc["profile"]
        lines += ["", f"Live profile (py-spy, {prof['seconds']:g} s at 16 connections through the picker's "
                  f"direct_response listener, {prof['rps_while_profiled']:,.0f} req/s, "
                  f"{prof['python_cpu_us_per_decision_profiled']:.1f} µs of picker CPU per decision with py-spy "
                  f"attached; {prof['samples']} event-loop samples; share of the samples in Python code, "
                  f"µs = share × the rounds' "
                  f"{prof['python_cpu_us_per_decision']:.1f} µs per decision without py-spy):", "",
                  "| part | share | ≈ µs / decision |", "| --- | --- | --- |"]
        lines += [f"| {p['part']} | {p['share']:.1%} | {p['us_per_decision']:.1f} |"
                  for p in prof["parts"] if p["share"] is not None and p["share"] >= 0.005]
        lines += [f"| {p['part']} | {p['samples']} samples, left out | — |"
                  for p in prof["parts"] if p["share"] is None]
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
    replace_marked(path, begin, end, f"{begin}\n{section}\n{end}")
