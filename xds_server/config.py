"""YAML configuration -> typed, validated :class:`Config`.

Every error names the field (a dotted path such as ``services[0].versions[1].endpoints[2].address``)
and, when the config came from a file, the line of that field, so an operator can find it at once.
A bad config is refused at startup; nothing is half-applied.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
VERSION_RE = r"^[A-Za-z0-9][A-Za-z0-9_.]*$"  # no '-': the cluster name "<service>-<version>" stays unique
HEADER_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")

#: Per GPU class: relative capacity (throughput vs an A100) and GPU memory (MiB). Operators may override.
DEFAULT_GPU_CLASSES: dict[str, dict[str, float]] = {
    "a100": {"capacity": 1.0, "memory_mib": 81920},
    "h100": {"capacity": 1.6, "memory_mib": 81920},
    "a10": {"capacity": 0.4, "memory_mib": 24576},
}


class ConfigError(ValueError):
    """Raised when a config cannot be loaded; ``str(err)`` lists every problem, one per line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_hostport(value: str, ip_only: bool = False) -> str:
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

    _hp = field_validator("xds", "ext_proc", "admin")(_check_hostport)


class OutlierDetection(_Strict):
    """Envoy's outlier detection on every inference cluster (passive health checking, case C13).

    ``consecutive_5xx`` / ``consecutive_gateway_failure``: errors in a row that eject a host (a
    per-try timeout counts as a gateway failure); ``interval_s``: how often Envoy sweeps (s);
    ``base_ejection_time_s``: first ejection length (s; Envoy multiplies it by the ejection count,
    up to ``max_ejection_time_s``);
    ``max_ejection_percent``: most of a cluster ejected at once (Envoy always allows one host).
    Source: Envoy docs, "Outlier detection" (config.cluster.v3.OutlierDetection).
    """

    consecutive_5xx: int = Field(5, ge=1)
    consecutive_gateway_failure: int = Field(3, ge=1)
    interval_s: float = Field(2.0, gt=0)
    base_ejection_time_s: float = Field(10.0, gt=0)
    max_ejection_time_s: float = Field(300.0, gt=0)
    max_ejection_percent: int = Field(50, ge=0, le=100)


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


class AdminConfig(_Strict):
    """Admin API access. ``token``: bearer token for write operations (drain, reload); the env var
    ``INFERLB_ADMIN_TOKEN`` is used when unset. Without a token, write operations are allowed only
    when the admin API binds a loopback address.
    """

    token: str | None = Field(None, min_length=16, repr=False)


class EnvoySide(_Strict):
    """What the control plane configures inside Envoy (sent over LDS/RDS/CDS).

    ``listener``: the address Envoy's inference listener binds (``HOST:PORT``).
    ``ext_proc_timeout_s``: how long Envoy waits for the picker per request before failing open (s).
    ``failure_mode_allow``: true = a dead or slow picker degrades to weighted load balancing; false = 5xx.
    ``route_timeout_s``: upstream request timeout (s).
    ``ext_proc_address``: where Envoy dials the picker (``HOST:PORT``); default: ``listen.ext_proc``
    with a wildcard host read as 127.0.0.1. Set it when Envoy runs on another host.
    """

    listener: str = "127.0.0.1:10000"
    ext_proc_address: str | None = None
    ext_proc_timeout_s: float = Field(0.25, gt=0, le=60)
    failure_mode_allow: bool = True
    route_timeout_s: float = Field(120.0, gt=0)
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

    @field_validator("listener", "ext_proc_address")
    @classmethod
    def _hp(cls, v: str | None) -> str | None:
        return None if v is None else _check_hostport(v)


class PrometheusSource(_Strict):
    """Where the sliding-window statistics come from.

    ``window_s``: PromQL range for rates and averages (s); must cover >= 2 scrape intervals.
    ``interval_s``: how often the control plane queries and recomputes weights (s).
    ``timeout_s``: per-query timeout (s); a slow Prometheus counts as a failed round.
    """

    url: str = "http://127.0.0.1:9090"
    window_s: float = Field(60.0, gt=0)
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    #: The first snapshot waits this long (s) for a successful metrics round; then it goes out
    #: with neutral weights (flagged), so a dead Prometheus can't keep Envoy unconfigured forever.
    first_round_wait_s: float = Field(10.0, ge=0)

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


