"""What reading the request body costs the picker, per Envoy body mode, on real Envoy.

``python -m bench.body_modes [--runs 3] [--requests 60] [--json PATH]``

One simulated A100 backend (time scale 0.01: a few ms per request), the control plane with its
in-process picker (``inferlb serve``; no Prometheus: neutral weights), Envoy. For each
``picker.body_mode`` (``buffered``, ``streamed``; one control plane each) and each prompt size (2, 20,
200 KB of chat message text), ``requests`` sequential POSTs on one keep-alive connection:

- ``headers``: version, session and request class in headers: the picker never asks for the body
  (the baseline);
- ``body``: no such headers: the picker holds the request for its body (Envoy's BUFFERED mode,
  or STREAMED: decided on the first chunk) and reads ``model``, ``user``, the prefix key and the
  prompt size from it.

Added latency = p50 (and p90) of ``body`` minus ``headers``, per run; medians over runs. Kinds and
sizes alternate within a run so drifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from inferlb.devstack import stack
from xds_server.resources.bootstrap import render_bootstrap

SIZES_KB = (2, 20, 200)


def _body(kb: int) -> bytes:
    text = ("The quick brown fox jumps over the lazy dog. " * (kb * 1024 // 45 + 1))[: kb * 1024]
    return json.dumps({"model": "v1", "max_tokens": 8, "user": "bench-user",
                       "messages": [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": text}]}).encode()


def _time(conn: http.client.HTTPConnection, body: bytes, headers: dict[str, str]) -> float:
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json", **headers})
    r = conn.getresponse()
    r.read()
    elapsed = (time.perf_counter() - start) * 1000.0
    if r.status != 200:
        raise RuntimeError(f"status {r.status}")
    return elapsed


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_mode(mode: str, runs: int, requests: int, work: Path) -> dict:
    """All runs of one body mode; returns ``{size_kb: {"headers": [...], "body": [...]}}`` (p50, p90 per run)."""
    ports = {n: stack.free_port() for n in ("sim", "listener", "admin", "envoy_admin", "dead", "xds")}
    procs: list[stack.Proc] = []
    try:
        procs.append(stack.start_sim(ports["sim"], work, gpu_class="a100", version="v1",
                                     extra=["--time-scale", "0.01"]))
        cfg = {"listen": {"xds": f"127.0.0.1:{ports['xds']}", "ext_proc": "127.0.0.1:0",
                          "admin": f"127.0.0.1:{ports['admin']}"},
               "envoy": {"listener": f"127.0.0.1:{ports['listener']}"},
               "prometheus": {"url": f"http://127.0.0.1:{ports['dead']}", "interval_s": 5, "timeout_s": 0.2},
               "loop": {"first_round_wait_s": 0.5},
               "picker": {"body_max_bytes": 1024 * 1024, "body_mode": mode},
               "services": [{"name": "chat", "default_version": "v1",
                             "versions": [{"name": "v1", "endpoints": [{"address": f"127.0.0.1:{ports['sim']}"}]}]}]}
        path = work / f"inferlb-{mode}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        procs.append(stack.start_control_plane(path, work, ports["admin"], name=f"inferlb-{mode}"))
        xds_port = ports["xds"]
        procs.append(stack.start_envoy(render_bootstrap(xds_address=f"127.0.0.1:{xds_port}", node_id=f"bench-{mode}",
                                                        admin_port=ports["envoy_admin"]), work, ports["envoy_admin"],
                                       name=f"envoy-{mode}"))
        stack.wait_http(f"http://127.0.0.1:{ports['envoy_admin']}/ready", procs[-1], timeout=20)
        conn = http.client.HTTPConnection("127.0.0.1", ports["listener"], timeout=10)
        deadline = time.monotonic() + 20
        while True:  # the listener and the picker are ready
            try:
                _time(conn, _body(2), {})
                break
            except (OSError, RuntimeError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    raise
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", ports["listener"], timeout=10)
                time.sleep(0.2)
        full = {"model-version": "v1", "x-session-id": "bench-user", "x-inferlb-request-class": "bench"}
        out: dict = {kb: {"headers": [], "body": []} for kb in SIZES_KB}
        for _ in range(runs):
            samples = {(kb, kind): [] for kb in SIZES_KB for kind in ("headers", "body")}
            bodies = {kb: _body(kb) for kb in SIZES_KB}
            for _ in range(5):  # warm-up
                for kb in SIZES_KB:
                    _time(conn, bodies[kb], full)
                    _time(conn, bodies[kb], {})
            for _ in range(requests):
                for kb in SIZES_KB:
                    samples[(kb, "headers")].append(_time(conn, bodies[kb], full))
                    samples[(kb, "body")].append(_time(conn, bodies[kb], {}))
            for (kb, kind), values in samples.items():
                out[kb][kind].append((statistics.median(values), _pct(values, 0.9)))
        conn.close()
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def main(argv: list[str] | None = None) -> dict:
    """Run both modes, print a Markdown table, optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="inferlb-body-"))
    result = {mode: run_mode(mode, args.runs, args.requests, work) for mode in ("buffered", "streamed")}
    rows = ["| body mode | prompt | p50 headers only (ms) | p50 body read (ms) "
            "| added p50 (ms, median [min, max] of runs) | added p90 (ms) |", "| --- | --- | --- | --- | --- | --- |"]
    doc: dict = {}
    for mode, sizes in result.items():
        for kb, kinds in sizes.items():
            added50 = [b[0] - h[0] for h, b in zip(kinds["headers"], kinds["body"], strict=True)]
            added90 = [b[1] - h[1] for h, b in zip(kinds["headers"], kinds["body"], strict=True)]
            h50 = statistics.median(x[0] for x in kinds["headers"])
            b50 = statistics.median(x[0] for x in kinds["body"])
            doc[f"{mode}_{kb}kb"] = {"headers_p50_ms": h50, "body_p50_ms": b50, "added_p50_ms": added50,
                                     "added_p90_ms": added90}
            rows.append(f"| {mode} | {kb} KB | {h50:.2f} | {b50:.2f} | {statistics.median(added50):+.2f} "
                        f"[{min(added50):+.2f}, {max(added50):+.2f}] | {statistics.median(added90):+.2f} |")
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
