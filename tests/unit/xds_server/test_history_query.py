"""History query parameters (durations, RFC 3339, clear errors) and the step-function series."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests.support.history_rows import row
from xds_server.engine.types import UNHEALTHY
from xds_server.history.query import HistoryQuery, QueryError, build_series, parse_query
from xds_server.history.timeparse import parse_duration, parse_time
from xds_server.history.types import KEYFRAME

NOW = 1_800_000_000.0
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("10m", 600), ("1h30m", 5400), ("2d", 172800),
                                          ("1w", 604800), ("500ms", 0.5), ("1m30s", 90)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "", "1.5h", "10 m", "-5m", "0s", "5M", "m"])
def test_bad_durations_say_what_is_expected(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_times_are_durations_ago_or_rfc3339():
    assert parse_time("10m", NOW) == NOW - 600
    assert parse_time("2026-01-02T03:04:05Z", NOW) == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    assert parse_time("2026-01-02t05:04:05.250+02:00", NOW) == \
        datetime(2026, 1, 2, 3, 4, 5, 250000, tzinfo=UTC).timestamp()
    for bad in ("2026-01-02T03:04:05", "2026-01-02", "yesterday", "1800000000"):
        with pytest.raises(ValueError, match="RFC 3339"):
            parse_time(bad, NOW)
    with pytest.raises(ValueError, match="RFC 3339"):
        parse_time("2026-13-02T03:04:05Z", NOW)
    with pytest.raises(ValueError, match="day is out of range"):
        parse_time("2026-02-30T03:04:05Z", NOW)
    assert parse_time("0s", NOW) == NOW  # "0s ago" is now


@pytest.mark.parametrize("text", ["01s", "1234567890123s", "١h", "²s", "9" * 310 + "s"])
def test_durations_are_ascii_integers_without_leading_zeros_and_stay_finite(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_the_longest_duration_is_finite():
    assert parse_duration("999999999999w" * 100) == pytest.approx(100 * 999999999999 * 604800)


def test_query_defaults_and_values():
    assert parse_query({}, NOW) == HistoryQuery(NOW - 3600, NOW)
    q = parse_query({"cluster": "chat-v1", "endpoint": A, "since": "10m", "until": "5m", "step": "30s",
                     "limit": "50"}, NOW)
    assert q == HistoryQuery(NOW - 600, NOW - 300, "chat-v1", A, 30.0, 50)


def test_an_endpoint_is_matched_in_the_config_s_spelling_as_a_drain_reads_it():
    assert parse_query({"endpoint": "127.0.0.1:08002"}, NOW).endpoint == "127.0.0.1:8002"
    assert parse_query({"endpoint": "[FD00:0::1]:080"}, NOW).endpoint == "[fd00::1]:80"
    assert parse_query({"endpoint": "not-an-address"}, NOW).endpoint == "not-an-address"  # as written


@pytest.mark.parametrize("params,param,message", [
    ({"since": "ten minutes"}, "since", "duration ago"),
    ({"until": "2026-02-30T00:00:00Z"}, "until", "RFC 3339"),
    ({"since": "5m", "until": "10m"}, "since", "before until"),
    ({"step": "fast"}, "step", "duration"),
    ({"since": "7d", "step": "1s"}, "step", "11000 points"),
    ({"limit": "0"}, "limit", "1..100000"),
    ({"limit": "lots"}, "limit", "integer"),
    ({"cluster": ""}, "cluster", "empty"),
])
def test_bad_parameters_are_named(params, param, message):
    with pytest.raises(QueryError, match=message) as err:
        parse_query(params, NOW)
    assert err.value.param == param and str(err.value).startswith(f"{param}: ")


def test_raw_series_carry_the_value_in_force_at_since():
    q = HistoryQuery(since=100.0, until=200.0)
    carried = [row(50, A, 10)]
    rows = [row(120, A, 20), row(130, B, 5, UNHEALTHY), row(150, A, 30, kind=KEYFRAME)]
    series = build_series(q, carried, rows)
    assert [(s["cluster"], s["endpoint"]) for s in series] == [("chat-v1", A), ("chat-v1", B)]
    assert [(p["t"], p["weight"], p["kind"]) for p in series[0]["points"]] == \
        [(100.0, 10, "carried"), (120, 20, "change"), (150, 30, "keyframe")]
    assert series[1]["points"][0]["health"] == UNHEALTHY
    assert series[0]["points"][1]["inputs"] == {"latency_mean_ms": 120.0, "running": 2.0}


def test_step_series_hold_each_value_until_the_next_row():
    q = HistoryQuery(since=100.0, until=160.0, step=20.0)
    series = build_series(q, [row(90, A, 10)], [row(100, B, 7), row(125, A, 20), row(140, A, 30)])
    assert [(p["t"], p["weight"]) for p in series[0]["points"]] == [(100, 10), (120, 10), (140, 30), (160, 30)]
    assert [(p["t"], p["weight"]) for p in series[1]["points"]] == [(100, 7), (120, 7), (140, 7), (160, 7)]
    late = build_series(q, [], [row(130, A, 1)])
    assert [(p["t"], p["weight"]) for p in late[0]["points"]] == [(140, 1), (160, 1)]