class Scorers(_Strict):
    """Relative weights (>= 0) of the scorers in the weighted sum; a scorer at 0 is off."""

    idle_compute: float = Field(1.0, ge=0)
    concurrency: float = Field(1.0, ge=0)
    latency: float = Field(1.0, ge=0)


class Engine(_Strict):
    """Weight-engine parameters (see ``xds_server/engine``).

    ``stale_after_s``: metrics older than this exclude an endpoint (never all of a cluster).
    ``request_memory_mib``: GPU memory a typical request needs; ``memory_margin``: safety share on top (0–1).
    ``max_weight``: the weight of a perfect endpoint on an A100-class GPU; EDS weights are 1..max_weight x capacity.
    ``hysteresis``: relative weight change (0–1) below which the previous weight is kept.
    """

    stale_after_s: float = Field(15.0, gt=0)
    request_memory_mib: float = Field(2048.0, ge=0)
    memory_margin: float = Field(0.2, ge=0, le=10)
    max_weight: int = Field(100, ge=1, le=1_000_000)
    hysteresis: float = Field(0.1, ge=0, lt=1)
    scorers: Scorers = Scorers()


class GpuClass(_Strict):
    """``capacity``: throughput relative to an A100 (> 0); ``memory_mib``: GPU memory (MiB)."""

    capacity: float = Field(gt=0)
    memory_mib: float = Field(gt=0)


class EndpointConfig(_Strict):
    """One inference server. ``address`` HOST:PORT serves both inference and ``/metrics``."""

    address: str
    gpu_class: str = "a100"
    max_concurrency: int = Field(8, ge=1)
    gpu_memory_mib: float | None = Field(None, gt=0)
    metrics_instance: str | None = None

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return _check_hostport(v, ip_only=True)

    @property
    def instance(self) -> str:
        """The Prometheus ``instance`` label of this endpoint's series."""
        return self.metrics_instance or self.address


class VersionConfig(_Strict):
    """One model version of a service: its own Envoy cluster ``<service>-<version>``."""

    name: str = Field(pattern=VERSION_RE)
    endpoints: tuple[EndpointConfig, ...] = Field(min_length=1)


