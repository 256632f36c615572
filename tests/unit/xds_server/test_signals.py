"""Signal definitions -> PromQL (rendering) and -> values over our own scrape windows (evaluation).

The two must mean the same thing; the integration tests compare them on real Prometheus.
"""

from __future__ import annotations

import math

import pytest

from xds_server.metrics import presets
from xds_server.metrics.promql import render
from xds_server.metrics.signals import (
    Gauge,
    HistogramMean,
    HistogramQuantile,
    Plus,
    Rate,
    Ratio,
    SampleTime,
    Sel,
    Total,
)
from xds_server.metrics.stats import SIGNAL_FIELDS
from xds_server.metrics.window import Scrape, evaluate, histogram_quantile

# --- rendering ------------------------------------------------------------------------------------


def test_gauge_over_the_window_and_newest():
    assert render(Gauge(Sel(("g",)), "max"), ("instance",)) == "max by (instance) (avg_over_time(g[{w}]))"
    assert render(Gauge(Sel(("g",)), "min", over_window=False), ("instance",)) == "min by (instance) (g)"


def test_fallback_names_become_or_per_join_key():
    q = render(Gauge(Sel(("new", "old")), "max"), ("instance",))
    assert q == "(max by (instance) (avg_over_time(new[{w}]))) or (max by (instance) (avg_over_time(old[{w}])))"


def test_union_tags_each_part_so_or_keeps_them_and_sums():
    q = render(Rate(Sel(("a", "b"), union=True)), ("instance",))
    assert q.startswith("sum by (instance) (label_replace(sum by (instance) (rate(a[{w}]))")
    assert 'label_replace(sum by (instance) (rate(b[{w}])), "inferlb_part", "1", "", "")' in q
    assert "__name__" not in q  # a multi-name rate() fails on Prometheus 2


def test_matchers_are_quoted():
    q = render(Rate(Sel(("http_requests_total",), (("status", "=~", "5.."),))), ("instance",))
    assert q == 'sum by (instance) (rate(http_requests_total{status=~"5.."}[{w}]))'


def test_histograms_and_quantile():
    base = Sel(("vllm:e2e_request_latency_seconds",))
    assert render(HistogramMean(base), ("instance",)) == (
        "sum by (instance) (rate(vllm:e2e_request_latency_seconds_sum[{w}]))"
        " / sum by (instance) (rate(vllm:e2e_request_latency_seconds_count[{w}]))")
    assert render(HistogramQuantile(0.95, base), ("namespace", "pod")) == (
        "histogram_quantile(0.95, sum by (le, namespace, pod) (rate(vllm:e2e_request_latency_seconds_bucket[{w}])))")
    with pytest.raises(ValueError):
        render(HistogramMean(Sel(("a", "b"), union=True)), ("instance",))


def test_ratio_fills_a_missing_numerator_with_zero_unless_told_not_to():
    q = render(Ratio(Sel(("err",)), Sel(("all",))), ("instance",))
    assert " or (0 * (" in q
    q = render(Ratio(Sel(("dur",)), Sel(("ok",)), zero_fill=False), ("instance",))
    assert q == "(sum by (instance) (rate(dur[{w}]))) / (sum by (instance) (rate(ok[{w}])))"


def test_total_sampletime_plus_and_minus():
    assert render(Total(Sel(("c",))), ("instance",)) == "sum by (instance) (c)"
    assert render(SampleTime(Sel(("g",))), ("instance",)) == "max by (instance) (timestamp(g))"
    plus = Plus((Gauge(Sel(("a",)), over_window=False), Gauge(Sel(("b",)), over_window=False)))
    assert render(plus, ("instance",)) == "(sum by (instance) (a)) + (sum by (instance) (b))"
    minus = Gauge(Sel(("total",)), "min", over_window=False, minus=Sel(("used",)))
    assert render(minus, ("instance",)) == "min by (instance) (total - used)"
    # joined by other labels, exported_<label> (Prometheus's rename on a clash) wins where set
    assert render(minus, ("pod",)) == 'min by (pod) (label_replace(total - used, "pod", "$1", "exported_pod", "(.+)"))'
    with pytest.raises(ValueError):
        Gauge(Sel(("a",)), minus=Sel(("b",)))


@pytest.mark.parametrize("engine", sorted(presets.ENGINE_PRESETS))
@pytest.mark.parametrize("gpu", sorted(presets.GPU_PRESETS))
def test_every_preset_renders_and_names_only_known_inputs(engine, gpu):
    specs = presets.preset(engine, gpu)
    assert presets.SAMPLE_TIME in specs
    assert set(specs) - {presets.SAMPLE_TIME} <= set(SIGNAL_FIELDS)
    for field, (query, scale, by) in presets.promql_queries(specs, ("namespace", "pod")).items():
        assert query.count("(") == query.count(")"), field
        assert scale > 0
        assert by == (("namespace", "pod") if specs[field].gpu else ("instance",)), field


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="tgi"):
        presets.preset("vllm2")
    with pytest.raises(KeyError, match="dcgm"):
        presets.preset("vllm", "nvml")


