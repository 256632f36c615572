"""The per-request decision: request headers + endpoint view -> cluster and pinned endpoint.

Pure and cheap (a few µs): no I/O, no locks, no mutation of its inputs, and no exception for
any header value a client can send. The transport (``ext_proc.transport.grpcio``) turns a
:class:`Decision` into Envoy's ext_proc answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ext_proc.ring import key_hash
from ext_proc.sessions import session_slot
from ext_proc.view import MIX_BUCKETS, EndpointView, ServiceRoute

__all__ = ["BodyFields", "Decision", "MAX_VERSION_BYTES", "NO_BODY", "overloaded", "pick", "session_cookie"]


class _Pins(Protocol):
    def get(self, slot: int, /) -> str | None: ...


MAX_VERSION_BYTES = 256
"""Version header values longer than this are rejected without decoding them."""

# Longest part of a client-supplied value quoted back in an error body.
_MAX_QUOTED = 128


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one request.

    Attributes:
        cluster: the cluster to route to (the picker sets the cluster header to it); None when
            rejecting or when the picker has no view yet.
        endpoint: ``"HOST:PORT"`` to pin through the override-host header, or None to leave the
            choice to Envoy's weighted fallback policy.
        status: HTTP status of an immediate rejection, None when routing.
        body: the rejection's JSON body (``{"error": "..."}``), empty when routing.
        reason: why, a short stable label (a metrics label value): "session", "no-session",
            "no-healthy-endpoint", "unknown-service", "unknown-version", "invalid-version",
            "not-ready".
        session: the session-table key (:func:`~ext_proc.sessions.session_slot`) when a
            session was pinned, else None.
        retry_after_s: the ``Retry-After`` of a 429 (whole seconds), else None.
    """

    cluster: str | None
    endpoint: str | None
    status: int | None
    body: bytes
    reason: str
    session: int | None = None
    retry_after_s: int | None = None

    @property
    def rejected(self) -> bool:
        """True when the request is answered at once with ``status`` and ``body``."""
        return self.status is not None


_NOT_READY = Decision(None, None, None, b"", "not-ready")


def _reject(status: int, reason: str, message: str) -> Decision:
    return Decision(None, None, status, json.dumps({"error": message}).encode(), reason)


def overloaded(cluster: str, retry_after_s: int) -> Decision:
    """The 429 for a request whose cluster is at its max concurrency (reason "overloaded")."""
    message = f"cluster '{cluster}' is at its max concurrency; retry after {retry_after_s} s"
    return Decision(None, None, 429, json.dumps({"error": message}).encode(), "overloaded",
                    retry_after_s=retry_after_s)


def _quote(raw: bytes) -> str:
    """A client value made safe to quote in a message: decoded leniently and shortened."""
    text = raw[:_MAX_QUOTED].decode("utf-8", errors="backslashreplace")
    return text + "..." if len(raw) > _MAX_QUOTED else text


def _authority_host(authority: bytes) -> str:
    """Lower-case host of an authority (``host``, ``host:port``, ``[v6]:port``), "" if unusable."""
    if authority.startswith(b"["):
        end = authority.find(b"]")
        host = authority[: end + 1] if end > 0 else authority
    else:
        host, sep, port = authority.rpartition(b":")
        if not sep or not port.isdigit():
            host = authority
    try:
        return host.decode("ascii").lower().rstrip(".")
    except UnicodeDecodeError:
        return ""


def _known(service: ServiceRoute) -> str:
    return ", ".join(sorted([*service.clusters, *service.mixes]))


def _bad_version(where: str, raw: bytes, service: ServiceRoute) -> Decision:
    """The 400 for a version value that is not a valid version string at all."""
    if len(raw) > MAX_VERSION_BYTES:
        problem = f"is too long ({len(raw)} bytes, limit {MAX_VERSION_BYTES})"
    else:
        problem = f"is not valid UTF-8 ({_quote(raw)!r})"
    return _reject(400, "invalid-version", f"model version in {where} {problem}; known versions: {_known(service)}")


def session_cookie(cookie: bytes | None, name: bytes) -> bytes | None:
    """The value of cookie ``name`` in a ``cookie`` header value (``a=1; b=2``), or None."""
    if not cookie:
        return None
    for part in cookie.split(b";"):
        key, sep, value = part.strip().partition(b"=")
        if sep and key == name:
            return value or None
    return None


