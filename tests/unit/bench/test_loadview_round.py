"""The load-view benchmark's measurement runs the real servicer and every picker gets the round."""

from __future__ import annotations

import asyncio

from bench.loadview_round import PICKERS, measure, report


def test_every_picker_gets_every_sample_of_the_round_and_the_table_says_so():
    result = asyncio.run(measure(500, load=20, history_s=0.2))
    assert result["samples"] == 500
    assert 0.0 <= result["loop_blocked_ms"] <= result["round_s"] * 1000 + 5
    assert result["cpu_s"] > 0.0
    table = report([(500, 0.2, [result])], load=20)
    assert "| 500 | 0.2 |" in table and f"{PICKERS} pickers" in table
