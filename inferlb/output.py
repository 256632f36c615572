"""What the CLI and the demo show a person: the ``/api/v1/weights`` and ``/api/v1/history`` documents as
fixed-width tables, and the weight history as a PNG plot (matplotlib, no display needed)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path


def _fmt(v: float | None, unit: str = "", digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


#: Characters of the reasons a table row shows.
REASON_WIDTH = 90


def reasons_text(reasons: list[str] | None, width: int = REASON_WIDTH) -> str:
    """Every reason of a weight, in order, joined with "; " and cut to ``width`` with an ellipsis:
    the first alone would show "score 0.74 ... -> 74" beside a weight of 80 that a later step held.

    >>> reasons_text(["score 0.74 x max_weight 100 -> 74", "held at 80: change under hysteresis 0.05"], 60)
    'score 0.74 x max_weight 100 -> 74; held at 80: change under…'
    """
    text = "; ".join(reasons or ())
    return text if len(text) <= width else text[:width - 1] + "…"


#: What the weights table's weight, score and capacity columns mean, a line each: the demo prints
#: them under its table, since an A10's score above an A100's beside a far smaller weight reads as a
#: bug without them (found by a new-user trial).
WEIGHT_COLUMNS = (
    "weight: the load_balancing_weight Envoy gets = score x max_weight x capacity (x any other factor; "
    "a small change is held)",
    "score: 0-1, how the endpoint does against its own GPU class (headroom, latency, errors), so an A10 can "
    "score above an A100",
    "capacity: the GPU class's throughput relative to an A100 (1.00); it, not the score, gives a slower class "
    "less weight",
)


def _capacity(endpoint: dict) -> float | None:
    """The capacity factor the engine applied to ``endpoint``'s weight (None when excluded or turned off)."""
    return (endpoint.get("factors") or {}).get("capacity")


def weights_table(doc: dict, source_line: bool = True) -> str:
    """A fixed-width table: cluster, endpoint, weight, health, score, capacity factor, key inputs, its
    reasons; then the metrics source (unless ``source_line`` is false: the demo's summary says it)
    and the warnings."""
    head = f"{'cluster':<12} {'endpoint':<21} {'weight':>6} {'health':<9} {'score':>5} {'capacity':>8} " \
           f"{'lat ms':>7} {'p95 ms':>7} {'run':>5} {'gpu%':>5} {'age s':>5}  reason"
    rows = [head, "-" * len(head)]
    for c in doc.get("clusters", []):
        for e in c["endpoints"]:
            i = e.get("inputs", {})
            gpu = None if i.get("gpu_util") is None else i["gpu_util"] * 100
            reason = reasons_text(e.get("reasons"))
            rows.append(
                f"{c['name']:<12} {e['address']:<21} {e['weight']:>6} {e['health']:<9} "
                f"{_fmt(e.get('score'), digits=2):>5} {_fmt(_capacity(e), digits=2):>8} "
                f"{_fmt(i.get('latency_mean_ms')):>7} "
                f"{_fmt(i.get('latency_p95_ms')):>7} {_fmt(i.get('running'), digits=1):>5} "
                f"{_fmt(gpu):>5} {_fmt(i.get('sample_age_s'), digits=1):>5}  {reason}"
            )
    if source_line:
        rows.append(_source_line(doc))
    rows.extend(f"WARNING: {w['message']}" for w in doc.get("warnings", []))
    return "\n".join(rows)


