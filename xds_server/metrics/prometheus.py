"""The Prometheus metrics source: sliding-window PromQL -> :class:`EndpointStats` per instance.

Thin I/O shell: it runs the preset's queries with prometheus-api-client and parses the vectors.
It keeps two pieces of state per instance: the newest sample time seen, so an endpoint whose series
went stale (Prometheus drops them from instant queries) keeps an honest, growing age (case C04);
and when it was first asked for, so an endpoint never seen yet ages from then (a new endpoint, or
every endpoint at start-up before Prometheus's first scrape, is not stale at once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace

from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests import RequestException
from urllib3.util.retry import Retry

from .presets import VLLM_DCGM
from .stats import EndpointStats, finite

log = logging.getLogger(__name__)


class MetricsUnavailable(RuntimeError):
    """The source could not produce a round of statistics (Prometheus down, slow or answering garbage)."""


def _window(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def parse_vector(result: object, scale: float = 1.0) -> dict[str, float | None]:
    """A PromQL instant-vector answer -> ``{instance: value x scale}``; NaN/Inf -> ``None`` (C08).

    Raises:
        MetricsUnavailable: the answer is not a list of ``{"metric": {...}, "value": [ts, "v"]}``.
    """
    if not isinstance(result, list):
        raise MetricsUnavailable(f"expected a vector, got {type(result).__name__}")
    out: dict[str, float | None] = {}
    for series in result:
        try:
            instance = series["metric"]["instance"]
            raw = series["value"][1]
        except (KeyError, IndexError, TypeError) as err:
            raise MetricsUnavailable(f"malformed series in answer: {series!r:.200}") from err
        value = finite(raw)
        out[str(instance)] = None if value is None else value * scale
    return out


class PrometheusSource:
    """Queries Prometheus every round. ``window_s``: range of rates/averages (s); ``timeout_s`` per query."""

    name = "prometheus"

    def __init__(self, url: str, window_s: float, timeout_s: float,
                 queries: Mapping[str, tuple[str, float]] = VLLM_DCGM) -> None:
        # No client-side retries: a hung Prometheus would cost (retries + 1) x timeout per query; the
        # next round is the retry.
        self._prom = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s, retry=Retry(total=0))
        self._timeout_s = timeout_s
        self._queries = {k: (q.replace("{w}", _window(window_s)), s) for k, q_s in queries.items()
                         for q, s in [q_s]}
        self._last_seen: dict[str, float] = {}
        self._first_asked: dict[str, float] = {}

    def fetch(self, instances: Iterable[str], now: float | None = None) -> dict[str, EndpointStats]:
        """One round: ``{instance: EndpointStats}`` for every instance asked for (no data -> fields ``None``).

        ``sample_age_s`` is the age of the newest sample seen, or, never seen, the time since the
        instance was first asked for.

        Blocking (run it in a thread). Raises:
            MetricsUnavailable: any query failed, timed out or returned garbage; nothing is partial.
        """
        values: dict[str, dict[str, float | None]] = {}
        for field, (query, scale) in self._queries.items():
            try:
                result = self._prom.custom_query(query, params={"timeout": f"{round(self._timeout_s * 1000)}ms"})
            except (PrometheusApiClientException, RequestException, ValueError) as err:
                raise MetricsUnavailable(f"query for {field} failed: {err}") from err
            except (KeyError, TypeError) as err:  # a 200 whose JSON is not a Prometheus answer
                raise MetricsUnavailable(f"query for {field}: not a Prometheus answer ({err!r})") from err
            values[field] = parse_vector(result, scale)
        now = time.time() if now is None else now
        out: dict[str, EndpointStats] = {}
        for inst in instances:
            ts = values["last_sample_ts"].get(inst)
            if ts is not None:
                self._last_seen[inst] = max(ts, self._last_seen.get(inst, ts))
            seen = self._last_seen.get(inst) or self._first_asked.setdefault(inst, now)
            stats = EndpointStats(**{f: values[f].get(inst) for f in values if f != "last_sample_ts"})
            out[inst] = replace(stats, sample_age_s=max(0.0, now - seen))
        return out
