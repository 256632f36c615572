"""etcd discovery against a real etcd (Debian's etcd-server, a plain process) and real simulated backends.

Backends register themselves (``inferlb sim-backend --etcd URL``) on a lease; the watcher lists
then watches the prefix through etcd's v3 JSON gateway. Covered: register, update, lease expiry
(removed), graceful shutdown (DRAINING, then removed), an etcd restart (the watch resumes from its
revision; changes made while it reconnects are not lost, no re-list), a compacted revision (list
again), and traffic through a real Envoy following the registrations.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from inferlb.devstack import stack
from inferlb.devstack.loadgen import Session, Traffic, drive
from inferlb.serve import InferLB
from tests.integration.conftest import LLM_TIME_SCALE, LoopThread, wait_until
from xds_server.config import parse_config
from xds_server.discovery.etcd import EtcdWatcher
from xds_server.metrics.sources.status import StatusSource
from xds_server.resources.bootstrap import render_bootstrap


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Etcd:
    """A one-member etcd on fixed ports in ``workdir`` (restartable on the same data)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port, self.peer = workdir, stack.free_port(), stack.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = stack.start_etcd(workdir, self.port, self.peer)

    def restart(self) -> None:
        self.proc.stop()
        self.proc = stack.start_etcd(self.workdir, self.port, self.peer)

    def post(self, path: str, body: dict) -> dict:
        r = requests.post(f"{self.url}{path}", json=body, timeout=5)
        r.raise_for_status()
        return r.json()

    def put(self, key: str, value: dict, ttl: int | None = None) -> int:
        lease = self.post("/v3/lease/grant", {"TTL": ttl})["ID"] if ttl else None
        doc = self.post("/v3/kv/put", {"key": b64(key), "value": b64(json.dumps(value)),
                                       **({"lease": lease} if lease else {})})
        return int(doc["header"]["revision"])

    def delete(self, key: str) -> int:
        return int(self.post("/v3/kv/deleterange", {"key": b64(key)})["header"]["revision"])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[Etcd]:
    e = Etcd(tmp_path_factory.mktemp("etcd"))
    yield e
    e.proc.stop()


def spec_for(etcd: Etcd, prefix: str, **extra):
    doc = {"discovery": {"etcd": {"endpoints": [etcd.url], "prefix": prefix, "watch_timeout_s": 30,
                                  "services": [{"name": "chat", "default_version": "v1"}], **extra}},
           "services": [], "metrics": {"sources": ["status"]}}
    return parse_config(yaml.safe_dump(doc))


class Watching:
    """An EtcdWatcher running on its own loop; ``seen`` is every discovered set it emitted."""

    def __init__(self, etcd: Etcd | None, prefix: str, cfg=None) -> None:
        cfg = cfg or spec_for(etcd, prefix)
        self.status = StatusSource()
        self.seen: list[dict] = []

        async def on_change(d):
            self.seen.append(d)

        self.watcher = EtcdWatcher(cfg.discovery.etcd, cfg.gpu_classes, on_change, self.status)
        self.loop = LoopThread()
        self.task = None
        self.start()

    def start(self) -> None:
        async def go():
            self.task = asyncio.create_task(self.watcher.run())
        self.loop.run(go())

    def pause(self) -> None:
        async def cancel():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.loop.run(cancel())

    def endpoints(self) -> dict[str, dict]:
        """``{address: endpoint}`` of the last emitted set (service chat)."""
        last = self.seen[-1]["chat"] if self.seen else {}
        return {e["address"]: {**e, "version": v} for v, eps in last.items() for e in eps}

    def close(self) -> None:
        self.pause()
        self.loop.close()


def sim(workdir: Path, etcd: Etcd, prefix: str, *, version: str = "v1", gpu: str = "a100", ttl: int = 2,
        extra: list[str] | None = None, urls: str | None = None) -> tuple[stack.Proc, str]:
    port = stack.free_port()
    proc = stack.start_sim(port, workdir, gpu_class=gpu, version=version, extra=[
        "--time-scale", LLM_TIME_SCALE, "--max-concurrency", "4", "--etcd", urls or etcd.url, "--etcd-prefix", prefix,
        "--etcd-ttl", str(ttl), "--etcd-service", "chat", "--etcd-status-interval-s", "0.5",
        "--etcd-drain-s", "1", *(extra or [])])
    return proc, f"127.0.0.1:{port}"


