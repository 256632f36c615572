"""The per-request decision: request headers + endpoint view -> cluster and pinned endpoint.

Pure and cheap (a few µs): no I/O, no locks, no mutation of its inputs, and no exception for
any header value a client can send. The transport (``ext_proc.transport.grpcio``) turns a
:class:`Decision` into Envoy's ext_proc answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import NamedTuple, Protocol

from ext_proc.body import NO_BODY, BodyFields
from ext_proc.errors import error_body
from ext_proc.prefix_index import PrefixIndex
from ext_proc.ring import key_hash, session_hash
from ext_proc.scheduling import Request
from ext_proc.scheduling.affinity import STRICT, strict_choice
from ext_proc.sessions import session_slot
from ext_proc.tiers import tier_for
from ext_proc.view import MIX_BUCKETS, EndpointView, RoutingTable, ServiceRoute

__all__ = ["Decision", "MAX_VERSION_BYTES", "body_too_large", "declared_mib", "header_session_key",
           "model_not_found", "overloaded", "pick", "request_need", "served_names", "session_cookie",
           "size_header_problem", "too_deep", "too_large"]


class _Pins(Protocol):
    def get(self, slot: int, /) -> str | None: ...


MAX_VERSION_BYTES = 256
"""Version header values longer than this are rejected without decoding them."""

# Longest part of a client-supplied value quoted back in an error body.
_MAX_QUOTED = 128


class Decision(NamedTuple):
    """What to do with one request (a named tuple: built on every request, ~0.2 µs, where a frozen
    dataclass costs a ``object.__setattr__`` per field).

    Attributes:
        cluster: the cluster to route to (the picker sets the cluster header to it); None when
            rejecting or when the picker has no view yet.
        endpoint: ``"HOST:PORT"`` to pin through the override-host header, or None to leave the
            choice to Envoy's weighted fallback policy.
        status: HTTP status of an immediate rejection, None when routing.
        body: the rejection's body, an OpenAI error object (:func:`ext_proc.errors.error_body`: ``code``
            is ``reason`` with underscores), empty when routing.
        reason: why, a short stable label (a metrics label value): the scheduling profile's outcomes
            (:data:`ext_proc.scheduling.OUTCOMES`: "affinity", "spilled", "memory", "repinned",
            "least-loaded", "no-memory"), the request control's "pin-moved" and memory grant outcomes
            ("grant-granted", "grant-refused", "grant-unanswered"; counted beside the decision's
            own reason, see :meth:`ext_proc.requestcontrol.RequestControl._confirm`), and "no-healthy-endpoint",
            "unknown-service", "unknown-version", "model-not-found", "invalid-version", "version-unavailable",
            "not-ready", "overloaded", "too-large", "body-too-deep", "request-body-too-large".
        session: the session-table key (:func:`~ext_proc.sessions.session_slot`) when a
            session was pinned, else None.
        retry_after_s: the ``Retry-After`` of a 429 (whole seconds), else None.
        pinned: the session's pin before this request (None: none).
        key: what the affinity key was: "session", "prefix" or "none".
        work: the request's predicted work (1 = a typical request).
        mib: the request's GPU memory need (MiB, without the margin).
        prompt_tokens, output_tokens: the tokens the need and work came from (None: unknown).
        gpu_class: the chosen endpoint's GPU class ("" unknown).
        margin: the memory margin admission added to ``mib`` (a share; 0 for a declared need).
        plugins: the plugins of the scheduling profile that decided it, joined with ``+`` (a metrics
            label value, one of a bounded set per profile: :meth:`ext_proc.scheduling.Profile.label`);
            ``strict-affinity`` (with the hard filter that made it wait, if one did) for a session of a
            strict service kept on its pin (:mod:`ext_proc.scheduling.affinity`); "" when no profile ran.
        blocks: the prompt's chained block keys (:func:`ext_proc.prefix_index.block_hashes`; empty:
            unknown): the picker's prefix index records them for ``endpoint`` when committed.
        conversation: the prefix key's hash of a conversation the prefix index follows
            (:attr:`BodyFields.continued` not None): recorded as going to ``endpoint`` when committed.
    """

    cluster: str | None
    endpoint: str | None
    status: int | None
    body: bytes
    reason: str
    session: int | None = None
    retry_after_s: int | None = None
    pinned: str | None = None
    key: str = "none"
    work: float = 1.0
    mib: float = 0.0
    prompt_tokens: float | None = None
    output_tokens: float | None = None
    gpu_class: str = ""
    margin: float = 0.0
    plugins: str = ""
    blocks: tuple[int, ...] = ()
    conversation: int | None = None

    @property
    def rejected(self) -> bool:
        """True when the request is answered at once with ``status`` and ``body``."""
        return self.status is not None


_NOT_READY = Decision(None, None, None, b"", "not-ready")


def _reject(status: int, reason: str, message: str, param: str | None = None) -> Decision:
    """An immediate answer: ``status`` with the OpenAI error object (code = ``reason``, :mod:`ext_proc.errors`)."""
    return Decision(None, None, status, error_body(status, reason, message, param), reason)


def overloaded(cluster: str, retry_after_s: int, why: str = "is at its max concurrency") -> Decision:
    """The 429 for a request no endpoint of ``cluster`` can take now (reason "overloaded")."""
    message = f"cluster '{cluster}' {why}; retry after {retry_after_s} s"
    return _reject(429, "overloaded", message)._replace(retry_after_s=retry_after_s)


def too_large(cluster: str, need_mib: float, largest_mib: float) -> Decision:
    """The 503 for a request that needs more GPU memory (``need_mib``) than any endpoint of
    ``cluster`` has in all (``largest_mib``, MiB): reason "too-large", no ``Retry-After`` (retrying
    the same request cannot help)."""
    message = (f"cluster '{cluster}' has no endpoint with {need_mib:.0f} MiB of GPU memory for this request "
               f"(the largest has {largest_mib:.0f} MiB in all)")
    return _reject(503, "too-large", message)


def too_deep(limit: int) -> Decision:
    """The 400 for a JSON body nested deeper than ``limit`` levels (reason "body-too-deep")."""
    message = f"the request body is JSON nested deeper than {limit} levels, the most this gateway reads"
    return _reject(400, "body-too-deep", message)


def body_too_large(routing: RoutingTable) -> Decision:
    """The 413 for a body above ``routing.body_max_bytes`` (not read) whose ``model`` would choose the
    request's version (no version header; a service that lists model names or has more than one
    version or mix): routed by its headers alone it would go to the default version, whatever model
    it names (reason "request-body-too-large"). Its body is the message alone: Envoy's local reply
    mapper for 413 (:mod:`xds_server.resources.local_reply`, which matches the status, as Envoy's own
    413 carries no response flag) wraps it in the OpenAI error object, code ``request_body_too_large``,
    as Envoy's own 413 for a body above its buffer limit; an error object here would be wrapped again,
    as the mapper's message."""
    message = (f"the request body is above the {routing.body_max_bytes} bytes this gateway reads "
               f"(picker.body_max_bytes), so its 'model' cannot choose the model version; name the version "
               f"in the '{routing.version_header}' header, or send a smaller body")
    return Decision(None, None, 413, message.encode(), "request-body-too-large")


