"""The metrics source the control plane uses: the configured sources, merged, with an optional fallback.

Pull sources (``prometheus``, ``scrape``) answer per round; the ``push`` source holds what nodes
streamed. Per endpoint and input the freshest answer wins (:func:`.merge.merge`). When a pull source
fails (down, slow, garbage) the failure is counted and flagged; if ``fallback`` (the scrape source)
is configured it answers in its place, otherwise the round fails with :class:`MetricsUnavailable`
and the control plane keeps the last good weights (C05) — a source outage must not mark healthy
endpoints stale. :attr:`CombinedSource.name` says which sources answered the last round.

Another source (e.g. Envoy's access-log view of each endpoint, giving the ``client_*`` inputs) plugs
in as one more pull source: any object with ``name`` and a non-blocking or blocking
``fetch(instances) -> {instance: EndpointStats}`` whose ``sample_age_s`` is the age of its data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import Counter, Gauge

from xds_server.metrics.merge import merge
from xds_server.metrics.source import MetricsUnavailable, PullSource
from xds_server.metrics.sources.envoy import EnvoyView
from xds_server.metrics.stats import EndpointStats

log = logging.getLogger(__name__)

FAILURES = Counter("inferlb_metrics_source_failures_total", "Rounds a metrics source failed in", ["source"])
SOURCE_OK = Gauge("inferlb_metrics_source_ok", "1 when the source answered the last round", ["source"])
FALLBACK = Gauge("inferlb_metrics_fallback_active", "1 while the fallback source answers for a failed one")


class CombinedSource:
    """``pulls`` (priority order), optional held sources (``push``: pushed over gRPC; ``status``: the
    snapshots in etcd registrations), which never fail, and an optional ``fallback`` pull source;
    ``envoy``: Envoy's view, which fills the ``client_*`` inputs after the merge (see :mod:`.envoy_view`).

    ``stale_after_s``: answers older than this are dropped when a fresher one exists (s).
    """

    def __init__(self, pulls: Sequence[PullSource], *, push: PullSource | None = None,
                 fallback: PullSource | None = None, stale_after_s: float = 15.0,
                 envoy: EnvoyView | None = None, status: PullSource | None = None) -> None:
        if not pulls and push is None and status is None:
            raise ValueError("at least one metrics source is needed")
        self.pulls = list(pulls)
        self.push = push
        self.held = [s for s in (push, status) if s is not None]
        self.fallback = fallback if fallback is not None and fallback not in self.pulls else None
        self.stale_after_s = stale_after_s
        self.envoy = envoy
        configured = [s.name for s in self.pulls] + [s.name for s in self.held]
        self._name = "+".join(configured)
        self.configured = configured
        self.fallback_active = False
        self.errors: dict[str, str] = {}
        self.failures: dict[str, int] = {}
        self.origin: Mapping[str, Mapping[str, str]] = {}

    @property
    def name(self) -> str:
        """The sources that answered the last round, joined by ``+`` (e.g. ``scrape`` when the fallback answered)."""
        return self._name

    def fetch(self, instances: Iterable[str]) -> dict[str, EndpointStats]:
        """One round: ``{instance: merged EndpointStats}``; :attr:`origin` says which source gave each input.

        Blocking. Raises:
            MetricsUnavailable: a pull source failed and no fallback answered in its place.
        """
        instances = list(instances)
        answers: dict[str, Mapping[str, EndpointStats]] = {}
        failed: dict[str, str] = {}
        for src in self.pulls:
            try:
                answers[src.name] = src.fetch(instances)
            except MetricsUnavailable as err:
                failed[src.name] = str(err) or type(err).__name__
        for src in self.pulls:
            ok = src.name not in failed
            SOURCE_OK.labels(src.name).set(1 if ok else 0)
            if not ok:
                FAILURES.labels(src.name).inc()
                self.failures[src.name] = self.failures.get(src.name, 0) + 1
                if self.errors.get(src.name) is None:
                    log.error("metrics source %s failed: %s", src.name, failed[src.name])
            elif self.errors.get(src.name) is not None:
                log.info("metrics source %s answers again", src.name)
            self.errors[src.name] = failed.get(src.name)  # type: ignore[assignment]
        use_fallback = bool(failed) and self.fallback is not None
        if use_fallback != self.fallback_active:
            log.warning("fallback source %s %s", self.fallback.name if self.fallback else "-",
                        "answers for the failed source(s)" if use_fallback else "no longer needed")
        self.fallback_active = use_fallback
        FALLBACK.set(1 if use_fallback else 0)
        if failed and not use_fallback:
            raise MetricsUnavailable("; ".join(f"{n}: {e}" for n, e in failed.items()))
        if use_fallback:
            assert self.fallback is not None
            answers[self.fallback.name] = self.fallback.fetch(instances)
        for src in self.held:
            answers[src.name] = src.fetch(instances)
        merged, self.origin = merge(answers, instances, self.stale_after_s)
        used = self.origin.sources()
        self._name = "+".join(n for n in answers if n in used) or "+".join(answers)
        return self.envoy.enrich(merged) if self.envoy is not None else merged

    def sample_intervals(self) -> dict[str, float]:
        """``{source name: how often its samples are renewed (s)}`` for the pull sources that know it
        (Prometheus once its scrape interval was read from its targets API; the scrape source)."""
        out = {}
        for src in [*self.pulls, *([self.fallback] if self.fallback else [])]:
            interval = getattr(src, "sample_interval_s", None)
            if isinstance(interval, int | float) and interval > 0:
                out[src.name] = float(interval)
        return out

    def describe(self) -> dict:
        """For the admin API: configured sources, per-source failures and last error, fallback state."""
        sources = {}
        for src in [*self.pulls, *([self.fallback] if self.fallback else []), *self.held]:
            d = {"failures": self.failures.get(src.name, 0), "last_error": self.errors.get(src.name)}
            extra = getattr(src, "describe", None)
            if callable(extra):
                d.update(extra())
            sources[src.name] = d
        return {"configured": self.configured, "fallback": self.fallback.name if self.fallback else None,
                "fallback_active": self.fallback_active, "sources": sources}