def fault(address: str, **faults) -> None:
    requests.post(f"http://{address}/sim/fault", json=faults, timeout=5).raise_for_status()


def test_register_update_status_and_lease_expiry(etcd: Etcd, tmp_path):
    prefix = "/t/expiry/"
    w = Watching(etcd, prefix)
    proc, addr = sim(tmp_path, etcd, prefix, gpu="a10", version="v2")
    try:
        wait_until(lambda: addr in w.endpoints(), 10, 0.05, "the registration")
        assert w.endpoints()[addr] == {"address": addr, "gpu_class": "a10", "max_concurrency": 4,
                                       "gpu_memory_mib": 24576.0, "version": "v2"}
        # The status snapshot feeds the status source, fresh.
        stats = wait_until(lambda: w.status.fetch([addr]).get(addr), 5, 0.05, "a status snapshot")
        assert stats.running == 0 and stats.queue == 0 and stats.gpu_mem_free_mib > 0
        assert stats.sample_age_s < 1.0
        # Update: another key, written by hand, with a changed field.
        etcd.put(prefix + "127.0.0.9:9000", {"service": "chat", "version": "v1", "max_concurrency": 2}, ttl=30)
        wait_until(lambda: "127.0.0.9:9000" in w.endpoints(), 5, 0.05, "the second registration")
        etcd.put(prefix + "127.0.0.9:9000", {"service": "chat", "version": "v1", "max_concurrency": 3}, ttl=30)
        wait_until(lambda: w.endpoints().get("127.0.0.9:9000", {}).get("max_concurrency") == 3, 5, 0.05,
                   "the update")
        emitted, accepted = len(w.seen), w.status.accepted
        # Status-only changes (every 0.5 s) update the status, not the endpoint set.
        wait_until(lambda: w.status.accepted >= accepted + 2, 3, 0.05, "two status refreshes")
        assert len(w.seen) == emitted
        # Lease expiry: the node stops renewing (it still serves); its key goes after the TTL (2 s).
        fault(addr, etcd="stop")
        wait_until(lambda: addr not in w.endpoints(), 6, 0.05, "the lease to expire")
        assert w.status.fetch([addr]) == {}
        assert "127.0.0.9:9000" in w.endpoints()
        assert w.watcher.lists == 1
        # Back: a new lease, registered again.
        fault(addr, etcd="ok")
        wait_until(lambda: addr in w.endpoints(), 6, 0.05, "the registration again")
    finally:
        proc.stop()
        w.close()


def test_graceful_shutdown_drains_then_removes(etcd: Etcd, tmp_path):
    prefix = "/t/drain/"
    w = Watching(etcd, prefix)
    dead = f"http://127.0.0.1:{stack.free_port()}"
    proc, addr = sim(tmp_path, etcd, prefix, ttl=30, urls=f"{dead},{etcd.url}")   # the first one is down
    try:
        wait_until(lambda: addr in w.endpoints(), 10, 0.05, "the registration")
        proc.popen.terminate()
        wait_until(lambda: w.endpoints().get(addr, {}).get("drain"), 5, 0.05, "the drain announcement")
        # Removed when the lease is revoked (after --etcd-drain-s 1), long before its 30 s TTL.
        wait_until(lambda: addr not in w.endpoints(), 5, 0.05, "the removal")
        assert proc.popen.wait(10) == 0
        states = [s["chat"].get("v1", [{}])[0].get("drain", False) if s["chat"] else None for s in w.seen]
        assert states[-3:] == [False, True, None]   # registered, draining, gone
    finally:
        proc.stop()
        w.close()