def _quote(raw: bytes) -> str:
    """A client value made safe to quote in a message: decoded leniently and shortened."""
    text = raw[:_MAX_QUOTED].decode("utf-8", errors="backslashreplace")
    return text + "..." if len(raw) > _MAX_QUOTED else text


@lru_cache(maxsize=1024)
def _authority_host(authority: bytes) -> str:
    """Lower-case host of an authority (``host``, ``host:port``, ``[v6]:port``), "" if unusable.
    Pure, so its answers are kept (a request's own authority is one of a few: 0.1 µs against 1 µs)."""
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
    known = ", ".join(sorted([*service.clusters, *service.mixes]))
    if service.models:
        models = ", ".join(sorted(m.decode() for m in service.models))
        known += f" (model names for {service.default_version}: {models})"
    return known


_BODY_MODEL = "body field 'model'"


def _names_version(service: ServiceRoute, model: bytes) -> bool:
    """Whether a body's ``model`` names a version, mix or version without endpoints of ``service``."""
    try:
        name = model.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return name in service.clusters or name in service.mixes or name in service.unavailable


def served_names(service: ServiceRoute) -> list[str]:
    """What a client may send as ``model`` and be served: the service's model names (while its default
    version has endpoints), then its versions with endpoints, then its mixes, each group sorted. The
    control plane's ``GET /v1/models`` lists the same names (``xds_server.resources.routes``)."""
    models = [] if service.default_version in service.unavailable else sorted(m.decode() for m in service.models)
    return [*models, *sorted(service.clusters), *sorted(service.mixes)]


