"""The load the scheduler reads when several pickers (one per Envoy) share one load view (pure).

Each picker sees only its own Envoy's requests; with N gateways every bounded-load and admission
decision would be made on about 1/N of the load. The control plane sums every picker's report
(``protos/inferlb/v1/load_view.proto``) and answers each with the sum and this picker's share of
it, so the *others'* load at the view's time is ``total - own share`` (:func:`others_of`). The
scheduler then reads, per endpoint and per cluster::

    own live load (now, from InFlight: includes every pick since the view)
      + the others' load (at the view's time, until the next view: pushed when any picker reports)

:class:`SharedLoad` presents that sum under the attribute names the scheduler reads from an
:class:`~ext_proc.inflight.InFlight` (``work``, ``cluster_work``, ``clusters``, ``free``,
``failed``), so the one seam is which object the request control passes. No I/O and no locks: the view is
swapped by the client (:mod:`ext_proc.load_client`) on the same event loop, one assignment per map.

Free GPU memory: an endpoint's estimate is the picker's own (last sample minus its own picks since)
minus what the others added since that sample: their memory in flight now minus their memory in
flight when the sample was taken (the baseline: sent with the sample by the control plane, from the
others' reports at that time; else their memory in flight when this picker first reads the sample),
and minus the memory of this picker's requests waiting for a grant and what grant refusals reported
of the others' requests its view does not show yet (:class:`~ext_proc.grants.Grants`). Where the
control plane learned the endpoint's capacity (the memory its requests can use), the estimate is at
most that capacity less every picker's memory in flight there: the credits for finished requests
can count one twice, never the capacity.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import NamedTuple

from ext_proc.grants import Grants
from ext_proc.inflight import InFlight

__all__ = ["NO_OTHERS", "Others", "SharedLoad", "freed", "others_of"]

_NONE: Mapping[str, float] = MappingProxyType({})

#: ``{(cluster, endpoint): (requests in flight, work, MiB)}`` as carried by a view.
EndpointRows = Mapping[tuple[str, str], tuple[float, float, float]]
#: ``{cluster: (requests in flight, work)}``.
ClusterRows = Mapping[str, tuple[float, float]]


class Others(NamedTuple):
    """The other pickers' load at one view's time.

    Attributes:
        work: ``{"HOST:PORT": work in flight}`` (typical requests, summed over clusters).
        in_flight: ``{"HOST:PORT": requests in flight}``.
        memory_mib: ``{"HOST:PORT": GPU memory of their requests in flight}`` (MiB).
        clusters: ``{cluster: requests in flight}``; ``cluster_work``: ``{cluster: work in flight}``.
        pickers: pickers in the control plane's sum (this one included when it is counted).
        idle: of those, the others with no picks and nothing in flight lately (no Envoy sends them
            traffic): ``pickers - idle <= 1`` means no other picker decides on this one's load.
    """

    work: Mapping[str, float] = _NONE
    in_flight: Mapping[str, float] = _NONE
    memory_mib: Mapping[str, float] = _NONE
    clusters: Mapping[str, float] = _NONE
    cluster_work: Mapping[str, float] = _NONE
    pickers: int = 0
    idle: int = 0


NO_OTHERS = Others()


def others_of(total_endpoints: EndpointRows, total_clusters: ClusterRows, own_endpoints: EndpointRows,
              own_clusters: ClusterRows, pickers: int = 0, idle: int = 0) -> Others:
    """The others' load: the view's totals minus this picker's share of them, never below 0 (pure).

    >>> o = others_of({("c", "a:1"): (5, 5.5, 500.0)}, {"c": (6, 6.5)},
    ...               {("c", "a:1"): (2, 2.0, 200.0)}, {"c": (2, 2.0)})
    >>> o.work["a:1"], o.in_flight["a:1"], o.memory_mib["a:1"], o.clusters["c"], o.cluster_work["c"]
    (3.5, 3.0, 300.0, 4.0, 4.5)
    """
    work: dict[str, float] = {}
    count: dict[str, float] = {}
    mib: dict[str, float] = {}
    for key, (n, w, m) in total_endpoints.items():
        on, ow, om = own_endpoints.get(key, (0.0, 0.0, 0.0))
        endpoint = key[1]
        if n - on > 0:
            count[endpoint] = count.get(endpoint, 0.0) + n - on
        if w - ow > 1e-9:
            work[endpoint] = work.get(endpoint, 0.0) + w - ow
        if m - om > 1e-9:
            mib[endpoint] = mib.get(endpoint, 0.0) + m - om
    clusters: dict[str, float] = {}
    cluster_work: dict[str, float] = {}
    for cluster, (n, w) in total_clusters.items():
        on, ow = own_clusters.get(cluster, (0.0, 0.0))
        if n - on > 0:
            clusters[cluster] = float(n - on)
        if w - ow > 1e-9:
            cluster_work[cluster] = w - ow
    return Others(work, count, mib, clusters, cluster_work, pickers, idle)


def freed(before: Others, after: Others) -> bool:
    """Whether the others' load went down from ``before`` to ``after`` (pure): some endpoint's GPU
    memory in flight, or some cluster's requests in flight (a request waiting for memory or for a slot
    may fit now). O(the endpoints and clusters in ``before``).

    >>> freed(Others(memory_mib={"a:1": 8192.0}), Others(memory_mib={"a:1": 8192.0, "b:1": 1.0}))
    False
    >>> freed(Others(memory_mib={"a:1": 8192.0}), Others())
    True
    >>> freed(Others(clusters={"c": 2.0}), Others(clusters={"c": 1.0}))
    True
    """
    mib, clusters = after.memory_mib, after.clusters
    return (any(mib.get(e, 0.0) < m for e, m in before.memory_mib.items())
            or any(clusters.get(c, 0.0) < n for c, n in before.clusters.items()))


class _Plus(Mapping[str, float]):
    """``own.get(k) + others.get(k)``: a picker's live map plus the others' (read on the request path)."""

    __slots__ = ("own", "others")

    def __init__(self, own: Mapping[str, float]) -> None:
        self.own = own
        self.others: Mapping[str, float] = _NONE

    def get(self, key: str, default: float = 0.0) -> float:  # type: ignore[override]
        return self.own.get(key, default) + self.others.get(key, 0.0)

    def __getitem__(self, key: str) -> float:
        if key not in self.own and key not in self.others:
            raise KeyError(key)
        return self.get(key)

    def __iter__(self) -> Iterator[str]:
        yield from self.own
        yield from (k for k in self.others if k not in self.own)

    def __len__(self) -> int:
        return len(self.own) + sum(1 for k in self.others if k not in self.own)

    def __contains__(self, key: object) -> bool:
        return key in self.own or key in self.others


class _Free(Mapping[str, float]):
    """Estimated free GPU memory: the picker's own estimate minus what the others added since its sample."""

    __slots__ = ("_inflight", "_grants", "others", "capacity", "_sample", "_baseline", "_next")

    def __init__(self, inflight: InFlight, grants: Grants) -> None:
        self._inflight = inflight
        self._grants = grants
        self.others: Mapping[str, float] = _NONE
        self.capacity: Mapping[str, float] = _NONE
        """``{endpoint: GPU memory its requests can use, MiB}`` (the control plane's
        ``RoundCounts.capacities`` in ``xds_server/loadview/rounds.py``): the estimate never exceeds it less
        the memory every picker has in flight there."""
        self._sample: Mapping[str, float] | None = None
        self._baseline: Mapping[str, float] = _NONE
        self._next: Mapping[str, float] | None = None

    def rebase(self, baseline: Mapping[str, float]) -> None:
        """The others' memory in flight when the next sample was taken (``{endpoint: MiB}``, from the
        control plane): used from that sample on, instead of their memory at its first read. Call it
        just before the sample is set."""
        self._next = baseline

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        own = self._inflight.free
        value = own.get(key)
        if value is None:
            return default
        if own is not self._sample:  # a new sample (InFlight.set_samples replaces the map): rebase
            self._baseline = self._next if self._next is not None else self.others
            self._sample, self._next = own, None
        others = self.others.get(key, 0.0)
        value -= others - self._baseline.get(key, 0.0)
        capacity = self.capacity.get(key)
        if capacity is not None:
            value = min(value, capacity - others - self._inflight.memory.get(key, 0.0))
        grants = self._grants
        return value - grants.held(key) if grants.pending_mib or grants.refused_mib else value

    def __getitem__(self, key: str) -> float:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._inflight.free)

    def __len__(self) -> int:
        return len(self._inflight.free)


