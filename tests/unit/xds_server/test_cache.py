"""The snapshot cache: debounce and coalescing, node groups, validation before publishing."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.xds_server.test_sotw import BASE, assignment, snap
from tests.unit.xds_server.test_validate import bad_snapshot
from xds_server.ads.cache import SnapshotCache, publish_at
from xds_server.snapshot import ENDPOINT_TYPE


def test_publish_at_is_quiet_after_the_last_set_but_never_past_the_max():
    assert publish_at(first_pending=10.0, last_set=10.0, debounce_s=0.1, debounce_max_s=1.0) == pytest.approx(10.1)
    assert publish_at(10.0, 10.5, 0.1, 1.0) == pytest.approx(10.6)
    assert publish_at(10.0, 10.95, 0.1, 1.0) == pytest.approx(11.0)  # capped by the max


def versions(n: int):
    """``n`` distinct snapshots (weights of "a" change)."""
    return [snap({**BASE, "a": [i + 1]}) for i in range(n)]


async def test_first_snapshot_is_published_at_once():
    cache = SnapshotCache(debounce_s=5, debounce_max_s=10)
    s0 = versions(1)[0]
    await cache.set(s0)
    assert cache.snapshot is s0 and cache.generation == 1


async def test_a_burst_is_coalesced_into_one_publication_after_the_quiet_period():
    cache = SnapshotCache(debounce_s=0.05, debounce_max_s=1.0)
    s = versions(6)
    await cache.set(s[0])
    for x in s[1:]:
        await cache.set(x)
        await asyncio.sleep(0.01)
    assert cache.snapshot is s[0] and cache.latest() is s[-1]
    await asyncio.sleep(0.1)
    assert cache.snapshot is s[-1]
    assert cache.generation == 2  # s[1..4] were never published


async def test_a_steady_stream_of_changes_is_published_by_the_max_delay():
    cache = SnapshotCache(debounce_s=0.05, debounce_max_s=0.2)
    s = versions(40)
    await cache.set(s[0])
    loop = asyncio.get_running_loop()
    started = loop.time()
    published_at = None
    for x in s[1:]:
        await cache.set(x)
        await asyncio.sleep(0.02)  # never quiet for 50 ms
        if published_at is None and cache.generation > 1:
            published_at = loop.time() - started
    assert published_at is not None and 0.15 <= published_at <= 0.35, published_at


async def test_waiters_wake_on_publication_only():
    cache = SnapshotCache(debounce_s=0.05, debounce_max_s=1.0)
    s = versions(2)
    await cache.set(s[0])
    wake = asyncio.Event()
    cache.listen(wake)
    await cache.set(s[1])
    await asyncio.sleep(0.01)
    assert not wake.is_set()
    await asyncio.wait_for(wake.wait(), 1.0)
    assert cache.snapshot is s[1]
    wake.clear()
    cache.unlisten(wake)
    await cache.set(s[0])
    await asyncio.sleep(0.15)
    assert cache.snapshot is s[0] and not wake.is_set()


async def test_setting_the_same_version_again_publishes_nothing():
    cache = SnapshotCache(debounce_s=0, debounce_max_s=0)
    s0 = versions(1)[0]
    await cache.set(s0)
    await cache.set(snap({**BASE, "a": [1]}))  # equal content, equal version
    assert cache.generation == 1


async def test_node_groups_get_their_own_snapshot_and_others_the_default():
    cache = SnapshotCache(debounce_s=0, debounce_max_s=0)
    default, edge = versions(2)
    await cache.set(default)
    await cache.set(edge, group="edge")
    assert cache.snapshot_for("edge") is edge
    assert cache.snapshot_for("anything-else") is default
    assert cache.snapshot is default


async def test_an_invalid_resource_is_not_published_and_the_last_good_stays():
    cache = SnapshotCache(debounce_s=0, debounce_max_s=0)
    s0 = snap(BASE)
    await cache.set(s0)
    served = await cache.set(bad_snapshot(BASE, **{ENDPOINT_TYPE: {"b": assignment("b", [0, 1])}}))
    assert served is cache.snapshot
    assert cache.snapshot.of(ENDPOINT_TYPE)["b"] is s0.of(ENDPOINT_TYPE)["b"]
    [rej] = cache.rejections
    assert rej.name == "b" and rej.kept == s0.of(ENDPOINT_TYPE)["b"].version