def model_not_found(model: bytes, service: ServiceRoute) -> Decision:
    """The 404 for a body ``model`` that is none of the names ``service`` serves (it lists ``models``):
    an OpenAI error object, code ``model_not_found`` and param ``model`` as OpenAI's API answers an
    unknown model (vLLM's server: 404 ``NotFoundError``), naming the served names (reason
    "model-not-found")."""
    message = (f"The model '{_quote(model)}' does not exist here; served models: "
               f"{', '.join(served_names(service))}")
    return Decision(None, None, 404, error_body(404, "model-not-found", message, param="model"), "model-not-found")


def _bad_version(where: str, param: str, raw: bytes, service: ServiceRoute) -> Decision:
    """The 400 for a version value that is not a valid version string at all."""
    if len(raw) > MAX_VERSION_BYTES:
        problem = f"is too long ({len(raw)} bytes, limit {MAX_VERSION_BYTES})"
    else:
        problem = f"is not valid UTF-8 ('{_quote(raw)}', its invalid bytes as \\x escapes)"
    return _reject(400, "invalid-version", f"model version in {where} {problem}; known versions: {_known(service)}",
                   param)


def session_cookie(cookie: bytes | None, name: bytes) -> bytes | None:
    """The value of cookie ``name`` in a ``cookie`` header value (``a=1; b=2``), or None."""
    if not cookie:
        return None
    for part in cookie.split(b";"):
        key, sep, value = part.strip().partition(b"=")
        if sep and key == name:
            return value or None
    return None


def header_session_key(headers: Mapping[str, bytes], routing: RoutingTable) -> bytes | None:
    """The session key the headers give: the first non-empty of ``routing.session_headers``, else
    the ``routing.session_cookie`` cookie (when configured); None when neither (then the body's
    ``user``, else its ``prompt_cache_key``, is the key: :func:`pick`)."""
    for name in routing.session_headers:
        key = headers.get(name)
        if key:
            return key
    if routing.session_cookie is not None:
        return session_cookie(headers.get("cookie"), routing.session_cookie.encode())
    return None


def declared_mib(raw: bytes | None) -> float | None:
    """A memory header's value: MiB in [0, 1e9), or None when absent, empty or not such a number."""
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0.0 <= value < 1e9 else None


