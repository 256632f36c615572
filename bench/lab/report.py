"""The lab's part of BENCHMARKS.md (pure: the lab's JSON in, markdown out).

Per scenario: what it tests, each policy's highest QPS within the SLO, the figures at the
*headline point* (the highest QPS at which the best prefix-aware peer still meets the SLO: where
the published comparisons are made), TTFT p90 at every point, the two plots, and plainly where
inferlb stands against each peer. Then the published results the lab is checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.lab.scenarios import SCENARIOS

__all__ = ["BEGIN", "END", "PEERS", "PREFIX_PEERS", "checks", "headline_qps", "lab_section"]

BEGIN, END = "<!-- lab:start -->", "<!-- lab:end -->"
#: The peers' published algorithms that read the prompt.
PREFIX_PEERS = ("llm_d", "sglang_cache_aware", "dynamo_kv")
#: Everything inferlb is compared with.
PEERS = ("round_robin", "least_request", "ring_hash_bounded", "random", *PREFIX_PEERS, "oracle")


def _meets(p: Mapping[str, Any], slo: float) -> bool:
    return p.get("ttft_p90_ms") is not None and p["ttft_p90_ms"] <= slo and (p.get("error_rate") or 0) <= 0.01


def _point(sc: Mapping[str, Any], policy: str, qps: float) -> Mapping[str, Any] | None:
    data = sc["policies"].get(policy)
    return None if data is None else next((p for p in data["points"] if p["qps"] == qps), None)


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


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "–"
    return f"{a / b:.1f}x"


def _standing(sc: Mapping[str, Any], slo: float, qps: float | None) -> list[str]:
    """One line per peer: inferlb's highest QPS within the SLO against the peer's, and TTFT p90 at the headline."""
    mine = sc["policies"].get("inferlb")
    if mine is None:
        return []
    out = []
    for peer in PEERS:
        theirs = sc["policies"].get(peer)
        if theirs is None:
            continue
        a, b = mine.get("max_qps_within_slo"), theirs.get("max_qps_within_slo")
        verdict = ("ahead" if (a or 0) > (b or 0) else "behind" if (a or 0) < (b or 0) else "level")
        line = f"- vs `{peer}`: {verdict} (max QPS within SLO {_num(a, '{:g}')} against {_num(b, '{:g}')})"
        if qps is not None:
            pa, pb = _point(sc, "inferlb", qps), _point(sc, peer, qps)
            if pa and pb:
                line += (f"; at {qps:g} QPS TTFT p90 {_ms(pa['ttft_p90_ms'])} against {_ms(pb['ttft_p90_ms'])}, "
                         f"{_num(pa['output_tokens_per_s'])} against {_num(pb['output_tokens_per_s'])} tok/s")
        out.append(line)
    return out


def _scenario(name: str, sc: Mapping[str, Any], plots: str, slo: float) -> list[str]:
    known = SCENARIOS.get(name)
    policies = list(sc["policies"])
    qps = headline_qps(sc, slo)
    lines = [f"### {name}: {sc['title']}", ""]
    if known is not None:
        lines += [f"Trap: {known.trap}.", ""]
    lines += [f"{sc['engines']} engines, {sc['duration_s']:g} s of arrivals per point (the first "
              f"{sc['warmup_s']:g} s not measured). Headline point: "
              + (f"{qps:g} QPS, the highest at which the best prefix-aware peer meets the SLO." if qps is not None
                 else "none: no prefix-aware peer meets the SLO at any point."), ""]
    lines += ["| policy | max QPS within SLO | TTFT p50 | TTFT p90 | TTFT p99 | ITL p90 | e2e p95 | tok/s | "
              "prefix hits | preemptions | errors |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              "---: | ---: | ---: |"]
    at = qps if qps is not None else max(p["qps"] for d in sc["policies"].values() for p in d["points"])
    for policy in policies:
        p = _point(sc, policy, at) or {}
        lines.append(
            f"| {policy} | {_num(sc['policies'][policy].get('max_qps_within_slo'), '{:g}')} | "
            f"{_ms(p.get('ttft_p50_ms'))} | {_ms(p.get('ttft_p90_ms'))} | {_ms(p.get('ttft_p99_ms'))} | "
            f"{_ms(p.get('itl_p90_ms'))} | {_ms(p.get('e2e_p95_ms'))} | {_num(p.get('output_tokens_per_s'))} | "
            f"{_num(p.get('prefix_hit_rate'), '{:.0%}')} | {_num(p.get('preemptions'))} | "
            f"{_num(p.get('error_rate'), '{:.1%}')} |")
    lines += ["", f"(Figures at {at:g} QPS.) TTFT p90 at every point:", ""]
    points = sorted({p["qps"] for d in sc["policies"].values() for p in d["points"]})
    lines += ["| policy | " + " | ".join(f"{q:g}" for q in points) + " |",
              "| --- |" + " ---: |" * len(points)]
    for policy in policies:
        lines.append(f"| {policy} | " + " | ".join(_ms((_point(sc, policy, q) or {}).get("ttft_p90_ms"))
                                                  for q in points) + " |")
    stem = name.replace(":", "-").replace("/", "_")
    lines += ["", f"![TTFT p90 against QPS]({plots}/{stem}-ttft.png) "
              f"![output tokens per s against QPS]({plots}/{stem}-tokens.png)", ""]
    standing = _standing(sc, slo, qps)
    if standing:
        lines += ["Where inferlb stands:", "", *standing, ""]
    return lines


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
        top = max(p["qps"] for d in chat["policies"].values() for p in d["points"])
        lr = _point(chat, "least_request", top)
        best = min((_point(chat, peer, top) for peer in PREFIX_PEERS if _point(chat, peer, top)),
                   key=lambda p: p.get("ttft_mean_ms") or 1e18, default=None)
        if lr and best:
            x = (lr["ttft_mean_ms"] or 0) / max(best["ttft_mean_ms"] or 1e-9, 1e-9)
            out.append(f"- KubeAI's ShareGPT conversations (prefix-aware mean TTFT far below least_request's at high "
                       f"load): **{'met' if x >= 5 else 'not met'}** - at {top:g} QPS mean TTFT "
                       f"{_ms(best['ttft_mean_ms'])} against {_ms(lr['ttft_mean_ms'])} ({x:.0f}x). Published: "
                       f"39.2 s -> 0.24 s.")
    return out


def lab_section(doc: Mapping[str, Any], plots: str) -> str:
    """The whole lab section of BENCHMARKS.md (between :data:`BEGIN` and :data:`END`)."""
    slo = doc["slo_ttft_p90_ms"]
    lines = [BEGIN, f"Command: `{doc['command']}` · commit {doc['commit']} · {doc['date']} · seed {doc['seed']} · "
                    f"SLO: TTFT p90 <= {slo / 1000:g} s and errors <= 1 %", ""]
    found = checks(doc)
    if found:
        lines += ["Published results, reproduced?", "", *found, ""]
    for name, sc in doc["scenarios"].items():
        lines += _scenario(name, sc, plots, slo)
    lines.append(END)
    return "\n".join(lines) + "\n"
