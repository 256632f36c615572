"""The SQLite history backend (stdlib ``sqlite3``): one table, WAL journal, bounded retention.

One connection, used under a lock by the writer thread and by the admin API's worker threads;
``:memory:`` works the same way (in-process, lost at exit). Retention: rows older than
``retention_s`` and all but the newest ``max_rows`` rows are deleted by :meth:`SqliteHistory.prune`.
Row ids grow with time (one writer, appending in time order), so the row cap is a range delete on
the primary key, never a count over the table.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from collections.abc import Mapping
from itertools import groupby
from pathlib import Path

from xds_server.config import History
from xds_server.history.types import HistoryError, HistoryRow, Layout, RowBatch

#: 1: ``inputs`` and ``scores`` as JSON objects. 2: as JSON arrays named by a row's ``layout`` (a
#: ``history_layouts`` row); version-1 rows are kept as they are (``layout`` NULL) and read as before.
#: 3: a row names its endpoint by ``endpoint_id`` (a ``history_endpoints`` row: cluster and address),
#: indexed with ``t``: at 60 000 endpoints the index of ``(cluster, endpoint, t)`` text made ~20 % of
#: a round's insert (35 000 rows); older files are rewritten once, in one transaction, when opened.
SCHEMA_VERSION = 3
_SCHEMA = """
CREATE TABLE IF NOT EXISTS history_endpoints (
    id INTEGER PRIMARY KEY,
    cluster TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    UNIQUE (cluster, endpoint)
);
CREATE TABLE IF NOT EXISTS weight_history (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,
    endpoint_id INTEGER NOT NULL,
    weight INTEGER NOT NULL,
    health TEXT NOT NULL,
    score REAL,
    inputs TEXT NOT NULL,
    scores TEXT NOT NULL,
    reasons TEXT NOT NULL,
    kind TEXT NOT NULL,
    snapshot_version TEXT,
    layout INTEGER
);
CREATE INDEX IF NOT EXISTS weight_history_endpoint_t ON weight_history (endpoint_id, t);
CREATE INDEX IF NOT EXISTS weight_history_t ON weight_history (t);
CREATE TABLE IF NOT EXISTS history_layouts (
    id INTEGER PRIMARY KEY,
    inputs TEXT NOT NULL,
    scores TEXT NOT NULL,
    UNIQUE (inputs, scores)
);
"""
#: Schema 1 or 2 -> 3, in one transaction: the endpoints named once, every row kept (same id).
_UPGRADE = """
BEGIN;
ALTER TABLE weight_history RENAME TO weight_history_old;
DROP INDEX IF EXISTS weight_history_endpoint_t;
DROP INDEX IF EXISTS weight_history_t;
{schema}
INSERT INTO history_endpoints (cluster, endpoint)
    SELECT DISTINCT cluster, endpoint FROM weight_history_old ORDER BY cluster, endpoint;
INSERT INTO weight_history (id, t, endpoint_id, weight, health, score, inputs, scores, reasons, kind,
                            snapshot_version, layout)
    SELECT w.id, w.t, e.id, w.weight, w.health, w.score, w.inputs, w.scores, w.reasons, w.kind,
           w.snapshot_version, {layout}
    FROM weight_history_old w JOIN history_endpoints e ON e.cluster = w.cluster AND e.endpoint = w.endpoint;
DROP TABLE weight_history_old;
PRAGMA user_version = 3;
COMMIT;
"""
#: Rows per C-level step in :meth:`SqliteHistory._endpoints` (one over a round's 35 000 rows held the
#: GIL, which the event loop shares, long enough for a 25 ms watchdog to catch it).
_PIECE = 4096
#: Bytes per database page of a new file (an existing file keeps its own: SQLite changes it only by a
#: VACUUM outside WAL mode). A round's ~35 000 rows (10 MB) go through a quarter of the pages, page
#: writes and B-tree splits of SQLite's default 4 096: inserting them took 0.154–0.155 s against
#: 0.189–0.201 s at 4 096 (medians of 8 steady batches, 2 files each, ``/tmp`` script under the
#: benchmark lock, 2026-12-03); one endpoint's rows, every endpoint's last row and the newest 10 000
#: rows read as fast.
PAGE_SIZE = 16384
_INSERT = ("INSERT INTO weight_history (t, endpoint_id, weight, health, score, inputs, scores, reasons, kind, "
           "snapshot_version, layout) VALUES (?,?,?,?,?,?,?,?,?,?,?)")
_SELECT = ("SELECT w.t, e.cluster, e.endpoint, w.weight, w.health, w.score, w.inputs, w.scores, w.reasons, w.kind, "
           "w.snapshot_version, w.layout FROM weight_history w JOIN history_endpoints e ON e.id = w.endpoint_id")


def default_path() -> Path:
    """``$XDG_STATE_HOME/inferlb/history.sqlite3``, or ``~/.local/state/inferlb/history.sqlite3``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "inferlb" / "history.sqlite3"