class SharedLoad:
    """The scheduler's loads with the shared view: ``inflight`` (own, live) + the others' (last view).

    Attributes (what :func:`ext_proc.picker.pick` and the request control's admission read):
        work, cluster_work, clusters: own + others (mappings with ``get``).
        endpoints: ``{"HOST:PORT": requests in flight}``, own + others (the edge tier's load:
            :func:`ext_proc.tiers.tier_for`).
        free: estimated free GPU memory (MiB), see the module docstring.
        failed: the picker's own failing endpoints (not shared).
        others: the last :class:`Others` (:data:`NO_OTHERS` before the first view and after the
            view is lost).
        viewed_at: when ``others`` was set (the in-flight clock, s; None: never).
        grants: this picker's memory grant requests (see :meth:`grant_room`).
    """

    __slots__ = ("inflight", "others", "work", "cluster_work", "clusters", "endpoints", "free", "failed",
                 "viewed_at", "grants")

    def __init__(self, inflight: InFlight) -> None:
        self.inflight = inflight
        self.grants = Grants()
        self.others = NO_OTHERS
        self.work = _Plus(inflight.work)
        self.cluster_work = _Plus(inflight.cluster_work)
        self.clusters = _Plus(inflight.clusters)  # type: ignore[arg-type]
        self.endpoints = _Plus(inflight.endpoints)  # type: ignore[arg-type]
        self.free = _Free(inflight, self.grants)
        self.failed = inflight.failed
        self.viewed_at: float | None = None

    def set_others(self, others: Others, at: float | None = None) -> None:
        """Take a new view of the others' load (``at``: the in-flight clock's time; None: now)."""
        self.others = others
        self.work.others = others.work
        self.cluster_work.others = others.cluster_work
        self.clusters.others = others.clusters
        self.endpoints.others = others.in_flight
        self.free.others = others.memory_mib
        self.viewed_at = self.inflight.now() if at is None else at

    def alone(self) -> bool:
        """True when no other picker decides now: the last view counts no other picker with picks or
        requests in flight lately (also before the first view and after the view is lost)."""
        others = self.others
        return others.pickers - others.idle <= 1

    def grant_room(self, endpoint: str, need_mib: float) -> float | None:
        """The room (MiB) to send with a grant request for a request of ``need_mib`` MiB just admitted
        on ``endpoint`` (its estimated free memory once the request is on it), or None when it needs
        no grant: no other picker decides now, the need is 0, or the endpoint's free memory is
        unknown (admitted without a sample, as without the view).

        Every other admission asks, however much room it leaves: a request that leaves room for
        one more of its own size can still meet a larger one another picker admits at the same
        moment (measured: 22 of 55 OOMs in a ``multi_gateway`` round came after such a local
        admission, the others after grants that did not know of it).
        """
        if self.alone() or need_mib <= 0:
            return None
        free = self.free.get(endpoint)
        return None if free is None else free - need_mib
