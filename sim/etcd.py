"""Register this node in etcd (v3 JSON gRPC gateway over HTTP, aiohttp) and keep a status snapshot there.

What is written (the format inferlb's etcd discovery reads): the key ``<prefix><HOST:PORT>`` on a
lease of ``ttl_s`` seconds, with a JSON value naming the address, service, model version, GPU
class, max concurrency and GPU memory, ``draining``, and ``status`` (running, waiting, KV-cache use
0–1, free GPU memory MiB, GPU utilisation 0–1: what ``/metrics`` exposes; ``at`` = this node's
clock, s). The lease is kept alive every ``ttl_s / 3`` s and the value rewritten every
``status_interval_s`` s. If etcd is unreachable the node retries with a capped back-off; if its
lease is gone (expired while etcd was away), it takes a new one and registers again.

:meth:`EtcdRegistration.deregister` (graceful shutdown) writes ``draining: true``, waits
``drain_s`` seconds while still serving (rewriting its status every 0.5 s, so the control plane
sees its requests finish), then revokes the lease (etcd deletes the key at once).
The ``etcd`` fault (``stop``) pauses keep-alives and status writes, so the lease expires while the
node still answers: the test of a lease expiring.

Gateway paths: ``/v3/lease/grant``, ``/v3/lease/keepalive``, ``/v3/kv/put``, ``/v3/lease/revoke``
(etcd 3.4+; keys and values base64).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from sim.node import SimNode

log = logging.getLogger("inferlb.sim.etcd")

#: While draining, the status is rewritten this often (s), so the control plane sees requests finish.
DRAIN_STATUS_S = 0.5


class EtcdUnavailable(RuntimeError):
    """etcd did not answer, or answered with an error."""


class LeaseGone(EtcdUnavailable):
    """The lease expired or was revoked: register again."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def registration_value(node: SimNode, address: str, service: str, draining: bool = False) -> dict:
    """The JSON value this node registers: identity, capacity, ``draining`` and the status snapshot now."""
    g = node.gauges()
    cfg = node.cfg
    return {
        "address": address, "service": service, "version": cfg.version, "gpu_class": cfg.gpu_class,
        "max_concurrency": node.max_concurrency, "gpu_memory_mib": cfg.gpu_memory_total_mib,
        "model_name": cfg.model_name, "draining": draining,
        "status": {"running": g.running, "waiting": g.waiting, "kv_cache_usage": round(g.kv_usage, 6),
                   "gpu_memory_free_mib": round(g.fb_free_mib, 3), "gpu_utilization": g.gpu_util_percent / 100.0,
                   "at": round(time.time(), 3)},
    }


