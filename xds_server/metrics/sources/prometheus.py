"""The Prometheus metrics source: sliding-window PromQL -> :class:`EndpointStats` per instance.

Thin I/O shell: it runs the preset's queries with prometheus-api-client (in parallel, all under
one deadline) and parses the vectors. It keeps two pieces of state per instance: the newest sample
time seen, so an endpoint whose series went stale (Prometheus drops them from instant queries)
keeps an honest, growing age (case C04); and when it was first asked for, so an endpoint never seen
yet ages from then (a new endpoint, or every endpoint at start-up before Prometheus's first scrape,
is not stale at once) -- unless Prometheus's own scrapes say its newest sample is older: each round
also reads each target's last successful scrape within a range longer than the staleness threshold
(or, failed throughout, its earliest failed scrape there), so a control plane restarted while a
backend is down finds that backend as old as its last good scrape, not as new as the restart (see
:func:`unsampled_since`).

An endpoint's age does not count the time Prometheus itself did not scrape it: each round also reads
when Prometheus last scraped each target (``timestamp(up)``, written at every scrape, failed or not).
After a Prometheus stall, restart or slow scrape loop, the targets it has not scraped again yet are
not made stale by Prometheus's silence (see :func:`sample_age_s`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests import RequestException
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from xds_server.metrics.presets import SAMPLE_TIME, VLLM_DCGM
from xds_server.metrics.source import MetricsUnavailable
from xds_server.metrics.stats import EndpointStats, finite

log = logging.getLogger(__name__)

#: Queries of one round run at once, each on its own thread and pooled connection.
MAX_PARALLEL_QUERIES = 16
#: ``{field: (PromQL template with {w}, scale, join labels)}``; a 2-tuple means join by ``instance``.
Queries = Mapping[str, tuple[str, float, tuple[str, ...]] | tuple[str, float]]


def _window(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


#: Field of the round's answers with when Prometheus last scraped each target (Unix s).
SCRAPE_TIME = "last_scrape_ts"
#: When Prometheus last scraped each target, failed scrapes included (Prometheus writes ``up`` at each).
SCRAPE_TIME_QUERY = "max by (instance) (timestamp(up))"
#: Field of the round's answers with each target's last successful scrape within a range (Unix s), or,
#: every scrape in it failed, the earliest of them: no sample of the target is newer (see
#: :func:`good_scrape_query`).
GOOD_SCRAPE_TIME = "last_good_scrape_ts"
#: Steps of the :func:`good_scrape_query` subqueries at most (their resolution: range / this).
GOOD_SCRAPE_STEPS = 60
#: Rounds in a row an endpoint's GPU inputs must match nothing before it is logged.
GPU_MISSING_ROUNDS = 3
#: How often the targets' scrape interval is read again from ``/api/v1/targets`` (s).
INTERVAL_REFRESH_S = 300.0
_GO_DURATION = re.compile(r"([0-9]+)(ms|y|w|d|h|m|s)")
_GO_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}


def parse_prometheus_duration(text: object) -> float | None:
    """A Prometheus duration (``model.Duration`` as the targets API writes it: ``20s``, ``1m30s``,
    ``500ms``) -> seconds; None for anything else.

    >>> parse_prometheus_duration("1m30s"), parse_prometheus_duration("500ms"), parse_prometheus_duration("x")
    (90.0, 0.5, None)
    """
    if not isinstance(text, str) or not re.fullmatch(r"(?:[0-9]+(?:ms|y|w|d|h|m|s))+", text):
        return None
    return sum(int(n) * _GO_UNITS[u] for n, u in _GO_DURATION.findall(text))


def scrape_interval(targets_answer: object, instances: Iterable[str]) -> float | None:
    """The longest ``scrapeInterval`` of the active targets whose ``instance`` label is one of
    ``instances``, from a ``/api/v1/targets`` answer (Prometheus >= 2.3x lists it per target); None
    when no target matches or the answer is not of that shape."""
    wanted = set(instances)
    try:
        targets = targets_answer["data"]["activeTargets"]  # type: ignore[index]
        found = [parse_prometheus_duration(t.get("scrapeInterval")) for t in targets
                 if isinstance(t, dict) and isinstance(t.get("labels"), dict)
                 and t["labels"].get("instance") in wanted]
    except (KeyError, TypeError):
        return None
    found = [f for f in found if f]
    return max(found) if found else None


def sample_age_s(now: float, seen: float, scraped: float | None, interval_s: float | None) -> float:
    """An endpoint's sample age (s) for the staleness rule: ``now - seen``, less the time Prometheus
    did not scrape the endpoint beyond one scrape interval.

    ``seen``: the newest sample's time (or when the endpoint was first asked for), Unix s;
    ``scraped``: when Prometheus last scraped the target (``timestamp(up)``, None when unknown);
    ``interval_s``: the scrape interval (None: unknown; then nothing is taken off, since the normal
    lag of a scrape cannot be told from a stall). A target Prometheus keeps scraping without getting
    samples ages by the wall clock; while Prometheus is stalled, the endpoint ages at most by one
    interval.

    >>> sample_age_s(100.0, 90.0, 99.5, 1.0)   # scraped, no sample for 10 s: stale by the wall clock
    10.0
    >>> sample_age_s(100.0, 94.0, 94.0, 1.0)   # Prometheus silent 6 s: 5 s of it do not count
    1.0
    """
    lag = 0.0 if scraped is None or interval_s is None else max(0.0, now - scraped - interval_s)
    return max(0.0, now - seen - lag)


def good_scrape_range_s(stale_after_s: float, interval_s: float | None) -> float:
    """The range (s) of :func:`good_scrape_query`: twice the staleness threshold in use, which the
    control plane raises to 2 x the scrape interval when shorter (``engine.stale_after_s``, s;
    ``interval_s``: Prometheus's scrape interval, s, None while unknown: the first round, as the
    targets API is read after the round's queries). Longer than the threshold, so a target down
    throughout the range is stale at once (in the first round only if ``engine.stale_after_s`` is
    already >= 2 x the interval; else within the difference).

    >>> good_scrape_range_s(15.0, None), good_scrape_range_s(15.0, 1.0), good_scrape_range_s(15.0, 15.0)
    (30.0, 30.0, 60.0)
    """
    return max(2.0 * stale_after_s, 4.0 * (interval_s or 0.0))


def good_scrape_query(range_s: float) -> str:
    """PromQL: per target, its last successful scrape within the last ``range_s`` seconds (Unix s), or,
    when every scrape in the range failed, its earliest scrape in the range. Either way, no sample of
    the target is newer: Prometheus writes ``up`` 1 with the samples of a good scrape and ``up`` 0 at a
    failed one. Absent: Prometheus did not scrape the target in the range (a new or unknown target).

    ``timestamp(up) * up`` is the scrape's own time when it succeeded, 0 when it failed
    (``timestamp`` of a plain selector is the sample's time, not the evaluation step's). The
    subqueries take :data:`GOOD_SCRAPE_STEPS` steps at most (at least 1 s apart), so the answer is
    within a step and a scrape interval of the truth. One query (checked on Prometheus 2.42).

    >>> print(good_scrape_query(30.0).replace(" or ", "\\nor "))
    (max by (instance) (max_over_time((timestamp(up) * up)[30s:1s])) > 0)
    or min by (instance) (min_over_time(timestamp(up)[30s:1s]))
    """
    r, step = _window(range_s), _window(max(1.0, range_s / GOOD_SCRAPE_STEPS))
    return (f"(max by (instance) (max_over_time((timestamp(up) * up)[{r}:{step}])) > 0)"
            f" or min by (instance) (min_over_time(timestamp(up)[{r}:{step}]))")


def unsampled_since(first_asked: float, good_scrape: float | None) -> float:
    """The time (Unix s) an endpoint with no sample seen by this process is aged from: when this
    process first asked for it (``first_asked``), or, earlier, ``good_scrape``: its last successful
    Prometheus scrape within :func:`good_scrape_range_s`, or its earliest failed one there when all
    failed (:func:`good_scrape_query`; None when Prometheus did not scrape it in the range).

    A backend killed before the control plane (re)started is as old as its last good scrape, so the
    staleness rule applies in the first round; a target that is new (not scraped yet) or up (its
    last good scrape is now) ages from when it was first asked for, as before.

    >>> unsampled_since(1000.0, None), unsampled_since(1000.0, 980.0), unsampled_since(1000.0, 1001.0)
    (1000.0, 980.0, 1000.0)
    """
    return first_asked if good_scrape is None else min(first_asked, good_scrape)


def scrape_missed(now: float, scraped: float | None, interval_s: float | None) -> bool:
    """Prometheus missed at least one whole scrape of a target: its last scrape (Unix s) is more than
    two intervals old. (Beyond one interval, the time is already left out of the sample's age by
    :func:`sample_age_s`; a scrape a few ms late is the scrape loop's normal jitter, not worth a
    warning: at a 0.5 s interval a one-interval rule warned every 1-5 s of a benchmark run.)

    >>> scrape_missed(100.0, 99.3, 0.5), scrape_missed(100.0, 98.9, 0.5), scrape_missed(100.0, None, 0.5)
    (False, True, False)
    """
    return scraped is not None and interval_s is not None and now - scraped > 2 * interval_s


def join_key(labels: Mapping[str, str], by: tuple[str, ...]) -> str:
    """The join key of a series: its ``by`` label values joined with ``/`` (``instance`` -> the instance)."""
    return "/".join(str(labels[k]) for k in by)


def parse_vector(result: object, scale: float = 1.0, by: tuple[str, ...] = ("instance",)) -> dict[str, float | None]:
    """A PromQL instant-vector answer -> ``{join key: value x scale}``; NaN/Inf -> ``None`` (C08).

    Joined by ``instance``, every series must carry it; joined by other labels (``namespace``/``pod``),
    a series without them cannot be joined and is skipped.

    Raises:
        MetricsUnavailable: the answer is not a list of ``{"metric": {...}, "value": [ts, "v"]}``, or a
            sample value or time is not a number (Prometheus's HTTP API writes values as strings of
            Go floats: digits, ``NaN``, ``+Inf``, ``-Inf``): a malformed answer fails the round.
    """
    if not isinstance(result, list):
        raise MetricsUnavailable(f"expected a vector, got {type(result).__name__}")
    out: dict[str, float | None] = {}
    for series in result:
        try:
            labels = series["metric"]
            ts, raw = series["value"]
            if not isinstance(raw, str):
                raise TypeError("sample value must be a string")
            float(ts), float(raw)  # Prometheus sends numbers, "NaN" and "+Inf"/"-Inf"; "abc" is garbage
            if by == ("instance",):
                key = str(labels["instance"])
            elif all(k in labels for k in by):
                key = join_key(labels, by)
            else:
                continue
        except (KeyError, ValueError, TypeError) as err:
            raise MetricsUnavailable(f"malformed series in answer: {series!r:.200}") from err
        value = finite(raw)
        out[key] = None if value is None else value * scale
    return out


class PrometheusSource:
    """Queries Prometheus every round.

    ``window_s``: range of rates/averages (s); ``timeout_s``: deadline of one round's queries (s);
    ``queries``: see :data:`Queries` (default: vLLM + DCGM joined by instance); ``gpu_keys``:
    ``{instance: join key}`` for fields joined by other labels than ``instance`` (e.g. ``ns/pod``);
    ``gpu_fields``: the GPU inputs: an endpoint whose own series answer but that none of them joins
    to is logged once, with the query (a renamed label or a wrong pod name); ``stale_after_s``: the
    engine's staleness threshold (s), which sets the range of :func:`good_scrape_query`.
    """

    name = "prometheus"

    def __init__(self, url: str, window_s: float, timeout_s: float, queries: Queries = VLLM_DCGM,
                 gpu_keys: Mapping[str, str] | None = None, gpu_fields: Iterable[str] = (),
                 stale_after_s: float = 15.0) -> None:
        self._timeout_s = timeout_s
        self._stale_after_s = stale_after_s
        self._queries = {f: (q[0].replace("{w}", _window(window_s)), q[1], tuple(q[2]) if len(q) > 2 else ("instance",))
                         for f, q in queries.items()}
        if SAMPLE_TIME not in self._queries:
            raise ValueError(f"queries must include {SAMPLE_TIME!r} (the newest sample's time)")
        self._queries.setdefault(SCRAPE_TIME, (SCRAPE_TIME_QUERY, 1.0, ("instance",)))
        self._set_good_scrape_range(None)
        workers = min(MAX_PARALLEL_QUERIES, len(self._queries))
        # No client-side retries: a hung Prometheus would cost (retries + 1) x timeout per query; the
        # next round is the retry. One pooled connection per query thread: with urllib3's default of
        # 10, 14 parallel queries logged "Connection pool is full" every round (issue 15 item 9).
        session = requests.Session()
        session.verify = False
        self._prom = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s, retry=Retry(total=0),
                                       session=session)
        session.mount(url, HTTPAdapter(max_retries=Retry(total=0), pool_connections=1, pool_maxsize=workers))
        self._gpu_keys = dict(gpu_keys or {})
        self._gpu_fields = tuple(f for f in gpu_fields if f in self._queries)
        self._gpu_warned: set[str] = set()
        self._gpu_missing: dict[str, int] = {}  # rounds in a row with own series but no GPU series
        self._last_seen: dict[str, float] = {}
        self._first_asked: dict[str, float] = {}
        self._behind_logged = False  # a Prometheus scrape lag is logged once per episode
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="promql")
        self._url, self._session = url, session
        #: Prometheus's scrape interval for the configured endpoints (s), read from its targets API;
        #: None until read (or when it cannot be read).
        self.sample_interval_s: float | None = None
        self._interval_read_at: float | None = None

    def _set_good_scrape_range(self, interval_s: float | None) -> None:
        query = good_scrape_query(good_scrape_range_s(self._stale_after_s, interval_s))
        self._queries[GOOD_SCRAPE_TIME] = (query, 1.0, ("instance",))

    def _read_interval(self, instances: list[str], now: float) -> None:
        if self._interval_read_at is not None and now - self._interval_read_at < INTERVAL_REFRESH_S:
            return
        try:
            answer = self._session.get(f"{self._url}/api/v1/targets", params={"state": "active"},
                                       timeout=self._timeout_s).json()
        except (RequestException, ValueError) as err:
            log.debug("cannot read Prometheus's targets for their scrape interval: %s", err)
            return
        interval = scrape_interval(answer, instances)
        if interval is None:  # targets not discovered yet, or renamed: try again next round
            return
        self._interval_read_at = now
        if interval != self.sample_interval_s:
            log.info("Prometheus scrapes the endpoints every %g s (from %s/api/v1/targets)", interval, self._url)
            self._set_good_scrape_range(interval)
        self.sample_interval_s = interval

    def describe(self) -> dict:
        """For the admin API: the scrape interval learned from Prometheus (s, or None)."""
        return {"scrape_interval_s": self.sample_interval_s}

    def _query(self, field: str, at: float) -> dict[str, float | None]:
        query, scale, by = self._queries[field]
        try:
            result = self._prom.custom_query(query, params={"timeout": f"{round(self._timeout_s * 1000)}ms",
                                                            "time": f"{at:.3f}"})
        except (PrometheusApiClientException, RequestException, ValueError) as err:
            raise MetricsUnavailable(f"query for {field} failed: {err}") from err
        except (KeyError, TypeError) as err:  # a 200 whose JSON is not a Prometheus answer
            raise MetricsUnavailable(f"query for {field}: not a Prometheus answer ({err!r})") from err
        return parse_vector(result, scale, by)

    def fetch(self, instances: Iterable[str], now: float | None = None) -> dict[str, EndpointStats]:
        """One round: ``{instance: EndpointStats}`` for every instance asked for (no data -> fields ``None``).

        ``sample_age_s`` is the age of the newest sample seen, or, never seen, the time since the
        instance was first asked for or since its last good Prometheus scrape, whichever is older
        (:func:`unsampled_since`), less the time Prometheus did not scrape it (:func:`sample_age_s`).

        Every query of a round is evaluated at one time (Prometheus's ``time`` parameter, the wall
        clock as the round starts), so the values and the sample time describe one moment: without
        it, each query was evaluated when it reached Prometheus, and a scrape landing between two of
        them paired a newer GPU memory value with an older sample time (seen in the ``edge_cloud``
        benchmark: a node's free memory from one scrape dated to the scrape before it, 0.5 s
        earlier, so the picker's memory estimate subtracted its requests of those 0.5 s twice).

        Blocking (run it in a thread). Raises:
            MetricsUnavailable: any query failed, timed out or returned garbage; nothing is partial.
        """
        instances = list(instances)
        at = time.time() if now is None else now
        seen_all = all(i in self._last_seen for i in instances)  # the range query only helps the unseen:
        futures = {f: self._pool.submit(self._query, f, at) for f in self._queries  # a steady round skips it
                   if not (seen_all and f == GOOD_SCRAPE_TIME)}
        done, pending = wait(futures.values(), timeout=self._timeout_s + 0.5)
        if pending:
            for fut in pending:
                fut.cancel()
            raise MetricsUnavailable(f"{len(pending)} queries did not answer within {self._timeout_s:g} s")
        values = {f: fut.result() for f, fut in futures.items()}  # re-raises MetricsUnavailable
        now = time.time() if now is None else now
        self._read_interval(instances, now)  # after the queries: a hung Prometheus costs one timeout a round
        out: dict[str, EndpointStats] = {}
        scraped, good, behind = values.pop(SCRAPE_TIME), values.pop(GOOD_SCRAPE_TIME, {}), []
        for inst in instances:
            ts = values[SAMPLE_TIME].get(inst)
            if ts is not None:
                self._last_seen[inst] = max(ts, self._last_seen.get(inst, ts))
            seen = self._last_seen.get(inst)
            if seen is None:
                seen = self._first_asked[inst] = unsampled_since(self._first_asked.get(inst, now), good.get(inst))
            fields = {}
            for f, v in values.items():
                if f != SAMPLE_TIME:
                    by = self._queries[f][2]
                    fields[f] = v.get(inst if by == ("instance",) else self._gpu_keys.get(inst, ""))
            last_scrape = scraped.get(inst)
            age = sample_age_s(now, seen, last_scrape, self.sample_interval_s)
            if scrape_missed(now, last_scrape, self.sample_interval_s):
                behind.append(inst)
            out[inst] = replace(EndpointStats(**fields), sample_age_s=age)
            if ts is not None and self._gpu_fields and all(fields[f] is None for f in self._gpu_fields):
                self._warn_no_gpu(inst)
            else:
                self._gpu_missing.pop(inst, None)
        self._log_behind(behind, instances, scraped, now)
        return out

    def _log_behind(self, behind: list[str], instances: list[str], scraped: Mapping[str, float | None],
                    now: float) -> None:
        """Once per episode: Prometheus missed whole scrapes of some endpoints (:func:`scrape_missed`)."""
        if not behind:
            if self._behind_logged:
                log.info("Prometheus scrapes every endpoint on time again")
            self._behind_logged = False
            return
        if not self._behind_logged:
            oldest = max(now - (scraped.get(i) or now) for i in behind)
            log.warning("Prometheus has not scraped %d of %d endpoints for up to %.1f s (its scrape loop is "
                        "behind, e.g. after a stall or restart): that time is not counted as their metrics' "
                        "staleness", len(behind), len(instances), oldest)
        self._behind_logged = True

    def _warn_no_gpu(self, inst: str) -> None:
        """Once per endpoint: its own metrics answer, but no GPU series joins to it (in
        :data:`GPU_MISSING_ROUNDS` rounds in a row: not at start-up, when Prometheus may have scraped
        the endpoint but not yet its GPU exporter)."""
        self._gpu_missing[inst] = self._gpu_missing.get(inst, 0) + 1
        if inst in self._gpu_warned or self._gpu_missing[inst] < GPU_MISSING_ROUNDS:
            return
        self._gpu_warned.add(inst)
        field = self._gpu_fields[0]
        query, _, by = self._queries[field]
        key = inst if by == ("instance",) else self._gpu_keys.get(inst, "")
        log.warning("endpoint %s: its GPU inputs (%s) match no series: no %s=%r in the answer to %s",
                    inst, ", ".join(self._gpu_fields), "/".join(by), key, query)
