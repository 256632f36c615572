"""Config -> the metrics sources (``metrics`` section): Prometheus, scrape, push, status, combined."""

from __future__ import annotations

from dataclasses import dataclass

from xds_server.config import Config
from xds_server.metrics.combined import CombinedSource
from xds_server.metrics.presets import preset, promql_queries
from xds_server.metrics.source import PullSource
from xds_server.metrics.sources.envoy import ClientView, EnvoyView
from xds_server.metrics.sources.prometheus import PrometheusSource
from xds_server.metrics.sources.push import PushSource
from xds_server.metrics.sources.scrape import ScrapeSource
from xds_server.metrics.sources.status import StatusSource


@dataclass
class Sources:
    """The built sources: ``combined`` is what the control plane fetches from; ``scrape`` (its loop must
    run), ``push`` (its gRPC server must be started) and ``status`` (the etcd watcher feeds it) are
    set when configured."""

    combined: CombinedSource
    scrape: ScrapeSource | None
    push: PushSource | None
    status: StatusSource | None = None


def build_sources(cfg: Config, client_view: ClientView | None = None) -> Sources:
    """The sources ``cfg.metrics`` asks for, reading the preset's metric names (custom PromQL included).

    ``client_view``: Envoy's view of the endpoints (the picker's access-log completions), which fills
    the ``client_*`` inputs.
    """
    m = cfg.metrics
    specs = preset(m.preset, m.gpu)
    endpoints = [e for s in cfg.services for v in s.versions for e in v.endpoints]
    pod_join = m.gpu_join == "pod"
    gpu_by = ("namespace", "pod") if pod_join else ("instance",)
    window, stale = cfg.prometheus.window_s, cfg.engine.stale_after_s

    scrape = None
    if "scrape" in m.sources or m.fallback == "scrape":
        scrape = ScrapeSource(
            {e.instance: f"http://{e.address}{m.scrape.path}" for e in endpoints}, specs, window,
            m.scrape.interval_s, m.scrape.timeout_s,
            {e.instance: {"namespace": e.namespace, "pod": e.pod} for e in endpoints} if pod_join else None,
            {e.instance: e.gpu_metrics_url for e in endpoints if e.gpu_metrics_url})
    pulls: list[PullSource] = []
    for name in m.sources:
        if name == "prometheus":
            queries = promql_queries(specs, gpu_by)
            for field, q in m.queries.items():
                gpu = field in specs and specs[field].gpu
                queries[field] = (q, 1.0, gpu_by if gpu else ("instance",))
            gpu_keys = {e.instance: f"{e.namespace}/{e.pod}" for e in endpoints} if pod_join else None
            gpu_fields = [f for f, spec in specs.items() if spec.gpu]
            pulls.append(PrometheusSource(cfg.prometheus.url, window, cfg.loop.timeout_s, queries, gpu_keys,
                                          gpu_fields, stale_after_s=stale))
        elif name == "scrape":
            assert scrape is not None
            pulls.append(scrape)
    push = PushSource([e.instance for e in endpoints]) if "push" in m.sources else None
    fallback = scrape if m.fallback == "scrape" and "scrape" not in m.sources else None
    envoy = EnvoyView(client_view, {e.address: e.instance for e in endpoints}) if client_view is not None else None
    status = StatusSource() if "status" in m.sources else None
    return Sources(CombinedSource(pulls, push=push, fallback=fallback, stale_after_s=stale, envoy=envoy,
                                  status=status), scrape, push, status)
