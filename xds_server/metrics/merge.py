"""Several sources' answers -> one :class:`EndpointStats` per endpoint: per input, the freshest (pure).

Each source reports, per instance, its values and the age of its newest sample. For every input
the value of the source with the youngest sample that has a value for it wins; a source whose
sample is older than the staleness limit is dropped as long as the endpoint has a fresh one (a
stale answer must not mix in: C04). When every source is stale for an endpoint, the freshest
values are kept for display and the endpoint's age is the freshest age (the engine excludes it,
or keeps the last weights when the whole cluster is stale: C05). Ties go to the earlier source.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping

from xds_server.metrics.stats import SIGNAL_FIELDS, EndpointStats

_SIGNALS = operator.attrgetter(*SIGNAL_FIELDS)
_NONES = (None,) * len(SIGNAL_FIELDS)
#: Instances per C-level dict update with one source (one update of 60 000 held the GIL, which the
#: event loop shares, for tens of ms: caught by a faulthandler watchdog at 35 ms).
PIECE = 4096


class Origins(Mapping[str, Mapping[str, str]]):
    """``{instance: {input: source name}}`` of one merge, read-only. Instances whose stats came whole
    from one source (the common case) are kept as ``{source name: {instance: stats}}`` and get their
    mapping when it is read (``/api/v1/weights``), not in every round: with a mapping made for each
    (the pattern of present inputs, a 16-item tuple each) a fetch of 60 000 endpoints from one source
    took 98–150 ms, now 28–40 ms (``CombinedSource.fetch`` over the scale benchmark's answers, GC off,
    3 interleaved runs, medians of 8 rounds). Mappings are shared between instances alike: read
    them, never change them.
    """

    def __init__(self, given: dict[str, Mapping[str, str]], whole: dict[str, dict[str, EndpointStats]],
                 shared: dict[tuple, dict[str, str]]) -> None:
        self._given = given  # merged from several sources, or from none (empty)
        self._whole = whole  # source name -> {instance: its stats}, for instances answered by it alone
        self._shared = shared  # (source, present inputs) -> mapping, for _origin

    def __getitem__(self, inst: str) -> Mapping[str, str]:
        for name, stats in self._whole.items():
            st = stats.get(inst)
            if st is not None:
                return _origin(self._shared, name, st)
        return self._given[inst]

    def __iter__(self) -> Iterator[str]:
        yield from self._given
        for stats in self._whole.values():
            yield from stats

    def __len__(self) -> int:
        return len(self._given) + sum(map(len, self._whole.values()))

    def sources(self) -> set[str]:
        """The names of the sources that gave any instance any input."""
        distinct = {id(w): w for w in self._given.values()}.values()  # shared mappings: each once
        given = {n for where in distinct for n in where.values()}
        return {name for name, stats in self._whole.items() if stats} | given


def merge(answers: Mapping[str, Mapping[str, EndpointStats]], instances: Iterable[str], stale_after_s: float
          ) -> tuple[dict[str, EndpointStats], Origins]:
    """``({instance: merged stats}, {instance: {input: source name}})``.

    ``answers``: ``{source name: {instance: stats}}`` in priority order; an instance a source has no
    answer for (or whose ``sample_age_s`` is ``None``) is not seen by that source.
    """
    origin: dict[str, Mapping[str, str]] = {}
    shared: dict[tuple, dict[str, str]] = {}
    sources = list(answers.items())
    if len(sources) == 1:  # one source (the common case): its answers as they are, by C-level dict builds
        name, answer = sources[0]
        instances = list(instances)
        merged = {}
        for start in range(0, len(instances), PIECE):  # one C call per piece: the GIL changes hands between
            piece = instances[start:start + PIECE]
            merged.update(zip(piece, map(answer.get, piece), strict=True))
        for inst in [inst for inst, st in merged.items() if st is None or st.sample_age_s is None]:
            merged[inst], origin[inst] = EndpointStats(), {}
        whole = dict(merged) if not origin else {i: st for i, st in merged.items() if i not in origin}
        return merged, Origins(origin, {name: whole}, shared)
    merged: dict[str, EndpointStats] = {}
    for inst in instances:
        seen = [(st.sample_age_s, i, name, st) for i, (name, by_inst) in enumerate(sources)
                if (st := by_inst.get(inst)) is not None and st.sample_age_s is not None]
        if not seen:
            merged[inst] = EndpointStats()
            origin[inst] = {}
            continue
        usable = seen  # one source saw it: nothing to rank
        if len(seen) > 1:
            seen.sort(key=lambda x: (x[0], x[1]))
            youngest = seen[0][0]
            usable = seen if youngest > stale_after_s else [x for x in seen if x[0] <= stale_after_s]
        if len(usable) == 1:  # one source answers: its stats as they are (O(fields))
            name, st = usable[0][2], usable[0][3]
            merged[inst], origin[inst] = st, _origin(shared, name, st)
            continue
        values: dict[str, float | None] = {}
        where: dict[str, str] = {}
        for field in SIGNAL_FIELDS:
            for _, _, name, st in usable:
                v = getattr(st, field)
                if v is not None:
                    values[field], where[field] = v, name
                    break
        merged[inst] = EndpointStats(**values, sample_age_s=youngest)
        where["sample_age_s"] = seen[0][2]
        origin[inst] = where
    return merged, Origins(origin, {}, shared)


def _origin(shared: dict[tuple, dict[str, str]], name: str, st: EndpointStats) -> dict[str, str]:
    """``{input: name}`` for the inputs ``st`` has: one mapping per source and set of inputs, shared
    (through ``shared``) by the endpoints alike (read-only)."""
    key = (name, tuple(map(operator.is_not, _SIGNALS(st), _NONES)))
    where = shared.get(key)
    if where is None:
        where = shared[key] = {f: name for f, has in zip(SIGNAL_FIELDS, key[1], strict=True) if has}
        where["sample_age_s"] = name
    return where
