"""What the pickers share: which filter turns an endpoint away, and the best-scored endpoints (pure).

"Best" is the highest weighted sum of the scorers' scores; where the profile's only scorer is the
share-weighted load (:class:`~ext_proc.scheduling.api.LoadPerShare`), it is the lowest load per
share, computed inline (one loop, no call per endpoint: the scan of a 64-endpoint pool runs once
per request without a key). Ties are values within :data:`TIE` of the best in those terms (load
per share, or total score). Filter rules of the shapes :class:`~ext_proc.scheduling.api.Without`
and :class:`~ext_proc.scheduling.api.Floor` are evaluated inline too.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from ext_proc.scheduling.api import INF, Check, Choice, Floor, LoadPerShare, Request, Score, Without

__all__ = ["TIE", "Scores", "draw", "kept", "lowest", "lowest_first", "nothing_left", "refusal", "soft_active",
           "values"]

#: Two values this close are a tie.
TIE = 1e-12

#: Scorer rules: ``[(weight, score), ...]`` (:meth:`ext_proc.scheduling.profile.Profile.scores`).
Scores = Sequence[tuple[float, Score]]

_new = tuple.__new__
_NOTHING: frozenset[str] = frozenset()


def refusal(request: Request, profile: Any, endpoint: str, hard_only: bool = False) -> int:
    """The index (in ``profile.filters``) of the first filter that turns ``endpoint`` away
    (``hard_only``: of the hard ones), -1 when every one keeps it."""
    soft = profile.soft_bits if hard_only else 0
    bits = profile.filter_bits
    for k, keep in enumerate(profile.keeps):
        if not soft & bits[k] and not keep(request, endpoint):  # a soft one is not asked (filters are pure)
            return k
    return -1


def soft_active(request: Request, profile: Any) -> bool:
    """True when a soft filter may turn an endpoint away for this request."""
    for f, bit in zip(profile.filters, profile.filter_bits, strict=True):
        if profile.soft_bits & bit:
            rule = getattr(f, "rule", None)
            if rule is None or rule(request) is not None:
                return True
    return False


def _shapes(rules: list[Check]) -> tuple[Container[str], Mapping[str, float] | None, float, list[Check] | None]:
    """``rules`` as ``(endpoints turned away, values, floor, other rules)``: one :class:`Without` and one
    :class:`Floor` (the built-in hard filters) inline, the rest (and a second one of a shape) in
    ``other`` (None: none)."""
    out: Container[str] = _NOTHING
    values: Mapping[str, float] | None = None
    floor = 0.0
    other: list[Check] | None = None
    for rule in rules:
        kind = type(rule)
        if kind is Without and out is _NOTHING:
            out = rule[0]
        elif kind is Floor and values is None:
            values, floor = rule
        elif other is None:
            other = [rule]
        else:
            other.append(rule)
    return out, values, floor, other


def kept(request: Request, profile: Any, endpoints: Sequence[str], hard_only: bool = False,
         skip: str | None = None) -> list[str]:
    """The endpoints every filter (``hard_only``: every hard filter) keeps, in order, without ``skip``."""
    rules = profile.rules(request, hard_only)
    out, values, floor, other = _shapes(rules)
    if other is not None:
        return [e for e in endpoints if e != skip and all(rule(e) for rule in rules)]
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
            got = score(endpoints)
            if len(got) != len(out) or not all(0.0 <= s <= 1.0 for s in got):
                _broken(score, got, len(out))
            for i, s in enumerate(got):
                out[i] -= weight * s
        return out

    return totals


def _broken(score: Score, got: Sequence[float], n: int) -> None:
    """Raise for a scorer's answer that breaks the contract (one score in [0, 1] per endpoint; NaN is
    none): the picker reports the failure (``pick-failed``, logged with this message) and Envoy's
    failure mode routes the request, where the wrong scores would have decided it silently (a NaN
    made every endpoint look refused: outcome ``no-memory``).

    Raises:
        ValueError: always, naming the plugin where the rule is its bound ``score``.
    """
    owner = getattr(getattr(score, "func", None), "__self__", None)
    name = getattr(owner, "name", None) or getattr(score, "__qualname__", repr(score))
    raise ValueError(f"scorer {name!r} gave {len(got)} scores for {n} endpoints, each must be in [0, 1]: "
                     f"{list(got)[:8]}")


def lowest(request: Request, profile: Any, scores: Scores, endpoints: Sequence[str], shares: Mapping[str, float],
           hard_only: bool = False) -> tuple[list[str], float]:
    """Of the endpoints every filter (``hard_only``: every hard filter) keeps: those tied for the
    lowest value (in ``endpoints`` order; a later value more than :data:`TIE` lower starts the ties
    again) and the sum of their ``shares``."""
    out, free, need, other = _shapes(profile.rules(request, hard_only))
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
    candidates = kept(request, profile, endpoints, hard_only)
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


def nothing_left(request: Request, profile: Any) -> Choice:
    """The choice when no endpoint is left (outcome ``no-memory``): its plugins are the hard filters
    that turned an endpoint away (the soft ones gave way)."""
    mask = 0
    bits = profile.filter_bits
    for e in request.pool.endpoints:
        k = refusal(request, profile, e, hard_only=True)
        if k >= 0:
            mask |= bits[k]
    return _new(Choice, (None, "no-memory", profile.label(mask or profile.picker_bit)))
