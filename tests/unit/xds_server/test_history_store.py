"""The SQLite history store and the recorder: retention, row cap, restart survival, change-only rows."""

from __future__ import annotations

import sqlite3
import time
from types import SimpleNamespace

import pytest

from tests.support.history_rows import row, stored, verdict
from xds_server.config import History
from xds_server.engine.types import DRAINING, UNHEALTHY
from xds_server.history.changes import Recorded, to_record
from xds_server.history.recorder import ERRORS, HistoryRecorder
from xds_server.history.sqlite import PAGE_SIZE, SqliteHistory, default_path, open_store
from xds_server.history.types import CHANGE, KEYFRAME, HistoryError, RowBatch

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def store(path=":memory:", retention_s: float = 3600.0, max_rows: int = 1000) -> SqliteHistory:
    return SqliteHistory(path, retention_s, max_rows)


def test_rows_round_trip_with_filters():
    s = store()
    s.append(RowBatch.of([row(100, A, 10), row(101, B, 20), row(102, A, 30, UNHEALTHY, cluster="chat-v2"),
                          row(103, A, 40)]))
    got = s.rows(100, 103)
    assert [(r.t, r.endpoint, r.weight) for r in got] == [(100, A, 10), (101, B, 20), (102, A, 30), (103, A, 40)]
    assert got[2].health == UNHEALTHY and got[2].cluster == "chat-v2"
    assert got[0].inputs == {"latency_mean_ms": 120.0, "running": 2.0}
    assert got[0].scores == {"latency": 0.5} and got[0].reasons == ("weight 10",)
    assert [r.weight for r in s.rows(100, 103, cluster="chat-v1", endpoint=A)] == [10, 40]
    assert [r.weight for r in s.rows(101, 102)] == [20, 30]
    assert [r.weight for r in s.rows(100, 103, limit=2)] == [10, 20]


def test_last_before_gives_each_endpoints_newest_older_row():
    s = store()
    s.append(RowBatch.of([row(100, A, 10), row(101, B, 20), row(105, A, 30), row(110, B, 40)]))
    assert {(r.endpoint, r.weight) for r in s.last_before(106)} == {(A, 30), (B, 20)}
    assert {(r.endpoint, r.weight) for r in s.last_before(105)} == {(A, 10), (B, 20)}
    assert [r.weight for r in s.last_before(106, endpoint=B)] == [20]
    assert {(r.endpoint, r.weight) for r in s.last_before(float("inf"))} == {(A, 30), (B, 40)}
    assert s.last_before(100) == []


def test_retention_drops_rows_older_than_the_period():
    s = store(retention_s=60)
    s.append(RowBatch.of([row(t, A, t) for t in (100, 130, 170, 200)]))
    assert s.prune(now=200) == 2  # 100 and 130 are older than 200 - 60
    assert [r.t for r in s.rows(0, 1000)] == [170, 200]


def test_row_cap_keeps_the_newest_rows():
    s = store(max_rows=3)
    s.append(RowBatch.of([row(t, A if t % 2 else B, t) for t in range(100, 110)]))
    assert s.prune(now=110) == 7
    assert [r.t for r in s.rows(0, 1000)] == [107, 108, 109]
    s.append(RowBatch.of([row(110, A, 1)]))
    assert s.prune(now=110) == 1
    assert [r.t for r in s.rows(0, 1000)] == [108, 109, 110]


def test_file_store_uses_wal_and_survives_reopening(tmp_path):
    path = tmp_path / "sub" / "history.sqlite3"
    s = store(path)
    s.append(RowBatch.of([row(100, A, 10), row(101, B, 20)]))
    s.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE
    again = store(path)
    assert [(r.endpoint, r.weight) for r in again.rows(0, 1000)] == [(A, 10), (B, 20)]
    again.append(RowBatch.of([row(102, B, 21), row(103, A, 30, cluster="chat-v2"), row(104, A, 11)]))
    assert [(r.cluster, r.endpoint, r.weight) for r in again.rows(102, 1000)] == [
        ("chat-v1", B, 21), ("chat-v2", A, 30), ("chat-v1", A, 11)]
    assert again._db().execute("SELECT count(*) FROM history_endpoints").fetchone()[0] == 3  # known ids reused
    again.close()
    with pytest.raises(HistoryError, match="closed"):
        again.rows(0, 1)