class EtcdRegistration:
    """Keeps ``node`` registered under ``prefix + address`` in etcd until cancelled. ``url``: etcd client
    URLs (``http://HOST:PORT``), comma-separated; after a failure the next one is used."""

    def __init__(self, node: SimNode, url: str, *, prefix: str, ttl_s: int, service: str, address: str,
                 status_interval_s: float = 5.0, drain_s: float = 2.0, timeout_s: float = 3.0,
                 user: str | None = None) -> None:
        self.node = node
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        self._url_index = 0
        self.key = prefix + address
        self.ttl_s = ttl_s
        self.service = service
        self.address = address
        self.status_interval_s = status_interval_s
        self.drain_s = drain_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.lease: str | None = None
        self.registered = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self.task: asyncio.Task | None = None   # the run() task, set by whoever starts it
        self.user = user   # "NAME:PASSWORD" for etcd's user authentication, as etcdctl --user
        self._token: str | None = None

    @property
    def url(self) -> str:
        """The etcd endpoint in use."""
        return self.urls[self._url_index % len(self.urls)]

    async def _headers(self) -> dict[str, str]:
        """``Authorization: <token>`` with a user (authenticating first when needed), else none."""
        if self.user is None:
            return {}
        if self._token is None:
            name, _, password = self.user.partition(":")
            self._token = (await self._post("/v3/auth/authenticate", {"name": name, "password": password},
                                            auth=False)).get("token")
        return {"Authorization": self._token} if self._token else {}

    async def _post(self, path: str, body: dict, auth: bool = True) -> dict:
        assert self._http is not None
        headers = await self._headers() if auth else {}
        try:
            async with self._http.post(f"{self.url}{path}", json=body, headers=headers, timeout=self.timeout) as r:
                doc = await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as err:
            raise EtcdUnavailable(f"{path}: {err or type(err).__name__}") from None
        if r.status != 200 or not isinstance(doc, dict) or "error" in doc:
            message = doc.get("message") if isinstance(doc, dict) else doc
            if isinstance(doc, dict) and "lease not found" in str(message):
                raise LeaseGone(str(message))
            if "auth" in str(message):
                self._token = None   # expired or refused: authenticate again next time
            raise EtcdUnavailable(f"{path}: HTTP {r.status}: {message}")
        return doc

    async def _put(self, draining: bool = False) -> None:
        value = json.dumps(registration_value(self.node, self.address, self.service, draining))
        await self._post("/v3/kv/put", {"key": _b64(self.key), "value": _b64(value), "lease": self.lease})

    async def _register(self) -> None:
        doc = await self._post("/v3/lease/grant", {"TTL": self.ttl_s})
        self.lease = doc["ID"]
        await self._put()
        self.registered.set()
        log.info("registered %s in etcd %s (lease %s, TTL %d s)", self.key, self.url, self.lease, self.ttl_s)

    async def _keepalive(self) -> None:
        """One keep-alive (the gateway's bidirectional stream, one request and its first answer)."""
        assert self._http is not None
        try:
            async with self._http.post(f"{self.url}/v3/lease/keepalive", json={"ID": self.lease},
                                       headers=await self._headers(), timeout=self.timeout) as r:
                line = await r.content.readline()
        except (TimeoutError, aiohttp.ClientError) as err:
            raise EtcdUnavailable(f"keepalive: {err or type(err).__name__}") from None
        try:
            result = json.loads(line).get("result", {})
        except ValueError:
            raise EtcdUnavailable(f"keepalive: HTTP {r.status}, not JSON: {line[:100]!r}") from None
        if int(result.get("TTL") or 0) <= 0:
            raise LeaseGone(f"lease {self.lease} expired")

    async def run(self) -> None:
        """Register, then keep the lease alive and the status fresh; re-register when the lease is gone."""
        self._http = aiohttp.ClientSession()
        backoff = 0.1
        keepalive_every = max(0.2, self.ttl_s / 3)
        try:
            while True:
                try:
                    if self.lease is None:
                        await self._register()
                    next_status = time.monotonic() + self.status_interval_s
                    while True:
                        await asyncio.sleep(min(keepalive_every, max(0.0, next_status - time.monotonic())))
                        if self.node.faults.etcd != "ok":
                            continue
                        await self._keepalive()
                        if time.monotonic() >= next_status:
                            await self._put()
                            next_status = time.monotonic() + self.status_interval_s
                        backoff = 0.1
                except LeaseGone as err:
                    log.warning("etcd: %s; registering again", err)
                    self.lease = None
                except EtcdUnavailable as err:
                    log.warning("etcd %s: %s; retrying in %.1f s", self.url, err, backoff)
                    self._url_index += 1
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            await self._http.close()
            self._http = None

    async def deregister(self) -> None:
        """Graceful shutdown: ``draining: true``, ``drain_s`` s of serving (status rewritten every
        :data:`DRAIN_STATUS_S`), then revoke the lease.
        Best effort: an unreachable etcd is logged (the lease then expires on its own)."""
        if self.lease is None:
            return
        self._http = self._http or aiohttp.ClientSession()
        try:
            await self._put(draining=True)
            log.info("etcd: %s draining; revoking the lease in %.1f s", self.key, self.drain_s)
            end = time.monotonic() + self.drain_s
            while (left := end - time.monotonic()) > 0:   # the status keeps showing requests finish
                await asyncio.sleep(min(left, DRAIN_STATUS_S))
                if time.monotonic() < end:
                    await self._put(draining=True)
            await self._post("/v3/lease/revoke", {"ID": self.lease})
            log.info("etcd: %s deregistered", self.key)
        except EtcdUnavailable as err:
            log.warning("etcd: could not deregister %s (%s); its lease expires in %d s", self.key, err, self.ttl_s)
        finally:
            self.lease = None
            await self._http.close()
            self._http = None
