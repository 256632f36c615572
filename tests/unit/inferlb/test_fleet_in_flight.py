"""The autoscaling signal's requests in flight: the shared view's sum, and the in-process picker's own."""

from __future__ import annotations

from inferlb.serve import fleet_in_flight


def test_without_reporting_pickers_the_in_process_count_is_used():
    assert fleet_in_flight({}, 0, {"chat-v1": 3}, True) == {"chat-v1": 3}
    assert fleet_in_flight({"chat-v1": 9.0}, 0, {"chat-v1": 3}, False) == {"chat-v1": 3}


def test_the_in_process_picker_in_the_view_is_counted_once():
    assert fleet_in_flight({"chat-v1": 7.0}, 3, {"chat-v1": 2}, True) == {"chat-v1": 7.0}


def test_with_tls_the_in_process_picker_is_added_to_the_standalone_pickers_sum():
    got = fleet_in_flight({"chat-v1": 4.0}, 2, {"chat-v1": 2, "chat-v2": 1}, False)
    assert got == {"chat-v1": 6.0, "chat-v2": 1.0}