def request_need(headers: Mapping[str, bytes], routing: RoutingTable, body: BodyFields
                 ) -> tuple[float, float | None, float | None, bool]:
    """A request's GPU memory need and tokens: ``(MiB, prompt tokens or None, output tokens or None,
    declared)``.

    In order: the ``request_memory_header`` (MiB, when configured and a number >= 0; ``declared``
    True: the client states its reservation, so memory admission adds no margin to it); the
    body's prompt length and ``max_tokens`` (``default_max_tokens`` when absent) x
    ``kv_mib_per_token``; the class named by ``request_class_header`` (``request_classes``); else
    ``default_request_mib`` (these are estimates: admission adds ``memory_margin``). Tokens come
    from the body, else the class. Never raises.
    """
    prompt = output = None
    if body.prompt_tokens is not None:
        prompt = body.prompt_tokens
        output = float(body.max_tokens if body.max_tokens is not None else routing.default_max_tokens)
    cls = routing.request_classes.get(headers.get(routing.request_class_header, b"")) \
        if routing.request_classes else None
    if cls is not None and prompt is None:
        prompt, output = cls.prompt_tokens, cls.output_tokens
    if routing.request_memory_header is not None:
        value = declared_mib(headers.get(routing.request_memory_header))
        if value is not None:
            return value, prompt, output, True
    if body.prompt_tokens is not None:
        mib = (prompt + output) * routing.kv_mib_per_token  # type: ignore[operator]
    elif cls is not None:
        mib = cls.memory_mib
    else:
        mib = routing.default_request_mib
    return mib, prompt, output, False


def size_header_problem(headers: Mapping[str, bytes], routing: RoutingTable) -> tuple[str, str] | None:
    """``(kind, message)`` when a size header the request sent cannot be used, else None (pure): a
    ``request_class_header`` naming none of the ``request_classes`` (when classes are configured), or a
    ``request_memory_header`` that is not a number of MiB in [0, 1e9). :func:`request_need` then
    goes on without it, as it always did; the handler counts and logs the problem
    (``inferlb_ext_proc_errors_total{kind}``), so a client's misspelt class is not ignored
    silently."""
    if routing.request_classes:
        name = headers.get(routing.request_class_header)
        if name and name not in routing.request_classes:
            known = ", ".join(sorted(k.decode("utf-8", "replace") for k in routing.request_classes))
            return ("request-class-unknown", f"unknown request class '{_quote(name)}' in header "
                    f"'{routing.request_class_header}' (sized by the body or the default); known: {known}")
    if routing.request_memory_header is not None:
        raw = headers.get(routing.request_memory_header)
        if raw and declared_mib(raw) is None:
            return ("request-memory-invalid", f"header '{routing.request_memory_header}' must be MiB >= 0, "
                        f"got '{_quote(raw)}' (sized by the body, the class or the default)")
    return None


class _Live(Protocol):
    work: Mapping[str, float]
    cluster_work: Mapping[str, float]
    free: Mapping[str, float]
    failed: Mapping[str, float]


class _Costs(Protocol):
    def relative_work(self, gpu_class: str | None, prompt_tokens: float | None,
                      output_tokens: float | None, /) -> float: ...


_NO_LOADS: Mapping[str, float] = {}
_new = tuple.__new__  # a named tuple without its Python-level __new__ (~0.1 µs a request)


