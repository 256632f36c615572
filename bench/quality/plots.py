"""PNG plots of one scenario run (matplotlib, no display needed).

- ``<scenario>-latency.png``: the CDF of successful requests' end-to-end latency, one line per policy
  (every round's requests together);
- ``<scenario>-ttft.png``: the CDF of successful streamed requests' time to first token, likewise;
- ``<scenario>-weights.png``: Envoy's per-host weight over time under each inferlb policy (a host
  that is not HEALTHY is drawn at 0), with the end of warm-up and the scenario's events marked.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.quality.policies import INFERLB, policies_for  # noqa: E402
from bench.quality.runner import ScenarioRun  # noqa: E402


def _cdf(run: ScenarioRun, path: Path, attr: str, xlabel: str, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for policy in policies_for(run.scenario):  # the gateway scenarios run their own policies
        values = sorted(v for pr in run.runs.get(policy, []) for v in getattr(pr, attr))
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=f"{policy} (n={len(values)})", linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    rounds = len(run.orders)
    ax.set_title(f"{run.scenario.name}: {title}" + (" (quick)" if run.quick else "")
                 + (f", {rounds} rounds" if rounds > 1 else ""))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def latency_cdf(run: ScenarioRun, path: Path) -> Path:
    """Write the end-to-end latency CDF of every policy of ``run`` (all rounds) to ``path``; returns it."""
    return _cdf(run, path, "latencies_ms", "end-to-end latency of successful requests, ms (log scale)",
                "latency CDF")


def ttft_cdf(run: ScenarioRun, path: Path) -> Path:
    """Write the TTFT CDF of every policy of ``run`` (streamed requests, all rounds) to ``path``; returns it."""
    return _cdf(run, path, "ttfts_ms", "time to first token of successful streamed requests, ms (log scale)",
                "TTFT CDF")


def weights_over_time(run: ScenarioRun, path: Path) -> Path | None:
    """Write Envoy's weights over time under each inferlb policy of ``run``; None if none ran."""
    policies = [p for p in INFERLB if p in run.runs]
    if not policies:
        return None
    fig, axes = plt.subplots(len(policies), 1, figsize=(7, 2.8 * len(policies)), dpi=110, sharex=True,
                             squeeze=False)
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        pr = run.runs[policy][-1]  # the last round's run
        series: dict[tuple[str, str], tuple[list[float], list[int]]] = {}
        for t, cluster, address, weight, health in pr.weights:
            if not cluster.startswith("chat"):
                continue
            xs, ys = series.setdefault((cluster, address), ([], []))
            xs.append(t)
            ys.append(weight if health == "HEALTHY" else 0)
        for (cluster, address), (xs, ys) in sorted(series.items(), key=lambda kv: run.node_label(kv[0][1])):
            ax.step(xs, ys, where="post", label=f"{run.node_label(address)} ({cluster})", linewidth=1.2)
        ax.axvline(run.warmup_s, color="grey", linestyle=":", linewidth=1)
        for t, label in pr.events:
            ax.axvline(t, color="black", linestyle="--", linewidth=0.8)
            ax.annotate(label, (t, 1), xycoords=("data", "axes fraction"), fontsize=6, rotation=90,
                        va="top", ha="right")
        ax.set_ylabel("EDS weight in Envoy")
        ax.set_title(f"{run.scenario.name} / {policy}, round {pr.round + 1} (0 = not HEALTHY; dotted: end of "
                     "warm-up)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("time since the replay started, s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