def test_etcd_restart_resumes_the_watch_and_loses_nothing(etcd: Etcd, tmp_path):
    prefix = "/t/restart/"
    etcd.put(prefix + "127.0.0.21:9000", {"service": "chat", "version": "v1"})
    w = Watching(etcd, prefix)
    proc, addr = sim(tmp_path, etcd, prefix, ttl=5)
    try:
        wait_until(lambda: {addr, "127.0.0.21:9000"} <= set(w.endpoints()), 10, 0.05, "both registrations")
        watches = w.watcher.watches
        etcd.restart()
        # Changes right after the restart, while the watcher is still reconnecting: resumed, not lost.
        etcd.delete(prefix + "127.0.0.21:9000")
        etcd.put(prefix + "127.0.0.22:9000", {"service": "chat", "version": "v1"})
        wait_until(lambda: "127.0.0.22:9000" in w.endpoints() and "127.0.0.21:9000" not in w.endpoints(), 10,
                   0.05, "the changes made around the restart")
        assert w.watcher.lists == 1 and w.watcher.watches > watches
        # The backend's lease survived the restart: still registered, still refreshing its status.
        assert addr in w.endpoints()
        wait_until(lambda: w.status.fetch([addr])[addr].sample_age_s < 1.0, 5, 0.1, "fresh status after restart")
    finally:
        proc.stop()
        w.close()


def test_a_compacted_revision_lists_again(etcd: Etcd):
    prefix = "/t/compact/"
    etcd.put(prefix + "127.0.0.31:9000", {"service": "chat", "version": "v1"})
    w = Watching(etcd, prefix)
    try:
        wait_until(lambda: "127.0.0.31:9000" in w.endpoints(), 5, 0.05, "the first list")
        w.pause()   # the watcher is away while history moves on and is compacted
        etcd.delete(prefix + "127.0.0.31:9000")
        rev = etcd.put(prefix + "127.0.0.32:9000", {"service": "chat", "version": "v2"})
        etcd.post("/v3/kv/compaction", {"revision": rev})
        w.start()
        wait_until(lambda: w.watcher.lists == 2, 5, 0.05, "a second list")
        wait_until(lambda: set(w.endpoints()) == {"127.0.0.32:9000"}, 5, 0.05, "the listed state")
        assert w.watcher.revision >= rev
    finally:
        w.close()


def test_a_registration_no_service_takes_is_logged_once_as_left_out(etcd: Etcd, caplog):
    prefix = "/t/unknown/"
    etcd.put(prefix + "127.0.0.41:9000", {"service": "sim-7b", "version": "v1"})   # listed
    w = Watching(etcd, prefix)
    try:
        with caplog.at_level(logging.WARNING, logger="xds_server.discovery.etcd"):
            etcd.put(prefix + "127.0.0.42:9000", {"service": "chat", "version": "v1"})
            wait_until(lambda: "127.0.0.42:9000" in w.endpoints(), 5, 0.05, "the known service's node")
            etcd.put(prefix + "127.0.0.43:9000", {"service": "sim-7b", "version": "v1"})  # watched
            etcd.put(prefix + "127.0.0.43:9000", {"service": "sim-7b", "version": "v2"})  # again: no new line
            wait_until(lambda: sum("127.0.0.43:9000" in r.getMessage() for r in caplog.records) >= 1, 5, 0.05,
                       "the watched one's warning")
            time.sleep(0.3)
        left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert sorted(m.split()[1] for m in left_out) == ["127.0.0.41:9000", "127.0.0.43:9000"]
        assert "registered as service 'sim-7b', which no discovery.etcd.services entry takes" in left_out[0]
        assert "127.0.0.41:9000" not in w.endpoints() and "127.0.0.43:9000" not in w.endpoints()
    finally:
        w.close()


