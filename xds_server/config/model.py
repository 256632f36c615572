"""The config model: every section as a frozen pydantic model, validated with errors that name the field.

Every error names the field (a dotted path such as ``services[0].versions[1].endpoints[2].address``)
and, when the config came from a file, the line of that field, so an operator can find it at once.
A bad config is refused at startup; nothing is half-applied.
"""

from __future__ import annotations

import ipaddress
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from xds_server.engine.settings import parse_scorers, parse_switchable
from xds_server.metrics.presets import GPU_MEMORY, PREALLOCATED, SAMPLE_TIME
from xds_server.metrics.stats import SIGNAL_FIELDS

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
#: The longest version, mix or model name (bytes): the picker reads no longer version header or body
#: ``model`` (``ext_proc.picker.MAX_VERSION_BYTES``), so a longer name could never be chosen.
MAX_NAME_BYTES = 256
# no '-': the cluster name "<service>-<version>" stays unique
VERSION_RE = rf"^[A-Za-z0-9][A-Za-z0-9_.]{{0,{MAX_NAME_BYTES - 1}}}$"
HEADER_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")

#: Per GPU class: relative capacity (throughput vs an A100) and GPU memory (MiB). Operators may override.
#: Capacity: requests/s a saturated vLLM engine serving Llama-3.1-8B completes on the class over an
#: A100's, for requests of 1 024 prompt + 128 output tokens (the defaults of vLLM's serving benchmark),
#: from the simulator's engine physics (``sim.engines.hardware.relative_capacity``: BLIS's step-time
#: fits, the batch the KV cache and ``max_num_seqs`` allow), rounded to 2 decimals; docs/engine.md.
DEFAULT_GPU_CLASSES: dict[str, dict[str, float]] = {
    "a100": {"capacity": 1.0, "memory_mib": 81920},
    "h100": {"capacity": 2.92, "memory_mib": 81920},
    "a10": {"capacity": 0.19, "memory_mib": 24576},
    "l4": {"capacity": 0.12, "memory_mib": 24576},
}


class FieldProblem(ValueError):
    """A cross-field check's finding about the field at ``loc`` (a path like pydantic's)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


#: Upper bounds that catch a typo (an extra zero run) rather than any real node: concurrent requests
#: per endpoint (vLLM's max_num_seqs defaults to 256), and GPU memory per endpoint (16 TiB).
MAX_CONCURRENCY = 1_000_000
MAX_GPU_MEMORY_MIB = 16 * 1024 * 1024


def _scalar_types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (``float | None`` -> {float, NoneType})."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _scalar_types(args[0])
    return {t for a in args for t in _scalar_types(a)} if args else {annotation}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number_mixup(cls, value: Any, info: ValidationInfo) -> Any:
        """A number field refuses ``true``/``false`` and a yes/no field refuses text and numbers (pydantic's
        lax mode would read ``true`` as 1, and ``"yes"`` or ``0`` as a switch: a typo would pass as a setting)."""
        if isinstance(value, bool) and (cls, info.field_name) in _NUMBER_FIELDS:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if isinstance(value, str | int | float) and not isinstance(value, bool) and (
                cls, info.field_name) in _SWITCH_FIELDS:
            raise ValueError(f"expected true or false, got {value!r}")
        return value

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Note which fields are numbers and which yes/no switches, once per class (working it out per
        value from the annotation took ~0.8 s of validating a 60 000-endpoint config)."""
        super().__pydantic_init_subclass__(**kwargs)
        for name, info in cls.model_fields.items():
            types = _scalar_types(info.annotation)
            if bool not in types and types & {int, float}:
                _NUMBER_FIELDS.add((cls, name))
            elif types and types <= {bool, type(None)}:
                _SWITCH_FIELDS.add((cls, name))


#: ``(model class, field)`` of the number fields and of the yes/no fields (see ``_Strict``).
_NUMBER_FIELDS: set[tuple[type, str]] = set()
_SWITCH_FIELDS: set[tuple[type, str]] = set()


