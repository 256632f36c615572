"""The latency-outlier filter's default follows the picker: off with it, on without it, as configured when set."""

from __future__ import annotations

import pytest

from tests.support.factories import config
from xds_server.control import engine_params


@pytest.mark.parametrize(("sections", "off"), [
    ({}, True),  # the picker is on by default: its live load keeps requests off a slow endpoint
    ({"envoy": {"picker": False}}, False),  # EDS weights alone: ejection is the only remedy
    ({"engine": {"filters": {"latency_outlier": {"factor": 4.0}}}}, False),  # configured: kept
    ({"envoy": {"picker": False}, "engine": {"filters": {"latency_outlier": False}}}, True),
])
def test_latency_outlier_is_off_with_the_picker_unless_configured(sections, off):
    p = engine_params(config(**sections))
    assert ("latency_outlier" in p.disabled) is off
    if "engine" in sections and not off:
        assert p.plugin_params["latency_outlier"].factor == 4.0
