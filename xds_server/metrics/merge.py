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
from collections.abc import Iterable, Mapping

from xds_server.metrics.stats import SIGNAL_FIELDS, EndpointStats

_SIGNALS = operator.attrgetter(*SIGNAL_FIELDS)
_NONES = (None,) * len(SIGNAL_FIELDS)


def merge(answers: Mapping[str, Mapping[str, EndpointStats]], instances: Iterable[str], stale_after_s: float
          ) -> tuple[dict[str, EndpointStats], dict[str, dict[str, str]]]:
    """``({instance: merged stats}, {instance: {input: source name}})``.

    ``answers``: ``{source name: {instance: stats}}`` in priority order; an instance a source has no
    answer for (or whose ``sample_age_s`` is ``None``) is not seen by that source. The ``{input:
    source}`` mappings are shared between endpoints with the same origins: read them, never change them.
    """
    merged: dict[str, EndpointStats] = {}
    origin: dict[str, dict[str, str]] = {}
    shared: dict[tuple, dict[str, str]] = {}
    sources = list(answers.items())
    only = sources[0] if len(sources) == 1 else None  # one source (the common case): no list per endpoint
    for inst in instances:
        if only is not None:
            st = only[1].get(inst)
            if st is not None and st.sample_age_s is not None:
                merged[inst], origin[inst] = st, _origin(shared, only[0], st)
                continue
            seen = []
        else:
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
    return merged, origin


def _origin(shared: dict[tuple, dict[str, str]], name: str, st: EndpointStats) -> dict[str, str]:
    """``{input: name}`` for the inputs ``st`` has: one mapping per source and set of inputs, shared
    (through ``shared``) by the endpoints alike (read-only)."""
    key = (name, tuple(map(operator.is_not, _SIGNALS(st), _NONES)))
    where = shared.get(key)
    if where is None:
        where = shared[key] = {f: name for f, has in zip(SIGNAL_FIELDS, key[1], strict=True) if has}
        where["sample_age_s"] = name
    return where