def _row(r: tuple, layouts: Mapping[int, Layout]) -> HistoryRow:
    inputs, scores = json.loads(r[6]), json.loads(r[7])
    if r[11] is not None:  # schema 2: arrays, named by the layout
        names = layouts[r[11]]
        inputs, scores = dict(zip(names.inputs, inputs, strict=True)), dict(zip(names.scores, scores, strict=True))
    return HistoryRow(t=r[0], cluster=r[1], endpoint=r[2], weight=r[3], health=r[4], score=r[5],
                      inputs=inputs, scores=scores, reasons=tuple(json.loads(r[8])), kind=r[9], snapshot_version=r[10])


def _where(clauses: list[str], args: list, cluster: str | None, endpoint: str | None) -> str:
    if cluster is not None:
        clauses.append("e.cluster = ?")
        args.append(cluster)
    if endpoint is not None:
        clauses.append("e.endpoint = ?")
        args.append(endpoint)
    return " AND ".join(clauses) or "1"


class SqliteHistory:
    """A :class:`~xds_server.history.types.HistoryStore` in one SQLite database.

    Args:
        path: database file (parent folders are created) or ``":memory:"``.
        retention_s: rows older than this many seconds are pruned (> 0).
        max_rows: at most this many rows are kept (>= 1).
    Raises:
        HistoryError: the file cannot be opened or created, or was written by a newer schema.
    """

    def __init__(self, path: str | Path, retention_s: float, max_rows: int) -> None:
        self.path = str(path)
        self.retention_s = retention_s
        self.max_rows = max_rows
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._conn: sqlite3.Connection | None = sqlite3.connect(self.path, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout = 5000")
            self._conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # before WAL: a new file only
            self._conn.execute("PRAGMA journal_mode = WAL")  # answers "memory" for :memory:
            self._conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(f"history.path: {self.path} was written by a newer inferlb "
                                   f"(schema {version} > {SCHEMA_VERSION})")
            if version in (1, 2):  # version-1 rows keep their JSON objects (layout NULL)
                self._conn.executescript(_UPGRADE.format(schema=_SCHEMA, layout="NULL" if version == 1 else "w.layout"))
            with self._conn:
                self._conn.executescript(_SCHEMA)
                self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._layouts: dict[int, Layout] = {
                i: Layout(tuple(json.loads(a)), tuple(json.loads(b)))
                for i, a, b in self._conn.execute("SELECT id, inputs, scores FROM history_layouts")}
            self._layout_ids = {v: k for k, v in self._layouts.items()}
            self._endpoint_ids: dict[str, dict[str, int]] = {}  # cluster -> {endpoint: id}
            for i, c, e in self._conn.execute("SELECT id, cluster, endpoint FROM history_endpoints"):
                self._endpoint_ids.setdefault(c, {})[e] = i
        except (sqlite3.Error, OSError) as err:
            raise HistoryError(f"history.path: cannot open {self.path}: {err}") from err

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise HistoryError(f"history store {self.path} is closed")
        return self._conn

    def append(self, rows: RowBatch) -> None:
        """Insert ``rows`` in one transaction. Raises :class:`HistoryError` on a database error."""
        with self._lock:
            added: dict[tuple[str, str], int] = {}
            try:
                with self._db() as db:  # straight from the columns: no tuple per row is kept
                    ids = [self._layout_id(db, layout) for layout in rows.layouts]
                    endpoints = self._endpoints(db, rows, added)
                    db.executemany(_INSERT, zip(rows.t, endpoints, rows.weight, rows.health, rows.score, rows.inputs,
                                                rows.scores, rows.reasons, rows.kind, rows.snapshot_version,
                                                map(ids.__getitem__, rows.layout), strict=True))
            except sqlite3.Error as err:
                raise HistoryError(f"history: cannot write to {self.path}: {err}") from err
            for (cluster, endpoint), new in added.items():  # known once their rows are written
                self._endpoint_ids.setdefault(cluster, {})[endpoint] = new

    def _endpoints(self, db: sqlite3.Connection, rows: RowBatch, added: dict[tuple[str, str], int]) -> list[int]:
        """Each row's endpoint id; an endpoint seen for the first time is stored (inside the caller's
        transaction) and put in ``added``.

        Looked up per run of rows of one cluster, by address (a round's rows come cluster by cluster):
        no ``(cluster, endpoint)`` tuple is made and hashed per row (16 ms for a round's 36 000 rows,
        against ~3 ms by address, timed alone)."""
        ids: list[int | None] = []
        start = 0
        for cluster, run in groupby(rows.cluster):
            end = start + len(list(run))
            table = self._endpoint_ids.get(cluster, {})
            for at in range(start, end, _PIECE):  # one C call per piece: the GIL changes hands between
                ids += map(table.get, rows.endpoint[at:min(at + _PIECE, end)])
            start = end
        if None in ids:
            for i in [i for i, known in enumerate(ids) if known is None]:
                key = (rows.cluster[i], rows.endpoint[i])
                new = added.get(key)
                if new is None:
                    new = added[key] = db.execute("INSERT INTO history_endpoints (cluster, endpoint) VALUES (?, ?)",
                                                  key).lastrowid
                ids[i] = new
        return ids  # type: ignore[return-value]

    def _layout_id(self, db: sqlite3.Connection, layout: Layout) -> int:
        """The id of ``layout``, stored on first use (inside the caller's transaction)."""
        known = self._layout_ids.get(layout)
        if known is None:
            known = db.execute("INSERT INTO history_layouts (inputs, scores) VALUES (?, ?)",
                               (json.dumps(layout.inputs), json.dumps(layout.scores))).lastrowid
            self._layouts[known] = layout
            self._layout_ids[layout] = known
        return known

    def prune(self, now: float) -> int:
        """Delete rows older than ``now - retention_s`` and past ``max_rows``; returns the count deleted."""
        with self._lock:
            try:
                with self._db() as db:
                    old = db.execute("DELETE FROM weight_history WHERE t < ?", (now - self.retention_s,)).rowcount
                    over = db.execute(
                        "DELETE FROM weight_history WHERE id <= (SELECT max(id) FROM weight_history) - ?",
                        (self.max_rows,)).rowcount
            except sqlite3.Error as err:
                raise HistoryError(f"history: cannot prune {self.path}: {err}") from err
        return old + over

    def rows(self, since: float, until: float, cluster: str | None = None, endpoint: str | None = None,
             limit: int = 10_000) -> list[HistoryRow]:
        """See :meth:`HistoryStore.rows`."""
        args: list = [since, until]
        where = _where(["w.t >= ?", "w.t <= ?"], args, cluster, endpoint)
        return self._select(f"{_SELECT} WHERE {where} ORDER BY w.t, w.id LIMIT ?", [*args, limit])

    def last_before(self, t: float, cluster: str | None = None, endpoint: str | None = None) -> list[HistoryRow]:
        """See :meth:`HistoryStore.last_before`."""
        args: list = []
        clauses = [] if math.isinf(t) else ["w.t < ?"]
        if clauses:
            args.append(t)
        where = _where(clauses, args, cluster, endpoint)
        return self._select(
            f"{_SELECT} WHERE w.id IN (SELECT max(w.id) FROM weight_history w JOIN history_endpoints e "
            f"ON e.id = w.endpoint_id WHERE {where} GROUP BY w.endpoint_id) ORDER BY e.cluster, e.endpoint", args)

    def _select(self, sql: str, args: list) -> list[HistoryRow]:
        with self._lock:
            try:
                return [_row(r, self._layouts) for r in self._db().execute(sql, args).fetchall()]
            except sqlite3.Error as err:
                raise HistoryError(f"history: cannot read {self.path}: {err}") from err

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def check_path(cfg: History) -> None:
    """Refuse a ``history.path`` the store could not open, without creating anything: its nearest
    existing folder must be a writable folder and the file, where it exists, a writable file
    (``:memory:`` always passes). ``inferlb validate`` and ``inferlb serve`` both ask it.

    Raises:
        HistoryError: naming the path and what is wrong with it.
    """
    if cfg.path == ":memory:":
        return
    path = Path(cfg.path) if cfg.path is not None else default_path()
    if path.exists():
        if not path.is_file():
            raise HistoryError(f"history.path {str(path)!r} is not a file")
        if not os.access(path, os.R_OK | os.W_OK):
            raise HistoryError(f"history.path {str(path)!r} is not writable by this user")
        return
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise HistoryError(f"history.path {str(path)!r}: {str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise HistoryError(f"history.path {str(path)!r}: cannot create it, {str(folder)!r} is not writable "
                           "by this user")


def open_store(cfg: History) -> SqliteHistory:
    """The store the ``history`` config section names (see :class:`xds_server.config.History`).

    Raises:
        HistoryError: the database cannot be opened.
    """
    path = cfg.path if cfg.path is not None else default_path()
    return SqliteHistory(path, retention_s=cfg.retention_days * 86400.0, max_rows=cfg.max_rows)
