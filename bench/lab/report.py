"""The lab's part of BENCHMARKS.md (pure: the lab's JSON in, markdown out), kept short.

First the published results the lab is checked against, and inferlb's own targets
(:mod:`bench.lab.targets`). Then per sweep (a scenario with several QPS
points): each policy's highest QPS within the SLO, its TTFT p90 at every point and, at the
*headline point* (the highest QPS at which the best prefix-aware peer still meets the SLO: where
the published comparisons are made), its output tokens per s, prefix hits and errors; the two
plots; where inferlb stands against each peer, in one line. Then the traps (one point each) in one
table, TTFT p90 and errors per scenario and policy, and inferlb's standing per trap.

The stored results (``results.json`` beside the plots) are the page's source: a run of some
scenarios or policies replaces only their rows there (:func:`merge_results`), and the section's
first line says which rows came from which later run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.lab.scenarios import SCENARIOS
from bench.lab.targets import PREFIX_PEERS, targets

__all__ = ["BEGIN", "END", "PEERS", "PREFIX_PEERS", "checks", "headline_qps", "lab_section", "merge_results"]

BEGIN, END = "<!-- lab:start -->", "<!-- lab:end -->"
#: Everything inferlb is compared with.
PEERS = ("round_robin", "least_request", "ring_hash_bounded", "random", *PREFIX_PEERS, "oracle")


def _meets(p: Mapping[str, Any], slo: float) -> bool:
    return p.get("ttft_p90_ms") is not None and p["ttft_p90_ms"] <= slo and (p.get("error_rate") or 0) <= 0.01


def _point(sc: Mapping[str, Any], policy: str, qps: float) -> Mapping[str, Any] | None:
    data = sc["policies"].get(policy)
    return None if data is None else next((p for p in data["points"] if p["qps"] == qps), None)


def _qps_points(sc: Mapping[str, Any]) -> list[float]:
    return sorted({p["qps"] for d in sc["policies"].values() for p in d["points"]})


def headline_qps(sc: Mapping[str, Any], slo: float) -> float | None:
    """The highest QPS at which the best prefix-aware peer (the one with the highest such QPS) meets the SLO."""
    best = None
    for peer in PREFIX_PEERS:
        data = sc["policies"].get(peer)
        if data is None:
            continue
        ok = [p["qps"] for p in data["points"] if _meets(p, slo)]
        if ok and (best is None or max(ok) > best):
            best = max(ok)
    return best


def _ms(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v / 1000:.1f} s" if v >= 10_000 else f"{v:.0f} ms"


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "–" if v is None else fmt.format(v)


def _standing(sc: Mapping[str, Any], at: float) -> str:
    """inferlb against every peer in one line: by max QPS within the SLO, then errors at ``at`` (more than
    half a point apart), then TTFT p90 at ``at`` (more than 20 % apart); else level."""
    mine = sc["policies"].get("inferlb")
    if mine is None:
        return ""
    mq, mp = mine.get("max_qps_within_slo") or 0, _point(sc, "inferlb", at) or {}
    groups: dict[str, list[str]] = {"ahead of": [], "level with": [], "behind": []}
    for peer in PEERS:
        theirs = sc["policies"].get(peer)
        if theirs is None:
            continue
        tq, tp = theirs.get("max_qps_within_slo") or 0, _point(sc, peer, at) or {}
        a, b = mp.get("ttft_p90_ms"), tp.get("ttft_p90_ms")
        ea, eb = mp.get("error_rate") or 0.0, tp.get("error_rate") or 0.0
        if mq != tq:
            key = "ahead of" if mq > tq else "behind"
        elif abs(ea - eb) > 0.005:
            key = "ahead of" if ea < eb else "behind"
        elif a is not None and b is not None and abs(a - b) > 0.2 * min(a, b):
            key = "ahead of" if a < b else "behind"
        else:
            key = "level with"
        groups[key].append(f"`{peer}` ({_ms(b)}" + (f", {eb:.1%} errors)" if eb else ")"))
    parts = [f"{k} {', '.join(v)}" for k, v in groups.items() if v]
    errors = f", {mp['error_rate']:.1%} errors" if mp.get("error_rate") else ""
    return (f"**inferlb** (max QPS within SLO {_num(mine.get('max_qps_within_slo'), '{:g}')}, TTFT p90 "
            f"{_ms(mp.get('ttft_p90_ms'))}{errors} at {at:g} QPS): " + "; ".join(parts) + ".")


def _sweep(name: str, sc: Mapping[str, Any], plots: str, slo: float) -> list[str]:
    known = SCENARIOS.get(name)
    points = _qps_points(sc)
    qps = headline_qps(sc, slo)
    at = qps if qps is not None else points[-1]
    lines = [f"### {name}: {sc['title']}", ""]
    trap = f"{known.trap}. " if known is not None else ""
    lines += [f"{trap}{sc['engines']} engines, {sc['duration_s']:g} s of arrivals per point. Headline point "
              + (f"{at:g} QPS." if qps is not None else f"none (no prefix-aware peer meets the SLO): {at:g} QPS."),
              "", "| policy | max QPS in SLO | " + " | ".join(f"TTFT p90 @{q:g}" for q in points)
              + f" | tok/s @{at:g} | hits | errors |", "| --- | ---: |" + " ---: |" * (len(points) + 3)]
    for policy, data in sc["policies"].items():
        p = _point(sc, policy, at) or {}
        lines.append(f"| {policy} | {_num(data.get('max_qps_within_slo'), '{:g}')} | "
                     + " | ".join(_ms((_point(sc, policy, q) or {}).get("ttft_p90_ms")) for q in points)
                     + f" | {_num(p.get('output_tokens_per_s'))} | {_num(p.get('prefix_hit_rate'), '{:.0%}')} | "
                     f"{_num(p.get('error_rate'), '{:.1%}')} |")
    stem = name.replace(":", "-").replace("/", "_")
    lines += ["", f"![TTFT p90 against QPS]({plots}/{stem}-ttft.png) "
              f"![output tokens per s against QPS]({plots}/{stem}-tokens.png)", ""]
    standing = _standing(sc, at)
    return lines + ([standing, ""] if standing else [])


def _traps(doc: Mapping[str, Any], names: list[str]) -> list[str]:
    scs = {n: doc["scenarios"][n] for n in names}
    policies = list(dict.fromkeys(p for sc in scs.values() for p in sc["policies"]))
    lines = ["### The traps, one point each", "",
             "TTFT p90 (errors) per scenario; each scenario's QPS and cluster in its line below.", "",
             "| policy | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for policy in policies:
        cells = []
        for n in names:
            p = (scs[n]["policies"].get(policy) or {"points": [{}]})["points"][0]
            cells.append(f"{_ms(p.get('ttft_p90_ms'))} ({_num(p.get('error_rate'), '{:.1%}')})")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines.append("")
    for n, sc in scs.items():
        known = SCENARIOS.get(n)
        at = _qps_points(sc)[-1]
        lines.append(f"- `{n}` ({sc['engines']} engines, {at:g} QPS): {known.trap if known else sc['title']}. "
                     + _standing(sc, at))
    return lines + [""]


def checks(doc: Mapping[str, Any]) -> list[str]:
    """The published results the lab must reproduce in direction and rough size, each met or not."""
    slo = doc["slo_ttft_p90_ms"]
    out = []
    sp = doc["scenarios"].get("shared_prefix")
    if sp is not None:
        qps = headline_qps(sp, slo)
        best = max(PREFIX_PEERS, key=lambda peer: (sp["policies"].get(peer) or {}).get("max_qps_within_slo") or 0)
        a, b = (_point(sp, best, qps), _point(sp, "round_robin", qps)) if qps is not None else (None, None)
        if a and b:
            ttft_x = (b["ttft_p90_ms"] or 0) / max(a["ttft_p90_ms"] or 1e-9, 1e-9)
            tok_x = (a["output_tokens_per_s"] or 0) / max(b["output_tokens_per_s"] or 1e-9, 1e-9)
            verdict = "met" if ttft_x >= 10 and tok_x >= 1.5 else "not met"
            out.append(f"- llm-d's shared prefixes (TTFT p90 >= 10x better than round robin, tok/s >= 1.5x, at the "
                       f"highest point where the best prefix-aware peer meets the SLO): **{verdict}**"
                       f" - `{best}` at {qps:g} QPS: TTFT p90 {_ms(a['ttft_p90_ms'])} against round robin's "
                       f"{_ms(b['ttft_p90_ms'])} ({ttft_x:.0f}x), {_num(a['output_tokens_per_s'])} against "
                       f"{_num(b['output_tokens_per_s'])} tok/s ({tok_x:.2f}x). Published: 92.6 s random -> 0.54 s "
                       f"precise, 4 429 -> 8 730 tok/s.")
        else:
            out.append("- llm-d's shared prefixes: **not measured** (no point where a prefix-aware peer meets the SLO)")
    chat = doc["scenarios"].get("sharegpt_chat")
    if chat is not None:
        top = _qps_points(chat)[-1]
        lr = _point(chat, "least_request", top)
        best = min((_point(chat, peer, top) for peer in PREFIX_PEERS if _point(chat, peer, top)),
                   key=lambda p: p.get("ttft_mean_ms") or 1e18, default=None)
        if lr and best:
            x = (lr["ttft_mean_ms"] or 0) / max(best["ttft_mean_ms"] or 1e-9, 1e-9)
            out.append(f"- KubeAI's ShareGPT conversations (prefix-aware mean TTFT far below least_request's at high "
                       f"load): **{'met' if x >= 5 else 'not met'}** - at {top:g} QPS mean TTFT "
                       f"{_ms(best['ttft_mean_ms'])} against {_ms(lr['ttft_mean_ms'])} ({x:.1f}x). Published: "
                       f"39.2 s -> 0.24 s.")
    return out


def merge_results(stored: Mapping[str, Any] | None, run: Mapping[str, Any]) -> dict[str, Any]:
    """The stored results with ``run``'s rows in place of theirs (pure; both lab JSON documents).

    A run that covers every (scenario, policy) row of ``stored`` replaces it whole (None: nothing
    stored). Otherwise each of ``run``'s scenarios replaces its settings (title, engines, ...) and its
    policies' rows, every other row stays, and ``reruns`` (oldest first) gains
    ``{"command", "commit", "date", "wall_s", "rows": {scenario: [policy, ...]}}``; a row re-run
    again is named by its latest run only. The base run's ``command``, ``commit`` and ``date`` stay.
    """
    rows = {name: list(sc["policies"]) for name, sc in run["scenarios"].items()}
    if stored is None or all(set(sc["policies"]) <= set(rows.get(name, ()))
                             for name, sc in stored["scenarios"].items()):
        return dict(run)
    merged = dict(stored)
    merged["scenarios"] = {name: dict(sc, policies=dict(sc["policies"])) for name, sc in stored["scenarios"].items()}
    for name, sc in run["scenarios"].items():
        into = merged["scenarios"].setdefault(name, {"policies": {}})
        into.update({k: v for k, v in sc.items() if k != "policies"})
        into["policies"].update(sc["policies"])
    earlier = []
    for rerun in stored.get("reruns", []):
        left = {name: [p for p in pols if p not in rows.get(name, ())] for name, pols in rerun["rows"].items()}
        left = {name: pols for name, pols in left.items() if pols}
        if left:
            earlier.append(dict(rerun, rows=left))
    merged["reruns"] = [*earlier, {"command": run["command"], "commit": run["commit"], "date": run["date"],
                                   "wall_s": run.get("wall_s", 0), "rows": rows}]
    return merged


def _reruns(doc: Mapping[str, Any]) -> str:
    """The section's words on the rows later runs replaced ("" when none did)."""
    parts = []
    for r in doc.get("reruns", []):
        by_policy: dict[str, list[str]] = {}
        for name, pols in r["rows"].items():
            for pol in pols:
                by_policy.setdefault(pol, []).append(name)
        rows = "; ".join(f"{pol} on {', '.join(names)}" for pol, names in by_policy.items())
        parts.append(f"`{r['command']}` (commit {r['commit']}, {r['date']}, {r['wall_s']:.0f} s of wall time) "
                     f"for {rows}")
    return (" Rows from later runs: " + "; ".join(parts) + "; every other row is the run above's.") if parts else ""


