"""``ring_hash_bounded``: Envoy's ``RING_HASH`` on the session header, with ``hash_balance_factor``.

Sources: Envoy docs (arch_overview/upstream/load_balancing/load_balancers, "Ring hash";
``RingHashLbConfig``: ``minimum_ring_size`` default 1024; ``ConsistentHashingLbConfig``:
``hash_balance_factor``) and Envoy's ``BoundedLoadHashingLoadBalancer``
(``source/extensions/load_balancing_policies/common/thread_aware_lb_impl.cc``): the ring picks the
host of the request's hash; the host takes it if ``rq_active <= slots`` with
``slots = max(ceil(ceil((cluster rq_active + 1) x factor / 100) x w), 1)`` (``w``: its share of the
weights), else hosts are probed in a random order seeded by the hash (after Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", and arXiv 1908.08762's random jumps) and
the first under its slots wins, else the least overloaded. Active counts are this Envoy's own.
``hash_balance_factor`` 150 here, as ``inferlb bench quality``'s baseline
(:data:`bench.quality.policies.HASH_BALANCE_FACTOR`).

The request hash is the route's hash policy: the session header's value (``x-session-id``). A
request without it has no hash and Envoy picks a random host ("If no hash policy ... or the hash
policy yields no hash", ring hash docs). Envoy can hash only headers, cookies and connection
properties, never the body: a prompt's prefix cannot steer it.

Differences kept small on purpose: the ring's points and the request's hash are BLAKE2b (Envoy's
default is xxHash64) and the probe order is Python's Mersenne Twister seeded with the hash (Envoy
seeds its own ``std::mt19937``), so the same key lands on a different (equally uniform) host than
in Envoy.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence

from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Request
from bench.quality.policies import HASH_BALANCE_FACTOR

__all__ = ["MIN_RING_SIZE", "RingHashBounded"]

#: Envoy's ``minimum_ring_size`` default.
MIN_RING_SIZE = 1024


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _Ring:
    """Envoy's ring: each host gets ``round(scale x w)`` points, ``scale`` making the lightest host's
    share at least one point of a ``MIN_RING_SIZE`` ring (Envoy's ``RingHashLoadBalancer::Ring``)."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        total = sum(e.weight for e in endpoints)
        shares = [e.weight / total for e in endpoints]
        lightest = min(shares)
        scale = math.ceil(lightest * MIN_RING_SIZE) / lightest
        points = []
        for e, share in zip(endpoints, shares, strict=True):
            for i in range(max(1, round(scale * share))):
                points.append((_hash(f"{e.address}_{i}".encode()), e.address))
        points.sort()
        self.keys = [k for k, _ in points]
        self.hosts = [h for _, h in points]
        self.shares = dict(zip((e.address for e in endpoints), shares, strict=True))
        self.order = [e.address for e in endpoints]

    def host(self, h: int) -> str:
        i = bisect.bisect_left(self.keys, h)
        return self.hosts[i if i < len(self.hosts) else 0]


class RingHashBounded(ProxyPolicy):
    """Envoy's ring hash with bounded loads.

    Args:
        hash_balance_factor: percent of the average load a host may take (>= 100).
        header: the header the route hashes.
    """

    name = "ring_hash_bounded"

    def __init__(self, hash_balance_factor: int = HASH_BALANCE_FACTOR, header: str = "x-session-id") -> None:
        super().__init__()
        if hash_balance_factor < 100:
            raise ValueError(f"ring_hash_bounded: hash_balance_factor must be >= 100, got {hash_balance_factor}")
        self.factor = hash_balance_factor
        self.header = header
        self._rings: dict[str, tuple[tuple[Endpoint, ...], _Ring]] = {}

    def _overload(self, address: str, share: float, cluster_active: int) -> float:
        total_slots = ((cluster_active + 1) * self.factor + 99) // 100
        slots = max(math.ceil(total_slots * share), 1)
        return self.active.get(address, 0) / slots

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        key = request.headers.get(self.header)
        if not key:
            return endpoints[self.ctx.rng.randrange(len(endpoints))]
        kept = self._rings.get(cluster)
        if kept is None or kept[0] != tuple(endpoints):
            kept = self._rings[cluster] = (tuple(endpoints), _Ring(endpoints))
        members, ring = kept
        h = _hash(key)
        host = ring.host(h)
        active = self.cluster_active.get(cluster, 0)
        factor = self._overload(host, ring.shares[host], active)
        if factor > 1.0:
            best, best_factor = host, factor
            order = list(ring.order)
            random.Random(h).shuffle(order)
            for alt in order:
                if alt == host:
                    continue
                f = self._overload(alt, ring.shares[alt], active)
                if f <= 1.0:
                    best = alt
                    break
                if f < best_factor:
                    best, best_factor = alt, f
            host = best
        return next(e for e in members if e.address == host)
