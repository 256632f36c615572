"""Endpoints from nodes that register in etcd, over etcd's v3 JSON gRPC gateway (aiohttp, no etcd client library).

Registration (what a node writes; the simulator's ``--etcd`` does it): one key per node,
``<prefix><HOST:PORT>``, attached to a lease with a TTL the node keeps alive, whose value is a JSON
object::

    {"address": "10.0.0.5:8000", "service": "chat", "version": "v1", "gpu_class": "a100",
     "max_concurrency": 8, "gpu_memory_mib": 81920, "draining": false,
     "status": {"running": 2, "waiting": 0, "kv_cache_usage": 0.12, "gpu_memory_free_mib": 61000,
                "gpu_utilization": 0.25, "at": 1764582000.1}}

``address`` defaults to the key's suffix; ``gpu_class``, ``max_concurrency`` and ``gpu_memory_mib``
are optional; ``status`` (refreshed every few seconds) feeds the ``status`` metrics source
(:mod:`xds_server.metrics.sources.status`). A node that stops renewing its lease loses its key when
the lease expires (etcd deletes it): the endpoint is removed. A node shutting down writes
``draining: true`` first (the endpoint turns DRAINING), then revokes its lease (removed).

Pure part: :func:`parse_registration`, :func:`endpoints_from` and :func:`compose_config` (the
registrations as services of the config, validated like any config). I/O part:
:class:`EtcdWatcher` lists the prefix (``/v3/kv/range``), then watches it (``/v3/watch``) from
the revision after the list, resuming from the last revision it saw after a disconnect (an etcd
restart loses nothing: its keys and revisions are on disk) and listing again when that revision
was compacted. Paths and JSON shapes: etcd docs, "gRPC gateway" (``/v3/...`` since 3.4) and
``etcdserverpb/rpc.proto``; keys and values are base64 in the JSON.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import Counter, Gauge
from pydantic import ValidationError

from xds_server.config import Config, EndpointConfig, EtcdDiscovery
from xds_server.config.model import NAME_RE, VERSION_RE
from xds_server.discovery.services import Discovered, service_entry
from xds_server.metrics.sources.status import BadSnapshot, StatusSource, snapshot_stats
from xds_server.metrics.stats import EndpointStats

log = logging.getLogger(__name__)

SKIPPED = Counter("inferlb_etcd_registrations_skipped_total", "etcd registrations left out, by reason", ["reason"])
RELISTS = Counter("inferlb_etcd_relists_total", "Full lists of the etcd prefix (start and compaction)")
WATCH_RESTARTS = Counter("inferlb_etcd_watch_restarts_total", "etcd watches re-opened, by reason", ["reason"])
REGISTERED = Gauge("inferlb_etcd_registered_endpoints", "Endpoints registered in etcd (valid registrations)")
UP = Gauge("inferlb_etcd_up", "1 while the etcd list or watch is connected, 0 while it retries")
#: The etcd password when ``discovery.etcd.password`` is not set.
PASSWORD_ENV = "INFERLB_ETCD_PASSWORD"
REVISION = Gauge("inferlb_etcd_revision", "The last etcd revision the watcher has seen")


class BadRegistration(ValueError):
    """A registration that cannot be used; ``field`` names the offending key of its value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class EtcdError(RuntimeError):
    """etcd answered with an error (or something that is not its JSON)."""


class Compacted(EtcdError):
    """The watch's start revision was compacted away: list again."""


