"""Endpoints from Kubernetes EndpointSlices (discovery.k8s.io/v1), with the official ``kubernetes`` client.

Pure part: :func:`endpoints_from` turns EndpointSlices plus their pods' labels into inferlb
endpoints per service and version; :func:`compose_config` adds them to the static config as
services, validated like any config. I/O part: :class:`KubernetesWatcher` lists the slices (and
pods), then watches the slices, resuming from the last ``resourceVersion`` it saw; a ``410 Gone``
(history compacted) makes it list again. Each change calls back with the whole discovered set.

Rules (Kubernetes docs, "EndpointSlices"): an endpoint takes traffic when ``conditions.ready`` is
not false; its pod is ``targetRef`` (kind Pod); the slice's ``ports`` name the port numbers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import Counter

from xds_server.config import Config, ConfigError, KubernetesDiscovery
from xds_server.discovery.services import Discovered, service_entry

log = logging.getLogger(__name__)

SKIPPED = Counter("inferlb_discovery_endpoints_skipped_total", "Discovered endpoints left out, by reason",
                  ["reason"])
RELISTS = Counter("inferlb_discovery_relists_total", "Full lists of EndpointSlices (start and 410 Gone)")
SERVICE_LABEL = "kubernetes.io/service-name"


def require_client(cfg: Config) -> None:
    """With ``discovery.kubernetes`` configured, check that the ``kubernetes`` package (the ``k8s``
    extra) can be imported (else the watcher's import fails in its loop task and /readyz stays 503).

    Raises:
        ConfigError: it cannot; one line naming ``discovery.kubernetes`` and the fix.
    """
    if cfg.discovery.kubernetes is None:
        return
    try:
        import kubernetes  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"discovery.kubernetes needs the kubernetes package, which cannot be imported ({err}): "
                          "pip install 'inferlb[k8s]'") from None


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if obj is None:
            return default
        obj = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
    return default if obj is None else obj


def _port(slice_: Mapping, wanted: int | str) -> int | None:
    ports = _get(slice_, "ports", default=[])
    if isinstance(wanted, int):
        return wanted if any(_get(p, "port") == wanted for p in ports) or not ports else None
    return next((_get(p, "port") for p in ports if _get(p, "name") == wanted), None)


def endpoints_from(slices: Iterable[Mapping], pod_labels: Mapping[str, Mapping[str, str]],
                   spec: KubernetesDiscovery) -> Discovered:
    """EndpointSlices (API JSON, camelCase) + ``{pod name: labels}`` -> endpoints per service and version.

    Ready endpoints only; one per address; versions and endpoints in a stable order (sorted), so
    two control planes given the same inputs produce the same config. Pure.
    """
    by_k8s = {s.service: s for s in spec.services}
    out: Discovered = {s.name: {} for s in spec.services}
    seen: set[str] = set()
    for slice_ in slices:
        svc = by_k8s.get(_get(slice_, "metadata", "labels", default={}).get(SERVICE_LABEL))
        if svc is None:
            continue
        port = _port(slice_, svc.port)
        if port is None:
            SKIPPED.labels("no-port").inc()
            continue
        for ep in _get(slice_, "endpoints", default=[]):
            if _get(ep, "conditions", "ready") is False:
                continue
            pod = _get(ep, "targetRef", "name")
            labels = pod_labels.get(pod) if pod else None
            version = (labels or {}).get(spec.version_label)
            if not version:
                SKIPPED.labels("no-version-label").inc()
                continue
            for ip in _get(ep, "addresses", default=[])[:1]:
                address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                if address in seen:
                    continue
                seen.add(address)
                out[svc.name].setdefault(version, []).append({
                    "address": address,
                    "gpu_class": labels.get(spec.gpu_class_label, spec.default_gpu_class),
                    "max_concurrency": svc.max_concurrency,
                })
    return {name: {v: sorted(eps, key=lambda e: e["address"]) for v, eps in sorted(versions.items())}
            for name, versions in out.items()}


def compose_config(base: Config, discovered: Discovered) -> Config:
    """``base`` with one service per discovered Kubernetes service that has endpoints (a version
    without ready endpoints has no cluster until it has some).

    Raises:
        pydantic.ValidationError: the result is not a valid config (a bad label value, say).
    """
    spec = base.discovery.kubernetes
    if spec is None:
        return base
    extra = [service_entry(s, discovered.get(s.name, {})) for s in spec.services if discovered.get(s.name)]
    data = base.model_dump(mode="json", exclude_none=True)
    data["services"] = [*data["services"], *extra]
    return Config.model_validate(data)


class KubernetesWatcher:
    """Lists and watches EndpointSlices (and lists pods for their labels) in a background thread.

    ``on_change(discovered)`` is called from that thread after the first list and after every
    change; hand it to the event loop (``loop.call_soon_threadsafe``). ``api_client``: a
    ``kubernetes.client.ApiClient`` (default: from ``spec.api_server``, in-cluster or kubeconfig).
    """

    def __init__(self, spec: KubernetesDiscovery, on_change: Callable[[Discovered], None],
                 api_client: Any = None, watch_timeout_s: int = 300) -> None:
        from kubernetes import client

        self.spec = spec
        self._on_change = on_change
        self._api = api_client or _api_client(spec)
        self._discovery = client.DiscoveryV1Api(self._api)
        self._core = client.CoreV1Api(self._api)
        self._timeout = watch_timeout_s
        self._selector = f"{SERVICE_LABEL} in ({','.join(sorted({s.service for s in spec.services}))})"
        self._slices: dict[str, dict] = {}
        self._pods: dict[str, dict[str, str]] = {}
        self.resource_version: str | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)

    def start(self) -> None:
        """Start listing and watching in the background."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (returns at once; the thread ends when its watch call returns)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> None:
        RELISTS.inc()
        result = self._discovery.list_namespaced_endpoint_slice(self.spec.namespace, label_selector=self._selector,
                                                                 _preload_content=False)
        doc = _json(result)
        self._slices = {_get(i, "metadata", "name"): i for i in doc.get("items", [])}
        self.resource_version = _get(doc, "metadata", "resourceVersion")
        self._list_pods()
        self._emit()

    def _list_pods(self) -> None:
        doc = _json(self._core.list_namespaced_pod(self.spec.namespace, _preload_content=False))
        self._pods = {_get(p, "metadata", "name"): _get(p, "metadata", "labels", default={})
                      for p in doc.get("items", [])}

    def _emit(self) -> None:
        pods = {_get(ep, "targetRef", "name") for s in self._slices.values() for ep in _get(s, "endpoints", default=[])}
        if pods - set(self._pods) - {None}:
            self._list_pods()   # a pod we have not seen yet: read the labels again
        self._on_change(endpoints_from(self._slices.values(), self._pods, self.spec))

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch = watch.Watch()
                for event in self._watch.stream(self._discovery.list_namespaced_endpoint_slice, self.spec.namespace,
                                                label_selector=self._selector, resource_version=self.resource_version,
                                                timeout_seconds=self._timeout, allow_watch_bookmarks=True):
                    self._apply(event)
                    backoff = 0.5
                    if self._stop.is_set():
                        break
            except ApiException as err:
                if err.status == 410:
                    log.info("EndpointSlice watch: resourceVersion %s is gone; listing again", self.resource_version)
                    self.resource_version = None
                    continue
                log.warning("EndpointSlice watch failed (%s); retrying in %.1f s", err.status, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30)
            except Exception as err:  # network errors: keep the last discovered set, retry
                log.warning("EndpointSlice watch failed: %s; retrying in %.1f s", err, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30)

    def _apply(self, event: Mapping) -> None:
        kind, obj = event.get("type"), event.get("raw_object") or event.get("object")
        rv = _get(obj, "metadata", "resourceVersion")
        if kind == "ERROR":
            from kubernetes.client.exceptions import ApiException

            raise ApiException(status=_get(obj, "code", default=500), reason=_get(obj, "message"))
        if rv:
            self.resource_version = rv
        if kind == "BOOKMARK":
            return
        name = _get(obj, "metadata", "name")
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = obj
        self._emit()


def _json(response: Any) -> dict:
    import json

    return json.loads(response.data)


def _api_client(spec: KubernetesDiscovery) -> Any:
    from kubernetes import client, config

    if spec.api_server:
        conf = client.Configuration()
        conf.host = spec.api_server
        return client.ApiClient(conf)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()

