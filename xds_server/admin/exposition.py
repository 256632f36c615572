"""Prometheus collectors rendered from the control plane's state at scrape time.

Rendering at scrape time (rather than setting gauges each round) means an endpoint or node that
is gone has no series left behind, and an input with no data has no sample (never a fake 0).

- :class:`EndpointCollector`: per ``{cluster, endpoint}``: ``inferlb_endpoint_weight`` (the EDS
  ``load_balancing_weight``), ``inferlb_endpoint_health{status}`` (1 for the current health status,
  0 for the others), ``inferlb_endpoint_score{plugin}`` (each scorer's 0–1 score) and the engine's
  inputs as seen, in base units (:data:`INPUTS`).
- :class:`AutoscalingCollector`: per ``{cluster}``: the autoscaling signal (:data:`AUTOSCALING`).
- :class:`NodeCollector`: per connected Envoy ``{node, type}``: ``inferlb_xds_node_acked_version_info
  {version}``, ``inferlb_xds_node_in_sync`` (1 when the node ACKed the current snapshot's version),
  ``inferlb_xds_node_acks_total``, ``inferlb_xds_node_nacks_total`` (per stream: they restart with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from xds_server.autoscaling import ClusterLoad, signal
from xds_server.config.model import Autoscaling
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight

HEALTH_STATUSES = (HEALTHY, UNHEALTHY, DRAINING)
_MIB = 1024.0 * 1024.0
#: EndpointStats field -> (metric name, help, factor to the base unit).
INPUTS: dict[str, tuple[str, str, float]] = {
    "latency_mean_ms": ("inferlb_endpoint_latency_mean_seconds", "Mean request latency over the window", 1e-3),
    "latency_p95_ms": ("inferlb_endpoint_latency_p95_seconds", "95th-percentile request latency over the window",
                       1e-3),
    "itl_mean_ms": ("inferlb_endpoint_inter_token_latency_mean_seconds",
                    "Mean time between two output tokens over the window", 1e-3),
    "queue": ("inferlb_endpoint_queue_requests", "Waiting requests (window average)", 1.0),
    "running": ("inferlb_endpoint_running_requests", "Running requests (window average)", 1.0),
    "gpu_util": ("inferlb_endpoint_gpu_utilization_ratio", "GPU utilisation, 0-1", 1.0),
    "gpu_mem_free_mib": ("inferlb_endpoint_gpu_memory_free_bytes", "Free GPU memory", _MIB),
    "gpu_mem_used_mib": ("inferlb_endpoint_gpu_memory_used_bytes", "Used GPU memory", _MIB),
    "kv_cache": ("inferlb_endpoint_kv_cache_usage_ratio", "KV-cache usage, 0-1", 1.0),
    "in_flight": ("inferlb_endpoint_in_flight_requests", "Requests in flight (pushed node status)", 1.0),
    "request_rate": ("inferlb_endpoint_request_rate_per_second", "Finished requests per second over the window",
                     1.0),
    "error_rate": ("inferlb_endpoint_error_ratio", "Share of requests answered with a 5xx over the window, 0-1",
                   1.0),
    "success_total": ("inferlb_endpoint_backend_success", "Requests the backend reports served (its counter)", 1.0),
    "oom_total": ("inferlb_endpoint_backend_oom", "Requests the backend refused for GPU memory (its counter)", 1.0),
    "client_latency_mean_ms": ("inferlb_endpoint_client_latency_mean_seconds",
                               "Mean latency as Envoy saw it over the window", 1e-3),
    "client_latency_p95_ms": ("inferlb_endpoint_client_latency_p95_seconds",
                              "95th-percentile latency as Envoy saw it over the window", 1e-3),
    "client_error_rate": ("inferlb_endpoint_client_error_ratio", "Share of 5xx as Envoy saw it, 0-1", 1.0),
    "sample_age_s": ("inferlb_endpoint_sample_age_seconds", "Age of the newest metrics sample", 1.0),
}


class EndpointCollector(Collector):
    """Endpoint weights, health, scores and inputs from ``weights()`` (the control plane's last round)."""

    def __init__(self, weights: Callable[[], Sequence[EndpointWeight]]) -> None:
        self._weights = weights

    def collect(self) -> Iterator[Metric]:
        """The metric families (names in the module docstring)."""
        labels = ["cluster", "endpoint"]
        weight = GaugeMetricFamily("inferlb_endpoint_weight", "EDS load_balancing_weight pushed", labels=labels)
        health = GaugeMetricFamily("inferlb_endpoint_health", "1 for the endpoint's EDS health status, else 0",
                                   labels=[*labels, "status"])
        score = GaugeMetricFamily("inferlb_endpoint_score", "Score of one scorer plugin, 0-1 (absent: no data)",
                                  labels=[*labels, "plugin"])
        inputs = {field: GaugeMetricFamily(name, f"{doc} (input as seen by the weight engine)", labels=labels)
                  for field, (name, doc, _) in INPUTS.items()}
        for w in self._weights():
            key = [w.cluster, w.address]
            weight.add_metric(key, w.weight)
            for status in HEALTH_STATUSES:
                health.add_metric([*key, status], 1.0 if w.health == status else 0.0)
            for plugin, value in sorted(w.scores.items()):
                if value is not None:
                    score.add_metric([*key, plugin], value)
            for field, family in inputs.items():
                value = getattr(w.inputs, field)
                if value is not None:
                    family.add_metric(key, value * INPUTS[field][2])
        yield weight
        yield health
        yield score
        yield from inputs.values()


class NodeCollector(Collector):
    """Per-node xDS state from ``nodes()`` (``AdsServicer.describe_nodes()`` documents), compared with
    ``versions()``: the current snapshot's version per short type name (``Cluster``, ...)."""

    def __init__(self, nodes: Callable[[], list[dict]], versions: Callable[[], Mapping[str, str]]) -> None:
        self._nodes = nodes
        self._versions = versions

    def collect(self) -> Iterator[Metric]:
        """The metric families (names in the module docstring)."""
        labels = ["node", "type"]
        acked = GaugeMetricFamily("inferlb_xds_node_acked_version_info",
                                  "version_info the node last ACKed, per xDS type (value always 1)",
                                  labels=[*labels, "version"])
        in_sync = GaugeMetricFamily("inferlb_xds_node_in_sync",
                                    "1 when the node ACKed the current snapshot's version of the type",
                                    labels=labels)
        acks = CounterMetricFamily("inferlb_xds_node_acks", "ACKs on the node's current stream", labels=labels)
        nacks = CounterMetricFamily("inferlb_xds_node_nacks", "NACKs on the node's current stream", labels=labels)
        current = self._versions()
        for node in self._nodes():
            for type_name, st in sorted(node["types"].items()):
                key = [node["node_id"], type_name]
                if st["acked_version"] is not None:
                    acked.add_metric([*key, st["acked_version"]], 1.0)
                in_sync.add_metric(key, 1.0 if st["acked_version"] == current.get(type_name) else 0.0)
                acks.add_metric(key, st["acks"])
                nacks.add_metric(key, st["nacks"])
        yield acked
        yield in_sync
        yield acks
        yield nacks


#: The autoscaling signal's families: name -> help (one gauge each, label ``cluster``). Built for a
#: Kubernetes HPA through prometheus-adapter (an External metric) and for KEDA's Prometheus scaler:
#: ``inferlb_cluster_desired_replicas`` with target AverageValue 1 (threshold 1) makes the scaler's
#: replica count this suggestion; ``inferlb_cluster_saturation_ratio`` suits a Value target instead.
AUTOSCALING: dict[str, str] = {
    "inferlb_cluster_saturation_ratio": "Requests in flight and waiting in the picker over the max concurrency of "
                                        "the cluster's serving endpoints, 0-1 (1 = full or over)",
    "inferlb_cluster_queue_requests": "Requests waiting: in the picker's admission queue plus at the backends",
    "inferlb_cluster_queue_wait_seconds": "Expected wait of a request joining the queue now: queue / finished "
                                          "requests per second (Little's law); absent when unknown",
    "inferlb_cluster_replicas": "Endpoints of the cluster serving now (HEALTHY in EDS)",
    "inferlb_cluster_desired_replicas": "Suggested replica count: ceil(replicas x saturation / target saturation), "
                                        "the Kubernetes HPA rule with its tolerance; use with target AverageValue 1",
}


class AutoscalingCollector(Collector):
    """The autoscaling signal of every cluster (:mod:`xds_server.autoscaling`), computed at scrape time
    from ``loads()`` and the ``settings()`` in force (target saturation, tolerance)."""

    def __init__(self, loads: Callable[[], Sequence[ClusterLoad]], settings: Callable[[], Autoscaling]) -> None:
        self._loads = loads
        self._settings = settings

    def collect(self) -> Iterator[Metric]:
        """The metric families of :data:`AUTOSCALING`."""
        families = {name: GaugeMetricFamily(name, doc, labels=["cluster"]) for name, doc in AUTOSCALING.items()}
        settings = self._settings()
        for load in self._loads():
            s = signal(load, settings.target_saturation, settings.tolerance)
            key = [s.cluster]
            families["inferlb_cluster_saturation_ratio"].add_metric(key, s.saturation)
            families["inferlb_cluster_queue_requests"].add_metric(key, s.queue)
            if s.wait_s is not None:
                families["inferlb_cluster_queue_wait_seconds"].add_metric(key, s.wait_s)
            families["inferlb_cluster_replicas"].add_metric(key, s.replicas)
            families["inferlb_cluster_desired_replicas"].add_metric(key, s.desired_replicas)
        yield from families.values()
