"""A control plane restarted while a backend is dead must not bring it back: found by a user trial
(the restarted `inferlb serve` aged the dead backend from its own start and sent it HEALTHY to Envoy
until `stale_after_s` passed again). Real sims, Prometheus, `inferlb serve` and Envoy."""

from __future__ import annotations

import signal
import time

import pytest
import requests
import yaml

from inferlb.devstack import stack as stk
from inferlb.devstack.envoy_admin import envoy_hosts
from tests.faults.conftest import wait_until
from tests.integration.conftest import LLM_TIME_SCALE, backend_config, merge
from xds_server.resources.bootstrap import render_bootstrap

pytestmark = pytest.mark.integration


class _B:  # what backend_config reads
    def __init__(self, address: str) -> None:
        self.version, self.gpu_class, self.address = "v1", "a100", address


def test_a_backend_dead_before_a_restart_stays_unhealthy_in_envoy(tmp_path):
    procs: list[stk.Proc] = []
    cp = None
    try:
        sims, addresses = [], []
        for _ in range(3):
            port = stk.free_port()
            sims.append(stk.start_sim(port, tmp_path, gpu_class="a100", version="v1",
                                      extra=["--time-scale", LLM_TIME_SCALE]))
            addresses.append(f"127.0.0.1:{port}")
        procs += sims
        prom_port = stk.free_port()
        procs.append(stk.start_prometheus(addresses, tmp_path, prom_port, 0.5))
        listener, envoy_admin, admin, xds = stk.free_port(), stk.free_port(), stk.free_port(), stk.free_port()
        cfg = merge(backend_config([_B(a) for a in addresses], f"http://127.0.0.1:{prom_port}", listener), {
            "listen": {"xds": f"127.0.0.1:{xds}", "ext_proc": f"127.0.0.1:{stk.free_port()}",
                       "admin": f"127.0.0.1:{admin}"},
            "prometheus": {"first_round_wait_s": 30},
        })
        cfg_path = tmp_path / "inferlb.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))

        def start_cp(name: str) -> stk.Proc:
            p = stk.start_control_plane(cfg_path, tmp_path, admin, name=name, extra=["--shutdown-grace", "1"])
            stk.wait_http(f"http://127.0.0.1:{admin}/readyz", p, timeout=30)
            return p

        cp = start_cp("inferlb")
        envoy = stk.start_envoy(render_bootstrap(xds_address=f"127.0.0.1:{xds}", node_id="restart-dead",
                                                 admin_port=envoy_admin), tmp_path, envoy_admin)
        procs.append(envoy)
        eadmin = f"http://127.0.0.1:{envoy_admin}"
        stk.wait_http(f"{eadmin}/ready", envoy, timeout=20)

        def health(address: str) -> str | None:
            return envoy_hosts(eadmin).get("chat-v1", {}).get(address, {}).get("health")

        wait_until(lambda: all(health(a) == "HEALTHY" for a in addresses), 20, 0.2, "every backend HEALTHY")

        def sampled() -> bool:   # the control plane has a metrics sample of every backend
            doc = requests.get(f"http://127.0.0.1:{admin}/api/v1/weights", timeout=2).json()
            ages = [e["inputs"].get("sample_age_s") for c in doc["clusters"] for e in c["endpoints"]]
            up = requests.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": "count(up == 1)"},
                              timeout=2).json()["data"]["result"]
            return len(ages) == 3 and all(a is not None and a < 2 for a in ages) and up[0]["value"][1] == "3" \
                if up else False

        wait_until(sampled, 20, 0.2, "a sample of every backend")
        time.sleep(1.0)
        dead = addresses[0]
        sims[0].stop()
        wait_until(lambda: health(dead) == "UNHEALTHY", cfg["engine"]["stale_after_s"] + 10, 0.2,
                   "the dead backend UNHEALTHY (stale)")

        cp.popen.send_signal(signal.SIGKILL)
        cp.popen.wait(10)
        cp = start_cp("inferlb-restarted")

        def nodes() -> list[dict]:
            return requests.get(f"http://127.0.0.1:{admin}/api/v1/nodes", timeout=2).json()["nodes"]

        wait_until(lambda: any(n["node_id"] == "restart-dead" and n["types"]
                               and all(t["acked_version"] for t in n["types"].values()) for n in nodes()),
                   30, 0.2, "Envoy synced with the restarted control plane")
        seen = set()
        until = time.monotonic() + 3.0   # the first rounds after the restart
        while time.monotonic() < until:
            seen.add(health(dead))
            time.sleep(0.1)
        assert seen == {"UNHEALTHY"}, seen
        weights = requests.get(f"http://127.0.0.1:{admin}/api/v1/weights", timeout=5).json()
        verdict = next(e for c in weights["clusters"] for e in c["endpoints"] if e["address"] == dead)
        assert verdict["health"] == "UNHEALTHY" and "stale" in verdict["reasons"][0], verdict
    finally:
        if cp is not None:
            cp.stop()
        for p in reversed(procs):
            p.stop()