def lab_section(doc: Mapping[str, Any], plots: str) -> str:
    """The whole lab section of BENCHMARKS.md (between :data:`BEGIN` and :data:`END`)."""
    slo = doc["slo_ttft_p90_ms"]
    lines = [BEGIN, f"Command: `{doc['command']}` · commit {doc['commit']} · {doc['date']} · seed {doc['seed']} · "
                    f"SLO: TTFT p90 <= {slo / 1000:g} s and errors <= 1 % · virtual time (deterministic; "
                    f"{doc.get('wall_s', 0):.0f} s of wall time, {doc.get('cpu_s', 0):.0f} s of CPU in the runs). "
                    f"How to read it: docs/benchmarks.md, Policy lab.{_reruns(doc)}", ""]
    found = checks(doc)
    if found:
        lines += ["Published results, reproduced?", "", *found, ""]
    judged = targets(doc)
    if judged:
        lines += ["Targets for `inferlb` (the default scheduling profile):", "", "| target | measured | verdict |",
                  "| --- | --- | --- |", *(f"| {t.what} | {t.measured} | {'met' if t.met else '**missed**'} |"
                                          for t in judged), ""]
    single = []
    for name, sc in doc["scenarios"].items():
        if len(_qps_points(sc)) > 1:
            lines += _sweep(name, sc, plots, slo)
        else:
            single.append(name)
    if single:
        lines += _traps(doc, single)
    lines.append(END)
    return "\n".join(lines) + "\n"