class ServiceConfig(_Strict):
    """A model service reachable through the listener; ``hosts`` match ``:authority`` ("*" = any).

    ``lb_policy``: Envoy's fallback policy for requests the picker does not pin (honours EDS weights).
    ``panic_threshold_percent``: Envoy's healthy panic threshold; 0 (default) never sends traffic to
    hosts we marked unhealthy (the control plane already never excludes a whole cluster).
    """

    name: str = Field(pattern=NAME_RE)
    hosts: tuple[str, ...] = ("*",)
    default_version: str | None = None
    connect_timeout_s: float = Field(1.0, gt=0)
    lb_policy: Literal["round_robin", "least_request"] = "least_request"
    panic_threshold_percent: float = Field(0.0, ge=0, le=100)
    versions: tuple[VersionConfig, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _default_version(self) -> ServiceConfig:
        names = [v.name for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate version names in {names}")
        if self.default_version is not None and self.default_version not in names:
            raise ValueError(f"default_version {self.default_version!r} is not one of {names}")
        return self

    @property
    def default(self) -> str:
        """The version used when a request names none."""
        return self.default_version or self.versions[0].name


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
    lb_policy: Literal["round_robin", "least_request"] = "least_request"
    max_concurrency: int = Field(8, ge=1)


class KubernetesDiscovery(_Strict):
    """Discovery from Kubernetes EndpointSlices (discovery.k8s.io/v1) in one namespace.

    ``api_server``: the API server URL (tests, or out of cluster); default: the in-cluster service
    account, else ``~/.kube/config``. Pods without ``version_label`` are skipped (logged, counted);
    without ``gpu_class_label`` they get ``default_gpu_class``.
    """

    namespace: str = "default"
    api_server: str | None = None
    version_label: str = "inferlb.io/model-version"
    gpu_class_label: str = "inferlb.io/gpu-class"
    default_gpu_class: str = "a100"
    services: tuple[KubernetesService, ...] = Field(min_length=1)


class Discovery(_Strict):
    """Where endpoints come from besides ``services`` (static)."""

    kubernetes: KubernetesDiscovery | None = None


class Config(_Strict):
    """The whole inferlb config (one YAML file)."""

    listen: Listen = Listen()
    envoy: EnvoySide = EnvoySide()
    prometheus: PrometheusSource = PrometheusSource()
    headers: Headers = Headers()
    engine: Engine = Engine()
    gpu_classes: dict[str, GpuClass] = Field(
        default_factory=lambda: {k: GpuClass(**v) for k, v in DEFAULT_GPU_CLASSES.items()}
    )
    services: tuple[ServiceConfig, ...]
    tls: TlsConfig | None = None
    admin: AdminConfig = AdminConfig()
    discovery: Discovery = Discovery()

    @model_validator(mode="after")
    def _some_service(self) -> Config:
        if not self.services and self.discovery.kubernetes is None:
            raise ValueError("services: at least one service is needed (or discovery.kubernetes.services)")
        return self

    @model_validator(mode="after")
    def _tls(self) -> Config:
        if self.tls is not None and self.envoy.tls is None:
            raise ValueError("tls is set but envoy.tls is not: Envoy must dial the picker over TLS too "
                             "(envoy.tls.ca, and cert/key for mTLS)")
        if self.tls is not None and self.tls.require_client_cert and self.envoy.tls.cert is None:
            raise ValueError("tls.require_client_cert is set but envoy.tls has no cert/key for Envoy")
        return self

    @model_validator(mode="after")
    def _cross(self) -> Config:
        seen: dict[str, str] = {}
        for s in self.services:
            for v in s.versions:
                for e in v.endpoints:
                    if e.gpu_class not in self.gpu_classes:
                        raise ValueError(
                            f"endpoint {e.address}: unknown gpu_class {e.gpu_class!r}; "
                            f"known: {sorted(self.gpu_classes)}"
                        )
                    where = cluster_name(s.name, v.name)
                    if e.address in seen:
                        raise ValueError(f"endpoint {e.address} is listed twice ({seen[e.address]}, {where})")
                    seen[e.address] = where
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate service names in {names}")
        return self

    def memory_mib(self, endpoint: EndpointConfig) -> float:
        """GPU memory of ``endpoint`` in MiB: its own setting, else its GPU class's."""
        return endpoint.gpu_memory_mib or self.gpu_classes[endpoint.gpu_class].memory_mib


def cluster_name(service: str, version: str) -> str:
    """The Envoy cluster name of one service version: ``<service>-<version>``."""
    return f"{service}-{version}"


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at pydantic location ``loc`` (deepest node found)."""
    line = None if node is None else node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            nxt = None
        if nxt is None:
            break
        node, line = nxt, nxt.start_mark.line + 1
    return line


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not re.fullmatch(r"[A-Za-z0-9_-]+", str(part)):
            out += f"[{str(part)!r}]"  # an odd key (spaces, control characters) stays on one line
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate YAML ``text``.

    Raises:
        ConfigError: listing each problem as ``SOURCE:LINE: FIELD: message``.
    """
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = " ".join(str(getattr(err, "problem", None) or err).split())  # one line per problem
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a YAML mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        errors = [
            (tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))), e)
            for e in err.errors()
        ]
        # pydantic also reports a list as too short when its only items failed: keep the item errors.
        errors = [
            (loc, e) for loc, e in errors
            if not (e["type"] == "too_short" and any(o[: len(loc)] == loc and o != loc for o, _ in errors))
        ]
        lines = []
        for loc, e in errors:
            line = _line_of(node, loc)
            where = f"{source}:{line}" if line else source
            lines.append(f"{where}: {_path(loc)}: {e['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path) -> Config:
    """Read and validate the YAML file at ``path``.

    Raises:
        ConfigError: the file is missing, unreadable or invalid (each problem names field and line).
    """
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    return parse_config(text, str(path))