def test_presets_carry_the_engines_names():
    """Names from docs/metrics-names.md, with C09's rename as a fallback."""
    q = presets.promql_queries(presets.preset("vllm", "dcgm"))
    assert "vllm:kv_cache_usage_perc" in q["kv_cache"][0] and "vllm:gpu_cache_usage_perc" in q["kv_cache"][0]
    assert q["kv_cache"][0].index("kv_cache_usage_perc") < q["kv_cache"][0].index("gpu_cache_usage_perc")
    assert "DCGM_FI_DEV_FB_FREE" in q["gpu_mem_free_mib"][0] and "min by" in q["gpu_mem_free_mib"][0]
    assert "DCGM_FI_DEV_GPU_UTIL" in q["gpu_util"][0] and q["gpu_util"][1] == 0.01
    assert "sglang:token_usage" in presets.promql_queries(presets.preset("sglang"))["kv_cache"][0]
    tr = presets.promql_queries(presets.preset("triton", "triton"))
    assert "nv_inference_request_duration_us" in tr["latency_mean_ms"][0] and tr["latency_mean_ms"][1] == 0.001
    assert "nv_gpu_memory_total_bytes - nv_gpu_memory_used_bytes" in tr["gpu_mem_free_mib"][0]
    tgi = presets.promql_queries(presets.preset("tgi", "none"))
    assert "tgi_queue_size" in tgi["queue"][0] and "kv_cache" not in tgi and "gpu_util" not in tgi


# --- evaluation over scrapes ----------------------------------------------------------------------


def L(**labels: str):  # noqa: N802 (reads like a label set)
    return tuple(sorted(labels.items()))


def scrapes(*pages: tuple[float, dict]) -> list[Scrape]:
    return [Scrape(t, {name: tuple(series) for name, series in page.items()}) for t, page in pages]


def test_gauge_average_over_the_window_then_aggregate_over_series():
    w = scrapes((1, {"g": [(L(gpu="0"), 10.0), (L(gpu="1"), 50.0)]}),
                (2, {"g": [(L(gpu="0"), 30.0), (L(gpu="1"), 50.0)]}))
    assert evaluate(Gauge(Sel(("g",)), "max"), w) == 50.0
    assert evaluate(Gauge(Sel(("g",)), "min"), w) == 20.0  # gpu 0 averaged 20
    assert evaluate(Gauge(Sel(("g",)), "sum"), w) == 70.0
    assert evaluate(Gauge(Sel(("g",)), "min", over_window=False), w) == 30.0


