"""PNG plots of the weight history (matplotlib, no display needed): ``inferlb history --plot`` and the demo."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

#: Health statuses drawn with a marker of their own (an excluded endpoint keeps its weight in EDS).
_EXCLUDED_MARKERS = {"UNHEALTHY": "x", "DRAINING": "v"}


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def plot_history(doc: dict, path: str | Path, title: str = "inferlb: EDS weight per endpoint") -> int:
    """Write the ``/api/v1/history`` document ``doc`` as a PNG at ``path``; return the number of series drawn.

    One panel per cluster, one step line per endpoint (each value holds until the next point; the
    last until ``doc["until"]``), a dot per recorded point, and ``x`` (UNHEALTHY) or ``v`` (DRAINING)
    where the endpoint was excluded. Time axis in UTC. Raises ``OSError`` if ``path`` cannot be written.
    """
    from matplotlib import dates
    from matplotlib.figure import Figure

    clusters: dict[str, list[dict]] = {}
    for s in doc["series"]:
        clusters.setdefault(s["cluster"], []).append(s)
    panels = max(1, len(clusters))
    fig = Figure(figsize=(11, 2.2 + 2.6 * panels), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    drawn = 0
    for ax, (cluster, series) in zip(axes, sorted(clusters.items()), strict=False):
        for s in series:
            points = s["points"]
            if not points:
                continue
            xs = [_when(p["t"]) for p in points] + [_when(doc["until"])]
            ys = [p["weight"] for p in points] + [points[-1]["weight"]]
            (line,) = ax.step(xs, ys, where="post", linewidth=1.8, label=s["endpoint"])
            ax.plot(xs[:-1], ys[:-1], "o", markersize=3, color=line.get_color())
            for health, marker in _EXCLUDED_MARKERS.items():
                bad = [(x, p["weight"]) for x, p in zip(xs, points, strict=False) if p["health"] == health]
                if bad:
                    ax.plot(*zip(*bad, strict=True), marker, markersize=8, color=line.get_color())
            drawn += 1
        ax.set_title(cluster, loc="left", fontsize=10)
        ax.set_ylabel("EDS weight")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if not clusters:
        axes[0].text(0.5, 0.5, "no history in this range", ha="center", va="center", transform=axes[0].transAxes)
    axes[-1].xaxis.set_major_formatter(dates.DateFormatter("%H:%M:%S"))
    axes[-1].set_xlabel("time (UTC); x = UNHEALTHY, v = DRAINING")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return drawn