@dataclass(frozen=True, slots=True)
class BodyFields:
    """What the picker reads from an OpenAI-style JSON request body.

    Attributes:
        model: the ``model`` field (a version or mix name), raw UTF-8 bytes, or None.
        user: the ``user`` field (a session key), raw bytes, or None.
    """

    model: bytes | None = None
    user: bytes | None = None


NO_BODY = BodyFields()


def pick(
    headers: Mapping[str, bytes],
    view: EndpointView,
    loads: Mapping[str, int] | None = None,
    pins: _Pins | None = None,
    body: BodyFields = NO_BODY,
) -> Decision:
    """Decide the cluster and the pinned endpoint of one request.

    Args:
        headers: request headers, lower-case names -> raw value bytes (as Envoy's ext_proc
            sends them in ``raw_value``); pseudo-headers such as ``:authority`` included.
        view: the current endpoint view.
        loads: per-endpoint load (requests in flight) for bounded-load hashing; None hashes
            without load bounds.
        pins: the session table (read only: ``pins.get(slot)`` -> endpoint or None). A
            session whose pinned endpoint is still pinnable in the cluster keeps it; otherwise
            the ring chooses.
        body: fields of the JSON body, when body routing read it.

    Returns:
        A :class:`Decision`. Rejections: 404 when no service takes the authority's host,
        400 when the version (header, else the body's ``model``) names an unknown version or
        is not a valid version string (not UTF-8, longer than :data:`MAX_VERSION_BYTES`).
        Neither present means the service's default version. A version may be a mix (canary
        split): its share buckets are chosen by the session key's hash, so a session never
        flips versions while the split stays (requests without a session use the hash of
        ``x-request-id``). The session key is the first non-empty session header, else the
        session cookie (when configured), else the body's ``user``; it is hashed onto the ring
        of the cluster's healthy endpoints; without one, or without a healthy endpoint,
        nothing is pinned. Before the first real view, nothing is decided (reason
        "not-ready") so Envoy's own routing applies.

    Never raises for any header or body content.
    """
    if not view.ready:
        return _NOT_READY
    routing = view.routing
    authority = headers.get(":authority") or headers.get("host") or b""
    host = _authority_host(authority)
    service = view.service_for_host(host)
    if service is None:
        return _reject(404, "unknown-service", f"no service for host '{_quote(authority)}'")

    key = None
    for name in routing.session_headers:
        key = headers.get(name)
        if key:
            break
    if not key and routing.session_cookie is not None:
        key = session_cookie(headers.get("cookie"), routing.session_cookie.encode())
    if not key:
        key = body.user
    position = key_hash(key) if key else None

    raw = headers.get(routing.version_header)
    where = f"header '{routing.version_header}'"
    if not raw and body.model:
        raw, where = body.model, "body field 'model'"
    if not raw:
        version = service.default_version
    else:
        if len(raw) > MAX_VERSION_BYTES:
            return _bad_version(where, raw, service)
        try:
            version = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _bad_version(where, raw, service)
    cluster = service.clusters.get(version)
    if cluster is None:
        mix = service.mixes.get(version)
        if mix is None:
            return _reject(
                400,
                "unknown-version",
                f"unknown model version '{_quote(raw)}' in {where}; known versions: {_known(service)}",
            )
        bucket = (position if position is not None else key_hash(headers.get("x-request-id", b""))) % MIX_BUCKETS
        cluster = next(c for upto, c in mix if bucket < upto)

    if position is None:
        return Decision(cluster, None, None, b"", "no-session")
    pool = view.clusters.get(cluster)
    if pool is None or not pool.endpoints:
        return Decision(cluster, None, None, b"", "no-healthy-endpoint")
    slot = session_slot(position, pool.salt)
    if pins is not None:
        pinned = pins.get(slot)
        if pinned is not None and pinned in pool.members:
            return Decision(cluster, pinned, None, b"", "session", slot)
    endpoint = pool.ring.lookup_hash(position, loads, routing.load_factor)
    return Decision(cluster, endpoint, None, b"", "session", slot)