@dataclass(frozen=True, slots=True)
class Registration:
    """One node's registration. ``status``: its snapshot as EndpointStats (None: none, or refused,
    then ``status_error`` says why)."""

    key: str
    address: str
    service: str
    version: str
    gpu_class: str | None = None
    max_concurrency: int | None = None
    gpu_memory_mib: float | None = None
    draining: bool = False
    status: EndpointStats | None = None
    status_error: str | None = None

    def same_endpoint(self, other: Registration | None) -> bool:
        """True when only the status differs (the config made of it is the same)."""
        return other is not None and (self.address, self.service, self.version, self.gpu_class,
                                      self.max_concurrency, self.gpu_memory_mib, self.draining) == (
            other.address, other.service, other.version, other.gpu_class, other.max_concurrency,
            other.gpu_memory_mib, other.draining)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: str | bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix`` (etcd's rule,
    as ``clientv3.GetPrefixRangeEnd``: the prefix with its last byte below 0xff incremented, the
    rest dropped). Raises ValueError for an empty (or all-0xff) prefix."""
    raw = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        raise ValueError("an etcd key prefix must not be empty")
    raw[-1] += 1
    return bytes(raw)


def parse_registration(key: str, value: bytes, prefix: str) -> Registration:
    """One key and value (bytes, JSON) -> a :class:`Registration`. Pure.

    A bad ``status`` object does not refuse the registration: the node still takes traffic, its
    ``status`` is None and ``status_error`` says why.

    Raises:
        BadRegistration: not JSON, not an object, or a field of the wrong type or form; its
            ``field`` names the key.
    """
    try:
        doc = json.loads(value)
    except ValueError:
        raise BadRegistration("value", "the value is not JSON") from None
    if not isinstance(doc, dict):
        raise BadRegistration("value", f"the value must be a JSON object, got {type(doc).__name__}")
    address = doc.get("address", key[len(prefix):] if key.startswith(prefix) else key)
    for name, pattern in (("service", NAME_RE), ("version", VERSION_RE)):
        v = doc.get(name)
        if not isinstance(v, str) or not re.fullmatch(pattern, v):
            raise BadRegistration(name, f"{name} must be a name matching {pattern}, got {v!r}")
    draining = doc.get("draining", False)
    if not isinstance(draining, bool):
        raise BadRegistration("draining", f"draining must be true or false, got {draining!r}")
    optional = {k: doc[k] for k in ("gpu_class", "max_concurrency", "gpu_memory_mib") if doc.get(k) is not None}
    try:
        ep = EndpointConfig(address=address, **optional)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "value"
        raise BadRegistration(field, f"{field}: {first['msg']}") from None
    status, status_error = None, None
    if doc.get("status") is not None:
        try:
            status = snapshot_stats(doc["status"])
        except BadSnapshot as err:
            status_error = str(err)
    return Registration(key, ep.address, doc["service"], doc["version"], optional.get("gpu_class"),
                        ep.max_concurrency if "max_concurrency" in optional else None, ep.gpu_memory_mib,
                        draining, status, status_error)


def read_registration(key: str, value: bytes, prefix: str,
                      status: StatusSource | None = None) -> Registration | None:
    """:func:`parse_registration`, with problems logged and counted: None for a refused
    registration; a refused status is counted on ``status`` and the registration kept."""
    try:
        reg = parse_registration(key, value, prefix)
    except BadRegistration as err:
        SKIPPED.labels(f"bad-{err.field}").inc()
        log.warning("etcd registration %s refused: %s", key, err)
        return None
    if reg.status_error is not None:
        if status is not None:
            status.refuse()
        log.warning("etcd registration %s: status refused: %s", key, reg.status_error)
    return reg


def endpoints_from(registrations: Iterable[Registration], spec: EtcdDiscovery,
                   gpu_classes: Iterable[str]) -> Discovered:
    """Registrations -> endpoints per configured service and version, in a stable (sorted) order.

    Left out (counted in ``inferlb_etcd_registrations_skipped_total{reason}``): a service not in
    ``spec.services`` (``unknown-service``), an unknown GPU class (``unknown-gpu-class``), an
    address registered twice (``duplicate-address``; the first key in key order wins). Pure
    apart from the counter.
    """
    by_registered = {s.registered_as: s for s in spec.services}
    classes = set(gpu_classes)
    out: Discovered = {s.name: {} for s in spec.services}
    seen: set[str] = set()
    for reg in sorted(registrations, key=lambda r: r.key):
        svc = by_registered.get(reg.service)
        if svc is None:
            SKIPPED.labels("unknown-service").inc()
            continue
        gpu = reg.gpu_class or spec.default_gpu_class
        if gpu not in classes:
            SKIPPED.labels("unknown-gpu-class").inc()
            continue
        if reg.address in seen:
            SKIPPED.labels("duplicate-address").inc()
            continue
        seen.add(reg.address)
        ep: dict[str, Any] = {"address": reg.address, "gpu_class": gpu,
                              "max_concurrency": reg.max_concurrency or spec.default_max_concurrency}
        if reg.gpu_memory_mib is not None:
            ep["gpu_memory_mib"] = reg.gpu_memory_mib
        if reg.draining:
            ep["drain"] = True
        out[svc.name].setdefault(reg.version, []).append(ep)
    return {name: {v: sorted(eps, key=lambda e: e["address"]) for v, eps in sorted(versions.items())}
            for name, versions in out.items()}


def compose_config(base: Config, discovered: Discovered) -> Config:
    """``base`` with one service per configured etcd service that has registered endpoints.

    A registered address that ``base`` already has (a static or Kubernetes endpoint) is left out
    and counted (``address-taken``), so one such node cannot block the others.

    Raises:
        pydantic.ValidationError: the result is not a valid config (a service name that is also a
            static service's, say).
    """
    spec = base.discovery.etcd
    if spec is None:
        return base
    taken = {e.address for s in base.services for v in s.versions for e in v.endpoints}
    kept: Discovered = {}
    for name, versions in discovered.items():
        kept[name] = {}
        for version, eps in versions.items():
            free = [e for e in eps if e["address"] not in taken]
            SKIPPED.labels("address-taken").inc(len(eps) - len(free))
            if free:
                kept[name][version] = free
    discovered = kept
    extra = [service_entry(s, discovered.get(s.name, {})) for s in spec.services if discovered.get(s.name)]
    data = base.model_dump(mode="json", exclude_none=True)
    data["services"] = [*data["services"], *extra]
    return Config.model_validate(data)


def ssl_context(spec: EtcdDiscovery) -> ssl.SSLContext | None:
    """The client TLS context for ``spec.tls`` (None without it: system CAs for https URLs).

    Raises:
        OSError, ssl.SSLError: a file cannot be read or is not PEM.
    """
    if spec.tls is None:
        return None
    ctx = ssl.create_default_context(cafile=spec.tls.ca)
    if spec.tls.cert:
        ctx.load_cert_chain(spec.tls.cert, spec.tls.key)
    return ctx


class LineSplitter:
    """Splits a byte stream into its non-empty newline-terminated lines (the gateway writes one JSON
    message per line; one with many events is long: 600 registrations written at once came as one
    line of 261,735 bytes). ``max_bytes``: a longer unterminated line raises ValueError."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._buf = bytearray()
        self.max_bytes = max_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete lines ``chunk`` finishes, in order."""
        self._buf += chunk
        *done, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        if len(self._buf) > self.max_bytes:
            raise ValueError(f"a watch message longer than {self.max_bytes} bytes")
        return [bytes(line) for line in done if line.strip()]


OnChange = Callable[[Discovered], Awaitable[None]]


class EtcdWatcher:
    """Lists then watches ``spec.prefix`` on the running event loop (:meth:`run`).

    ``on_change(discovered)`` is awaited after the first list and after every change of an
    endpoint (a status-only change goes to ``status`` only). ``revision``: the last revision seen
    (None: list next). ``lists`` / ``watches``: how many of each were started (tests read them);
    ``page_size``: keys per list request.
    """

    def __init__(self, spec: EtcdDiscovery, gpu_classes: Iterable[str], on_change: OnChange,
                 status: StatusSource | None = None) -> None:
        self.spec = spec
        self.gpu_classes = tuple(gpu_classes)
        self._on_change = on_change
        self.status = status
        self._key = _b64(spec.prefix)
        self._end = _b64(prefix_end(spec.prefix))
        self.registrations: dict[str, Registration] = {}
        self._unknown_logged: set[tuple[str, str]] = set()  # (address, service) warned about once
        self.revision: int | None = None
        self.lists = 0
        self.watches = 0
        self.page_size = 1000   # keys per list request (the list pages at one revision)
        self.connected = False
        self.last_error: str | None = None
        self._url_index = 0
        self._ssl = ssl_context(spec)
        self._token: str | None = None

    @property
    def url(self) -> str:
        """The etcd endpoint in use."""
        return self.spec.endpoints[self._url_index % len(self.spec.endpoints)]

    async def run(self) -> None:
        """List, watch, resume; forever (cancel the task to stop). Errors are logged and retried
        with a capped back-off on the next endpoint; the last discovered set keeps serving."""
        backoff = 0.2
        connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl else None
        async with aiohttp.ClientSession(connector=connector) as http:
            while True:
                try:
                    if self.revision is None:
                        await self._list(http)
                    await self._watch(http)
                    backoff = 0.2
                except Compacted as err:
                    log.info("etcd watch from revision %s: compacted (%s); listing again", self._next(), err)
                    WATCH_RESTARTS.labels("compacted").inc()
                    self.revision = None
                except (TimeoutError, aiohttp.ClientError, EtcdError, ValueError) as err:
                    WATCH_RESTARTS.labels("error").inc()
                    if self.connected or self.last_error != str(err):
                        log.warning("etcd %s: %s; retrying in %.1f s", self.url, err or type(err).__name__, backoff)
                    self.connected, self._token = False, None   # authenticate again (the token may have expired)
                    UP.set(0)
                    self.last_error = str(err) or type(err).__name__
                    self._url_index += 1
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                except Exception:   # an answer of an unexpected shape: never stop watching; list again
                    log.exception("etcd %s: unexpected failure; listing again in %.1f s", self.url, backoff)
                    WATCH_RESTARTS.labels("error").inc()
                    self.connected, self.revision = False, None
                    UP.set(0)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)

    def _next(self) -> int:
        return (self.revision or 0) + 1

    async def _headers(self, http: aiohttp.ClientSession) -> dict[str, str]:
        """``Authorization: <token>`` with ``spec.username`` (authenticating first when there is no
        token yet, or the last request failed), else none."""
        if self.spec.username is None:
            return {}
        if self._token is None:
            password = self.spec.password if self.spec.password is not None else os.environ.get(PASSWORD_ENV, "")
            doc = await self._post(http, "/v3/auth/authenticate", {"name": self.spec.username, "password": password},
                                   auth=False)
            self._token = doc.get("token")
            if not self._token:
                raise EtcdError("/v3/auth/authenticate: no token in the answer (is auth enabled?)")
        return {"Authorization": self._token}

    async def _post(self, http: aiohttp.ClientSession, path: str, body: dict, auth: bool = True) -> dict:
        headers = await self._headers(http) if auth else {}
        async with http.post(f"{self.url}{path}", json=body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=self.spec.timeout_s)) as r:
            doc = await r.json(content_type=None)
            if r.status != 200 or not isinstance(doc, dict) or "error" in doc:
                raise EtcdError(f"{path}: HTTP {r.status}: {doc.get('message') if isinstance(doc, dict) else doc}")
            return doc

    async def _list(self, http: aiohttp.ClientSession) -> None:
        """Read every key under the prefix at one revision (paged), replace the table, emit."""
        self.lists += 1
        RELISTS.inc()
        found: dict[str, Registration] = {}
        key, revision = self._key, None
        while True:
            body = {"key": key, "range_end": self._end, "limit": self.page_size,
                    **({"revision": revision} if revision else {})}
            doc = await self._post(http, "/v3/kv/range", body)
            revision = revision or int(doc["header"]["revision"])
            kvs = doc.get("kvs", [])
            for kv in kvs:
                name = _unb64(kv["key"]).decode(errors="replace")
                reg = read_registration(name, _unb64(kv.get("value")), self.spec.prefix, self.status)
                if reg is not None:
                    found[name] = reg
                    self._warn_unknown(reg)
            if not doc.get("more") or not kvs:
                break
            key = _b64(_unb64(kvs[-1]["key"]) + b"\0")   # the next key after the last one read
        self.revision = revision
        self.connected, self.last_error = True, None
        UP.set(1)
        REVISION.set(revision)
        old = self.registrations
        self.registrations = found
        if self.status is not None:
            self.status.retain(r.address for r in found.values())
            for reg in found.values():
                self._status(reg)
        log.info("etcd %s: %d registrations under %s at revision %d", self.url, len(found), self.spec.prefix,
                 revision)
        if self.lists == 1 or set(old) != set(found) or any(not r.same_endpoint(old.get(k)) for k, r in found.items()):
            await self._emit()

    async def _watch(self, http: aiohttp.ClientSession) -> None:
        """One watch stream from the revision after the last one seen; returns after
        ``spec.watch_timeout_s`` (the caller opens the next). Raises Compacted, EtcdError, aiohttp errors."""
        self.watches += 1
        body = {"create_request": {"key": self._key, "range_end": self._end, "start_revision": self._next(),
                                   "progress_notify": True}}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.spec.timeout_s, sock_read=None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.watch_timeout_s
        async with http.post(f"{self.url}/v3/watch", json=body, headers=await self._headers(http),
                             timeout=timeout) as r:
            if r.status != 200:
                raise EtcdError(f"/v3/watch: HTTP {r.status}: {(await r.text())[:200]}")
            self.connected, self.last_error = True, None
            UP.set(1)
            lines = LineSplitter()
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    WATCH_RESTARTS.labels("timeout").inc()
                    return
                try:
                    async with asyncio.timeout(remaining):   # not wait_for: it can lose a cancellation on 3.11
                        chunk = await r.content.readany()
                except TimeoutError:
                    WATCH_RESTARTS.labels("timeout").inc()
                    return
                if not chunk:
                    raise EtcdError("the watch stream ended")
                for line in lines.feed(chunk):
                    await self._on_line(line)

    async def _on_line(self, line: bytes) -> None:
        msg = json.loads(line)
        if "error" in msg:
            err = msg["error"]
            raise EtcdError(f"watch: {err.get('message') or err}")
        result = msg.get("result", {})
        if result.get("canceled"):
            compact = int(result.get("compact_revision") or 0)
            if compact:
                raise Compacted(f"compacted up to revision {compact}")
            raise EtcdError(f"watch canceled: {result.get('cancel_reason') or 'no reason given'}")
        events = result.get("events", [])
        if not events and not result.get("created"):
            # A progress notification: every event up to its header revision has been sent, so
            # the watch can resume from there (fewer re-lists after a compaction). etcd's rule.
            rev = int(result.get("header", {}).get("revision") or 0)
            self.revision = max(self.revision or 0, rev)
            REVISION.set(self.revision)
            return
        changed = False
        for event in events:
            kv = event.get("kv", {})
            name = _unb64(kv.get("key")).decode(errors="replace")
            self.revision = max(self.revision or 0, int(kv.get("mod_revision") or 0))
            old = self.registrations.get(name)
            if event.get("type") == "DELETE":
                if old is not None:
                    del self.registrations[name]
                    if self.status is not None and not any(r.address == old.address
                                                           for r in self.registrations.values()):
                        self.status.discard(old.address)
                    log.info("etcd: %s deregistered (%s)", old.address, name)
                    changed = True
                continue
            reg = read_registration(name, _unb64(kv.get("value")), self.spec.prefix, self.status)
            if reg is None:
                if old is not None:
                    del self.registrations[name]
                    changed = True
                continue
            self.registrations[name] = reg
            if old is not None and old.address != reg.address and self.status is not None:
                self.status.discard(old.address)
            self._status(reg)
            if not reg.same_endpoint(old):
                log.info("etcd: %s %s (%s %s%s)", reg.address, "registered" if old is None else "updated",
                         reg.service, reg.version, ", draining" if reg.draining else "")
                self._warn_unknown(reg)
                changed = True
        REVISION.set(self.revision or 0)
        if changed:
            await self._emit()

    def _warn_unknown(self, reg: Registration) -> None:
        """Once per address and service: a registration no ``discovery.etcd.services`` entry takes is
        left out (counted as ``unknown-service`` by :func:`endpoints_from`); say so, with the names
        that would take it."""
        known = [s.registered_as for s in self.spec.services]
        if reg.service in known or (reg.address, reg.service) in self._unknown_logged:
            return
        self._unknown_logged.add((reg.address, reg.service))
        log.warning("etcd: %s registered as service '%s', which no discovery.etcd.services entry takes "
                    "(registered_as: %s): left out", reg.address, reg.service, ", ".join(known) or "none")

    def _status(self, reg: Registration) -> None:
        if self.status is not None and reg.status is not None:
            self.status.set(reg.address, reg.status)

    async def _emit(self) -> None:
        discovered = endpoints_from(self.registrations.values(), self.spec, self.gpu_classes)
        REGISTERED.set(sum(len(eps) for versions in discovered.values() for eps in versions.values()))
        try:
            await self._on_change(discovered)
        except Exception:   # the consumer's failure must not stop the watch
            log.exception("etcd: applying the discovered endpoints failed")

    def describe(self) -> dict:
        """For the admin API: endpoint in use, connected, revision, counts, last error."""
        return {"url": self.url, "connected": self.connected, "revision": self.revision, "lists": self.lists,
                "watches": self.watches, "registrations": len(self.registrations), "last_error": self.last_error}
