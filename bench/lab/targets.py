"""inferlb's targets in the lab, each measured and judged on a lab JSON document (pure).

The scheduler's targets (issue 37), as far as the lab's figures express them; the policy judged is
``inferlb`` (the default scheduling profile). A target whose scenario or policies are missing from the
document is left out (a run of some scenarios only judges those). Each row is a :class:`Target`:
what it asks, what was measured, and ``met``.

- ``shared_prefix``, ``sharegpt_chat``: the highest QPS within the SLO >= the smaller of 1.1 x the best
  prefix-aware peer's (:data:`PREFIX_PEERS`) and halfway from it to ``oracle``'s;
  TTFT p90 <= 1.05 x the best prefix-aware peer's at every QPS point (the lowest of theirs there);
  TTFT p90 >= 10 x better than round robin's at the top of the sweep.
- ``uniform``: TTFT p90 and e2e p95 at most 3 % above least_request's and output tok/s at most 3 %
  below, at every point (nothing shared: the scheduler must do no harm).
- ``heterogeneous``: the highest QPS within the SLO >= 1.2 x least_request's and >= every other
  policy's but ``oracle``.
- ``uneven``: no OOM, e2e p95 <= round robin's. ``versions``: no wrong-version answer.
- ``scaling``: sessions moved on the scale-up (:func:`bench.lab.figures.sessions_moved`) <= 1/N + 5 %,
  N the engines after it (the scenario's and the one that joins): what consistent hashing moves,
  plus a margin for spills.
- ``multi_gateway`` against ``uneven`` (the same traffic through one gateway): TTFT p90, e2e p95 and the
  error rate within 5 % of one gateway's (the error rate also passes within 0.05 points: 5 % of a
  near-zero rate is below one request in the lab's runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = ["JUDGED", "PREFIX_PEERS", "Target", "targets"]

#: The peers' published algorithms that read the prompt.
PREFIX_PEERS = ("llm_d", "sglang_cache_aware", "dynamo_kv")
_NOT_PEERS = ("inferlb", "inferlb_precise", "inferlb_latency", "oracle")

#: ``{scenario: policies}``: the runs :func:`targets` judges, and no more (``heterogeneous`` compares
#: every policy a run without ``--policy`` compares but the oracle; ``multi_gateway`` is judged against
#: ``uneven``'s inferlb). A lab of these alone gives every target (the quick lab's test in CI runs them).
JUDGED: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "shared_prefix": ("round_robin", *PREFIX_PEERS, "oracle", "inferlb"),
    "sharegpt_chat": ("round_robin", *PREFIX_PEERS, "oracle", "inferlb"),
    "uniform": ("least_request", "inferlb"),
    "heterogeneous": ("round_robin", "least_request", "ring_hash_bounded", "random", *PREFIX_PEERS, "inferlb"),
    "uneven": ("round_robin", "inferlb"),
    "versions": ("inferlb",),
    "scaling": ("inferlb",),
    "multi_gateway": ("inferlb",),
})


class Target(NamedTuple):
    """One target: ``what`` it asks, the ``measured`` figures (words), ``met``."""

    what: str
    measured: str
    met: bool


def _ms(v: float) -> str:
    return f"{v / 1000:.1f} s" if v >= 10_000 else f"{v:.0f} ms"


def _points(doc: Mapping[str, Any], scenario: str, policy: str) -> list[Mapping[str, Any]] | None:
    sc = doc["scenarios"].get(scenario)
    data = None if sc is None else sc["policies"].get(policy)
    return None if data is None else data["points"]


def _max_qps(doc: Mapping[str, Any], scenario: str, policy: str) -> float:
    return doc["scenarios"][scenario]["policies"][policy].get("max_qps_within_slo") or 0.0


def _prefix_sweep(doc: Mapping[str, Any], name: str) -> list[Target]:
    sc = doc["scenarios"].get(name)
    if sc is None or "inferlb" not in sc["policies"] or "oracle" not in sc["policies"]:
        return []
    peers = [p for p in PREFIX_PEERS if p in sc["policies"]]
    if not peers or "round_robin" not in sc["policies"]:
        return []
    best = max(peers, key=lambda p: _max_qps(doc, name, p))
    best_q, oracle_q, mine_q = _max_qps(doc, name, best), _max_qps(doc, name, "oracle"), _max_qps(doc, name, "inferlb")
    bar = min(1.1 * best_q, best_q + (oracle_q - best_q) / 2)
    out = [Target(f"{name}: max QPS within the SLO >= min(1.1 x best prefix-aware peer's, halfway to oracle's)",
                  f"{mine_q:g} against {bar:g} (`{best}` {best_q:g}, oracle {oracle_q:g})", mine_q >= bar)]
    mine = {p["qps"]: p for p in _points(doc, name, "inferlb") or []}
    worst = None
    for qps, p in sorted(mine.items()):
        theirs = [q["ttft_p90_ms"] for peer in peers for q in _points(doc, name, peer) or []
                  if q["qps"] == qps and q.get("ttft_p90_ms") is not None]
        if theirs and p.get("ttft_p90_ms") is not None:
            ratio = p["ttft_p90_ms"] / max(min(theirs), 1e-9)
            if worst is None or ratio > worst[0]:
                worst = (ratio, qps, p["ttft_p90_ms"], min(theirs))
    if worst is not None:
        ratio, qps, a, b = worst
        out.append(Target(f"{name}: TTFT p90 <= 1.05 x the best prefix-aware peer's at every point",
                          f"worst {ratio:.2f} x at {qps:g} QPS ({_ms(a)} against {_ms(b)})", ratio <= 1.05))
    top = max(mine)
    rr = next((q for q in _points(doc, name, "round_robin") or [] if q["qps"] == top), None)
    if rr is not None and mine[top].get("ttft_p90_ms") and rr.get("ttft_p90_ms") is not None:
        x = rr["ttft_p90_ms"] / mine[top]["ttft_p90_ms"]
        out.append(Target(f"{name}: TTFT p90 >= 10 x better than round robin's at the top of the sweep",
                          f"{x:.1f} x at {top:g} QPS ({_ms(mine[top]['ttft_p90_ms'])} against "
                          f"{_ms(rr['ttft_p90_ms'])})", x >= 10))
    return out


def _uniform(doc: Mapping[str, Any]) -> list[Target]:
    mine, lr = _points(doc, "uniform", "inferlb"), _points(doc, "uniform", "least_request")
    if mine is None or lr is None:
        return []
    by_qps = {p["qps"]: p for p in lr}
    worse = []
    for p in mine:
        q = by_qps.get(p["qps"])
        if q is None:
            continue
        for key, label, sign in (("ttft_p90_ms", "TTFT p90", 1), ("e2e_p95_ms", "e2e p95", 1),
                                 ("output_tokens_per_s", "tok/s", -1)):
            a, b = p.get(key), q.get(key)
            if a is not None and b and sign * (a - b) / b > 0.03:
                worse.append(f"{label} {a:.0f} against {b:.0f} at {p['qps']:g} QPS")
    return [Target("uniform: TTFT p90, e2e p95 and tok/s within 3 % of least_request's at every point",
                   "; ".join(worse) if worse else "no figure more than 3 % worse", not worse)]


def _heterogeneous(doc: Mapping[str, Any]) -> list[Target]:
    sc = doc["scenarios"].get("heterogeneous")
    if sc is None or "inferlb" not in sc["policies"] or "least_request" not in sc["policies"]:
        return []
    mine = _max_qps(doc, "heterogeneous", "inferlb")
    lr = _max_qps(doc, "heterogeneous", "least_request")
    others = [p for p in sc["policies"] if p not in _NOT_PEERS]
    best = max(others, key=lambda p: _max_qps(doc, "heterogeneous", p))
    best_q = _max_qps(doc, "heterogeneous", best)
    return [Target("heterogeneous: max QPS within the SLO >= 1.2 x least_request's and >= the best peer's",
                   f"{mine:g} against least_request {lr:g}, `{best}` {best_q:g}", mine >= 1.2 * lr and mine >= best_q)]


def _traps(doc: Mapping[str, Any]) -> list[Target]:
    out = []
    mine, rr = _points(doc, "uneven", "inferlb"), _points(doc, "uneven", "round_robin")
    if mine is not None and rr is not None:
        a, b = mine[0], rr[0]
        out.append(Target("uneven: no OOM and e2e p95 <= round robin's",
                          f"OOM {a['oom_rate']:.2%}, e2e p95 {_ms(a['e2e_p95_ms'])} against {_ms(b['e2e_p95_ms'])}",
                          a["oom_rate"] == 0 and a["e2e_p95_ms"] <= b["e2e_p95_ms"]))
    versions = _points(doc, "versions", "inferlb")
    if versions is not None:
        wrong = sum((p.get("errors") or {}).get("wrong-version", 0) for p in versions)
        out.append(Target("versions: no wrong-version answer", f"{wrong} wrong-version answers", wrong == 0))
    scaling = _points(doc, "scaling", "inferlb")
    if scaling is not None and scaling[0].get("sessions_moved") is not None:
        n = doc["scenarios"]["scaling"]["engines"] + 1   # the scenario's engines and the one that joins
        moved, bound = scaling[0]["sessions_moved"], 1 / n + 0.05
        out.append(Target("scaling: sessions moved on the scale-up <= 1/N + 5 %",
                          f"{moved:.1%} against {bound:.1%} (N = {n})", moved <= bound))
    many = _points(doc, "multi_gateway", "inferlb")
    if many is not None and mine is not None:
        a, b = many[0], mine[0]
        off = []
        for key, label in (("ttft_p90_ms", "TTFT p90"), ("e2e_p95_ms", "e2e p95")):
            if a[key] > 1.05 * b[key]:
                off.append(f"{label} {_ms(a[key])} against {_ms(b[key])}")
        if a["error_rate"] > max(1.05 * b["error_rate"], b["error_rate"] + 0.0005):
            off.append(f"errors {a['error_rate']:.2%} against {b['error_rate']:.2%}")
        out.append(Target("multi_gateway: TTFT p90, e2e p95 and errors within 5 % of one gateway's (uneven)",
                          "; ".join(off) if off else
                          f"TTFT p90 {_ms(a['ttft_p90_ms'])}, e2e p95 {_ms(a['e2e_p95_ms'])}, errors "
                          f"{a['error_rate']:.2%} against {_ms(b['ttft_p90_ms'])}, {_ms(b['e2e_p95_ms'])}, "
                          f"{b['error_rate']:.2%}", not off))
    return out


def targets(doc: Mapping[str, Any]) -> list[Target]:
    """inferlb's lab targets judged on ``doc`` (a lab JSON document: :func:`bench.lab.runner.lab_document`'s
    shape), in a fixed order; none for scenarios or policies the document lacks."""
    return [*_prefix_sweep(doc, "shared_prefix"), *_prefix_sweep(doc, "sharegpt_chat"), *_uniform(doc),
            *_heterogeneous(doc), *_traps(doc)]
