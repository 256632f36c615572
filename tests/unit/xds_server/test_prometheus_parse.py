"""PromQL answers -> per-endpoint stats: NaN/Inf are "no data" (C08), garbage fails the round, ages grow (C04).

``PrometheusSource.fetch`` runs here against a stub of its prometheus-api-client object that answers
canned vectors per query; the real Prometheus is covered by the integration tests.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests import ConnectionError as RequestsConnectionError

from tests.support.factories import spec
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import HEALTHY, UNHEALTHY, EngineParams, EngineState
from xds_server.metrics.presets import VLLM_DCGM
from xds_server.metrics.source import MetricsUnavailable
from xds_server.metrics.sources.prometheus import PrometheusSource, parse_vector
from xds_server.metrics.stats import SIGNAL_FIELDS, EndpointStats, finite


def series(instance: str, value: str, ts: float = 1700000000.0, **labels: str) -> dict:
    return {"metric": {"instance": instance, **labels}, "value": [ts, value]}


# --- parse_vector ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["NaN", "+Inf", "-Inf", "nan", "inf"])
def test_non_finite_values_mean_no_data(raw):
    assert parse_vector([series("a:1", raw), series("b:1", "0.5")], scale=1000.0) == {"a:1": None, "b:1": 500.0}


def test_values_are_scaled_and_keyed_by_instance():
    got = parse_vector([series("10.0.0.1:8000", "0.125"), series("10.0.0.2:8000", "85", job="dcgm")], scale=0.01)
    assert got == {"10.0.0.1:8000": pytest.approx(0.00125), "10.0.0.2:8000": pytest.approx(0.85)}


def test_zero_is_a_value_not_missing_data():
    assert parse_vector([series("a:1", "0")]) == {"a:1": 0.0}


def test_empty_vector_is_no_series():
    assert parse_vector([]) == {}


@pytest.mark.parametrize(
    "answer",
    [
        None,
        {"resultType": "vector", "result": []},
        "error",
        [{"value": [1, "1"]}],  # no metric
        [{"metric": {"job": "x"}, "value": [1, "1"]}],  # no instance label
        [{"metric": {"instance": "a:1"}}],  # no value
        [{"metric": {"instance": "a:1"}, "value": [1]}],  # value without the sample
        [{"metric": {"instance": "a:1"}, "value": None}],
        [{"metric": None, "value": [1, "1"]}],
        ["not a series"],
        [series("a:1", "1"), 42],
        [series("a:1", "abc")],  # JSON, but not a number (issue 15 item 3)
        [series("a:1", "")],
        [{"metric": {"instance": "a:1"}, "value": ["yesterday", "1"]}],
    ],
)
def test_malformed_answers_raise_metrics_unavailable(answer):
    with pytest.raises(MetricsUnavailable):
        parse_vector(answer)


@pytest.mark.parametrize(("raw", "expected"), [("1.5", 1.5), (2, 2.0), ("NaN", None), ("Inf", None), (None, None),
                                               ("abc", None), (float("nan"), None)])
def test_finite(raw, expected):
    assert finite(raw) == expected


# --- presets --------------------------------------------------------------------------------------


def test_preset_covers_every_stat_and_the_sample_time():
    client_side = {f for f in SIGNAL_FIELDS if f.startswith("client_")}  # Envoy's view, not the backend's
    assert set(VLLM_DCGM) == set(SIGNAL_FIELDS) - client_side | {"last_sample_ts"}
    for field, (query, *_) in VLLM_DCGM.items():
        assert "instance" in query, field
        assert not re.search(r"\{\s*\"", query), f"{field}: quoted metric names fail on Prometheus 2.42"


def test_preset_reads_both_kv_cache_metric_names():
    """C09: older vLLM exposes gpu_cache_usage_perc, newer kv_cache_usage_perc."""
    query, *_ = VLLM_DCGM["kv_cache"]
    assert "vllm:kv_cache_usage_perc" in query and "vllm:gpu_cache_usage_perc" in query
    assert " or " in query


def test_preset_scales_to_engine_units():
    assert VLLM_DCGM["latency_mean_ms"][1] == 1000.0  # seconds -> ms
    assert VLLM_DCGM["gpu_util"][1] == 0.01  # DCGM percent -> 0..1


# --- PrometheusSource.fetch with a stub client ------------------------------------------------------


class FakeProm:
    """Stands in for PrometheusConnect: ``custom_query`` answers from ``answers[field]`` (a vector)."""

    def __init__(self, queries: dict[str, str]):
        self.by_query = {q: f for f, q in queries.items()}
        self.answers: dict[str, object] = {}
        self.calls: list[tuple[str, dict]] = []
        self.fail: Exception | None = None

    def custom_query(self, query: str, params: dict | None = None):
        self.calls.append((query, params or {}))
        if self.fail is not None:
            raise self.fail
        return self.answers.get(self.by_query[query], [])


def source(window_s: float = 60.0, timeout_s: float = 2.0, stale_after_s: float = 15.0
           ) -> tuple[PrometheusSource, FakeProm]:
    src = PrometheusSource("http://127.0.0.1:1", window_s=window_s, timeout_s=timeout_s, stale_after_s=stale_after_s)
    fake = FakeProm({f: q for f, (q, *_) in src._queries.items()})
    src._prom = fake
    return src, fake


A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def test_fetch_runs_every_query_with_the_window_and_timeout():
    src, fake = source(window_s=30.0, timeout_s=1.5)
    src.fetch([A], now=1000.0)
    assert {q for q, _ in fake.calls} == set(fake.by_query)
    assert len(fake.calls) == len(VLLM_DCGM) + 2  # and when Prometheus last scraped each target, and last well
    fake.answers = {"last_sample_ts": [series(A, "999")]}
    src.fetch([A], now=1001.0)
    fake.calls.clear()
    src.fetch([A], now=1002.0)   # A had a sample: the last-good-scrape range query is not needed
    assert len(fake.calls) == len(VLLM_DCGM) + 1
    src.fetch([A, B], now=1003.0)   # B has none yet: asked again
    assert len(fake.calls) == 2 * len(VLLM_DCGM) + 3
    assert all("{w}" not in q for q, _ in fake.calls)
    assert any("[30s]" in q for q, _ in fake.calls)
    assert all(p["timeout"] == "1500ms" for _, p in fake.calls)


def test_every_query_of_a_round_is_evaluated_at_one_time():
    """One evaluation time per round: a scrape landing between two queries would otherwise pair a
    newer value with an older sample time."""
    src, fake = source()
    src.fetch([A, B], now=1000.25)
    assert {p["time"] for _, p in fake.calls} == {"1000.250"}
    fake.calls.clear()
    src.fetch([A, B])  # the wall clock, read once as the round starts
    times = {p["time"] for _, p in fake.calls}
    assert len(times) == 1 and abs(float(times.pop()) - time.time()) < 5


def test_fetch_joins_values_by_instance_and_scales_them():
    src, fake = source()
    fake.answers = {
        "latency_mean_ms": [series(A, "0.25"), series(B, "NaN")],  # B: no traffic in the window (C08)
        "gpu_util": [series(A, "85"), series(B, "10")],
        "running": [series(A, "3")],
        "kv_cache": [series(A, "0.5")],
        "gpu_mem_free_mib": [series(A, "4096")],
        "last_sample_ts": [series(A, "998"), series(B, "995")],
    }
    out = src.fetch([A, B], now=1000.0)
    assert set(out) == {A, B}
    a, b = out[A], out[B]
    assert a.latency_mean_ms == pytest.approx(250.0)
    assert a.gpu_util == pytest.approx(0.85)
    assert (a.running, a.kv_cache, a.gpu_mem_free_mib) == (3.0, 0.5, 4096.0)
    assert a.sample_age_s == pytest.approx(2.0)
    assert b.latency_mean_ms is None  # NaN is "no latency data", not 0 ms
    assert b.running is None and b.queue is None  # absent series: None, never 0
    assert b.gpu_util == pytest.approx(0.10)
    assert b.sample_age_s == pytest.approx(5.0)


def test_stale_age_grows_from_the_last_seen_sample_when_a_series_disappears():
    """C04: the target stops answering; Prometheus drops its series; the age keeps growing."""
    src, fake = source()
    fake.answers = {"last_sample_ts": [series(A, "1000"), series(B, "1000")],
                    "queue": [series(A, "0"), series(B, "2")], "kv_cache": [series(A, "0"), series(B, "0.3")]}
    first = src.fetch([A, B], now=1001.0)
    assert first[A].sample_age_s == pytest.approx(1.0)
    fake.answers = {"last_sample_ts": [series(B, "1019")], "queue": [series(B, "2")]}
    later = src.fetch([A, B], now=1020.0)
    assert later[A].sample_age_s == pytest.approx(20.0)
    assert later[A].queue is None  # it does not "look empty"
    assert later[B].sample_age_s == pytest.approx(1.0)
    even_later = src.fetch([A, B], now=1060.0)
    assert even_later[A].sample_age_s == pytest.approx(60.0)


def test_time_prometheus_did_not_scrape_an_endpoint_does_not_age_it():
    """Prometheus stalled 20 s (scrape interval 2 s): A, not scraped since, ages by one interval of
    it; B, scraped again without a sample (``up`` written), ages by the wall clock."""
    src, fake = source()
    src.sample_interval_s = 2.0
    src._interval_read_at = 1000.0  # read: the targets API is not asked again
    fake.answers = {"last_sample_ts": [series(A, "1000"), series(B, "1000")],
                    "last_scrape_ts": [series(A, "1000"), series(B, "1019")]}
    out = src.fetch([A, B], now=1020.0)
    assert out[A].sample_age_s == pytest.approx(2.0)
    assert out[B].sample_age_s == pytest.approx(20.0)
    src.sample_interval_s = None  # interval unknown: a stall cannot be told from a scrape's normal lag
    assert src.fetch([A], now=1020.0)[A].sample_age_s == pytest.approx(20.0)


def test_a_missed_scrape_is_logged_once_per_episode_and_a_late_one_not_at_all(caplog):
    src, fake = source()
    src.sample_interval_s = 0.5
    src._interval_read_at = 1000.0

    def behind(now: float, scraped: str) -> list[str]:
        caplog.clear()
        fake.answers = {"last_sample_ts": [series(A, scraped)], "last_scrape_ts": [series(A, scraped)]}
        with caplog.at_level(logging.INFO, logger="xds_server.metrics.sources.prometheus"):
            src.fetch([A], now=now)
        return [r.getMessage()[:30] for r in caplog.records if "scrape" in r.getMessage()]

    assert behind(1000.6, "1000") == []   # 0.1 s late: jitter, its 0.1 s is not counted as age either
    assert behind(1002.0, "1000") == ["Prometheus has not scraped 1 o"]
    assert behind(1003.0, "1000") == []   # the same episode
    assert behind(1003.2, "1003") == ["Prometheus scrapes every endpo"]


def test_an_older_timestamp_does_not_make_the_age_younger_or_older():
    src, fake = source()
    fake.answers = {"last_sample_ts": [series(A, "1000")]}
    src.fetch([A], now=1000.0)
    fake.answers = {"last_sample_ts": [series(A, "990")]}
    assert src.fetch([A], now=1005.0)[A].sample_age_s == pytest.approx(5.0)


def test_sample_time_in_the_future_gives_age_zero():
    src, fake = source()
    fake.answers = {"last_sample_ts": [series(A, "1010")]}
    assert src.fetch([A], now=1000.0)[A].sample_age_s == 0.0


def test_never_seen_instance_ages_from_when_it_was_first_asked_for():
    """A never-seen endpoint is not stale at once (start-up), but becomes stale after the limit."""
    src, fake = source()
    fake.answers = {"last_sample_ts": [series(A, "1000")]}
    first = src.fetch([A, C], now=1000.0)
    assert first[C] == EndpointStats(sample_age_s=0.0)
    assert src.fetch([A, C], now=1010.0)[C].sample_age_s == pytest.approx(10.0)
    assert src.fetch([A, C], now=1016.0)[C].sample_age_s == pytest.approx(16.0)


def test_instance_asked_for_later_ages_from_then():
    src, fake = source()
    src.fetch([A], now=1000.0)
    assert src.fetch([A, C], now=1100.0)[C].sample_age_s == 0.0
    assert src.fetch([A, C], now=1105.0)[A].sample_age_s == pytest.approx(105.0)


def test_series_for_unknown_instances_are_ignored():
    src, fake = source()
    fake.answers = {"running": [series("10.9.9.9:1", "5"), series(A, "1")], "last_sample_ts": [series(A, "1")]}
    out = src.fetch([A], now=2.0)
    assert set(out) == {A}
    assert out[A].running == 1.0


@pytest.mark.parametrize(
    "error",
    [PrometheusApiClientException("HTTP Status Code 503"), RequestsConnectionError("refused"),
     ValueError("bad json")],
)
def test_query_failure_raises_metrics_unavailable(error):
    src, fake = source()
    fake.fail = error
    with pytest.raises(MetricsUnavailable):
        src.fetch([A], now=1.0)


def test_garbage_answer_fails_the_whole_round():
    src, fake = source()
    fake.answers = {"running": [series(A, "1")], "gpu_util": {"oops": True}}
    with pytest.raises(MetricsUnavailable):
        src.fetch([A], now=1.0)


def test_nan_latency_reaches_the_engine_as_no_data():
    """C08 through the engine: an idle endpoint (0/0 latency) is scored without a latency score."""
    src, fake = source()
    eps = [spec(0, "c08"), spec(1, "c08")]
    a, b = eps[0].instance, eps[1].instance
    fake.answers = {
        "latency_mean_ms": [series(a, "NaN"), series(b, "0.2")],
        "gpu_util": [series(a, "20"), series(b, "20")],
        "last_sample_ts": [series(a, "100"), series(b, "100")],
    }
    stats = src.fetch([a, b], now=101.0)
    weights, _ = compute_weights(eps, stats, EngineState(), EngineParams(), plugins=BUILTIN)
    wa, wb = weights
    assert wa.health == HEALTHY and wb.health == HEALTHY
    assert wa.scores["latency"] is None
    assert wb.scores["latency"] == pytest.approx(1.0)


def test_fetched_stale_endpoint_is_excluded_by_the_engine():
    src, fake = source()
    eps = [spec(0, "c04"), spec(1, "c04")]
    a, b = eps[0].instance, eps[1].instance
    fake.answers = {"last_sample_ts": [series(a, "100"), series(b, "100")]}
    src.fetch([a, b], now=100.0)
    fake.answers = {"last_sample_ts": [series(b, "130")], "queue": [series(b, "3")]}
    weights, _ = compute_weights(eps, src.fetch([a, b], now=130.0), EngineState(), EngineParams(), plugins=BUILTIN)
    assert [w.health for w in weights] == [UNHEALTHY, HEALTHY]


def test_a_restarted_control_plane_ages_a_dead_backend_from_its_last_good_scrape():
    """The control plane restarts (a fresh source) while backend a has been down 20 s: its series are
    stale in Prometheus, but Prometheus scraped it (``up`` 0) and its last good scrape was 20 s ago,
    so it is 20 s old and UNHEALTHY in the first round, not HEALTHY for another stale_after_s. b is
    new (Prometheus has not scraped it) and c is up (its last good scrape is now) though its own
    series are missing: both age from the first round, as before."""
    src, fake = source()
    eps = [spec(0, "restart"), spec(1, "restart"), spec(2, "restart")]
    a, b, c = (e.instance for e in eps)
    fake.answers = {"last_scrape_ts": [series(a, "999.5"), series(c, "999.5")],
                    "last_good_scrape_ts": [series(a, "980"), series(c, "1000")]}
    first = src.fetch([a, b, c], now=1000.0)
    assert [first[i].sample_age_s for i in (a, b, c)] == pytest.approx([20.0, 0.0, 0.0])
    weights, _ = compute_weights(eps, first, EngineState(), EngineParams(stale_after_s=15.0), plugins=BUILTIN)
    assert weights[0].health == UNHEALTHY and any("stale metrics" in r for r in weights[0].reasons)
    fake.answers["last_good_scrape_ts"] = [series(a, "981"), series(c, "1009.5")]  # later range: never younger
    later = src.fetch([a, b, c], now=1010.0)
    assert [later[i].sample_age_s for i in (a, b, c)] == pytest.approx([30.0, 10.0, 10.0])


def test_a_backend_down_throughout_the_range_is_stale_at_once():
    """Every scrape in the range failed: the answer is the earliest of them (range 2 x stale_after_s
    ago), older than the threshold."""
    src, fake = source(stale_after_s=15.0)
    fake.answers = {"last_scrape_ts": [series(A, "999.5")], "last_good_scrape_ts": [series(A, "970")]}
    age = src.fetch([A], now=1000.0)[A].sample_age_s
    assert age == pytest.approx(30.0) and age > 15.0


class _Targets:
    def __init__(self, interval: str):
        self.answer = {"data": {"activeTargets": [{"labels": {"instance": A}, "scrapeInterval": interval}]}}

    def get(self, *args, **kwargs):
        return self

    def json(self):
        return self.answer


def test_the_good_scrape_range_covers_the_staleness_threshold_in_use():
    src, _ = source(stale_after_s=60.0)
    assert "[120s:2s]" in src._queries["last_good_scrape_ts"][0]
    src._session = _Targets("45s")  # the control plane then uses stale_after_s 90 s
    src._read_interval([A], now=1000.0)
    assert src.sample_interval_s == 45.0
    assert "[180s:3s]" in src._queries["last_good_scrape_ts"][0]
