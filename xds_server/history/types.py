"""What the weight history holds, and the interface every history backend implements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import orjson

#: A row written because weight or health changed vs the endpoint's previous row.
CHANGE = "change"
#: A row written because the endpoint had no row for ``history.keyframe_s`` (nothing changed).
KEYFRAME = "keyframe"


class HistoryError(RuntimeError):
    """The history store cannot be opened or used; the message names the path and the cause."""


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One recorded state of one endpoint.

    ``t``: when it was recorded (Unix seconds); ``weight``: the EDS ``load_balancing_weight``;
    ``health``: HEALTHY, UNHEALTHY or DRAINING; ``score``: the combined 0–1 score (None when
    excluded); ``inputs``: the engine's inputs as seen (``EndpointStats.as_dict()``: ms, 0–1, MiB,
    s; None = no data); ``scores``: per-scorer 0–1 scores; ``reasons``: the engine's reasons (the
    filters' and scorers' verdicts in words); ``kind``: :data:`CHANGE` or :data:`KEYFRAME`;
    ``snapshot_version``: the snapshot that carried this state (None if unknown).
    """

    t: float
    cluster: str
    endpoint: str
    weight: int
    health: str
    score: float | None
    inputs: Mapping[str, float | None]
    scores: Mapping[str, float | None]
    reasons: tuple[str, ...]
    kind: str
    snapshot_version: str | None


class Layout(NamedTuple):
    """The names of a row's ``inputs`` and ``scores`` values, in the order its JSON arrays hold them."""

    inputs: tuple[str, ...]
    scores: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RowBatch:
    """Rows to store, column by column: entry ``i`` of every column is row ``i`` (meanings and units as in
    :class:`HistoryRow`). ``inputs`` and ``scores`` hold each row's values as the text of a JSON array
    (numbers, ``null`` = no data) whose names are ``layouts[layout[i]]``; ``reasons`` a JSON array of
    strings. A round at 60 000 endpoints can write 60 000 rows: the recorder builds its batch
    array-wise from the engine's verdicts (:func:`~xds_server.history.changes.to_record`), without a
    Python object per row; :meth:`of` makes one from :class:`HistoryRow` s.

    Arrays, not ``{name: value}`` objects: the names are the same in every row of a round. At 60 000
    rows (the scale benchmark's inputs, one run of 4 rounds each, ``/tmp`` script) the objects took
    0.40–0.63 s to build and 0.33–0.41 s to insert, the arrays 0.24–0.25 s and 0.25–0.33 s; a row's
    inputs are 112 characters instead of 377.
    """

    t: Sequence[float]
    cluster: Sequence[str]
    endpoint: Sequence[str]
    weight: Sequence[int]
    health: Sequence[str]
    score: Sequence[float | None]
    inputs: Sequence[str]
    scores: Sequence[str]
    reasons: Sequence[str]
    kind: Sequence[str]
    snapshot_version: Sequence[str | None]
    layout: Sequence[int]
    layouts: Sequence[Layout]

    def __len__(self) -> int:
        return len(self.t)

    @classmethod
    def of(cls, rows: Sequence[HistoryRow]) -> RowBatch:
        """The batch holding ``rows``, in order (their values encoded with orjson: finite floats or None)."""
        def text(value: object) -> str:
            return orjson.dumps(value).decode()

        layouts: dict[Layout, int] = {}
        at = [layouts.setdefault(Layout(tuple(r.inputs), tuple(r.scores)), len(layouts)) for r in rows]
        return cls([r.t for r in rows], [r.cluster for r in rows], [r.endpoint for r in rows],
                   [r.weight for r in rows], [r.health for r in rows], [r.score for r in rows],
                   [text(list(r.inputs.values())) for r in rows], [text(list(r.scores.values())) for r in rows],
                   [text(list(r.reasons)) for r in rows], [r.kind for r in rows], [r.snapshot_version for r in rows],
                   at, list(layouts))


class HistoryStore(Protocol):
    """A place to keep :class:`HistoryRow` s. Implementations must be safe to call from any thread.

    Every method may raise :class:`HistoryError` when the backend fails.
    """

    def append(self, rows: RowBatch) -> None:
        """Store ``rows`` (in time order) atomically: all or none."""

    def prune(self, now: float) -> int:
        """Drop rows past the retention period or the row cap; return how many were dropped."""

    def rows(self, since: float, until: float, cluster: str | None = None, endpoint: str | None = None,
             limit: int = 10_000) -> list[HistoryRow]:
        """Rows with ``since <= t <= until`` (filtered when ``cluster``/``endpoint`` are given), oldest
        first, at most ``limit`` of them (the oldest ``limit``)."""

    def last_before(self, t: float, cluster: str | None = None, endpoint: str | None = None) -> list[HistoryRow]:
        """Per endpoint, its newest row with ``t' < t`` (``t = inf``: every endpoint's latest row)."""

    def close(self) -> None:
        """Release the backend; further calls raise :class:`HistoryError`."""
