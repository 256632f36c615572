"""2000 concurrent connections through real Envoy with the picker (wrk): no request fails for a
circuit-breaker limit inferlb left at Envoy's default of 1024 (issue 15 item 12).

Envoy's upstreams are two of its own static listeners that hold each request 0.5 s (fault filter)
and answer 200, so 2000 connections keep ~2000 requests in flight on the inference cluster, each
after an ext_proc stream on the picker's cluster. Every answer must be a 2xx, Envoy must count no
circuit-breaker overflow on any cluster, and the inference cluster must have had well over Envoy's
default limit in flight at once (sampled from Envoy's gauge), however fast this machine serves them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from inferlb.devstack import stack
from tests.integration.conftest import wait_until
from xds_server.resources.bootstrap import render_bootstrap

pytestmark = pytest.mark.integration

T = "type.googleapis.com/"
CONNECTIONS = 2000
DURATION_S = 5
DELAY_S = 0.5
OVERFLOWS = ("upstream_rq_pending_overflow", "upstream_cx_overflow", "upstream_rq_retry_overflow")


def slow_listener(port: int) -> dict:
    hcm = {"@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": f"upstream_{port}",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
           "http_filters": [
               {"name": "envoy.filters.http.fault", "typed_config": {
                   "@type": T + "envoy.extensions.filters.http.fault.v3.HTTPFault",
                   "max_active_faults": 100000,
                   "delay": {"fixed_delay": f"{DELAY_S}s", "percentage": {"numerator": 100}}}},
               {"name": "envoy.filters.http.router",
                "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}}]}
    return {"name": f"upstream_{port}", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def envoy_stats(admin: str, pattern: str | None = None) -> dict[str, int]:
    """Envoy's counters and gauges by name (``pattern``: Envoy's regex ``filter``)."""
    query = "" if pattern is None else "?" + urllib.parse.urlencode({"filter": pattern})
    with urllib.request.urlopen(f"{admin}/stats{query}", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


@pytest.fixture(scope="module")
def envoy_with_picker(tmp_path_factory):
    assert shutil.which("wrk"), "wrk is needed (Debian package wrk; scripts/setup.sh installs it)"
    work = tmp_path_factory.mktemp("breakers")
    ports = {n: stack.free_port() for n in ("xds", "admin", "ext_proc", "listener", "envoy_admin", "dead", "a", "b")}
    cfg = {
        "listen": {"xds": f"127.0.0.1:{ports['xds']}", "ext_proc": f"127.0.0.1:{ports['ext_proc']}",
                   "admin": f"127.0.0.1:{ports['admin']}"},
        "envoy": {"listener": f"127.0.0.1:{ports['listener']}", "ext_proc_timeout_s": 1.0},
        "prometheus": {"url": f"http://127.0.0.1:{ports['dead']}"},
        "loop": {"interval_s": 5, "timeout_s": 0.2, "first_round_wait_s": 0.5},
        "history": {"path": ":memory:"},
        "services": [{"name": "chat", "versions": [{"name": "v1", "endpoints": [
            {"address": f"127.0.0.1:{ports['a']}", "max_concurrency": 1000},
            {"address": f"127.0.0.1:{ports['b']}", "max_concurrency": 1000}]}]}],
    }
    (work / "inferlb.yaml").write_text(yaml.safe_dump(cfg))
    procs = [stack.start_control_plane(work / "inferlb.yaml", work, ports["admin"])]
    boot = yaml.safe_load(render_bootstrap(xds_address=f"127.0.0.1:{ports['xds']}", node_id="breakers",
                                           admin_port=ports["envoy_admin"]))
    boot["static_resources"]["listeners"] = [slow_listener(ports["a"]), slow_listener(ports["b"])]
    try:
        procs.append(stack.start_envoy(yaml.safe_dump(boot), work, ports["envoy_admin"]))
        admin = f"http://127.0.0.1:{ports['envoy_admin']}"
        wait_until(lambda: envoy_stats(admin).get("cluster.chat-v1.membership_healthy") == 2, 30, 0.2,
                   "Envoy to have the cluster with both endpoints")
        wait_until(lambda: envoy_stats(admin).get("listener_manager.total_listeners_active", 0) >= 3, 30, 0.2,
                   "the inference listener")
        yield f"http://127.0.0.1:{ports['listener']}", admin
    finally:
        for p in reversed(procs):
            p.stop()


def test_2000_concurrent_requests_hit_no_limit_inferlb_left_at_envoys_default(envoy_with_picker):
    url, admin = envoy_with_picker
    peaks = {"chat-v1": 0, "inferlb_ext_proc": 0}   # the most requests each cluster had in flight at once
    running = threading.Event()
    running.set()

    def sample() -> None:
        while running.is_set():
            stats = envoy_stats(admin, r"^cluster\.[^.]+\.upstream_rq_active$")
            for name in peaks:
                peaks[name] = max(peaks[name], stats.get(f"cluster.{name}.upstream_rq_active", 0))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = subprocess.run(["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{DURATION_S}s", "--timeout", "10s",
                              "-H", "x-session-id: load-1", "-H", "model-version: v1", f"{url}/v1/chat/completions"],
                             capture_output=True, text=True, timeout=DURATION_S + 60).stdout
    finally:
        running.clear()
        sampler.join(10)
    done = int(re.search(r"(\d+) requests in", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    stats = envoy_stats(admin)
    overflows = {k: v for k, v in stats.items()
                 if k.startswith("cluster.") and k.rsplit(".", 1)[-1] in OVERFLOWS and v}
    assert overflows == {}, overflows
    # Beyond Envoy's default of 1 024 at once on the inference cluster: the default would have failed
    # them. (The picker's streams last only until it answers, so how many it has at once depends on how
    # fast it answers, not on the connections: they are not asserted above 1 024.)
    assert peaks["chat-v1"] > 1024 * 1.2, (peaks, out)
    assert bad is None, out
    peak = stats.get("cluster.chat-v1.upstream_rq_total", 0)
    assert peak >= done * 0.9, (peak, done)
    for name in ("chat-v1", "inferlb_ext_proc"):
        assert stats[f"cluster.{name}.circuit_breakers.default.rq_open"] == 0, name
