"""inferlb's slow loop in the lab: engines' metrics, scraped and windowed as Prometheus would, into the
real weight engine, out as the EDS every policy sees.

Every ``prometheus.scrape_interval_s`` each present engine is scraped: its gauges and counters
(:class:`sim.engines.api.EngineStats`) and the end-to-end latency histogram and HTTP status counts
of the requests it finished (kept here from the harness's events, as vLLM's own ``/metrics`` counts
them), under the names vLLM V1, its HTTP server and the DCGM exporter use. The scrapes go into
inferlb's scrape source (:class:`xds_server.metrics.sources.scrape.ScrapeSource`: the same signal
definitions the Prometheus source renders to PromQL, evaluated over ``prometheus.window_s``), and
every ``loop.interval_s`` a round runs the real weight engine (an engine never scraped has no data, as
with the Prometheus source: its sample age is unknown, so it is stale)
(:func:`xds_server.engine.pipeline.compute_weights` with the built-in plugins and the config's
parameters) on those stats, as :class:`xds_server.control.ControlPlane` does. Its weights and
health become the lab's :class:`~bench.lab.policy.Eds` (drained-and-removed endpoints and nodes
that left discovery are left out).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from bench.lab.cluster import Cluster, SlowLoopTiming
from bench.lab.policy import Eds, Endpoint
from sim.engines.api import EngineStats
from sim.metrics import LATENCY_BUCKETS_S
from xds_server.config import Config
from xds_server.control import endpoint_specs, engine_params
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import EngineState
from xds_server.metrics.presets import preset
from xds_server.metrics.sources.scrape import ScrapeSource
from xds_server.metrics.window import Labels, Scrape

__all__ = ["EndpointCounters", "SlowLoop", "scrape_of"]

_NO_LABELS: Labels = ()
_LE = tuple(((("le", f"{b:g}"),)) for b in LATENCY_BUCKETS_S) + ((("le", "+Inf"),),)


@dataclass
class EndpointCounters:
    """What an engine's ``/metrics`` counts of its finished requests (cumulative): the end-to-end
    latency histogram (:data:`sim.metrics.LATENCY_BUCKETS_S`) and the HTTP answers by class."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0
    ok: int = 0
    errors: int = 0
    ooms: int = 0

    def finished(self, latency_s: float) -> None:
        """One request answered 200 after ``latency_s`` at the engine."""
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1
        self.latency_sum_s += latency_s
        self.ok += 1

    def failed(self, oom: bool) -> None:
        """One request answered 5xx (``oom``: out of GPU memory)."""
        self.errors += 1
        self.ooms += oom


def scrape_of(t: float, stats: EngineStats, counters: EndpointCounters) -> Scrape:
    """One scrape at ``t`` of an engine with ``stats`` and ``counters`` (the series inferlb's presets read)."""
    cumulative, total = [], 0
    for n in counters.buckets:
        total += n
        cumulative.append(total)
    one = lambda v: ((_NO_LABELS, float(v)),)  # noqa: E731
    samples = {
        "vllm:num_requests_running": one(stats.running),
        "vllm:num_requests_waiting": one(stats.waiting),
        "vllm:kv_cache_usage_perc": one(stats.kv_usage),
        "vllm:e2e_request_latency_seconds_bucket": tuple(zip(_LE, map(float, cumulative), strict=True)),
        "vllm:e2e_request_latency_seconds_sum": one(counters.latency_sum_s),
        "vllm:e2e_request_latency_seconds_count": one(counters.ok),
        "vllm:request_success_total": one(counters.ok),
        "http_requests_total": (((("status", "2xx"),), float(counters.ok)),
                                ((("status", "5xx"),), float(counters.errors))),
        "inferlb_sim_oom_total": one(counters.ooms),
        "DCGM_FI_DEV_FB_FREE": one(stats.memory_free_mib),
        "DCGM_FI_DEV_FB_USED": one(stats.memory_used_mib),
    }
    return Scrape(t, samples)


class SlowLoop:
    """inferlb's control plane in virtual time for one run.

    Args:
        cluster: the lab's nodes.
        config: inferlb's config for them (:meth:`bench.lab.cluster.Cluster.config`).
        timing: the scrape interval.
    """

    def __init__(self, cluster: Cluster, config: Config, timing: SlowLoopTiming) -> None:
        self.cluster = cluster
        self.specs = endpoint_specs(config)
        self.params = engine_params(config)
        self.routes = cluster.routes
        self.default_version = cluster.versions[0]
        specs = preset(config.metrics.preset, config.metrics.gpu)
        self.source = ScrapeSource({s.instance: f"lab://{s.instance}" for s in self.specs}, specs,
                                   config.prometheus.window_s, timing.scrape_interval_s)
        self.state = EngineState()
        self.version = 0
        self.eds: Eds | None = None
        self.present: set[str] = set()
        self.gone: set[str] = set()
        self.scraped: set[str] = set()

    def scrape(self, t: float, stats: Mapping[str, EngineStats], counters: Mapping[str, EndpointCounters]) -> None:
        """Scrape every present engine at ``t`` (``stats`` and ``counters`` by address)."""
        for address in sorted(self.present):
            self.source.add(address, scrape_of(t, stats[address], counters[address]))
            self.scraped.add(address)

    def round(self, t: float) -> Eds:
        """One weight round at ``t``; returns the EDS (a new :attr:`Eds.version` when it changed)."""
        specs = [s for s in self.specs if s.address not in self.gone]
        stats = self.source.fetch([s.instance for s in specs], now=t)
        for instance in [i for i in stats if i not in self.scraped]:  # no series yet: no data (Prometheus)
            stats[instance] = replace(stats[instance], sample_age_s=None)
        verdicts, self.state = compute_weights(specs, stats, self.state, self.params, now=t, plugins=BUILTIN)
        by_cluster: dict[str, list[Endpoint]] = {}
        for spec, w in zip(specs, verdicts, strict=True):
            if w.removed:
                continue
            by_cluster.setdefault(spec.cluster, []).append(Endpoint(
                spec.address, spec.cluster, int(w.weight), w.health, spec.gpu_class, spec.tier,
                spec.max_concurrency, spec.memory_mib))
        clusters = {c: tuple(sorted(eps)) for c, eps in sorted(by_cluster.items())}
        if self.eds is None or self.eds.clusters != clusters:
            self.version += 1
        self.eds = Eds(self.version, t, MappingProxyType(clusters), MappingProxyType(self.routes),
                       self.default_version, MappingProxyType({s.address: stats[s.instance] for s in specs}))
        return self.eds

    def join(self, address: str) -> None:
        """A node comes up: scraped from now on."""
        self.present.add(address)
        self.gone.discard(address)

    def leave(self, address: str) -> None:
        """A node leaves discovery: no longer scraped nor in any assignment."""
        self.present.discard(address)
        self.gone.add(address)
