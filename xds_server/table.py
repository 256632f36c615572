"""Plain-text rendering of the ``/api/v1/weights`` document (CLI and demo)."""

from __future__ import annotations


def _fmt(v: float | None, unit: str = "", digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def weights_table(doc: dict) -> str:
    """A fixed-width table: cluster, endpoint, weight, health, score, key inputs, first reason."""
    head = f"{'cluster':<12} {'endpoint':<21} {'weight':>6} {'health':<9} {'score':>5} " \
           f"{'lat ms':>7} {'p95 ms':>7} {'run':>5} {'gpu%':>5} {'age s':>5}  reason"
    rows = [head, "-" * len(head)]
    for c in doc.get("clusters", []):
        for e in c["endpoints"]:
            i = e.get("inputs", {})
            gpu = None if i.get("gpu_util") is None else i["gpu_util"] * 100
            reason = (e.get("reasons") or [""])[0]
            rows.append(
                f"{c['name']:<12} {e['address']:<21} {e['weight']:>6} {e['health']:<9} "
                f"{_fmt(e.get('score'), digits=2):>5} {_fmt(i.get('latency_mean_ms')):>7} "
                f"{_fmt(i.get('latency_p95_ms')):>7} {_fmt(i.get('running'), digits=1):>5} "
                f"{_fmt(gpu):>5} {_fmt(i.get('sample_age_s'), digits=1):>5}  {reason[:70]}"
            )
    src = doc.get("metrics_source") or {}
    rows.append(f"metrics source: {src.get('name')} ({'ok' if src.get('ok') else 'FAILING'}); "
                f"snapshot {doc.get('snapshot_version')}")
    return "\n".join(rows)


def history_table(doc: dict) -> str:
    """The ``/api/v1/history`` document as a fixed-width table, oldest first: time (UTC), cluster,
    endpoint, weight, health, score, kind and the first reason."""
    from datetime import UTC, datetime

    head = f"{'time (UTC)':<19} {'cluster':<12} {'endpoint':<21} {'weight':>6} {'health':<9} {'score':>5} " \
           f"{'kind':<8}  reason"
    points = sorted(((p["t"], s["cluster"], s["endpoint"], p) for s in doc.get("series", []) for p in s["points"]),
                    key=lambda x: x[:3])
    rows = [head, "-" * len(head)]
    for t, cluster, endpoint, p in points:
        reason = (p.get("reasons") or [""])[0]
        rows.append(f"{datetime.fromtimestamp(t, UTC).strftime('%Y-%m-%d %H:%M:%S'):<19} {cluster:<12} {endpoint:<21} "
                    f"{p['weight']:>6} {p['health']:<9} {_fmt(p.get('score'), digits=2):>5} {p['kind']:<8}  "
                    f"{reason[:70]}")
    rows.append(f"{len(points)} points in {len(doc.get('series', []))} series"
                + (" (truncated: narrow the range)" if doc.get("truncated") else ""))
    return "\n".join(rows)
