"""The weights as the demo's live terminal table (rich) and as plain lines: the same rows."""

from __future__ import annotations

from rich.console import Console

from inferlb.output import weights_rich_table, weights_table

DOC = {
    "snapshot_version": "abc123",
    "metrics_source": {"name": "prometheus", "ok": True},
    "clusters": [{"name": "chat-v1", "endpoints": [
        {"address": "127.0.0.1:8001", "weight": 84, "health": "HEALTHY", "score": 0.71,
         "inputs": {"latency_mean_ms": 120.0, "gpu_util": 0.5, "running": 2.0, "sample_age_s": 0.4},
         "factors": {"capacity": 0.19, "slow_start": 1.0}, "reasons": ["score 0.71"]},
        {"address": "127.0.0.1:8002", "weight": 10, "health": "DRAINING", "score": None, "inputs": {},
         "reasons": ["draining: no new requests"]},
    ]}],
}


def _render(table) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(table)
    return console.export_text()


def test_rich_table_has_every_row_of_the_plain_one():
    text = _render(weights_rich_table(DOC, "inferlb demo t=1.0s"))
    plain = weights_table(DOC)
    for needle in ("127.0.0.1:8001", "127.0.0.1:8002", "84", "DRAINING", "draining: no new requests",
                   "capacity", "0.19", "snapshot abc123", "inferlb demo t=1.0s"):
        assert needle in text
        assert needle in plain or needle.startswith("inferlb demo")
    assert "FAILING" in _render(weights_rich_table({**DOC, "metrics_source": {"name": "prometheus", "ok": False}}))


def test_a_weight_shows_every_reason_not_only_the_first():
    """A weight the hysteresis held beside a score's "-> 74" would read as a contradiction (found by a
    new-user trial); the row shows each step, and a long list is cut with an ellipsis."""
    held = ["score 0.74 x max_weight 100 -> 74", "held at 80: change under hysteresis 0.05"]
    doc = {**DOC, "clusters": [{"name": "chat-v1", "endpoints": [
        {"address": "127.0.0.1:8001", "weight": 80, "health": "HEALTHY", "score": 0.74, "inputs": {},
         "reasons": held},
        {"address": "127.0.0.1:8002", "weight": 9, "health": "HEALTHY", "score": 0.1, "inputs": {},
         "reasons": ["x" * 200]}]}]}
    plain, rich = weights_table(doc), _render(weights_rich_table(doc))
    assert "-> 74; held at 80: change under hysteresis 0.05" in plain
    assert "held at 80" in rich
    assert "x" * 89 + "…" in plain and "x" * 90 not in plain


def test_the_capacity_factor_has_its_own_column_and_the_live_table_explains_the_columns():
    """An A10's score above an A100's beside a far smaller weight read as a bug (a new-user trial): the
    capacity factor that makes the difference is a column, "-" where none applied, and the live
    table's caption says what weight, score and capacity are. Without ``source_line`` the plain table
    leaves the metrics source to the demo's summary."""
    from inferlb.output import WEIGHT_COLUMNS

    plain = weights_table(DOC).splitlines()
    assert plain[0].split()[4:6] == ["score", "capacity"]
    assert plain[2].split()[4:6] == ["0.71", "0.19"] and plain[3].split()[4:6] == ["-", "-"]
    rich = _render(weights_rich_table(DOC))
    assert all(line in rich for line in WEIGHT_COLUMNS)
    assert "metrics source" in plain[-1] and not any("metrics source" in x
                                                     for x in weights_table(DOC, source_line=False).splitlines())