def test_an_existing_file_keeps_its_page_size(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:  # as an earlier release created it: SQLite's default pages
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("CREATE TABLE t (a)")
    default = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    assert default != PAGE_SIZE
    s = store(path)
    s.append(RowBatch.of([row(100, A, 10)]))
    assert [r.weight for r in s.rows(0, 1000)] == [10]
    s.close()
    assert sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0] == default


#: A version-1 file as earlier inferlb releases wrote it (inputs and scores as JSON objects).
V1_SCHEMA = """
CREATE TABLE weight_history (id INTEGER PRIMARY KEY, t REAL NOT NULL, cluster TEXT NOT NULL,
    endpoint TEXT NOT NULL, weight INTEGER NOT NULL, health TEXT NOT NULL, score REAL, inputs TEXT NOT NULL,
    scores TEXT NOT NULL, reasons TEXT NOT NULL, kind TEXT NOT NULL, snapshot_version TEXT);
CREATE INDEX weight_history_endpoint_t ON weight_history (cluster, endpoint, t);
CREATE INDEX weight_history_t ON weight_history (t);
INSERT INTO weight_history (t, cluster, endpoint, weight, health, score, inputs, scores, reasons, kind,
    snapshot_version) VALUES (100, 'chat-v1', '10.0.0.1:8000', 10, 'HEALTHY', 0.5,
    '{"latency_mean_ms":120.0,"running":2.0}', '{"latency":0.5}', '["weight 10"]', 'change', 'v-test');
PRAGMA user_version = 1;
"""


def test_a_version_1_file_keeps_its_rows_and_takes_new_ones(tmp_path):
    path = tmp_path / "v1.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SCHEMA)
    s = store(path)
    s.append(RowBatch.of([row(101, B, 20)]))
    s.close()
    again = store(path)  # the layouts are read back from the file
    assert again.rows(0, 1000) == [row(100, A, 10), row(101, B, 20)]
    again.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3
        new = db.execute("SELECT inputs, scores FROM weight_history WHERE t = 101").fetchone()
    assert new == ("[120.0,2.0]", "[0.5]")


#: A version-2 file as earlier inferlb releases wrote it (endpoints named in every row), with a
#: version-1 row (layout NULL) and a version-2 row.
V2_SCHEMA = V1_SCHEMA.replace("snapshot_version TEXT);", "snapshot_version TEXT, layout INTEGER);").replace(
    "PRAGMA user_version = 1;", """
CREATE TABLE history_layouts (id INTEGER PRIMARY KEY, inputs TEXT NOT NULL, scores TEXT NOT NULL,
    UNIQUE (inputs, scores));
INSERT INTO history_layouts (inputs, scores) VALUES ('["latency_mean_ms", "running"]', '["latency"]');
INSERT INTO weight_history (t, cluster, endpoint, weight, health, score, inputs, scores, reasons, kind,
    snapshot_version, layout) VALUES (101, 'chat-v1', '10.0.0.2:8000', 20, 'HEALTHY', 0.5,
    '[120.0,2.0]', '[0.5]', '["weight 20"]', 'change', 'v-test', 1);
INSERT INTO weight_history (t, cluster, endpoint, weight, health, score, inputs, scores, reasons, kind,
    snapshot_version, layout) VALUES (102, 'chat-v1', '10.0.0.1:8000', 30, 'HEALTHY', 0.5,
    '[120.0,2.0]', '[0.5]', '["weight 30"]', 'change', 'v-test', 1);
PRAGMA user_version = 2;""")


def test_a_version_2_file_is_upgraded_in_place_with_every_row(tmp_path):
    path = tmp_path / "v2.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V2_SCHEMA)
    s = store(path)
    old = [row(100, A, 10), row(101, B, 20), row(102, A, 30)]
    assert s.rows(0, 1000) == old and s.last_before(float("inf")) == [old[2], old[1]]
    assert s.rows(0, 1000, endpoint=B) == [old[1]] and s.rows(0, 1000, cluster="chat-v2") == []
    s.append(RowBatch.of([row(103, B, 40), row(103, C, 50)]))
    s.close()
    again = store(path)
    assert again.rows(0, 1000) == [*old, row(103, B, 40), row(103, C, 50)]
    assert again.last_before(103) == [old[2], old[1]]
    again.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3
        assert db.execute("SELECT cluster, endpoint FROM history_endpoints ORDER BY id").fetchall() == [
            ("chat-v1", A), ("chat-v1", B), ("chat-v1", C)]
        assert [r[0] for r in db.execute("SELECT id FROM weight_history ORDER BY id")] == [1, 2, 3, 4, 5]


