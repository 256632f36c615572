"""The ``scrape`` metrics source: the control plane scrapes every endpoint's ``/metrics`` itself.

For demos without Prometheus, and as the fallback when Prometheus fails. An asyncio task
(:meth:`ScrapeSource.run`, aiohttp) GETs each endpoint every ``interval_s``, parses the exposition with
prometheus_client's text parser, keeps the samples the preset reads in a per-endpoint sliding window
of ``window_s``, and :meth:`ScrapeSource.fetch` evaluates the preset's signals over those windows
(:mod:`.window`: the same definitions the Prometheus source renders to PromQL). A failed or garbage
scrape adds nothing, so that endpoint's sample age grows until it is stale (C04).

Thread-safety: the loop thread appends, the round's worker thread reads; one lock guards the windows.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from xds_server.metrics.presets import SAMPLE_TIME
from xds_server.metrics.signals import (
    Gauge,
    HistogramMean,
    HistogramQuantile,
    Plus,
    Rate,
    Ratio,
    SampleTime,
    Sel,
    Signal,
    SignalSpec,
    Total,
)
from xds_server.metrics.stats import EndpointStats, finite
from xds_server.metrics.window import Labels, Scrape, evaluate

log = logging.getLogger(__name__)

#: Rounds in a row an endpoint's GPU inputs must match nothing before it is logged.
GPU_MISSING_ROUNDS = 3


def _sels(signal: Signal) -> list[tuple[Sel, tuple[str, ...]]]:
    if isinstance(signal, Gauge):
        return [(signal.sel, ("",)), *([(signal.minus, ("",))] if signal.minus else [])]
    if isinstance(signal, HistogramMean):
        return [(signal.base, ("_sum", "_count"))]
    if isinstance(signal, HistogramQuantile):
        return [(signal.base, ("_bucket",))]
    if isinstance(signal, Ratio):
        return [(signal.num, ("",)), (signal.den, ("",))]
    if isinstance(signal, Rate | Total | SampleTime):
        return [(signal.sel, ("",))]
    if isinstance(signal, Plus):
        return [x for p in signal.parts for x in _sels(p)]
    raise TypeError(f"not a signal: {signal!r}")


def sample_names(specs: Mapping[str, SignalSpec]) -> frozenset[str]:
    """Every sample name the specs read (histogram suffixes included)."""
    return frozenset(n + suffix for spec in specs.values() for sel, suffixes in _sels(spec.signal)
                     for n in sel.names for suffix in suffixes)


def parse_exposition(text: str, keep: frozenset[str]) -> dict[str, tuple[tuple[Labels, float], ...]]:
    """Prometheus text exposition -> ``{sample name: ((sorted labels, value), ...)}`` for names in ``keep``.

    NaN/Inf values are kept out (no data). Raises:
        ValueError: the text is not a valid exposition.
    """
    out: dict[str, list[tuple[Labels, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in keep:
                v = finite(s.value)
                if v is not None:
                    out.setdefault(s.name, []).append((tuple(sorted(s.labels.items())), v))
    return {k: tuple(v) for k, v in out.items()}


def _exporter(url: str) -> str:
    """The window key of a GPU exporter's page (shared by the endpoints that name its URL)."""
    return f"gpu-exporter {url}"


