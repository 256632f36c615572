"""PNG plots of a lab scenario's sweep (matplotlib, no display): TTFT p90 and output tokens per s against
QPS, one line per policy (``<scenario>-ttft.png``, ``<scenario>-tokens.png``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["sweep_plots"]

_STYLE = {"inferlb": dict(linewidth=2.6, color="black"), "oracle": dict(linestyle=":", color="grey")}


def _plot(name: str, scenario: Mapping[str, Any], key: str, ylabel: str, path: Path, log: bool,
          slo_ms: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for policy, data in scenario["policies"].items():
        pts = [(p["qps"], p.get(key)) for p in data["points"] if p.get(key) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=policy, **_STYLE.get(policy, {}))
    if slo_ms is not None:
        ax.axhline(slo_ms, color="red", linewidth=0.8, linestyle="--", label=f"SLO {slo_ms:g} ms")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("offered load, requests per s")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{name}: {scenario['engines']} engines, {scenario['duration_s']:g} s per point")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def sweep_plots(name: str, scenario: Mapping[str, Any], directory: Path, slo_ms: float) -> list[Path]:
    """Write the two plots of scenario ``name`` (its part of the lab's JSON) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = name.replace(":", "-").replace("/", "_")
    return [_plot(name, scenario, "ttft_p90_ms", "TTFT p90, ms (log scale)", directory / f"{stem}-ttft.png", True,
                  slo_ms),
            _plot(name, scenario, "output_tokens_per_s", "output tokens per s", directory / f"{stem}-tokens.png",
                  False)]