class Served:
    """inferlb serving the etcd spec of ``prefix`` behind a real Envoy; ``procs`` are stopped by :meth:`close`."""

    def __init__(self, etcd: Etcd, prefix: str, workdir: Path, node_id: str) -> None:
        self.loop = LoopThread()
        self.procs: list[stack.Proc] = []
        self.listener, self.envoy_admin_port = stack.free_port(), stack.free_port()
        cfg = spec_for(etcd, prefix).model_dump(mode="json", exclude_none=True)
        cfg.update({"listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                    "envoy": {"listener": f"127.0.0.1:{self.listener}"},
                    "loop": {"interval_s": 0.5, "timeout_s": 0.5}, "history": {"path": ":memory:"}})
        self.app = InferLB(parse_config(yaml.safe_dump(cfg)))
        self.loop.run(self.app.start())
        self.workdir, self.node_id = workdir, node_id

    def start_envoy(self) -> None:
        """Envoy on the control plane, once its first snapshot is ready."""
        wait_until(self.app.control.ready.is_set, 10, 0.05, "the first snapshot")
        self.procs.append(stack.start_envoy(render_bootstrap(
            xds_address=f"127.0.0.1:{self.app.xds_port}", node_id=self.node_id, admin_port=self.envoy_admin_port),
            self.workdir, self.envoy_admin_port))

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        try:
            self.loop.run(self.app.stop(grace_s=0.2))
        finally:
            self.loop.close()