class ScrapeSource:
    """Scrapes ``targets`` (``{instance: URL}``) and evaluates ``specs`` over ``window_s`` per instance.

    ``gpu_labels``: ``{instance: {label: value}}`` a GPU series must carry to count for that
    instance (the pod/namespace join; ``exported_<label>`` counts first, as Prometheus renames a
    clashing label); ``interval_s``/``timeout_s``: scrape period and timeout (s); ``gpu_targets``:
    ``{instance: URL}`` of a GPU exporter page (e.g. a node's dcgm-exporter) read for that instance's
    GPU inputs instead of its own page. An endpoint whose pages were read but that no GPU series
    counts for is logged once.
    """

    name = "scrape"

    def __init__(self, targets: Mapping[str, str], specs: Mapping[str, SignalSpec], window_s: float,
                 interval_s: float = 1.0, timeout_s: float = 1.0,
                 gpu_labels: Mapping[str, Mapping[str, str]] | None = None,
                 gpu_targets: Mapping[str, str] | None = None) -> None:
        if SAMPLE_TIME not in specs:
            raise ValueError(f"specs must include {SAMPLE_TIME!r}")
        self.targets = dict(targets)
        self._specs = dict(specs)
        self._keep = sample_names(specs)
        self.window_s = window_s
        self.interval_s = interval_s
        self.sample_interval_s = interval_s  #: how often its samples are renewed (s)
        self.timeout_s = timeout_s
        self._gpu_labels = {k: dict(v) for k, v in (gpu_labels or {}).items()}
        self.gpu_targets = dict(gpu_targets or {})
        self._gpu_specs = [f for f, spec in self._specs.items() if spec.gpu]
        self._gpu_warned: set[str] = set()
        self._gpu_missing: dict[str, int] = {}  # rounds in a row with own series but no GPU series
        self._windows: dict[str, deque[Scrape]] = {inst: deque() for inst in self.targets}
        for url in set(self.gpu_targets.values()):
            self._windows[_exporter(url)] = deque()
        self._first_asked: dict[str, float] = {}
        self._lock = threading.Lock()
        self.scrapes_ok = 0
        self.scrapes_failed = 0
        self.last_error: dict[str, str] = {}

    def ingest(self, instance: str, text: str, t: float) -> None:
        """Add one scrape of ``instance`` taken at ``t`` (Unix s). Raises ValueError on a garbage page."""
        self.add(instance, Scrape(t, parse_exposition(text, self._keep)))

    def add(self, instance: str, scrape: Scrape) -> None:
        """Add one parsed scrape of ``instance`` (its samples by name, taken at ``scrape.t``); scrapes
        older than the window (and one interval) are dropped. (``inferlb bench lab`` feeds its
        simulated engines' samples here, in virtual time, without an exposition to parse.)"""
        with self._lock:
            w = self._windows.setdefault(instance, deque())
            w.append(scrape)
            while w and w[0].t <= scrape.t - self.window_s - self.interval_s:
                w.popleft()

    def fetch(self, instances: Iterable[str], now: float | None = None) -> dict[str, EndpointStats]:
        """``{instance: EndpointStats}`` over each instance's window ending at ``now`` (no I/O, never raises).

        ``sample_age_s``: since the newest good scrape, or, never scraped, since first asked for.
        """
        now = time.time() if now is None else now
        out = {}
        for inst in instances:
            gpu_url = self.gpu_targets.get(inst)
            with self._lock:
                scrapes = [s for s in self._windows.get(inst, ()) if now - self.window_s < s.t <= now]
                newest = self._windows[inst][-1].t if self._windows.get(inst) else None
                gpu_scrapes = scrapes if gpu_url is None else [
                    s for s in self._windows.get(_exporter(gpu_url), ()) if now - self.window_s < s.t <= now]
            values: dict[str, float | None] = {}
            for field, spec in self._specs.items():
                if field == SAMPLE_TIME:
                    continue
                v = evaluate(spec.signal, gpu_scrapes if spec.gpu else scrapes,
                             self._gpu_labels.get(inst) if spec.gpu else None)
                values[field] = None if v is None else v * spec.scale
            if scrapes and gpu_scrapes and self._gpu_specs and all(values[f] is None for f in self._gpu_specs):
                self._warn_no_gpu(inst, gpu_url or self.targets.get(inst, "?"))
            else:
                self._gpu_missing.pop(inst, None)
            seen = newest if newest is not None else self._first_asked.setdefault(inst, now)
            out[inst] = EndpointStats(**values, sample_age_s=max(0.0, now - seen))
        return out

    def _warn_no_gpu(self, inst: str, url: str) -> None:
        """Once per endpoint: pages were read, but no GPU series in them counts for it (in
        :data:`GPU_MISSING_ROUNDS` rounds in a row)."""
        self._gpu_missing[inst] = self._gpu_missing.get(inst, 0) + 1
        if inst in self._gpu_warned or self._gpu_missing[inst] < GPU_MISSING_ROUNDS:
            return
        self._gpu_warned.add(inst)
        need = self._gpu_labels.get(inst)
        log.warning("endpoint %s: its GPU inputs (%s) match no series in %s%s", inst, ", ".join(self._gpu_specs),
                    url, f" with labels {need} (or exported_<label>)" if need else "")

    async def _scrape(self, http: aiohttp.ClientSession, instance: str, url: str) -> None:
        try:
            async with http.get(url) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                text = await r.text()
            self.ingest(instance, text, time.time())
            self.scrapes_ok += 1
            if self.last_error.pop(instance, None) is not None:
                log.info("scrape of %s (%s) works again", instance, url)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as err:
            self.scrapes_failed += 1
            msg = str(err) or type(err).__name__
            if instance not in self.last_error:
                log.warning("scrape of %s (%s) failed: %s", instance, url, msg)
            self.last_error[instance] = msg

    async def run(self) -> None:
        """Scrape every target every ``interval_s`` until cancelled."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                started = time.monotonic()
                await asyncio.gather(*(self._scrape(http, i, u) for i, u in self.targets.items()),
                                     *(self._scrape(http, _exporter(u), u) for u in set(self.gpu_targets.values())))
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def describe(self) -> dict:
        """Counters and per-target errors, for the admin API."""
        return {"scrapes_ok": self.scrapes_ok, "scrapes_failed": self.scrapes_failed,
                "failing_targets": dict(self.last_error)}