def pick(
    headers: Mapping[str, bytes],
    view: EndpointView,
    loads: _Live | Mapping[str, float] | None = None,
    pins: _Pins | None = None,
    body: BodyFields = NO_BODY,
    costs: _Costs | None = None,
    prefixes: PrefixIndex | None = None,
) -> Decision:
    """Decide the cluster and the pinned endpoint of one request.

    Args:
        headers: request headers, lower-case names -> raw value bytes (as Envoy's ext_proc
            sends them in ``raw_value``); pseudo-headers such as ``:authority`` included.
        view: the current endpoint view.
        loads: the live load: an :class:`~ext_proc.inflight.InFlight` (work in flight, estimated
            free memory, failing endpoints), or a plain ``{endpoint: load}`` mapping, or None (no
            load yet).
        pins: the session table (read only: ``pins.get(slot)`` -> endpoint or None).
        body: fields of the JSON body, when body routing read it.
        prefixes: the picker's prefix-cache index (None: none): a request without a pin whose
            body gave its prompt blocks is placed by its cached share and load
            (:func:`ext_proc.prefix_choice.choose_cached`).
        costs: the request cost model (None: every request weighs 1); plugins read it too (the
            ``affinity-slack`` filter's learned slack).

    Returns:
        A :class:`Decision`. Rejections: 404 when no service takes the authority's host,
        400 when the version header names an unknown version, or the version (header, else the
        body's ``model``) is not a valid version string (not UTF-8, longer than
        :data:`MAX_VERSION_BYTES`); 404 ``model_not_found`` (:func:`model_not_found`) when the body's
        ``model`` is none of the names a service that lists ``models`` serves. Neither present, a
        model name of the service (``ServiceRoute.models``), or, for a service that lists no
        ``models``, a body ``model`` that names no version (the service cannot tell a served name
        from another), means the service's default version. A version may be a mix (canary
        split): its share buckets are chosen by the session key's hash, so a session never
        flips versions while the split stays (requests without a session use the hash of
        ``x-request-id``). The session key is the first non-empty session header, else the
        session cookie (when configured), else the body's ``user``, else its
        ``prompt_cache_key``; without one, the body's prefix key gives the ring position. In a
        cluster of ``routing.per_request`` (servers that keep no KV cache between requests) a
        ``soft`` service's request has no key (no session pin, no prefix): the profile places it
        by load, as a request without one (the version mix still follows the session). A session
        of a service whose ``affinity`` is ``strict`` goes to its pinned endpoint while that is
        pinnable and the profile's hard filters keep it, whatever its load and in either tier, or
        waits for it (:func:`ext_proc.scheduling.affinity.strict_choice`). Every other
        request with a healthy endpoint is pinned, by the service's scheduling profile
        (:meth:`ext_proc.scheduling.Profile.choose`; the default: affinity, weighted bounded loads,
        memory admission, which a cluster of ``routing.preallocated`` never needs: its requests'
        need is 0; endpoints whose connections fail skipped, unless every endpoint with memory for
        the request fails: then it decides again as if none had failed) among the endpoints of one
        tier (:func:`ext_proc.tiers.tier_for`: the edge, or the cloud above the edge's
        ``spill_threshold`` or when no edge endpoint has the memory); reason "no-memory" (endpoint None)
        when no endpoint can hold it. Without a healthy endpoint nothing is pinned. Before the
        first real view, nothing is decided (reason "not-ready") so Envoy's own routing applies.

    Never raises for any header or body content.
    """
    if not view.ready:
        return _NOT_READY
    routing = view.routing
    authority = headers.get(":authority") or headers.get("host") or b""
    host = _authority_host(authority)
    service = view.service_for_host(host)
    if service is None:
        return _reject(404, "unknown-service", f"no service for host '{_quote(authority)}'", ":authority")

    key = header_session_key(headers, routing) or body.user or body.prompt_cache_key
    position = session_hash(key) if key else None

    raw = headers.get(routing.version_header)
    if not raw and body.too_large and (service.models or len(service.clusters) + len(service.mixes)
                                       + len(service.unavailable) > 1):
        return body_too_large(routing)
    where, param = f"header '{routing.version_header}'", routing.version_header
    if not raw and body.model is not None and (service.models or _names_version(service, body.model)):
        if not body.model:  # ``"model": ""`` names none of the served names (vLLM's server: 404 too)
            return model_not_found(body.model, service)
        raw, where, param = body.model, _BODY_MODEL, "model"
    if not raw or raw in service.models:
        version, param = service.default_version, None   # the request named no version
    else:
        if len(raw) > MAX_VERSION_BYTES:
            return _bad_version(where, param, raw, service)
        try:
            version = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _bad_version(where, param, raw, service)
    cluster = service.clusters.get(version)
    if cluster is None:
        if version in service.unavailable:
            return _reject(503, "version-unavailable",
                           f"model version '{version}' of service '{service.name}' has no endpoints now", param)
        mix = service.mixes.get(version)
        if mix is None:
            if where is _BODY_MODEL:
                return model_not_found(raw, service)
            return _reject(
                400,
                "unknown-version",
                f"unknown model version '{_quote(raw)}' in {where}; known versions: {_known(service)}",
                param,
            )
        bucket = (position if position is not None else key_hash(headers.get("x-request-id", b""))) % MIX_BUCKETS
        cluster = next(c for upto, c in mix if bucket < upto)

    pool = view.clusters.get(cluster)
    if pool is None or not pool.endpoints:
        return Decision(cluster, None, None, b"", "no-healthy-endpoint")
    if body is NO_BODY and not routing.sized:  # nothing tells the size: the default (the common case)
        mib, prompt, output, declared = routing.default_request_mib, None, None, False
    else:
        mib, prompt, output, declared = request_need(headers, routing, body)
    if cluster in routing.preallocated:  # a KV-cache pool taken at start: no GPU memory of its own
        mib = 0.0
    work = 1.0 if costs is None or prompt is None else costs.relative_work(pool.main_class, prompt, output)
    slot = pinned = None
    kind = "none"
    # A per-request server keeps no KV cache for a soft key to find: placed by load (RoutingTable.per_request).
    keyed = service.affinity == STRICT or cluster not in routing.per_request
    blocks = body.blocks if keyed else ()
    if not keyed:
        position = None
    if position is not None:
        kind = "session"
        slot = session_slot(position, pool.salt)  # both tiers share the cluster's name, so its salt
        if pins is not None:
            pinned = pins.get(slot)
    strict = pinned is not None and service.affinity == STRICT
    live = getattr(loads, "cluster_work", None)
    if live is not None:
        work_of, free, failed = loads.work, loads.free, loads.failed  # type: ignore[union-attr]
    elif loads is None:
        work_of, free, failed = _NO_LOADS, None, _NO_LOADS
    else:  # a plain {endpoint: load} mapping
        work_of, free, failed = loads, None, _NO_LOADS  # type: ignore[assignment]
    tiers = pool.spill is not None
    if pool.spill is not None:  # two tiers: the edge's or the cloud's endpoints, and that tier's load
        if strict and pinned in pool.spill.members:
            pool = pool.spill  # a strict session stays in its pin's tier
        elif loads is not None and not (strict and pinned in pool.members):
            pool = tier_for(pool, loads.endpoints if live is not None else loads,  # type: ignore[union-attr]
                            routing.spill_threshold)
    if live is not None and not tiers:
        total = live.get(cluster, 0.0)
    else:
        total = float(sum(work_of.get(e, 0.0) for e in pool.endpoints)) if loads is not None else 0.0
    if keyed and position is None and (body.prefix is not None or blocks):
        kind = "prefix"
        position = body.prefix
    rid = b""
    if position is None:  # the picker's draws (ties, two choices) hash it: ext_proc.scheduling.spin
        rid = headers.get("x-request-id") or b""
    margin = 0.0 if declared else routing.memory_margin  # a need the client declared is taken as it is
    need = mib * (1.0 + margin)
    if not free or need <= 0:
        free = None
    profile = routing.profiles[service.profile]
    followed = kind == "prefix" and body.continued is not None
    request = _new(Request, (cluster, pool, position, kind, pinned, rid, work, need, work_of, total, free, failed,
                             prompt, costs, blocks, prefixes, body.continued if followed else None))
    # strict: the pin, or a wait for it (None: the pin is unusable, the profile moves the session)
    choice = strict_choice(request, profile) if strict else None
    if choice is None:
        choice = profile.choose(request)
        if choice.endpoint is None and pool.spill is not None:  # no edge endpoint has the memory: the cloud tier
            pool = pool.spill
            request = request._replace(pool=pool, total=float(sum(work_of.get(e, 0.0) for e in pool.endpoints)))
            choice = profile.choose(request)
        if choice.endpoint is None and failed:  # every endpoint with memory for it fails: not a reason to refuse
            request = request._replace(failed=_NO_LOADS)
            choice = (strict and strict_choice(request, profile)) or profile.choose(request)
    endpoint, reason, plugins = choice
    return Decision(cluster, endpoint, None, b"", reason, slot, None, pinned, kind, work, mib, prompt, output,
                    pool.classes.get(endpoint, "") if endpoint is not None else "", margin, plugins, blocks,
                    position if followed else None)