def test_traffic_through_envoy_follows_the_registrations(etcd: Etcd, tmp_path):
    """A backend that registers gets traffic; one whose lease expires leaves Envoy's cluster and gets none;
    one that leaves gracefully under traffic gets no new request while still draining, and no request fails."""
    prefix = "/t/envoy/"
    served_stack = Served(etcd, prefix, tmp_path, "etcd-envoy")
    app, procs = served_stack.app, served_stack.procs
    listener, envoy_admin_port = served_stack.listener, served_stack.envoy_admin_port
    try:
        a, addr_a = sim(tmp_path, etcd, prefix, extra=["--etcd-drain-s", "3"])   # a leaves gracefully later
        b, addr_b = sim(tmp_path, etcd, prefix)
        procs += [a, b]
        served_stack.start_envoy()

        def hosts() -> set[str]:
            text = requests.get(f"http://127.0.0.1:{envoy_admin_port}/clusters", timeout=5).text
            return {line.split("::")[1] for line in text.splitlines()
                    if line.startswith("chat-v1::") and line.split("::")[2] == "cx_active"}

        def served(n: int) -> set[str]:
            return {requests.post(f"http://127.0.0.1:{listener}/v1/chat/completions",
                                  json={"max_tokens": 4, "messages": []}, timeout=5,
                                  headers={"x-session-id": f"s{i}"}).headers["x-served-by"] for i in range(n)}

        wait_until(lambda: hosts() == {addr_a, addr_b}, 15, 0.1, "both registered backends in Envoy")

        def engine_view() -> dict[str, dict]:
            doc = requests.get(f"http://127.0.0.1:{app.admin_port}/api/v1/weights", timeout=5).json()
            return {e["address"]: e for c in doc["clusters"] for e in c["endpoints"]}

        # The engine's inputs come from the status snapshots in the registrations.
        view = wait_until(lambda: (v := engine_view()) and all(v.get(x, {}).get("sources") for x in (addr_a, addr_b))
                          and v, 5, 0.1, "inputs from the status source")
        for x in (addr_a, addr_b):
            assert view[x]["sources"]["gpu_mem_free_mib"] == "status" and view[x]["health"] == "HEALTHY"
            assert view[x]["inputs"]["gpu_mem_free_mib"] > 0 and view[x]["inputs"]["sample_age_s"] < 2
        assert wait_until(lambda: served(16) == {addr_a, addr_b}, 10, 0.2, "traffic on both")
        fault(addr_b, etcd="stop")   # b still serves, but its lease (2 s) expires
        wait_until(lambda: hosts() == {addr_a}, 8, 0.1, "the expired backend to leave Envoy's cluster")
        assert served(16) == {addr_a}
        assert requests.get(f"http://{addr_b}/health", timeout=5).ok   # it was the lease, not the backend
        # A graceful leave under traffic: drain announced, then the lease revoked; no request fails.
        c, addr_c = sim(tmp_path, etcd, prefix)
        procs.append(c)
        wait_until(lambda: hosts() == {addr_a, addr_c}, 8, 0.1, "the third backend in Envoy")
        traffic = Traffic()
        sessions = [Session(f"d{i}", None) for i in range(20)]
        driver = threading.Thread(target=lambda: asyncio.run(drive(
            f"http://127.0.0.1:{listener}/v1/chat/completions", sessions, duration_s=3.5, concurrency=4,
            max_tokens=4, traffic=traffic)))
        driver.start()
        time.sleep(0.5)
        a.popen.terminate()
        # Within its drain time (3 s), while its key is still there (draining), new requests go to c only.
        wait_until(lambda: served(8) == {addr_c}, 2.0, 0.05, "traffic off the draining backend")
        kvs = etcd.post("/v3/kv/range", {"key": b64(prefix + addr_a)}).get("kvs", [])
        assert len(kvs) == 1 and json.loads(base64.b64decode(kvs[0]["value"]))["draining"] is True
        driver.join(30)
        assert a.popen.wait(10) == 0
        wait_until(lambda: hosts() == {addr_c}, 5, 0.1, "the drained backend to leave Envoy's cluster")
        statuses = [r.status for r in traffic.results]
        late = [r.served_by for r in traffic.results[len(traffic.results) // 2:]]
        assert len(statuses) > 50 and set(statuses) == {200}, sorted(set(statuses))
        assert set(late) == {addr_c}   # the second half of the run: only the backend that stays
    finally:
        served_stack.close()


def test_when_every_node_of_the_default_version_leaves_its_requests_get_503_not_another_model(etcd: Etcd, tmp_path):
    """chat's default is v1. While a v1 node is registered, requests naming no version go to it; when its
    lease expires, with a v2 node still there, they get the picker's 503 naming v1 (not v2's model, which
    may answer in another format), and requests naming v2 still get 200 from v2.

    The picker's view changes in the round; Envoy's route a debounce and a push later. In between, a
    request the picker did not answer in time fails open to Envoy's route, which may still hold v1's node
    (alive, only its lease expired): never v2's. Once Envoy's route has the same 503, every answer is it."""
    prefix = "/t/gone/"
    served_stack = Served(etcd, prefix, tmp_path, "gone-envoy")
    listener = served_stack.listener
    try:
        a, addr_a = sim(tmp_path, etcd, prefix, version="v1")
        b, addr_b = sim(tmp_path, etcd, prefix, version="v2")
        served_stack.procs += [a, b]
        served_stack.start_envoy()

        def ask(**headers) -> requests.Response:
            return requests.post(f"http://127.0.0.1:{listener}/v1/chat/completions", timeout=5, headers=headers,
                                 json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})

        def default_served_by() -> str | None:
            try:
                return ask().headers.get("x-served-by")
            except requests.ConnectionError:   # Envoy's listener is not there yet
                return None

        wait_until(lambda: default_served_by() == addr_a, 15, 0.1, "v1 serving the default")
        # v2 may reach Envoy's route a push after the picker's view: until then a request that fails
        # open gets Envoy's 400 for a version it does not know; while v2's node is registered but not yet
        # healthy, the picker's (or the route's) 503 that v2 has no endpoints now (CI saw one, 1 run in
        # 21). Never v1's model.
        early: list[requests.Response] = []
        wait_until(lambda: (r := ask(**{"model-version": "v2"}), early.append(r))[0].headers.get("x-served-by")
                   == addr_b, 10, 0.1, "v2 serving requests that name it")
        assert {(r.status_code, r.headers.get("x-served-by")) for r in early} <= {(200, addr_b), (400, None),
                                                                                  (503, None)}, \
            [(r.status_code, r.text[:200]) for r in early if r.status_code != 200]   # which answer, if one fails
        assert all(r.json()["error"]["code"] in ("version_unavailable", "no_healthy_upstream")
                   for r in early if r.status_code == 503), [r.text[:200] for r in early if r.status_code == 503]
        fault(addr_a, etcd="stop")   # a still serves, but its lease (2 s) expires
        seen: list[requests.Response] = []
        [gone] = wait_until(lambda: (r := ask(), seen.append(r))[0].status_code == 503 and [r], 10, 0.1,
                            "the default version's 503")
        assert gone.json() == {"error": {"message": "model version 'v1' of service 'chat' has no endpoints now",
                                         "type": "server_error", "param": None, "code": "version_unavailable"}}
        assert {r.headers.get("x-served-by") for r in seen} <= {addr_a, None}   # never v2's model
        routed = f"http://127.0.0.1:{served_stack.envoy_admin_port}/config_dump?resource=dynamic_route_configs"
        wait_until(lambda: "has no endpoints now" in requests.get(routed, timeout=5).text, 10, 0.1,
                   "Envoy's route answering v1's 503 itself")
        answers = [ask() for _ in range(10)] + [ask(**{"model-version": "v1"}) for _ in range(5)]
        assert [(r.status_code, r.headers.get("x-served-by")) for r in answers] == [(503, None)] * 15
        assert {ask(**{"model-version": "v2"}).headers.get("x-served-by") for _ in range(5)} == {addr_b}
        assert requests.get(f"http://{addr_a}/health", timeout=5).ok   # it was the lease, not the backend
    finally:
        served_stack.close()


def server_cert(path: Path, ca, write) -> tuple[str, str]:
    """etcd's server certificate: server and client auth (etcd's gRPC gateway dials etcd itself with
    it, as a client, when ``--client-cert-auth`` is on), for 127.0.0.1."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return write(path, key, cert)


def test_tls_with_client_certificates_and_endpoint_failover(tmp_path):
    """etcd requiring client certificates: the watcher with ``tls`` lists (after trying a dead endpoint
    first); without a client certificate it gets nothing."""
    from tests.integration.test_tls import _write, issue, make_ca

    ca = make_ca(tmp_path / "ca", "etcd-ca")
    server = server_cert(tmp_path / "server", ca, _write)
    client = issue(tmp_path / "client", ca, "inferlb", server=False)
    port = stack.free_port()
    proc = stack.start_etcd(tmp_path, port, tls=(*server, str(tmp_path / "ca.pem")), client_cert=client)
    url = f"https://127.0.0.1:{port}"
    try:
        requests.post(f"{url}/v3/kv/put", cert=client, verify=str(tmp_path / "ca.pem"), timeout=5, json={
            "key": b64("/t/tls/127.0.0.41:9000"), "value": b64(json.dumps({"service": "chat", "version": "v1"}))
        }).raise_for_status()
        dead = f"http://127.0.0.1:{stack.free_port()}"
        results = {}
        for name, tls in (("with", {"ca": str(tmp_path / "ca.pem"), "cert": client[0], "key": client[1]}),
                          ("without", {"ca": str(tmp_path / "ca.pem")})):
            c = parse_config(yaml.safe_dump({"discovery": {"etcd": {
                "endpoints": [dead, url] if name == "with" else [url], "prefix": "/t/tls/", "tls": tls,
                "services": [{"name": "chat"}]}}, "services": []}))
            w = Watching(None, "", c)
            try:
                if name == "with":
                    wait_until(lambda w=w: w.seen, 10, 0.05, "the list over TLS")
                else:
                    wait_until(lambda w=w: w.watcher.last_error, 10, 0.05, "the refusal")
                    time.sleep(0.5)
                results[name] = (w.seen, w.watcher.last_error)
            finally:
                w.close()
        assert results["with"][0][-1] == {"chat": {"v1": [{"address": "127.0.0.41:9000", "gpu_class": "a100",
                                                           "max_concurrency": 8}]}}
        assert results["without"][0] == [] and results["without"][1]
    finally:
        proc.stop()


def test_a_burst_of_registrations_in_one_big_watch_message(etcd: Etcd):
    """600 registrations written while the watcher is away arrive as one watch message (measured:
    261,735 bytes, 600 events, on one line): all of them are read."""
    prefix = "/t/burst/"
    w = Watching(etcd, prefix)
    try:
        wait_until(lambda: w.seen, 5, 0.05, "the first list")
        w.pause()
        pad = "x" * 200
        for t in range(5):
            etcd.post("/v3/kv/txn", {"success": [{"request_put": {
                "key": b64(f"{prefix}10.2.{t}.{i}:8000"),
                "value": b64(json.dumps({"service": "chat", "version": "v1", "model_name": pad}))}}
                for i in range(120)]})
        w.start()
        wait_until(lambda: len(w.endpoints()) == 600, 10, 0.05, "600 endpoints")
        assert w.watcher.lists == 1
    finally:
        w.close()
    # A list in pages of 7 keys (at one revision) finds the same 600.
    paged = Watching(etcd, prefix)
    try:
        paged.pause()
        paged.watcher.page_size, paged.watcher.revision = 7, None
        paged.start()
        wait_until(lambda: paged.watcher.lists == 2 and len(paged.endpoints()) == 600, 10, 0.05, "a paged list")
    finally:
        paged.close()


def test_user_authentication_survives_an_etcd_restart(tmp_path, monkeypatch):
    """etcd with users and roles (etcd docs, "Role-based access control"): a node registers as a user
    who may write the prefix, inferlb watches as one who may read it (password from
    INFERLB_ETCD_PASSWORD). An etcd restart forgets every token: both authenticate again. A wrong
    password gets nothing."""
    from xds_server.discovery.etcd import PASSWORD_ENV, prefix_end

    prefix = "/t/auth/"
    e = Etcd(tmp_path)
    try:
        def admin(path: str, body: dict, token: str | None = None) -> dict:
            r = requests.post(f"{e.url}{path}", json=body, headers={"Authorization": token} if token else {}, timeout=5)
            assert r.ok, r.text
            return r.json()

        span = {"key": b64(prefix), "range_end": base64.b64encode(prefix_end(prefix)).decode()}
        for user, password, role, perm in (("root", "rootpw", "root", None), ("node", "nodepw", "nodes", "READWRITE"),
                                           ("inferlb", "inferlbpw", "readers", "READ")):
            admin("/v3/auth/role/add", {"name": role})
            if perm:
                admin("/v3/auth/role/grant", {"name": role, "perm": {"permType": perm, **span}})
            admin("/v3/auth/user/add", {"name": user, "password": password})
            admin("/v3/auth/user/grant", {"user": user, "role": role})
        admin("/v3/auth/enable", {})
        assert requests.post(f"{e.url}/v3/kv/range", json=span, timeout=5).status_code != 200   # no token: refused

        monkeypatch.setenv(PASSWORD_ENV, "inferlbpw")
        cfg = spec_for(e, prefix, username="inferlb")
        w = Watching(None, "", cfg)
        proc, addr = sim(tmp_path, e, prefix, ttl=5, extra=["--etcd-user", "node:nodepw"])
        try:
            wait_until(lambda: addr in w.endpoints(), 10, 0.05, "the registration with users")
            e.restart()
            root = admin("/v3/auth/authenticate", {"name": "root", "password": "rootpw"})["token"]
            admin("/v3/kv/put", {"key": b64(prefix + "127.0.0.51:9000"),
                                 "value": b64(json.dumps({"service": "chat", "version": "v1"}))}, token=root)
            wait_until(lambda: "127.0.0.51:9000" in w.endpoints(), 10, 0.05, "a change after the restart")
            assert w.watcher.lists == 1
            wait_until(lambda: w.status.fetch([addr])[addr].sample_age_s < 1.0, 6, 0.1,
                       "the node writing its status again")
        finally:
            proc.stop()
            w.close()
        bad = Watching(None, "", spec_for(e, prefix, username="inferlb", password="wrong"))
        try:
            wait_until(lambda: bad.watcher.last_error, 5, 0.05, "the refusal")
            assert "authentication failed" in bad.watcher.last_error and not bad.seen
        finally:
            bad.close()
    finally:
        e.proc.stop()