def weights_rich_table(doc: dict, title: str = ""):
    """The same rows as :func:`weights_table` as a ``rich`` Table (for a live terminal view; needs
    the ``demo`` extra), the metrics source and :data:`WEIGHT_COLUMNS` as its caption."""
    from rich.table import Table

    table = Table(title=title or None, title_justify="left", caption_justify="left", expand=False)
    for name, justify in (("cluster", "left"), ("endpoint", "left"), ("weight", "right"), ("health", "left"),
                          ("score", "right"), ("capacity", "right"), ("lat ms", "right"), ("p95 ms", "right"),
                          ("run", "right"), ("gpu%", "right"), ("age s", "right"), ("reason", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "reason")
    colour = {"HEALTHY": "green", "UNHEALTHY": "red", "DRAINING": "yellow"}
    for c in doc.get("clusters", []):
        for e in c["endpoints"]:
            i = e.get("inputs", {})
            gpu = None if i.get("gpu_util") is None else i["gpu_util"] * 100
            health = e["health"]
            table.add_row(c["name"], e["address"], str(e["weight"]),
                          f"[{colour.get(health, 'white')}]{health}[/]", _fmt(e.get("score"), digits=2),
                          _fmt(_capacity(e), digits=2), _fmt(i.get("latency_mean_ms")), _fmt(i.get("latency_p95_ms")),
                          _fmt(i.get("running"), digits=1), _fmt(gpu), _fmt(i.get("sample_age_s"), digits=1),
                          reasons_text(e.get("reasons")))
    table.caption = "\n".join((_source_line(doc), *WEIGHT_COLUMNS))
    return table


def _source_line(doc: dict) -> str:
    src = doc.get("metrics_source") or {}
    return (f"metrics source: {src.get('name')} ({'ok' if src.get('ok') else 'FAILING'}); "
            f"snapshot {doc.get('snapshot_version')}")


def history_table(doc: dict) -> str:
    """The ``/api/v1/history`` document as a fixed-width table, oldest first: time (UTC), cluster,
    endpoint, weight, health, score, kind and its reasons."""
    from datetime import UTC, datetime

    head = f"{'time (UTC)':<19} {'cluster':<12} {'endpoint':<21} {'weight':>6} {'health':<9} {'score':>5} " \
           f"{'kind':<8}  reason"
    points = sorted(((p["t"], s["cluster"], s["endpoint"], p) for s in doc.get("series", []) for p in s["points"]),
                    key=lambda x: x[:3])
    rows = [head, "-" * len(head)]
    for t, cluster, endpoint, p in points:
        reason = reasons_text(p.get("reasons"))
        rows.append(f"{datetime.fromtimestamp(t, UTC).strftime('%Y-%m-%d %H:%M:%S'):<19} {cluster:<12} {endpoint:<21} "
                    f"{p['weight']:>6} {p['health']:<9} {_fmt(p.get('score'), digits=2):>5} {p['kind']:<8}  "
                    f"{reason}")
    rows.append(f"{len(points)} points in {len(doc.get('series', []))} series"
                + (" (truncated: narrow the range)" if doc.get("truncated") else ""))
    return "\n".join(rows)

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


#: What each session-affinity contract (``services[].session_affinity``) promises, as the demo says it.
AFFINITY_TEXT = {
    "strict": "strict (a session moves only when its backend is unhealthy, ejected, draining or gone; never for "
              "load)",
    "soft": "soft (a turn spills to another backend when its own is over its load bound; the session moves "
            "when spills persist)",
}


def demo_summary_text(s: dict) -> str:
    """The demo's summary (``inferlb demo --json``'s document) as lines a person reads: what each
    figure means, including what ``sticky`` counts under the session-affinity contract the demo ran
    (:data:`AFFINITY_TEXT`), whether Envoy's weights equal the control plane's, which metrics source
    answered (the demo's one metrics-source line: the weights table above it has none) and whether it
    was failing at the end, and every health change of the run. ``requests`` counts the completed
    requests, as the progress lines do (a request still in flight when the traffic stopped is not one)."""
    req, sessions, lat, ttft = s["requests"], s["sessions"], s["latency_ms"], s["ttft_ms"]
    lines = [
        f"metrics source: {s['metrics_source']}"
        + (" (Prometheus scraping the backends every 1 s)" if s["metrics_source"] == "prometheus"
           else " (the control plane scraping the backends' /metrics itself)")
        + ("" if s["metrics_source_ok"] else "; FAILING at the end of the run: the last good weights stay"),
        f"requests completed: {req['total']} ({req['ok']} ok, {req['errors']} errors, {req['streamed']} streamed)",
        f"sessions: {sessions['sticky']} of {sessions['total']} sticky (every turn of the session answered by "
        "one backend, where its earlier turns' KV cache is); session affinity "
        f"{AFFINITY_TEXT[s['session_affinity']]}",
    ]
    for version, v in sorted(s["versions"].items()):
        lines.append(f"version {version}: {v['correct']} of {v['requests']} requests answered by a {version} backend")
    lines.append(f"latency ms: p50 {_fmt(lat['p50'], digits=1)}, p95 {_fmt(lat['p95'], digits=1)}, "
                 f"p99 {_fmt(lat['p99'], digits=1)}; time to first token ms: p50 {_fmt(ttft['p50'], digits=1)}, "
                 f"p90 {_fmt(ttft['p90'], digits=1)}")
    differ = [f"{c} {a}: control plane {w['control_plane']}, Envoy {w['envoy']}"
              for c, eps in sorted(s["weights"].items()) for a, w in sorted(eps.items())
              if w["control_plane"] != w["envoy"]]
    count = sum(len(eps) for eps in s["weights"].values())
    lines.append(f"Envoy's weights equal the control plane's: yes, all {count} endpoints" if not differ
                 else "Envoy's weights differ from the control plane's: " + "; ".join(differ))
    changes = s.get("health_changes", [])
    lines.append(f"health changes: {len(changes)} ({s.get('ejections', 0)} ejections)")
    for c in changes:
        when = datetime.fromtimestamp(c["t"], UTC).strftime("%H:%M:%S")
        lines.append(f"  {when} {c['cluster']} {c['endpoint']} -> {c['health']}: {reasons_text([c['reason']])}")
    return "\n".join(lines)