def test_newer_schema_and_unopenable_paths_are_refused(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(HistoryError, match="newer inferlb"):
        store(newer)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HistoryError, match=r"history.path: cannot open .*file/h.sqlite3"):
        store(blocker / "h.sqlite3")


def test_default_path_follows_xdg_state_home(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / ".local" / "state" / "inferlb" / "history.sqlite3"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    s = open_store(History(path=None, retention_days=2, max_rows=5))
    assert s.path == str(tmp_path / "state" / "inferlb" / "history.sqlite3")
    assert (s.retention_s, s.max_rows) == (2 * 86400, 5)
    s.append(RowBatch.of([row(1.0)]))
    s.close()
    assert (tmp_path / "state" / "inferlb" / "history.sqlite3").exists()


def test_only_weight_or_health_changes_make_rows():
    rows, last = to_record([verdict(A, 10), verdict(B, 20)], {}, 100.0, "v1", keyframe_s=600)
    rows = stored(rows)
    assert [(r.endpoint, r.weight, r.kind) for r in rows] == [(A, 10, CHANGE), (B, 20, CHANGE)]
    assert rows[0].inputs["latency_mean_ms"] == 100.0 and rows[0].scores == {"latency": 0.5, "concurrency": None}
    # inputs alone moved: nothing recorded
    rows, last = to_record([verdict(A, 10, latency_ms=900), verdict(B, 20)], last, 101.0, "v2", 600)
    assert len(rows) == 0
    rows, last = to_record([verdict(A, 11), verdict(B, 20, DRAINING)], last, 102.0, "v3", 600)
    assert [(r.endpoint, r.weight, r.health, r.snapshot_version) for r in stored(rows)] == \
        [(A, 11, "HEALTHY", "v3"), (B, 20, DRAINING, "v3")]
    assert last[("chat-v1", A)] == Recorded(11, "HEALTHY", 102.0)


def test_unchanged_endpoints_get_keyframes():
    last = {("chat-v1", A): Recorded(10, "HEALTHY", 100.0), ("chat-v1", B): Recorded(20, "HEALTHY", 150.0)}
    rows, last = to_record([verdict(A, 10), verdict(B, 20)], last, 700.0, "v1", keyframe_s=600)
    assert [(r.endpoint, r.kind) for r in stored(rows)] == [(A, KEYFRAME)]
    rows, _ = to_record([verdict(A, 10), verdict(B, 21)], last, 701.0, "v1", 600, keyframes_only=True)
    assert len(rows) == 0  # a change is left to the snapshot hook


def _snap(version: str):
    return SimpleNamespace(version=version)


def test_recorder_writes_changes_from_its_thread_and_continues_after_restart(tmp_path):
    path = tmp_path / "h.sqlite3"
    rec = HistoryRecorder(store(path), keyframe_s=600)
    rec.start()
    rec.record(_snap("v1"), [verdict(A, 10), verdict(B, 20)])
    rec.record(_snap("v2"), [verdict(A, 10, latency_ms=500), verdict(B, 25)])
    assert rec.flush()
    assert [(r.endpoint, r.weight, r.snapshot_version) for r in rec.store.rows(0, time.time() + 1)] == \
        [(A, 10, "v1"), (B, 20, "v1"), (B, 25, "v2")]
    rec.close()

    restarted = HistoryRecorder(store(path), keyframe_s=600)
    restarted.start()
    restarted.record(_snap("v3"), [verdict(A, 10), verdict(B, 25)])  # unchanged across the restart
    restarted.record(_snap("v4"), [verdict(A, 12), verdict(B, 25)])
    assert restarted.flush()
    assert [(r.endpoint, r.weight) for r in restarted.store.rows(0, time.time() + 1)] == \
        [(A, 10), (B, 20), (B, 25), (A, 12)]
    restarted.close()


def test_recorder_keyframes_from_current_weights():
    clock = [1000.0]
    current = [verdict(A, 10)]
    rec = HistoryRecorder(store(), keyframe_s=0.2, current=lambda: ("v9", current), clock=lambda: clock[0])
    rec.start()
    rec.record(_snap("v1"), [verdict(A, 10)])
    assert rec.flush()
    clock[0] = 1001.0
    deadline = time.monotonic() + 5
    while len(rec.store.rows(0, 2000)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    rows = rec.store.rows(0, 2000)
    assert [(r.t, r.kind, r.snapshot_version) for r in rows[:2]] == [(1000.0, CHANGE, "v1"), (1001.0, KEYFRAME, "v9")]
    rec.close()


def test_a_failing_store_is_counted_and_the_change_is_written_later():
    s = store()
    rec = HistoryRecorder(s, keyframe_s=600)
    rec.start()
    real_append = s.append
    calls = []

    def failing(rows):
        calls.append(rows)
        if len(calls) == 1:
            raise HistoryError("disk full")
        real_append(rows)

    s.append = failing
    before = ERRORS.labels("write")._value.get()
    rec.record(_snap("v1"), [verdict(A, 10)])
    rec.record(_snap("v2"), [verdict(A, 10)])
    assert rec.flush()
    assert ERRORS.labels("write")._value.get() == before + 1
    assert [(r.weight, r.snapshot_version) for r in s.rows(0, time.time() + 1)] == [(10, "v2")]
    rec.close()


def test_a_full_queue_drops_rounds_instead_of_blocking():
    rec = HistoryRecorder(store(), keyframe_s=600, max_queue=2)  # thread not started: nothing drains
    from xds_server.history.recorder import DROPPED

    before = DROPPED._value.get()
    started = time.monotonic()
    for i in range(5):
        rec.record(_snap(f"v{i}"), [verdict(A, i + 1)])
    assert time.monotonic() - started < 0.5
    assert DROPPED._value.get() == before + 3


def test_rows_hold_what_the_verdicts_say_across_encoding_pieces():
    """Inputs as EndpointStats.as_dict() gives them, scores rounded to 4 (None kept), scorer names in
    order, reasons: for more rows than one encoding piece, endpoints without scores among them."""
    from xds_server.engine.types import EndpointWeight
    from xds_server.history.changes import CHUNK_ROWS
    from xds_server.metrics.stats import EndpointStats, rounded

    n = CHUNK_ROWS + 7
    weights = [EndpointWeight("chat-v1", f"10.0.{i // 256}.{i % 256}:8000", i + 1,
                              UNHEALTHY if i % 5 == 0 else "HEALTHY", None if i % 5 == 0 else i / 3000,
                              EndpointStats(latency_mean_ms=i * 1.23456, queue=None if i % 2 else 0.5,
                                            sample_age_s=1.0),
                              {} if i % 5 == 0 else {"queue": i / 7, "latency": None, 'odd "name" 100%': 0.123456},
                              (f"reason {i}", 'a "quoted" one'))
               for i in range(n)]
    rows, _ = to_record(weights, {}, 50.0, "v1", keyframe_s=600)
    s = store(max_rows=10 * n)
    s.append(rows)
    got = s.rows(0, 100, limit=n)
    assert len(got) == n
    for w, r in zip(weights, got, strict=True):
        assert (r.endpoint, r.weight, r.health, r.kind) == (w.address, w.weight, w.health, CHANGE)
        assert r.score == rounded([w.score], 4)[0]
        assert r.inputs == w.inputs.as_dict()
        assert list(r.scores) == list(w.scores)
        assert r.scores == dict(zip(w.scores, rounded(list(w.scores.values()), 4), strict=True))
        assert r.reasons == w.reasons


def test_check_path_refuses_what_the_store_could_not_open(tmp_path):
    """``check_path`` refuses, without creating anything, the paths the store would fail on."""
    from xds_server.history.sqlite import check_path

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HistoryError, match=r"history.path .*file/sub/h.sqlite3.*is not a folder"):
        check_path(History(path=str(blocker / "sub" / "h.sqlite3")))
    with pytest.raises(HistoryError, match=r"history.path .* is not a file"):
        check_path(History(path=str(tmp_path)))
    check_path(History(path=str(tmp_path / "new" / "deeper" / "h.sqlite3")))
    assert not (tmp_path / "new").exists()
    check_path(History(path=":memory:"))
    with pytest.raises(HistoryError):  # what the check refuses, the store refuses too
        store(blocker / "sub" / "h.sqlite3")