def test_fallback_name_is_read_when_the_new_one_is_absent():
    """C09 over our own windows."""
    w = scrapes((1, {"vllm:gpu_cache_usage_perc": [(L(), 0.4)]}), (2, {"vllm:gpu_cache_usage_perc": [(L(), 0.6)]}))
    sig = Gauge(Sel(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")), "max")
    assert evaluate(sig, w) == pytest.approx(0.5)
    w2 = scrapes((1, {"vllm:kv_cache_usage_perc": [(L(), 0.2)], "vllm:gpu_cache_usage_perc": [(L(), 0.9)]}))
    assert evaluate(sig, w2) == pytest.approx(0.2)  # the new name wins when both exist


def test_histogram_mean_is_increase_of_sum_over_increase_of_count():
    w = scrapes((0, {"h_sum": [(L(), 1.0)], "h_count": [(L(), 10.0)]}),
                (5, {"h_sum": [(L(), 3.0)], "h_count": [(L(), 14.0)]}))
    assert evaluate(HistogramMean(Sel(("h",))), w) == pytest.approx(0.5)


def test_no_traffic_in_the_window_is_no_data_not_zero():
    """C08: 0/0."""
    w = scrapes((0, {"h_sum": [(L(), 3.0)], "h_count": [(L(), 14.0)]}),
                (5, {"h_sum": [(L(), 3.0)], "h_count": [(L(), 14.0)]}))
    assert evaluate(HistogramMean(Sel(("h",))), w) is None
    assert evaluate(Ratio(Sel(("e",)), Sel(("h_count",))), w) is None


def test_a_rate_needs_two_samples():
    one = scrapes((0, {"c": [(L(), 5.0)]}))
    assert evaluate(Rate(Sel(("c",))), one) is None
    assert evaluate(HistogramMean(Sel(("h",))), scrapes((0, {"h_sum": [(L(), 1.0)], "h_count": [(L(), 1.0)]}))) is None


def test_counter_reset_counts_from_zero():
    w = scrapes((0, {"c": [(L(), 100.0)]}), (1, {"c": [(L(), 110.0)]}), (2, {"c": [(L(), 4.0)]}))
    assert evaluate(Rate(Sel(("c",))), w) == pytest.approx((10 + 4) / 2)


def test_ratio_with_matchers_and_missing_numerator():
    page = lambda ok, err: {"http_requests_total": [(L(status="2xx"), ok), *([(L(status="5xx"), err)]  # noqa: E731
                                                                          if err is not None else [])]}
    sig = Ratio(Sel(("http_requests_total",), (("status", "=~", "5.."),)), Sel(("http_requests_total",)))
    assert evaluate(sig, scrapes((0, page(10, 0)), (1, page(16, 2)))) == pytest.approx(2 / 8)
    assert evaluate(sig, scrapes((0, page(10, None)), (1, page(16, None)))) == 0.0  # no 5xx yet: 0 %
    strict = Ratio(Sel(("dur",)), Sel(("ok",)), zero_fill=False)
    assert evaluate(strict, scrapes((0, {"ok": [(L(), 1.0)]}), (1, {"ok": [(L(), 3.0)]}))) is None


def test_union_sums_every_name():
    w = scrapes((0, {"ok": [(L(), 0.0)], "fail": [(L(), 0.0)]}), (2, {"ok": [(L(), 6.0)], "fail": [(L(), 2.0)]}))
    assert evaluate(Rate(Sel(("ok", "fail"), union=True)), w) == pytest.approx(4.0)
    assert evaluate(Ratio(Sel(("fail",)), Sel(("ok", "fail"), union=True)), w) == pytest.approx(0.25)


def test_total_plus_minus_and_sample_time():
    w = scrapes((3, {"r": [(L(), 2.0)], "q": [(L(), 1.0)], "tot": [(L(gpu="0"), 100.0), (L(gpu="1"), 100.0)],
                     "used": [(L(gpu="0"), 30.0), (L(gpu="1"), 80.0)]}),
                (4, {"r": [(L(), 3.0)]}))
    assert evaluate(Total(Sel(("r",))), w) == 3.0
    assert evaluate(Plus((Gauge(Sel(("r",)), over_window=False), Gauge(Sel(("q",)), over_window=False))), w) == 4.0
    assert evaluate(Gauge(Sel(("tot",)), "min", over_window=False, minus=Sel(("used",))), w) == 20.0  # worst GPU
    assert evaluate(SampleTime(Sel(("r",))), w) == 4
    assert evaluate(SampleTime(Sel(("q",))), w) == 3
    assert evaluate(Plus((Gauge(Sel(("r",)), over_window=False), Gauge(Sel(("nope",)), over_window=False))), w) is None


def test_required_labels_join_gpu_series_to_one_pod():
    w = scrapes((0, {"util": [(L(pod="a", namespace="n"), 90.0), (L(pod="b", namespace="n"), 10.0)]}))
    sig = Gauge(Sel(("util",)), "max", over_window=False)
    assert evaluate(sig, w) == 90.0
    assert evaluate(sig, w, {"pod": "b", "namespace": "n"}) == 10.0
    assert evaluate(sig, w, {"pod": "c", "namespace": "n"}) is None


def test_empty_window_is_no_data():
    assert evaluate(Gauge(Sel(("g",))), []) is None


# --- histogram_quantile, as Prometheus computes it -------------------------------------------------


INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, [(0.1, 10), (0.2, 20), (INF, 20)], 0.1),  # rank 10 at the top of the first bucket
        (0.95, [(0.1, 10), (0.2, 20), (INF, 20)], 0.1 + 0.1 * (19 - 10) / 10),
        (0.25, [(0.1, 10), (0.2, 20), (INF, 20)], 0.05),  # the first bucket starts at 0
        (0.99, [(0.1, 10), (0.2, 10), (INF, 20)], 0.2),  # rank in +Inf: the highest finite bound
        (0.5, [(0.1, 0), (INF, 0)], None),  # no observations
        (0.5, [(0.1, 5), (0.2, 10)], None),  # no +Inf bucket
        (0.5, [(INF, 5)], None),  # fewer than two buckets
        (1.5, [(0.1, 5), (INF, 5)], None),
        (0.5, [(0.1, 6), (0.2, 4), (INF, 10)], 0.1 - 0.1 * (6 - 5) / 6),  # non-monotonic counts are fixed
    ],
)
def test_histogram_quantile(q, buckets, expected):
    got = histogram_quantile(q, buckets)
    assert got == (None if expected is None else pytest.approx(expected))