def check_hostport(value: str, ip_only: bool = False) -> str:
    """``value`` when it is ``HOST:PORT`` with a port 0-65535 (``ip_only``: an IP address, IPv6 in
    brackets), else ``ValueError`` saying what was expected."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port 0-65535, got {value!r}")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError as err:
        if ip_only or not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            what = "an IP address (EDS endpoints are not resolved)" if ip_only else "a host name or IP"
            raise ValueError(f"expected {what} in {value!r}") from err
    return value


def normalize_endpoint_address(value: str) -> str:
    """An endpoint's ``IP:PORT`` in one canonical spelling: the port without leading zeros, an IPv6
    address compressed, lower case and in brackets (``[fd00::1]:8000``). Two spellings of one socket
    address (``127.0.0.1:08701`` and ``127.0.0.1:8701``, ``[FD00:0::1]:80`` and ``[fd00::1]:80``) are
    one endpoint for Envoy, which merges them; inferlb must not keep two.

    >>> normalize_endpoint_address("127.0.0.1:08701"), normalize_endpoint_address("[FD00:0:0::1]:080")
    ('127.0.0.1:8701', '[fd00::1]:80')

    Raises:
        ValueError: not ``IP:PORT`` (see :func:`check_hostport`); an IPv6 address without brackets
            (``fd00::1:8000`` is ambiguous); IPv4 octets with leading zeros
            (``010.0.0.1``) are refused by :mod:`ipaddress` (ambiguous: octal or decimal).
    """
    check_hostport(value, ip_only=True)
    host, _, port = value.rpartition(":")
    ip = ipaddress.ip_address(host.strip("[]"))
    if ip.version == 6 and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"an IPv6 address needs brackets, e.g. [{ip.compressed}]:{int(port)}; got {value!r}")
    if int(port) == 0 or ip.is_unspecified:  # Envoy would take it as a host and fail every connection to it
        raise ValueError(f"an endpoint needs a port above 0 and an address other than {ip.compressed} (which "
                         f"names no host to connect to); got {value!r}")
    return f"[{ip.compressed}]:{int(port)}" if ip.version == 6 else f"{ip.compressed}:{int(port)}"


def host_key(host: str) -> str:
    """A service host as ``:authority`` is matched against it: without spaces and a trailing dot, lower
    case (the picker's :class:`ext_proc.view.ServiceRoute` reads ``hosts`` so; "" is no host name)."""
    return host.strip().lower().rstrip(".")


#: A service host (after :func:`host_key`): a DNS name or IPv4 address, or an IPv6 address in brackets.
_HOST_RE = re.compile(r"[a-z0-9_]([a-z0-9_.-]*)|\[[0-9a-f:.]+\]")

#: Hosts that bind every address of the machine.
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _socket_address(value: str) -> tuple[str, int]:
    """A valid ``HOST:PORT`` as ``(host, port)`` for comparison: an IP address in its canonical
    spelling (``::`` for ``[0:0::0]``), a host name in lower case."""
    host, port = split_hostport(value)
    try:
        return ipaddress.ip_address(host).compressed, port
    except ValueError:
        return host.lower(), port


def _canonical(value: str) -> str:
    """A valid ``HOST:PORT`` spelled as :func:`normalize_endpoint_address` spells an IP address."""
    host, port = _socket_address(value)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _clash(a: str, b: str, wildcard: bool) -> bool:
    """Whether listeners on ``a`` and ``b`` (valid ``HOST:PORT``) would collide: the same port, not 0,
    on the same host or, with ``wildcard``, a wildcard host on either side (on one machine)."""
    (host_a, port_a), (host_b, port_b) = _socket_address(a), _socket_address(b)
    return port_a == port_b != 0 and (host_a == host_b or wildcard and bool({host_a, host_b} & _WILDCARDS))


def _dotted(loc: tuple[str | int, ...]) -> str:
    """A config location as a dotted field name (``listen.xds``)."""
    return ".".join(map(str, loc))


def split_hostport(value: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; IPv6 brackets removed."""
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class Listen(_Strict):
    """Addresses our servers bind, each ``HOST:PORT`` (port 0 = any free port)."""

    xds: str = "127.0.0.1:18000"
    ext_proc: str = "127.0.0.1:18080"
    admin: str = "127.0.0.1:18090"
    #: ADS streams served at once; more are refused with RESOURCE_EXHAUSTED (bounded memory).
    max_xds_streams: int = Field(1024, ge=1, le=1_000_000)

    _hp = field_validator("xds", "ext_proc", "admin")(check_hostport)


class OutlierDetection(_Strict):
    """Envoy's outlier detection on every inference cluster (passive health checking, case C13).

    ``consecutive_5xx`` / ``consecutive_gateway_failure``: errors in a row that eject a host (a
    per-try timeout counts as a gateway failure); ``interval_s``: how often Envoy sweeps (s);
    ``base_ejection_time_s``: first ejection length (s; Envoy multiplies it by the ejection count,
    up to ``max_ejection_time_s``);
    ``max_ejection_percent``: most of a cluster ejected at once (Envoy always allows one host);
    ``enforcing_consecutive_5xx``: the chance (%, 0-100) that ``consecutive_5xx`` ejects a host it
    flags; null (default) = 0 on a cluster with one tier, 100 on one with a cloud tier. Envoy's
    default is 100. A 5xx the backend answers (a GPU out of memory: 500) is its answer about one
    request, not a host that is gone, and ejecting for it takes capacity out exactly when memory is
    short. Gateway failures (502/503/504, resets, connect failures, per-try timeouts) still eject;
    an endpoint that keeps failing requests is the engine's to exclude (``oom`` filter, ``errors``
    scorer). With tiers, though, Envoy moves its fallback traffic from the edge's priority to the
    cloud's only as edge hosts turn unhealthy, so there an edge GPU out of memory is ejected and its
    requests spill (what the picker does per request when it is up). Measured: BENCHMARKS.md,
    "uneven: the picker's queue, and Envoy's ejections on a backend's 500".
    Source: Envoy docs, "Outlier detection" (config.cluster.v3.OutlierDetection).
    """

    consecutive_5xx: int = Field(5, ge=1)
    enforcing_consecutive_5xx: int | None = Field(None, ge=0, le=100)
    consecutive_gateway_failure: int = Field(3, ge=1)
    interval_s: float = Field(2.0, gt=0)
    base_ejection_time_s: float = Field(10.0, gt=0)
    max_ejection_time_s: float = Field(300.0, gt=0)
    max_ejection_percent: int = Field(50, ge=0, le=100)


#: Envoy's own default for each circuit-breaker threshold (config.cluster.v3.CircuitBreakers).
ENVOY_DEFAULT_CIRCUIT_LIMIT = 1024
UINT32_MAX = 2**32 - 1


class CircuitBreakers(_Strict):
    """Envoy circuit-breaker thresholds of every inference cluster (per cluster, all Envoy workers
    together; Envoy docs, "Circuit breaking", config.cluster.v3.CircuitBreakers.Thresholds).

    Envoy's default for each is 1024: left unset, a cluster with more requests in flight than that
    answers 503 (``upstream_rq_pending_overflow``) although no one chose that limit. inferlb sets
    them high by default; load shedding is the picker's job (``picker.admission``: queue or 429).
    ``max_connections``: upstream connections (HTTP/1.1: one per request in flight);
    ``max_pending_requests``: requests waiting for a connection; ``max_requests``: requests in flight.
    The retry limit is the retry budget (``envoy.retry_budget_percent``).
    """

    max_connections: int = Field(100_000, ge=1, le=UINT32_MAX)
    max_pending_requests: int = Field(100_000, ge=1, le=UINT32_MAX)
    max_requests: int = Field(100_000, ge=1, le=UINT32_MAX)


class EnvoyTls(_Strict):
    """How Envoy dials inferlb's TLS gRPC servers (paths as Envoy's host sees them).

    ``ca``: CA bundle that signed inferlb's server certificate; ``cert``/``key``: Envoy's client
    certificate for mTLS (both or neither); ``server_name``: SNI sent and the subject alt name the
    server certificate must carry (default: none checked beyond the CA).
    """

    ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> EnvoyTls:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together (Envoy's client certificate for mTLS)")
        return self


class TlsConfig(_Strict):
    """TLS on inferlb's gRPC servers (xDS and ext_proc). PEM file paths on inferlb's host.

    ``require_client_cert``: mTLS; clients must present a certificate signed by ``ca``.
    """

    cert: str
    key: str
    ca: str | None = None
    require_client_cert: bool = False

    @model_validator(mode="after")
    def _ca(self) -> TlsConfig:
        if self.require_client_cert and not self.ca:
            raise ValueError("require_client_cert needs ca (the CA that signs client certificates)")
        return self


#: The shortest admin token accepted (``admin.token``, and ``INFERLB_ADMIN_TOKEN`` at ``inferlb serve``).
TOKEN_MIN_LENGTH = 16


class AdminConfig(_Strict):
    """Admin API access. ``token``: bearer token for write operations (drain, reload); the env var
    ``INFERLB_ADMIN_TOKEN`` is used when unset. Without a token, write operations are allowed only
    when the admin API binds a loopback address.
    """

    token: str | None = Field(None, min_length=TOKEN_MIN_LENGTH, repr=False)


class EnvoySide(_Strict):
    """What the control plane configures inside Envoy (sent over LDS/RDS/CDS).

    ``listener``: the address Envoy's inference listener binds (``HOST:PORT``).
    ``ext_proc_timeout_s``: how long Envoy waits for the picker per request before failing open (s).
    ``failure_mode_allow``: true = a dead or slow picker degrades to weighted load balancing; false = 5xx.
    ``route_timeout_s``: upstream request timeout (s).
    ``ext_proc_address``: where Envoy dials the picker (``HOST:PORT``); default: ``listen.ext_proc``
    with a wildcard host read as 127.0.0.1. Set it when Envoy runs on another host.
    ``picker``: true = the listener asks the ext_proc picker (version routing, session pinning);
    false = no ext_proc filter: routes match the version header and every request goes to the
    weighted fallback policy (EDS weights only).
    """

    listener: str = "127.0.0.1:10000"
    ext_proc_address: str | None = None
    ext_proc_timeout_s: float = Field(0.25, gt=0, le=60)
    failure_mode_allow: bool = True
    route_timeout_s: float = Field(120.0, gt=0)
    picker: bool = True
    #: Per-attempt upstream timeout (s): a backend that accepts and never answers times out (C13).
    per_try_timeout_s: float = Field(60.0, gt=0)
    #: Retries on connect failure, reset, 5xx or per-try timeout, each on another host.
    retries: int = Field(2, ge=0, le=10)
    #: Concurrent retries allowed per cluster, as % of its active requests, but at least
    #: ``min_retry_concurrency`` (Envoy's retry budget; its default of 3 concurrent retries turns a
    #: crashed backend under load into 503s: "upstream_rq_retry_overflow").
    retry_budget_percent: float = Field(25.0, gt=0, le=100)
    min_retry_concurrency: int = Field(16, ge=1)
    outlier_detection: OutlierDetection = OutlierDetection()
    tls: EnvoyTls | None = None
    #: Thresholds of every inference cluster (see :class:`CircuitBreakers`).
    circuit_breakers: CircuitBreakers = CircuitBreakers()
    #: Thresholds of the picker's cluster (``inferlb_ext_proc``): each request through the listener
    #: holds one ext_proc stream while it runs, so None (default) = each threshold is the sum of
    #: ``circuit_breakers.max_requests + max_pending_requests`` over the inference clusters
    #: (capped at uint32); an overflow there makes Envoy skip the picker (fail open: the pin is lost).
    picker_circuit_breakers: CircuitBreakers | None = None

    @field_validator("listener", "ext_proc_address")
    @classmethod
    def _hp(cls, v: str | None) -> str | None:
        return None if v is None else check_hostport(v)


class Loop(_Strict):
    """The slow loop's timing, for every metrics source.

    ``interval_s``: how often the control plane reads its metrics sources and recomputes weights (s).
    ``timeout_s``: per-query timeout (s); a round waits at most 3x this for its sources, then counts
    as failed (the last good weights stay). It may exceed ``interval_s``: rounds never overlap (each
    starts when the one before has ended), and a round that runs past ``interval_s`` is followed by the
    next at once, so while a source is slow rounds come as often as they end (Prometheus: within about
    ``timeout_s`` + 0.5 s), back every ``interval_s`` once it answers quickly.
    ``first_round_wait_s``: the first snapshot waits this long (s) for a successful metrics round;
    then it goes out with neutral weights (flagged), so a dead source can't keep Envoy unconfigured.
    """

    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    first_round_wait_s: float = Field(10.0, ge=0)


#: ``prometheus.<field>`` spellings of :class:`Loop` fields, still read (with a deprecation line).
LOOP_ALIASES = ("interval_s", "timeout_s", "first_round_wait_s")


class PrometheusSource(_Strict):
    """Where the sliding-window statistics come from.

    ``window_s``: PromQL range for rates and averages (s); must cover >= 2 scrape intervals.
    ``scrape_interval_s``: how often Prometheus scrapes the endpoints (s); None (default) = learned
    from Prometheus's ``/api/v1/targets`` at run time. Either way ``engine.stale_after_s`` must be
    at least :data:`STALE_INTERVALS` of it (checked at load when given, applied at run time when learned).
    The query interval and timeout are in :class:`Loop` (``prometheus.interval_s``,
    ``prometheus.timeout_s`` and ``prometheus.first_round_wait_s`` are read as deprecated aliases).
    """

    url: str = "http://127.0.0.1:9090"
    window_s: float = Field(60.0, gt=0)
    scrape_interval_s: float | None = Field(None, gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"expected an http(s) URL, got {v!r}")
        return v.rstrip("/")


class Headers(_Strict):
    """Request header names (lower-case). Routing headers are stripped from clients by Envoy."""

    version: str = "model-version"
    session: tuple[str, ...] = ("x-session-id", "x-user-id")
    override_host: str = "x-gateway-destination-endpoint"
    cluster: str = "x-inferlb-cluster"

    @field_validator("version", "override_host", "cluster")
    @classmethod
    def _one(cls, v: str) -> str:
        if not HEADER_RE.match(v):
            raise ValueError(f"not a lower-case HTTP header name: {v!r}")
        return v

    @field_validator("session")
    @classmethod
    def _many(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            cls._one(name)
        return v

    @model_validator(mode="after")
    def _distinct(self) -> Headers:
        """Each header has one role: the version header read as a session key, or the picker's
        override-host header taken as a version, would route by the wrong value."""
        roles: dict[str, str] = {}
        for role, name in (("version", self.version), ("override_host", self.override_host),
                           ("cluster", self.cluster), *(("session", n) for n in self.session)):
            if name in roles:
                raise ValueError(f"{role}: {name!r} is already headers.{roles[name]}; each header has one role")
            roles[name] = role
        return self


class Engine(_Strict):
    """Weight-engine parameters (see ``xds_server/engine`` and the README's weight-engine section).

    ``stale_after_s``: metrics older than this exclude an endpoint (never all of a cluster).
    ``request_memory_mib``: GPU memory a typical request needs on a per-request server (``VersionConfig.gpu_memory``;
    0 on a preallocated KV-cache pool); ``memory_margin``: safety share on top (0–1).
    ``max_weight``: the weight of a perfect endpoint on an A100-class GPU; EDS weights are 1..max_weight x capacity.
    ``hysteresis``: relative weight change (0–1) below which the previous weight is kept.
    ``quantum``: weights snap to multiples of ``quantum x max_weight`` (at least 1).
    ``max_change``: per round a weight grows at most x(1 + max_change) or shrinks at most /(1 + max_change);
    null = unbounded. ``drain_timeout_s``: a draining endpoint is removed at the latest after this long.
    ``filters`` / ``factors``: ``{plugin: {params}}``, ``{plugin: false}`` turns one off.
    ``scorers``: ``{plugin: weight}`` or ``{plugin: {weight: W, <params>}}``; weight 0 turns one off.
    ``health_rounds``: a filter's exclusion needs this many flagged rounds in a row, a return as many passed.
    """

    stale_after_s: float = Field(15.0, gt=0)
    request_memory_mib: float = Field(2048.0, ge=0)
    memory_margin: float = Field(0.2, ge=0, le=10)
    max_weight: int = Field(100, ge=1, le=1_000_000)
    hysteresis: float = Field(0.1, ge=0, lt=1)
    quantum: float = Field(0.01, ge=0, le=1)
    max_change: float | None = Field(1.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0)
    health_rounds: int = Field(2, ge=1, le=100)
    filters: dict[str, Any] = Field(default_factory=dict)
    scorers: dict[str, Any] = Field(default_factory=dict)
    factors: dict[str, Any] = Field(default_factory=dict)

    @field_validator("filters", "factors", mode="before")
    @classmethod
    def _switchable(cls, v: Any, info: ValidationInfo) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise ValueError(f"expected a mapping of plugin names, got {type(v).__name__}")
        return parse_switchable(info.field_name, v)

    @field_validator("scorers", mode="before")
    @classmethod
    def _scorers(cls, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise ValueError(f"expected a mapping of scorer names, got {type(v).__name__}")
        return parse_scorers(v)


class ScrapeSettings(_Strict):
    """The ``scrape`` source: the control plane GETs ``http://<address><path>`` of every endpoint itself.

    ``interval_s``: time between scrapes (s); ``timeout_s``: per scrape (s).
    """

    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    path: str = Field("/metrics", pattern=r"^/")


class PushSettings(_Strict):
    """The ``push`` source: nodes stream ``inferlb.v1.NodeStatus`` to this gRPC address (``HOST:PORT``)."""

    listen: str = "127.0.0.1:18070"

    _hp = field_validator("listen")(check_hostport)


class MetricsSettings(_Strict):
    """Where the engine's inputs come from and which metric names they are read from.

    ``sources``: any of ``prometheus``, ``scrape``, ``push``, ``status`` (the status snapshots nodes
    write to etcd; needs ``discovery.etcd``); per endpoint and input the freshest
    answer wins (stale answers are dropped). ``fallback``: ``scrape`` = when a pull source fails, the
    scrape source answers in its place; ``none`` = the round fails and the last good weights stay (C05).
    ``preset`` / ``gpu``: metric-name presets (engine: vllm | sglang | triton | tgi; GPU: dcgm | triton | none).
    ``gpu_join``: join GPU series to endpoints by ``instance`` or by ``pod`` (the ``namespace`` and ``pod``
    labels; every endpoint then names its ``pod`` and ``namespace``).
    ``queries``: ``{input: PromQL}`` replacing a preset query for the Prometheus source (``{w}`` = the
    window; values in engine units; one series per ``instance``, or per ``namespace``/``pod`` for GPU inputs).
    """

    sources: tuple[Literal["prometheus", "scrape", "push", "status"], ...] = Field(("prometheus",), min_length=1)
    fallback: Literal["scrape", "none"] = "none"
    preset: Literal["vllm", "sglang", "triton", "tgi"] = "vllm"
    gpu: Literal["dcgm", "triton", "none"] = "dcgm"
    gpu_join: Literal["instance", "pod"] = "instance"
    queries: dict[str, str] = Field(default_factory=dict)
    scrape: ScrapeSettings = ScrapeSettings()
    push: PushSettings = PushSettings()

    @field_validator("sources")
    @classmethod
    def _unique(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"sources listed twice in {list(v)}")
        return v

    @field_validator("queries")
    @classmethod
    def _queries(cls, v: dict[str, str]) -> dict[str, str]:
        known = (*SIGNAL_FIELDS, SAMPLE_TIME)
        for name, query in v.items():
            if name not in known:
                raise ValueError(f"unknown input {name!r}; known: {list(known)}")
            if not query.strip():
                raise ValueError(f"{name}: empty query")
        return v


class History(_Strict):
    """The weight-history store (see ``xds_server/history``).

    ``path``: the SQLite file; None (default) = ``$XDG_STATE_HOME/inferlb/history.sqlite3``
    (``~/.local/state/inferlb/history.sqlite3`` without XDG_STATE_HOME); a relative path is relative
    to the working directory; ``:memory:`` keeps history in memory only (lost at exit).
    ``retention_days``: rows older than this are deleted (days).
    ``max_rows``: at most this many rows are kept; the oldest go first.
    ``keyframe_s``: an endpoint whose weight and health did not change gets a row at least this
    often (s), so every time range starts from a recorded value.
    """

    path: str | None = None
    retention_days: float = Field(7.0, gt=0)
    max_rows: int = Field(1_000_000, ge=1)
    keyframe_s: float = Field(600.0, gt=0)


class GpuClass(_Strict):
    """``capacity``: throughput relative to an A100 (> 0); ``memory_mib``: GPU memory (MiB)."""

    capacity: float = Field(gt=0)
    memory_mib: float = Field(gt=0, le=MAX_GPU_MEMORY_MIB)


class EndpointConfig(_Strict):
    """One inference server. ``address`` IP:PORT serves both inference and ``/metrics``; it is kept in
    its canonical spelling (:func:`normalize_endpoint_address`), which is also the default ``instance``.

    ``drain``: take no new requests; removed once nothing is in flight (or after ``engine.drain_timeout_s``).
    ``pod`` / ``namespace``: its Kubernetes pod, for ``metrics.gpu_join: pod``.
    ``gpu_metrics_url``: where the ``scrape`` source reads this endpoint's GPU inputs, when a GPU
    exporter (dcgm-exporter, per node) serves them apart from the endpoint's own ``/metrics``;
    several endpoints may share one (then join by pod: ``metrics.gpu_join: pod``).
    ``tier``: ``edge`` (default; EDS priority 0) or ``cloud`` (EDS priority 1): a cluster's requests
    stay on its edge endpoints while their load is under ``picker.spill_threshold`` and spill to
    its cloud endpoints above it (the picker), or when the edge is unhealthy (Envoy's priority levels).
    """

    address: str
    gpu_class: str = "a100"
    tier: Literal["edge", "cloud"] = "edge"
    max_concurrency: int = Field(8, ge=1, le=MAX_CONCURRENCY)
    gpu_memory_mib: float | None = Field(None, gt=0, le=MAX_GPU_MEMORY_MIB)
    metrics_instance: str | None = None
    drain: bool = False
    pod: str | None = None
    namespace: str | None = None
    gpu_metrics_url: str | None = None

    @field_validator("gpu_metrics_url")
    @classmethod
    def _gpu_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"expected an http(s) URL such as http://10.0.0.5:9400/metrics, got {v!r}")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return normalize_endpoint_address(v)

    @property
    def instance(self) -> str:
        """The Prometheus ``instance`` label of this endpoint's series."""
        return self.metrics_instance or self.address


class VersionConfig(_Strict):
    """One model version of a service: its own Envoy cluster ``<service>-<version>``.

    ``gpu_memory``: how its servers hold GPU memory. ``preallocated``: the engine takes its KV-cache
    pool at start (vLLM, SGLang, TGI, Triton with TensorRT-LLM): free GPU memory says nothing, a
    request needs none of its own, and the headroom is the KV-cache usage. ``per_request``: each
    request takes GPU memory while it runs (a model served a request at a time by its own wrapper):
    free GPU memory is the headroom and the picker admits each request against it. None (default):
    the engine preset's (``metrics.preset``: :data:`xds_server.metrics.presets.GPU_MEMORY`).
    """

    name: str = Field(pattern=VERSION_RE)
    endpoints: tuple[EndpointConfig, ...] = Field(min_length=1)
    gpu_memory: Literal["preallocated", "per_request"] | None = None

    @field_validator("endpoints")
    @classmethod
    def _edge_first(cls, v: tuple[EndpointConfig, ...]) -> tuple[EndpointConfig, ...]:
        if all(e.tier == "cloud" for e in v):
            raise ValueError("every endpoint has tier 'cloud': the cloud tier is where the edge tier spills, "
                             "so a version with cloud endpoints needs at least one edge endpoint")
        return v


class ServiceConfig(_Strict):
    """A model service reachable through the listener; ``hosts`` match ``:authority``'s host name, any
    port ("*" = any host; a name, an IPv4 address or a bracketed IPv6 address, case-insensitive).

    ``lb_policy``: Envoy's fallback policy for requests the picker does not pin (honours EDS weights).
    ``panic_threshold_percent``: Envoy's healthy panic threshold (Envoy rounds it to an integer):
    below that share of healthy hosts Envoy spreads requests over all hosts. 1 (default): only when
    (almost) no host is healthy — under 100 hosts, when none is. The engine never excludes a whole
    cluster, but Envoy's own outlier detection may eject the hosts it left (it always may eject one),
    and the two together must not make an outage (issue 15 item 4). 0 = never panic (503
    ``no healthy upstream`` then).
    ``mixes``: canary splits usable like versions (in the version header, the body's ``model``,
    ``default_version``): ``{stable: {v1: 90, v2: 10}}``; each session stays on one version.
    ``models``: model names that mean the default version where a version is read (the body's
    ``model``, the version header): the name OpenAI clients send, which the backends serve the
    model under (vLLM's ``--served-model-name``), e.g. ``[llama-3-8b]``. With ``models`` listed, a
    body ``model`` that is no model, version or mix name gets a 404 ``model_not_found`` naming the
    served names (as an OpenAI server answers); without, a body ``model`` that names no version
    means the default version. An unknown version header gets a 400.
    ``unavailable_versions``: versions the service has but that have no endpoints now (discovery
    sets it when every node of the configured ``default_version`` has left; ``default_version`` may
    name one). A request for one, by name or as the default, gets a 503 that names the version (from
    the picker, or from Envoy's route without it), never another version's model.
    ``picker_profile``: the name of the scheduling profile (``picker.profiles``) that chooses its
    endpoints; null: the default profile (``picker.profile``).
    ``session_affinity``: what a session (``headers.session``, the session cookie, the body's ``user``
    or ``prompt_cache_key``) is promised. ``strict`` (default): every request of a session goes to
    the endpoint its first one went to, whatever that endpoint's load; the session moves only when
    its endpoint is unhealthy, ejected, draining, removed or refusing connections (for backends
    that keep a conversation's state on the node, and what a client that names a session expects).
    ``soft``: the endpoint's KV cache is all a session keeps there (OpenAI-style clients resend the
    history each turn): a turn spills to another endpoint when its own is over its load bound, and
    the session moves after ``picker.pin_move_after`` spills in a row. docs/configuration.md says
    how to choose; docs/picker.md, "Session affinity", gives the rules.
    """

    name: str = Field(pattern=NAME_RE)
    hosts: tuple[str, ...] = ("*",)
    default_version: str | None = None
    connect_timeout_s: float = Field(1.0, ge=0.001)
    lb_policy: Literal["round_robin", "least_request"] = "least_request"
    panic_threshold_percent: float = Field(1.0, ge=0, le=100)
    versions: tuple[VersionConfig, ...] = Field(min_length=1)
    mixes: dict[str, dict[str, float]] = Field(default_factory=dict)
    models: tuple[str, ...] = ()
    unavailable_versions: tuple[str, ...] = ()
    picker_profile: str | None = None
    session_affinity: Literal["strict", "soft"] = "strict"

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        """At least one host, each "*" (any) or a name once spaces and a trailing dot are taken off
        (:func:`host_key`): a DNS name, an IPv4 address or a bracketed IPv6 address, without a port
        (the request's port is not matched) and without a wildcard (Envoy's route would take
        ``*.example.com``, the picker, which matches whole names, would refuse every request)."""
        if not hosts:
            raise ValueError("needs at least one host (\"*\" = any)")
        for h in hosts:
            key = host_key(h)
            if key == "*":
                continue
            if "*" in key:
                raise ValueError(f"{h!r}: the only wildcard is \"*\" (any host); list each host name")
            if ":" in key and not _HOST_RE.fullmatch(key):
                raise ValueError(f"{h!r}: a host without its port (the request's port is not matched), an IPv6 "
                                 f"address in brackets")
            if not _HOST_RE.fullmatch(key):
                raise ValueError(f"{h!r} is not a host name (\"*\" = any)")
        return hosts

    @model_validator(mode="after")
    def _default_version(self) -> ServiceConfig:
        names = [v.name for v in self.versions]
        for gone in self.unavailable_versions:
            if not re.fullmatch(VERSION_RE, gone) or gone in names or gone in self.mixes:
                raise ValueError(f"unavailable_versions: {gone!r} must be a version name ({VERSION_RE}) that is "
                                 f"neither a version with endpoints nor a mix")
        for model in self.models:
            if not model.strip() or len(model.encode()) > MAX_NAME_BYTES:
                raise ValueError(f"models: {model!r} must be a non-empty name of at most {MAX_NAME_BYTES} bytes")
            if model in names or model in self.mixes:
                raise ValueError(f"models: {model!r} is already a version or mix name")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate version names in {names}")
        for mix, shares in self.mixes.items():
            if mix in names or not re.fullmatch(VERSION_RE, mix):
                raise ValueError(f"mix {mix!r}: needs a name of its own ({VERSION_RE}), not a version's")
            if not shares or set(shares) - set(names):
                raise ValueError(f"mix {mix!r}: shares must name versions of {names}, got {sorted(shares)}")
            if any(p < 0 for p in shares.values()) or abs(sum(shares.values()) - 100) > 1e-6:
                raise ValueError(f"mix {mix!r}: shares are percents >= 0 summing to 100, got {shares}")
        known = [*names, *self.mixes, *self.unavailable_versions]
        if self.default_version is not None and self.default_version not in known:
            raise ValueError(f"default_version {self.default_version!r} is not one of {known}")
        return self

    @property
    def default(self) -> str:
        """The version used when a request names none."""
        return self.default_version or self.versions[0].name


class XdsServing(_Strict):
    """How the ADS server pushes (see ``xds_server/ads``).

    A new snapshot is sent once no newer one has arrived for ``debounce_s`` seconds, and never later
    than ``debounce_max_s`` after the first unsent one (so a steady stream of changes still goes out).
    """

    debounce_s: float = Field(0.1, ge=0, le=10)
    debounce_max_s: float = Field(1.0, ge=0, le=60)

    @model_validator(mode="after")
    def _order(self) -> XdsServing:
        if self.debounce_max_s < self.debounce_s:
            raise ValueError(f"debounce_max_s ({self.debounce_max_s}) must be >= debounce_s ({self.debounce_s})")
        return self


class NodeGroup(_Strict):
    """Node-specific config: Envoys whose ``node.cluster`` is this group's name get this view.

    ``listener``: their inference listener address (default: ``envoy.listener``);
    ``services``: the services (names) they serve (default: all). Envoys of any other
    ``node.cluster`` get the default view.
    """

    listener: str | None = None
    services: tuple[str, ...] | None = Field(None, min_length=1)

    @field_validator("listener")
    @classmethod
    def _hp(cls, v: str | None) -> str | None:
        return None if v is None else check_hostport(v)


class RequestClassConfig(_Strict):
    """A request class named by the picker's ``request_class_header``: its GPU memory need (MiB) and,
    optionally, its typical prompt and output tokens (for the cost model)."""

    memory_mib: float = Field(ge=0, le=MAX_GPU_MEMORY_MIB)
    prompt_tokens: float | None = Field(None, ge=0)
    output_tokens: float | None = Field(None, ge=0)


PLUGIN_RE = r"^[a-z][a-z0-9-]{0,62}$"
MODULE_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _yaml(value: Any) -> str:
    """``value`` as YAML writes a scalar (``true``, ``null``, ``1.5``)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


class ProfileStep(_Strict):
    """One step of a scheduling profile: a per-request plugin by name, a scorer's ``weight`` (>= 0;
    default: the scorer's own) and the plugin's ``params`` (checked against the plugin's own parameter
    model when the picker's plugins are loaded: ``inferlb.picker_config.profile_problems``)."""

    plugin: str = Field(pattern=PLUGIN_RE)
    weight: float | None = Field(None, ge=0, le=1_000_000)
    params: dict[str, Any] = Field(default_factory=dict)


#: Picker settings the scheduling profile replaced: old name -> (plugin, its parameter).
REMOVED_PICKER_FIELDS = {
    "load_factor": ("bounded-load", "load_factor"),
    "pinned_load_factor": ("bounded-load", "pinned_load_factor"),
    "min_bound": ("bounded-load", "min_bound"),
    "affinity_slack": ("affinity-slack", "slack"),
    "cost_aware_affinity": ("affinity-slack", "cost_aware"),
}


#: A KV event publisher's address template: ``tcp://`` (or ``ipc://``) and placeholders ``{host}``,
#: ``{port}`` (the endpoint's serving port) or ``{port+N}`` / ``{port-N}`` only.
KV_EVENTS_ENDPOINT_RE = re.compile(r"^(tcp|ipc)://([^{}]|\{host\}|\{port([+-][0-9]{1,5})?\})+$")


class KvEventsConfig(_Strict):
    """Where the picker reads the engines' KV-cache events and how it keys a prompt as they do
    (``picker.prefix_source: kv_events``; docs/picker.md, "Precise mode").

    ``endpoint``: each endpoint's event publisher (vLLM's ``--kv-events-config`` ``endpoint``, by
    default ``tcp://*:5557`` on the engine's host; the simulator's ``--kv-events-endpoint``), a
    template of ``{host}`` and ``{port}`` (the endpoint's serving port; ``{port+N}``: that port plus
    N). ``topic``: the publishers' topic (vLLM's default: empty). ``block_size``: the engines' KV
    block (tokens; vLLM's and the simulator's default: 16). ``keys``: how the picker keys a body's
    blocks; ``sim``: as the ``llm`` simulator does (its chat template, 4 bytes a token or
    ``tokenizer``'s ids, its hash chain), matching the hashes it publishes; ``vllm``: the token ids
    vLLM's OpenAI server makes (the model's chat template and tokenizer in ``tokenizer``, read with
    ``transformers``: ``pip install 'inferlb[vllm-keys]'``) under the picker's own hash chain, and
    the engines' blocks re-keyed the same way from the token ids their events carry, so vLLM's own
    hash and seed never matter (needs ``tokenizer``). ``tokenizer``: the directory of the Hugging
    Face tokenizer the engines count with (its ``tokenizer.json``, and for ``vllm`` its
    ``tokenizer_config.json`` with the ``chat_template``: the served model's directory), read by the
    picker at start; null: 4 bytes a token (``sim`` only). ``pending_s``: how long the
    picker's own pick counts a prompt's blocks as held on its endpoint before events confirm them (s;
    null: ``ext_proc.prefix_events.PENDING_S``, 5 s; 0: events alone).
    """

    endpoint: str = "tcp://{host}:5557"
    topic: str = ""
    block_size: int = Field(16, ge=1, le=1024)
    keys: Literal["sim", "vllm"] = "sim"
    tokenizer: str | None = Field(None, min_length=1)
    pending_s: float | None = Field(None, ge=0, le=3600)

    @model_validator(mode="after")
    def _vllm_needs_tokenizer(self) -> KvEventsConfig:
        if self.keys == "vllm" and self.tokenizer is None:
            raise ValueError("keys: vllm needs tokenizer: the served model's directory (its tokenizer.json "
                             "and tokenizer_config.json with the chat template)")
        return self

    @field_validator("endpoint")
    @classmethod
    def _template(cls, v: str) -> str:
        if not KV_EVENTS_ENDPOINT_RE.match(v):
            raise ValueError(f"{v!r} is not a publisher address template: tcp://HOST:PORT (or ipc://PATH) "
                             "with only {host}, {port} or {port+N} as placeholders")
        return v


class Picker(_Strict):
    """The ext_proc picker (``ext_proc/``) and what Envoy is told about it.

    ``transport``: ``fast`` (a dedicated HTTP/2 server for the picker's two gRPC methods,
    ``ext_proc/transport``) or ``grpcio`` (grpc.aio, the compatibility transport); both make the
    same decisions.
    ``protocol``: how the picker answers: ``inferlb`` (the headers the listener inferlb renders routes
    by) or ``gateway-api`` (the Gateway API Inference Extension's endpoint-picker protocol, for a
    gateway whose InferencePool names inferlb as its endpoint picker; docs/picker.md).
    ``access_log_flush_s``: Envoy's ``buffer_flush_interval`` for the completion log (s): how late
    the picker learns that a request ended. ``access_log_buffer_bytes``: Envoy flushes earlier
    when a worker's buffer reaches this size (bytes). 64 KiB: a flush every 5 ms up to ~27 000
    requests/s per worker; a 16 KiB buffer cost Envoy 6–8 µs more per request at 11 000–13 000
    requests/s (``inferlb bench ext-proc-config``, BENCHMARKS.md).
    ``inflight_expiry_s``: a pick with no completion after this long is taken as finished (s);
    default: ``envoy.route_timeout_s`` + 10.
    ``session_ttl_s``: a session idle this long loses its pin (s). ``max_sessions``: session-table
    size; the least recently used session goes first. ``session_cookie``: a cookie read for the
    session key when no session header is present (None: cookies are not read).
    ``body_max_bytes``: body routing (default 1 MiB, Envoy's default buffer limit; 0 = off): a JSON
    request whose headers lack the version, the session or the size is held until Envoy buffers its
    body; ``model``, ``user``, the prompt (its prefix key and length) and ``max_tokens`` are read from
    bodies up to this size (bytes), so a client that sends only an OpenAI body is routed by it. A
    body whose ``content-length`` is above it is not asked for (routed by headers, counted; a 413
    ``request_body_too_large`` when its ``model`` would have chosen the version: no version header, a
    service with model names or more than one version or mix); a chunked one (no ``content-length``) is,
    and above Envoy's buffer limit (1 MiB) Envoy 1.40 gave it no answer: ``body_mode: streamed`` reads
    only its first chunk.
    ``admission`` (off by default): when a cluster's requests in flight reach the sum of its endpoints'
    ``max_concurrency``, hold new requests in a FIFO queue per cluster — at most ``max_queue``
    (0 = never queue), each at most ``queue_timeout_s`` (below ``envoy.ext_proc_timeout_s``) — and
    answer 429 with ``Retry-After: retry_after_s`` past either bound.
    The scheduler (every request; docs/picker.md, "The scheduling pipeline"): ``profile`` is the
    default scheduling profile, a list of steps ``{plugin, weight, params}`` (filters, weighted
    scorers, one picker; null: the built-in default profile, ``failed-endpoints``,
    ``memory-admission``, ``bounded-load``, ``least-loaded``, ``prefix-cache``); ``profiles`` are named
    profiles a service may choose (``services[].picker_profile``); ``plugin_modules`` are Python
    modules imported at start that register plugins of their own. ``memory_margin``
    (default: ``engine.memory_margin``) the memory-admission margin; a request's need comes from
    ``request_memory_header`` (MiB; declared, so admitted without the margin), the body
    (``kv_mib_per_token`` x (prompt tokens, estimated at
    ``chars_per_token``, + ``max_tokens`` or ``default_max_tokens``)), ``request_class_header`` +
    ``request_classes``, else ``engine.request_memory_mib``. ``prefix_messages`` /
    ``prefix_max_bytes``: what the prefix key hashes. ``prefix_cache_tokens``: the KV cache of one
    endpoint (tokens; vLLM logs it at start, ``num_gpu_blocks`` x ``block_size``): the picker's prefix
    index keeps, per endpoint, the prompt blocks it sent there up to this much and places a request
    without a session by the share of its prompt cached there against its load (docs/picker.md,
    "Prefix-cache index"); the default is llm-d's default index capacity (31 250 blocks of 16 tokens);
    0 turns the index off (the prefix key's ring places those requests). ``memory_queue``: a request no endpoint has
    memory for waits in the queue then gets 429 (false, the default: it is pinned to the endpoint
    with the most estimated free memory). ``memory_count_in_sample`` (off by default): the backends
    report the requests they hold (running + waiting) in the same scrape or push as their free GPU
    memory (the simulator's one ``/metrics`` page, a ``NodeStatus`` push; not vLLM beside a separate
    DCGM exporter, scraped at other times): the picker then settles with that count which of its
    latest requests the memory sample already held, instead of assuming the worst for them
    (docs/picker.md, "Memory admission"). ``pin_move_after``:
    spills in a row that move a session (of a service whose ``session_affinity`` is ``soft``).
    ``failure_hold_s``: an endpoint whose connections fail is not picked for this long (s).
    ``cost_forget`` / ``cost_min_samples``: the cost model.
    ``body_mode``: ``streamed`` (decide on the first body chunk) or ``buffered`` (the whole body).
    ``shared_view`` (on by default): every picker (one per Envoy) reports its live load to the control
    plane when it changed and other pickers are in the view, at most once per ``shared_view_interval_s``
    (s; at least every quarter of ``shared_view_expiry_s``), the control plane pushes the sum to every picker, and each
    decides on the sum over all pickers (one load view across many gateways); a picker whose last
    report is older than ``shared_view_expiry_s`` stops counting. Off: each picker decides on its own
    Envoy's load alone (it still reports, and still gets the slow loop's GPU memory samples over the
    same stream).
    ``prefix_source``: what feeds the prefix-cache index: ``routing`` (the picker's own picks, the
    approximate index) or ``kv_events`` (the engines' KV-cache events, subscribed to as endpoints
    join, with the prompt keyed as the engine keys it: ``kv_events``; docs/picker.md, "Precise
    mode"; needs ``pip install 'inferlb[kv-events]'`` and ``prefix_cache_tokens`` above 0).
    ``spill_threshold``: tiers (``services[].versions[].endpoints[].tier``): a request goes to its
    cluster's cloud tier when the edge tier's requests in flight are at least this share (0-1) of
    the edge tier's max concurrency, else to the edge tier.
    """

    transport: Literal["fast", "grpcio"] = "fast"
    protocol: Literal["inferlb", "gateway-api"] = "inferlb"
    access_log_flush_s: float = Field(0.005, gt=0, le=10)
    access_log_buffer_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024)
    inflight_expiry_s: float | None = Field(None, gt=0)
    body_max_bytes: int = Field(1024 * 1024, ge=0, le=64 * 1024 * 1024)
    admission: bool = False
    max_queue: int = Field(256, ge=0, le=1_000_000)
    queue_timeout_s: float = Field(0.1, gt=0)
    retry_after_s: int = Field(1, ge=1, le=3600)
    session_ttl_s: float = Field(1800.0, gt=0)
    max_sessions: int = Field(1_000_000, ge=1)
    session_cookie: str | None = Field(None, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    profile: tuple[ProfileStep, ...] | None = Field(None, min_length=1)
    profiles: dict[str, tuple[ProfileStep, ...]] = Field(default_factory=dict)
    plugin_modules: tuple[Annotated[str, Field(pattern=MODULE_RE)], ...] = ()
    memory_margin: float | None = Field(None, ge=0, le=10)
    kv_mib_per_token: float = Field(0.5, ge=0)
    default_max_tokens: int = Field(128, ge=0)
    chars_per_token: float = Field(4.0, gt=0)
    request_memory_header: str | None = Field(None, pattern=r"^[a-z0-9-]+$")
    request_class_header: str = Field("x-inferlb-request-class", pattern=r"^[a-z0-9-]+$")
    request_classes: dict[str, RequestClassConfig] = Field(default_factory=dict)
    prefix_messages: int = Field(2, ge=0, le=1000)
    prefix_max_bytes: int = Field(4096, ge=1, le=1024 * 1024)
    prefix_cache_tokens: int = Field(500_000, ge=0, le=1_000_000_000)
    prefix_source: Literal["routing", "kv_events"] = "routing"
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    body_mode: Literal["streamed", "buffered"] = "buffered"
    shared_view: bool = True
    shared_view_interval_s: float = Field(0.01, gt=0, le=10)
    shared_view_expiry_s: float = Field(1.0, gt=0, le=60)
    memory_queue: bool = False
    memory_count_in_sample: bool = False
    pin_move_after: int = Field(3, ge=1, le=1000)
    failure_hold_s: float = Field(5.0, gt=0, le=3600)
    cost_forget: float = Field(0.999, gt=0, le=1)
    cost_min_samples: int = Field(20, ge=3)
    spill_threshold: float = Field(0.6, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        """Settings the scheduling profile replaced are refused, with the profile to write instead
        (the default profile's steps with their values)."""
        if not isinstance(data, dict):
            return data
        given = [name for name in REMOVED_PICKER_FIELDS if name in data]
        if not given:
            return data
        params: dict[str, dict[str, Any]] = {}
        for name in given:
            plugin, param = REMOVED_PICKER_FIELDS[name]
            params.setdefault(plugin, {})[param] = data[name]
        slack = params.get("affinity-slack")
        if slack is not None:  # the old slack's default was null (off)
            slack.setdefault("slack", None)
            if slack["slack"] is None and not slack.get("cost_aware"):
                del params["affinity-slack"]

        def step(plugin: str) -> str:
            if plugin not in params:
                return f"{{plugin: {plugin}}}"
            shown = ", ".join(f"{k}: {_yaml(v)}" for k, v in params[plugin].items())
            return f"{{plugin: {plugin}, params: {{{shown}}}}}"

        plugins = ["failed-endpoints", "memory-admission", "bounded-load",
                   *(["affinity-slack"] if "affinity-slack" in params else []), "least-loaded", "prefix-cache"]
        raise FieldProblem(("picker", given[0]), (
            f"{', '.join('picker.' + n for n in given)} {'was' if len(given) == 1 else 'were'} removed: the "
            f"scheduling profile's plugins have these parameters now; write picker.profile: "
            f"[{', '.join(map(step, plugins))}] (docs/picker.md)"))

    @model_validator(mode="after")
    def _events_need_index(self) -> Picker:
        if self.prefix_source == "kv_events" and not self.prefix_cache_tokens:
            raise FieldProblem(("picker", "prefix_cache_tokens"), "prefix_source: kv_events needs the prefix "
                               "index: prefix_cache_tokens above 0 (what one engine's KV cache holds, tokens)")
        return self

    @field_validator("profiles")
    @classmethod
    def _profile_names(cls, v: dict[str, tuple[ProfileStep, ...]]) -> dict[str, tuple[ProfileStep, ...]]:
        for name, steps in v.items():
            if name == "default" or not re.fullmatch(NAME_RE, name):
                raise ValueError(f"profile name {name!r}: a name of its own ({NAME_RE}); the default profile is "
                                 "picker.profile")
            if not steps:
                raise ValueError(f"profile {name!r} has no steps")
        return v


class Autoscaling(_Strict):
    """The autoscaling signal at ``/metrics`` (``xds_server/autoscaling.py``).

    ``target_saturation``: the saturation (0-1, requests in flight and waiting over the serving
    endpoints' max concurrency) a cluster should run at; the suggested replica count is
    ``ceil(current x saturation / target_saturation)``, the Kubernetes HPA formula.
    ``tolerance``: no change is suggested while ``saturation / target_saturation`` is within
    1 +- this (the HPA's default tolerance is 0.1).
    """

    target_saturation: float = Field(0.7, gt=0, le=1)
    tolerance: float = Field(0.1, ge=0, lt=1)


class KubernetesService(_Strict):
    """One inferlb service whose endpoints come from a Kubernetes Service's EndpointSlices.

    ``service``: the Kubernetes Service (EndpointSlices labelled ``kubernetes.io/service-name``);
    ``port``: the port number or name serving inference and ``/metrics``; each ready endpoint's
    pod labels give its version (``version_label``) and GPU class (``gpu_class_label``). The other
    fields mean what they mean for a static service.
    """

    name: str = Field(pattern=NAME_RE)
    service: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    port: int | str = 8000
    hosts: tuple[str, ...] = ("*",)
    default_version: str | None = None
    models: tuple[str, ...] = ()
    lb_policy: Literal["round_robin", "least_request"] = "least_request"
    max_concurrency: int = Field(8, ge=1, le=MAX_CONCURRENCY)


class KubernetesInferencePool(_Strict):
    """One inferlb service whose endpoints are the members of an InferencePool
    (``inference.networking.k8s.io/v1``, the Gateway API Inference Extension's API).

    ``pool``: the InferencePool's name. Its members are the ready pods its ``spec.selector``
    matches, one endpoint per pod IP and ``spec.targetPorts`` number; a pod's ``version_label``
    gives its version, else ``version``; its ``gpu_class_label`` its GPU class. The other fields
    mean what they mean for a static service.
    """

    name: str = Field(pattern=NAME_RE)
    pool: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    version: str = Field("v1", pattern=VERSION_RE)
    hosts: tuple[str, ...] = ("*",)
    default_version: str | None = None
    models: tuple[str, ...] = ()
    lb_policy: Literal["round_robin", "least_request"] = "least_request"
    max_concurrency: int = Field(8, ge=1, le=MAX_CONCURRENCY)


class KubernetesDiscovery(_Strict):
    """Discovery from Kubernetes in one namespace: the EndpointSlices (discovery.k8s.io/v1) of
    ``services``, the InferencePools (inference.networking.k8s.io/v1) of ``inference_pools``.

    ``api_server``: the API server URL (tests, or out of cluster); default: the in-cluster service
    account, else ``~/.kube/config``. Pods of ``services`` without ``version_label`` are skipped
    (logged, counted); without ``gpu_class_label`` they get ``default_gpu_class``.
    """

    namespace: str = "default"
    api_server: str | None = None
    version_label: str = "inferlb.io/model-version"
    gpu_class_label: str = "inferlb.io/gpu-class"
    default_gpu_class: str = "a100"
    services: tuple[KubernetesService, ...] = ()
    inference_pools: tuple[KubernetesInferencePool, ...] = ()

    @model_validator(mode="after")
    def _something(self) -> KubernetesDiscovery:
        if not self.services and not self.inference_pools:
            raise ValueError("services or inference_pools must name at least one service")
        names = [s.name for s in (*self.services, *self.inference_pools)]
        if len(set(names)) != len(names):
            raise ValueError(f"a service name is used twice in services and inference_pools: {names}")
        pools = [p.pool for p in self.inference_pools]
        if len(set(pools)) != len(pools):
            raise ValueError(f"an InferencePool is listed twice: {pools}")
        return self


class EtcdService(_Strict):
    """One inferlb service whose endpoints are the nodes registered in etcd under ``service``.

    ``service``: the service name nodes register with (default: ``name``). The other fields mean
    what they mean for a static service.
    """

    name: str = Field(pattern=NAME_RE)
    service: str | None = Field(None, pattern=NAME_RE)
    hosts: tuple[str, ...] = ("*",)
    default_version: str | None = None
    models: tuple[str, ...] = ()
    lb_policy: Literal["round_robin", "least_request"] = "least_request"

    @property
    def registered_as(self) -> str:
        """The service name in the nodes' registrations."""
        return self.service or self.name


class EtcdTls(_Strict):
    """TLS to etcd's client port (PEM file paths on inferlb's host).

    ``ca``: CA bundle that signed etcd's server certificate (default: the system's);
    ``cert``/``key``: inferlb's client certificate (both or neither, for etcd's ``--client-cert-auth``).
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> EtcdTls:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together (inferlb's client certificate)")
        return self


class EtcdDiscovery(_Strict):
    """Discovery from nodes that register in etcd (v3 API, through etcd's JSON gRPC gateway).

    ``endpoints``: etcd client URLs (``http(s)://HOST:PORT``), tried in turn; ``prefix``: the key
    prefix nodes register under (``<prefix><HOST:PORT>``); ``services``: registered service ->
    inferlb service; a registration without ``gpu_class`` gets ``default_gpu_class``, without
    ``max_concurrency`` gets ``default_max_concurrency``. ``timeout_s``: per request (s);
    ``watch_timeout_s``: a watch is re-opened from the last revision after this long (s), which also
    bounds how long a silently dead connection goes unnoticed. ``tls``: see :class:`EtcdTls`
    (``https://`` endpoints without it use the system's CAs). ``username`` / ``password``: etcd's
    user authentication (``/v3/auth/authenticate``; the user needs read permission on the prefix);
    the password defaults to the environment variable ``INFERLB_ETCD_PASSWORD``.
    """

    endpoints: tuple[str, ...] = Field(("http://127.0.0.1:2379",), min_length=1)
    prefix: str = Field("/inferlb/endpoints/", min_length=1)
    default_gpu_class: str = "a100"
    default_max_concurrency: int = Field(8, ge=1, le=MAX_CONCURRENCY)
    timeout_s: float = Field(5.0, gt=0)
    watch_timeout_s: float = Field(300.0, gt=0)
    tls: EtcdTls | None = None
    username: str | None = Field(None, min_length=1)
    password: str | None = Field(None, repr=False)
    services: tuple[EtcdService, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _user(self) -> EtcdDiscovery:
        if self.password is not None and self.username is None:
            raise ValueError("password is set but username is not")
        return self

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for url in v:
            if not re.match(r"^https?://[^/\s]+/?$", url):
                raise ValueError(f"expected an etcd client URL http(s)://HOST:PORT, got {url!r}")
        return tuple(u.rstrip("/") for u in v)

    @field_validator("services")
    @classmethod
    def _unique(cls, v: tuple[EtcdService, ...]) -> tuple[EtcdService, ...]:
        for attr in ("name", "registered_as"):
            names = [getattr(s, attr) for s in v]
            if len(set(names)) != len(names):
                raise ValueError(f"a service is listed twice by {attr}: {names}")
        return v


class Discovery(_Strict):
    """Where endpoints come from besides ``services`` (static)."""

    kubernetes: KubernetesDiscovery | None = None
    etcd: EtcdDiscovery | None = None


class Config(_Strict):
    """The whole inferlb config (one YAML file)."""

    listen: Listen = Listen()
    envoy: EnvoySide = EnvoySide()
    loop: Loop = Loop()
    prometheus: PrometheusSource = PrometheusSource()
    headers: Headers = Headers()
    engine: Engine = Engine()
    history: History = History()
    picker: Picker = Picker()
    metrics: MetricsSettings = MetricsSettings()
    gpu_classes: dict[str, GpuClass] = Field(
        default_factory=lambda: {k: GpuClass(**d) for k, d in DEFAULT_GPU_CLASSES.items()})
    services: tuple[ServiceConfig, ...]
    xds: XdsServing = XdsServing()
    node_groups: dict[str, NodeGroup] = Field(default_factory=dict)
    tls: TlsConfig | None = None
    admin: AdminConfig = AdminConfig()
    discovery: Discovery = Discovery()
    autoscaling: Autoscaling = Autoscaling()

    @field_validator("gpu_classes", mode="after")
    @classmethod
    def _with_defaults(cls, v: dict[str, GpuClass]) -> dict[str, GpuClass]:
        """Configured classes extend (and may override) the built-in ones."""
        return {**{k: GpuClass(**d) for k, d in DEFAULT_GPU_CLASSES.items()}, **v}

    @model_validator(mode="after")
    def _some_service(self) -> Config:
        if not self.services and self.discovery.kubernetes is None and self.discovery.etcd is None:
            raise FieldProblem(("services",), "at least one service is needed "
                               "(or discovery.kubernetes.services, or discovery.etcd.services)")
        return self

    @model_validator(mode="after")
    def _status_needs_etcd(self) -> Config:
        if "status" in self.metrics.sources and self.discovery.etcd is None:
            raise FieldProblem(("metrics", "sources"), "the status source reads the snapshots nodes write to "
                               "etcd: it needs discovery.etcd")
        return self

    @model_validator(mode="after")
    def _tls(self) -> Config:
        if self.tls is not None and self.envoy.tls is None:
            raise FieldProblem(("envoy", "tls"), "tls is set but envoy.tls is not: Envoy must dial the picker "
                               "over TLS too (envoy.tls.ca, and cert/key for mTLS)")
        if self.tls is not None and self.tls.require_client_cert and self.envoy.tls.cert is None:
            raise FieldProblem(("envoy", "tls", "cert"),
                               "tls.require_client_cert is set but envoy.tls has no cert/key for Envoy")
        return self

    @model_validator(mode="after")
    def _cross(self) -> Config:
        seen: dict[str, str] = {}
        hosts: dict[str, str] = {}
        services: dict[str, int] = {}
        for i, s in enumerate(self.services):
            if s.name in services:
                raise FieldProblem(("services", i, "name"), f"service {s.name!r} is defined twice")
            services[s.name] = i
            for h in s.hosts:
                key = host_key(h)
                if key in hosts:
                    raise FieldProblem(("services", i, "hosts"),
                                       f"host {h!r} is already taken by service {hosts[key]!r}")
                hosts[key] = s.name
            for j, v in enumerate(s.versions):
                for k, e in enumerate(v.endpoints):
                    loc = ("services", i, "versions", j, "endpoints", k)
                    if e.gpu_class not in self.gpu_classes:
                        raise FieldProblem((*loc, "gpu_class"), f"unknown gpu_class {e.gpu_class!r}; "
                                                                f"known: {sorted(self.gpu_classes)}")
                    where = cluster_name(s.name, v.name)
                    if e.address in seen:
                        raise FieldProblem((*loc, "address"),
                                           f"endpoint {e.address} is listed twice ({seen[e.address]}, {where}); "
                                           "addresses are compared in their canonical spelling (port without "
                                           "leading zeros, IPv6 compressed)")
                    seen[e.address] = where
        for i, s in enumerate(self.services):
            if s.picker_profile is not None and s.picker_profile not in self.picker.profiles:
                raise FieldProblem(("services", i, "picker_profile"),
                                   f"unknown profile {s.picker_profile!r}; picker.profiles has "
                                   f"{sorted(self.picker.profiles) or 'none'}")
        names = [s.name for s in self.services]
        for group, g in self.node_groups.items():
            unknown = sorted(set(g.services or ()) - set(names))
            if unknown:
                raise FieldProblem(("node_groups", group, "services"),
                                   f"unknown services {unknown}; known: {names}")
        return self

    @model_validator(mode="after")
    def _distinct_addresses(self) -> Config:
        """No two listeners on one address. inferlb's own (``listen.*``, and ``metrics.push.listen``
        with the push source) share neither an address nor a port where one binds a wildcard; Envoy's
        listeners (``envoy.listener``, ``node_groups.*.listener``) and the endpoints are on none of
        their addresses, and the endpoints on no Envoy listener's. Port 0 (any free port) never clashes."""
        ours = [(("listen", "xds"), self.listen.xds), (("listen", "ext_proc"), self.listen.ext_proc),
                (("listen", "admin"), self.listen.admin)]
        if "push" in self.metrics.sources:
            ours.append((("metrics", "push", "listen"), self.metrics.push.listen))
        envoys = [(("envoy", "listener"), self.envoy.listener),
                  *((("node_groups", name, "listener"), g.listener) for name, g in self.node_groups.items()
                    if g.listener is not None)]
        for n, (loc, address) in enumerate(ours):
            for other_loc, other in ours[:n]:
                if _clash(address, other, wildcard=True):
                    same = _socket_address(address) == _socket_address(other)
                    raise FieldProblem(loc, f"{address} is also the address of {_dotted(other_loc)}: each "
                                            "listener needs its own" if same else
                                            f"{address} and {_dotted(other_loc)} ({other}) share a port and one "
                                            "of them binds every address of the host: each listener needs its own")
        for loc, address in envoys:
            for other_loc, other in ours:
                if _clash(address, other, wildcard=False):
                    raise FieldProblem(loc, f"{address} is also the address of {_dotted(other_loc)}: each "
                                            "listener needs its own")
        # endpoint addresses are canonical IP:PORT (normalize_endpoint_address): one lookup each
        listeners = {_canonical(address): loc for loc, address in reversed([*ours, *envoys])
                     if split_hostport(address)[1] != 0}
        for i, s in enumerate(self.services):
            for j, v in enumerate(s.versions):
                for k, e in enumerate(v.endpoints):
                    if e.address in listeners:
                        raise FieldProblem(("services", i, "versions", j, "endpoints", k, "address"),
                                           f"{e.address} is the address of {_dotted(listeners[e.address])}, not "
                                           "of an inference server")
        return self

    def for_node_group(self, group: str) -> Config:
        """The config as Envoys of ``node.cluster == group`` see it (itself for an unknown group)."""
        g = self.node_groups.get(group)
        if g is None:
            return self
        services = tuple(s for s in self.services if g.services is None or s.name in g.services)
        envoy = self.envoy.model_copy(update={"listener": g.listener}) if g.listener else self.envoy
        return self.model_copy(update={"services": services, "envoy": envoy})
    @model_validator(mode="after")
    def _queue_fits_envoy(self) -> Config:
        queues = self.picker.admission or self.picker.memory_queue  # either holds requests up to queue_timeout_s
        if queues and self.picker.queue_timeout_s >= self.envoy.ext_proc_timeout_s:
            raise ValueError(
                f"picker.queue_timeout_s ({self.picker.queue_timeout_s}) must be below envoy.ext_proc_timeout_s "
                f"({self.envoy.ext_proc_timeout_s}) with picker.admission or picker.memory_queue: Envoy stops "
                f"waiting for the picker then"
            )
        return self

    @model_validator(mode="after")
    def _staleness_fits_the_sources(self) -> Config:
        stale = self.engine.stale_after_s
        m = self.metrics
        intervals = []
        if "scrape" in m.sources or m.fallback == "scrape":
            intervals.append(("metrics.scrape.interval_s", m.scrape.interval_s))
        if "prometheus" in m.sources and self.prometheus.scrape_interval_s is not None:
            intervals.append(("prometheus.scrape_interval_s", self.prometheus.scrape_interval_s))
        for name, interval in intervals:
            if stale < STALE_INTERVALS * interval:
                raise FieldProblem(("engine", "stale_after_s"), stale_message(stale, name, interval))
            window = self.prometheus.window_s  # the window of every source's rates and averages
            if window < WINDOW_INTERVALS * interval:
                raise FieldProblem(("prometheus", "window_s"), (
                    f"prometheus.window_s ({window:g} s) is shorter than {WINDOW_INTERVALS:g} x {name} "
                    f"({interval:g} s): a rate needs two samples in its window; raise window_s"))
        return self

    @model_validator(mode="after")
    def _gpu_join(self) -> Config:
        if self.metrics.gpu_join == "pod":
            for s in self.services:
                for v in s.versions:
                    for e in v.endpoints:
                        if not (e.pod and e.namespace):
                            raise ValueError(f"endpoint {e.address}: metrics.gpu_join is 'pod', so it needs "
                                             "'pod' and 'namespace'")
        return self

    def memory_mib(self, endpoint: EndpointConfig) -> float:
        """GPU memory of ``endpoint`` in MiB: its own setting, else its GPU class's."""
        return endpoint.gpu_memory_mib or self.gpu_classes[endpoint.gpu_class].memory_mib

    def preallocates(self, version: VersionConfig) -> bool:
        """True when ``version``'s servers hold a preallocated KV-cache pool (its ``gpu_memory``,
        else the engine preset's, :data:`~xds_server.metrics.presets.GPU_MEMORY`), False when each
        request takes GPU memory of its own."""
        return (version.gpu_memory or GPU_MEMORY[self.metrics.preset]) == PREALLOCATED


#: ``engine.stale_after_s`` must be at least this many of a source's sample interval: between two
#: scrapes a sample ages up to one interval, and one late or failed scrape must not make it stale.
STALE_INTERVALS = 2.0
#: ``prometheus.window_s`` must cover this many sample intervals of each source (a rate needs two samples).
WINDOW_INTERVALS = 2.0


def stale_message(stale_after_s: float, source: str, interval_s: float) -> str:
    """Why ``stale_after_s`` is too short for a source sampled every ``interval_s`` (one line)."""
    return (f"engine.stale_after_s ({stale_after_s:g} s) is shorter than {STALE_INTERVALS:g} x {source} "
            f"({interval_s:g} s) = {STALE_INTERVALS * interval_s:g} s: samples age up to one interval between "
            "scrapes, so endpoints would flap between HEALTHY and UNHEALTHY; raise stale_after_s")


def cluster_name(service: str, version: str) -> str:
    """The Envoy cluster name of one service version: ``<service>-<version>``."""
    return f"{service}-{version}"
