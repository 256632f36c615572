"""Endpoints from Kubernetes, with the official ``kubernetes`` client: EndpointSlices (discovery.k8s.io/v1)
and InferencePools (inference.networking.k8s.io/v1, :mod:`xds_server.discovery.inferencepool`).

Pure part: :func:`endpoints_from` turns EndpointSlices plus their pods' labels into inferlb
endpoints per service and version; :func:`compose_config` adds them to the static config as
services, validated like any config. I/O part: :class:`KubernetesWatcher` lists, then watches,
each kind it needs (:class:`ListWatch`: resuming from the last ``resourceVersion`` it saw; a
``410 Gone``, history compacted, makes it list again). Each change calls back with the whole
discovered set.

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
from xds_server.discovery import inferencepool
from xds_server.discovery.services import Discovered, service_entry

log = logging.getLogger(__name__)

SKIPPED = Counter("inferlb_discovery_endpoints_skipped_total", "Discovered endpoints left out, by reason",
                  ["reason"])
RELISTS = Counter("inferlb_discovery_relists_total", "Full lists (start and 410 Gone), by kind "
                  "(endpointslices, inferencepools, pods)", ["kind"])
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
    """``base`` with one service per discovered Kubernetes service or InferencePool that has endpoints
    (a version without ready endpoints has no cluster until it has some).

    Raises:
        pydantic.ValidationError: the result is not a valid config (a bad label value, say).
    """
    spec = base.discovery.kubernetes
    if spec is None:
        return base
    extra = [service_entry(s, discovered.get(s.name, {})) for s in (*spec.services, *spec.inference_pools)
             if discovered.get(s.name)]
    data = base.model_dump(mode="json", exclude_none=True)
    data["services"] = [*data["services"], *extra]
    return Config.model_validate(data)


class ListWatch:
    """List, then watch, one kind of object in a background thread, for as long as ``stop`` is clear.

    ``list_fn(*args, **kwargs)``: a ``kubernetes`` client list method (it also serves the watch).
    ``on_list(items)`` gets every object of a full list (at start, and after ``410 Gone``);
    ``on_event(type, object)`` each ADDED / MODIFIED / DELETED event; both run in the thread. The
    watch resumes from the last ``resourceVersion`` seen (bookmarks included); other failures keep
    what was seen and retry with a back-off (0.5 s doubling to 30 s).
    """

    def __init__(self, kind: str, list_fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                 on_list: Callable[[list[dict]], None], on_event: Callable[[str, dict], None],
                 stop: threading.Event, watch_timeout_s: int) -> None:
        self.kind = kind
        self._list_fn, self._args, self._kwargs = list_fn, args, kwargs
        self._on_list, self._on_event = on_list, on_event
        self._stop = stop
        self._timeout = watch_timeout_s
        self.resource_version: str | None = None
        self._watch: Any = None
        self.thread = threading.Thread(target=self._run, name=f"k8s-{kind}", daemon=True)

    def stop(self) -> None:
        """End the watch call under way (the thread then sees ``stop`` set)."""
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> None:
        RELISTS.labels(self.kind).inc()
        doc = _json(self._list_fn(*self._args, **self._kwargs, _preload_content=False))
        self.resource_version = _get(doc, "metadata", "resourceVersion")
        self._on_list(list(doc.get("items", [])))

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                self._watch = watch.Watch()
                for event in self._watch.stream(self._list_fn, *self._args, **self._kwargs,
                                                resource_version=self.resource_version,
                                                timeout_seconds=self._timeout, allow_watch_bookmarks=True):
                    self._apply(event)
                    backoff = 0.5
                    if self._stop.is_set():
                        break
            except ApiException as err:
                if err.status == 410:
                    log.info("%s watch: resourceVersion %s is gone; listing again", self.kind, self.resource_version)
                    self.resource_version = None
                    continue
                log.warning("%s watch failed (%s); retrying in %.1f s", self.kind, err.status, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30)
            except Exception as err:  # network errors: keep the last discovered set, retry
                log.warning("%s watch failed: %s; retrying in %.1f s", self.kind, err, backoff)
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
        if kind != "BOOKMARK":
            self._on_event(str(kind), obj)


class KubernetesWatcher:
    """Lists and watches what ``spec`` names, each kind in its own background thread
    (:class:`ListWatch`): the EndpointSlices of ``spec.services`` (and lists pods for their
    labels), the InferencePools of ``spec.inference_pools`` and the pods of the namespace (watched:
    a pool's members are its ready pods).

    ``on_change(discovered)`` is called from those threads (one at a time) once every kind has been
    listed, and after every change then; hand it to the event loop (``loop.call_soon_threadsafe``).
    ``api_client``: a ``kubernetes.client.ApiClient`` (default: from ``spec.api_server``, in-cluster
    or kubeconfig).
    """

    def __init__(self, spec: KubernetesDiscovery, on_change: Callable[[Discovered], None],
                 api_client: Any = None, watch_timeout_s: int = 300) -> None:
        from kubernetes import client

        self.spec = spec
        self._on_change = on_change
        self._api = api_client or _api_client(spec)
        self._core = client.CoreV1Api(self._api)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._slices: dict[str, dict] = {}
        self._labels: dict[str, dict[str, str]] = {}   # pod name -> labels, listed for the slices
        self._pools: dict[str, dict] = {}
        self._pods: dict[str, dict] = {}               # pod name -> pod, watched for the pools
        self._watches: list[ListWatch] = []
        ns, timeout = spec.namespace, watch_timeout_s
        if spec.services:
            selector = f"{SERVICE_LABEL} in ({','.join(sorted({s.service for s in spec.services}))})"
            self._watches.append(ListWatch(
                "endpointslices", client.DiscoveryV1Api(self._api).list_namespaced_endpoint_slice, (ns,),
                {"label_selector": selector}, self._slices_listed, self._slice_event, self._stop, timeout))
        if spec.inference_pools:
            custom = client.CustomObjectsApi(self._api)
            self._watches.append(ListWatch(
                "inferencepools", custom.list_namespaced_custom_object,
                (inferencepool.GROUP, inferencepool.VERSION, ns, inferencepool.PLURAL), {},
                lambda items: self._listed(self._pools, items), lambda t, o: self._event(self._pools, t, o),
                self._stop, timeout))
            self._watches.append(ListWatch(
                "pods", self._core.list_namespaced_pod, (ns,), {},
                lambda items: self._listed(self._pods, items), lambda t, o: self._event(self._pods, t, o),
                self._stop, timeout))
        self._listed_kinds: set[str] = set()

    def start(self) -> None:
        """Start listing and watching in the background."""
        for w in self._watches:
            w.thread.start()

    def stop(self) -> None:
        """Stop watching (returns at once; each thread ends when its watch call returns)."""
        self._stop.set()
        for w in self._watches:
            w.stop()

    def _slices_listed(self, items: list[dict]) -> None:
        with self._lock:
            self._slices = {_get(i, "metadata", "name"): i for i in items}
            self._list_pod_labels()
            self._emit("endpointslices")

    def _slice_event(self, kind: str, obj: dict) -> None:
        with self._lock:
            name = _get(obj, "metadata", "name")
            if kind == "DELETED":
                self._slices.pop(name, None)
            else:
                self._slices[name] = obj
            self._emit("endpointslices")

    def _listed(self, store: dict[str, dict], items: list[dict]) -> None:
        with self._lock:
            store.clear()
            store.update((_get(i, "metadata", "name"), i) for i in items)
            self._emit("inferencepools" if store is self._pools else "pods")

    def _event(self, store: dict[str, dict], kind: str, obj: dict) -> None:
        with self._lock:
            name = _get(obj, "metadata", "name")
            if kind == "DELETED":
                store.pop(name, None)
            else:
                store[name] = obj
            self._emit("inferencepools" if store is self._pools else "pods")

    def _list_pod_labels(self) -> None:
        doc = _json(self._core.list_namespaced_pod(self.spec.namespace, _preload_content=False))
        self._labels = {_get(p, "metadata", "name"): _get(p, "metadata", "labels", default={})
                        for p in doc.get("items", [])}

    def _emit(self, kind: str) -> None:
        """Call back with everything discovered, once every kind has been listed (caller holds the lock)."""
        self._listed_kinds.add(kind)
        if len(self._listed_kinds) < len(self._watches):
            return
        discovered: Discovered = {}
        if self.spec.services:
            pods = {_get(ep, "targetRef", "name") for s in self._slices.values()
                    for ep in _get(s, "endpoints", default=[])}
            if pods - set(self._labels) - {None}:
                self._list_pod_labels()   # a pod we have not seen yet: read the labels again
            discovered.update(endpoints_from(self._slices.values(), self._labels, self.spec))
        if self.spec.inference_pools:
            discovered.update(inferencepool.endpoints_from_pools(self._pools.values(), self._pods.values(), self.spec))
        self._on_change(discovered)


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
