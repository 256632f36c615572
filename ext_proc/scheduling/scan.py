"""What the pickers share: which filter turns an endpoint away, and the best-scored endpoints (pure).

"Best" is the highest weighted sum of the scorers' scores; where the profile's only scorer is the
share-weighted load (:class:`~ext_proc.scheduling.api.LoadPerShare`), it is the lowest load per
share, computed inline (one loop, no call per endpoint: the scan of a 64-endpoint pool runs once
per request without a key). Ties are values within :data:`TIE` of the best in those terms (load
per share, or total score). Filters of the shapes :class:`~ext_proc.scheduling.api.Without` and
:class:`~ext_proc.scheduling.api.Floor` are evaluated inline too.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

from ext_proc.scheduling.api import INF, Check, Choice, Floor, LoadPerShare, Score, Stage, Without

__all__ = ["TIE", "Scores", "draw", "kept", "lowest", "lowest_first", "nothing_left", "refusal", "soft_active",
           "values"]

#: Two values this close are a tie.
TIE = 1e-12

#: Prepared scorers: ``[(weight, score), ...]`` (:meth:`ext_proc.scheduling.profile.Profile.scores`).
Scores = Sequence[tuple[float, Score]]

_new = tuple.__new__
_NOTHING: frozenset[str] = frozenset()


def refusal(stage: Stage, endpoint: str, hard_only: bool = False) -> int:
    """The index (in ``stage.profile.filters``) of the first filter that turns ``endpoint`` away
    (``hard_only``: of the hard ones), -1 when every one keeps it."""
    soft = stage.profile.soft_bits if hard_only else 0
    bits = stage.profile.filter_bits
    for k, check in enumerate(stage.checks):
        if check is not None and not check(endpoint) and not soft & bits[k]:
            return k
    return -1


def soft_active(stage: Stage) -> bool:
    """True when a soft filter has something to say about this request."""
    soft, bits = stage.profile.soft_bits, stage.profile.filter_bits
    return any(check is not None and soft & bits[k] for k, check in enumerate(stage.checks))


def _active(stage: Stage, hard_only: bool) -> list[Check]:
    soft, bits = stage.profile.soft_bits if hard_only else 0, stage.profile.filter_bits
    return [c for k, c in enumerate(stage.checks) if c is not None and not soft & bits[k]]


def _shapes(stage: Stage, hard_only: bool) -> tuple[Container[str], Mapping[str, float] | None, float,
                                                   list[Check] | None]:
    """The active checks as ``(endpoints turned away, values, floor, other checks)``: one
    :class:`Without` and one :class:`Floor` (the built-in hard filters) inline, the rest (and any
    second one of a shape) in ``other`` (None: none)."""
    soft, bits = stage.profile.soft_bits if hard_only else 0, stage.profile.filter_bits
    out: Container[str] = _NOTHING
    values: Mapping[str, float] | None = None
    floor = 0.0
    other: list[Check] | None = None
    k = -1
    for check in stage.checks:
        k += 1
        if check is None or soft & bits[k]:
            continue
        kind = type(check)
        if kind is Without and out is _NOTHING:
            out = check[0]
        elif kind is Floor and values is None:
            values, floor = check
        elif other is None:
            other = [check]
        else:
            other.append(check)
    return out, values, floor, other


def kept(stage: Stage, endpoints: Sequence[str], hard_only: bool = False, skip: str | None = None) -> list[str]:
    """The endpoints every filter (``hard_only``: every hard filter) keeps, in order, without ``skip``."""
    out, values, floor, other = _shapes(stage, hard_only)
    if other is not None:
        checks = _active(stage, hard_only)
        return [e for e in endpoints if e != skip and all(check(e) for check in checks)]
    if values is None:
        return [e for e in endpoints if e not in out and e != skip]
    get = values.get
    return [e for e in endpoints if e not in out and e != skip and get(e, INF) >= floor]


def values(scores: Scores) -> Callable[[Sequence[str]], list[float]]:
    """``values(endpoints)``: each endpoint's value, lower is better: its load per share when the only
    scorer is :class:`LoadPerShare`, else minus its weighted total score (0 without scorers)."""
    if len(scores) == 1 and type(scores[0][1]) is LoadPerShare:
        get, shares = scores[0][1].loads.get, scores[0][1].shares
        return lambda endpoints: [get(e, 0.0) / shares[e] for e in endpoints]

    def totals(endpoints: Sequence[str]) -> list[float]:
        out = [0.0] * len(endpoints)
        for weight, score in scores:
            for i, s in enumerate(score(endpoints)):
                out[i] -= weight * s
        return out

    return totals


def lowest(stage: Stage, scores: Scores, endpoints: Sequence[str], shares: Mapping[str, float],
           hard_only: bool = False) -> tuple[list[str], float]:
    """Of the endpoints every filter (``hard_only``: every hard filter) keeps: those tied for the
    lowest value (in ``endpoints`` order; a later value more than :data:`TIE` lower starts the ties
    again) and the sum of their ``shares``."""
    out, free, need, other = _shapes(stage, hard_only)
    low, tied, tied_share = INF, [], 0.0
    if other is None and len(scores) == 1 and type(scores[0][1]) is LoadPerShare:
        # The default profile: the lowest load per share, one loop.
        loads = scores[0][1].loads
        for e in endpoints:
            if e in out or (free is not None and free.get(e, INF) < need):
                continue
            rel = loads.get(e, 0.0) / shares[e]
            if rel < low - TIE:
                low, tied, tied_share = rel, [e], shares[e]
            elif rel <= low + TIE:
                tied.append(e)
                tied_share += shares[e]
        return tied, tied_share
    candidates = kept(stage, endpoints, hard_only)
    for e, v in zip(candidates, values(scores)(candidates), strict=True):
        if v < low - TIE:
            low, tied, tied_share = v, [e], shares[e]
        elif v <= low + TIE:
            tied.append(e)
            tied_share += shares[e]
    return tied, tied_share


def lowest_first(scores: Scores, candidates: Sequence[str]) -> str | None:
    """The first of ``candidates`` with the strictly lowest value (None when there are none)."""
    best, best_value = None, INF
    for e, v in zip(candidates, values(scores)(candidates), strict=True):
        if best is None or v < best_value:
            best, best_value = e, v
    return best


def draw(tied: Sequence[str], tied_share: float, shares: Mapping[str, float], spin: int) -> str:
    """One of ``tied`` (non-empty), drawn by share with the low 32 bits of ``spin`` (0: the first)."""
    u = (spin & 0xFFFFFFFF) / 4294967296.0 * tied_share
    for e in tied:
        u -= shares[e]
        if u < 0:
            return e
    return tied[-1]


def nothing_left(stage: Stage) -> Choice:
    """The choice when no endpoint is left (outcome ``no-memory``): its plugins are the filters that
    turned an endpoint away."""
    mask = 0
    bits = stage.profile.filter_bits
    for e in stage.request.pool.endpoints:
        k = refusal(stage, e)
        if k >= 0:
            mask |= bits[k]
    return _new(Choice, (None, "no-memory", stage.profile.label(mask or stage.profile.picker_bit)))
