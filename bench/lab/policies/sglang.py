"""``sglang_cache_aware``: SGLang's router (SMG) ``cache_aware`` policy.

Source read: sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs`` (commit 026f853b) and
``sgl-router/src/policies/tree.rs`` (commit 4d40eec0; the multi-tenant approximate radix tree), and
the defaults of the router's launcher (``RouterArgs`` of ``sglang_router``: ``cache_threshold`` 0.3,
``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5, ``eviction_interval_secs`` 60,
``max_tree_size`` 2**26; the lmsys blog's router of 2024-12 had a ``cache_threshold`` of 0.5):

- loads are the router's own requests in flight per worker (``worker.load()``);
- the load is *imbalanced* when ``max - min > balance_abs_threshold`` and
  ``max > balance_rel_threshold x min``: then the least loaded healthy worker takes the request
  (and the tree still records the request's text for it);
- otherwise the request's text is matched in one radix tree of raw characters whose nodes
  remember which workers (tenants) were sent that text and when; the worker of the deepest
  matched node wins when the matched share of the text is above ``cache_threshold``, else the
  worker whose text in the tree is smallest ("most available cache capacity"); the request's
  text is then inserted for the chosen worker;
- every ``eviction_interval_secs`` each worker whose text in the tree passes ``max_tree_size``
  characters loses its least recently used leaves until it fits.

The deepest node's worker is "the first tenant" of the node in their concurrent map (an order
that is arbitrary there); here the first in insertion order. The smallest worker, ties: the
lowest address.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Request

__all__ = ["RadixTree", "SglangCacheAware", "common_prefix"]


def common_prefix(a: str, b: str, start: int) -> int:
    """The length of the common prefix of ``a`` and ``b[start:]`` (string slices compared in C)."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start:start + n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "text", "tenants", "parent")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.children: dict[str, _Node] = {}
        self.text = text
        self.tenants: dict[str, float] = {}
        self.parent = parent


class RadixTree:
    """SGLang router's approximate radix tree of characters, shared by every worker (tenant)."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.chars: dict[str, int] = {}

    def insert(self, text: str, tenant: str, now: float) -> None:
        """Record that ``tenant`` was sent ``text`` at ``now``."""
        node = self.root
        node.tenants[tenant] = now
        chars = self.chars
        chars.setdefault(tenant, 0)
        i, n = 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                new = _Node(text[i:], node)
                new.tenants[tenant] = now
                node.children[text[i]] = new
                chars[tenant] += n - i
                return
            shared = common_prefix(child.text, text, i)
            if shared < len(child.text):  # split: node -> mid (shared part) -> child (the rest)
                mid = _Node(child.text[:shared], node)
                mid.tenants = dict(child.tenants)
                child.text = child.text[shared:]
                child.parent = mid
                mid.children[child.text[0]] = child
                node.children[text[i]] = mid
                child = mid
            if tenant not in child.tenants:
                chars[tenant] += len(child.text)
            child.tenants[tenant] = now
            node = child
            i += shared

    def prefix_match(self, text: str, now: float) -> tuple[int, str | None]:
        """``(matched characters, the deepest matched node's first tenant)`` (None: no tenant at all);
        that tenant's access times are refreshed up to the root."""
        node = self.root
        i, n = 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            shared = common_prefix(child.text, text, i)
            i += shared
            node = child
            if shared < len(child.text):
                break
        tenant = next(iter(node.tenants), None)
        if tenant is not None:
            walk: _Node | None = node
            while walk is not None:
                walk.tenants[tenant] = now
                walk = walk.parent
        return i, tenant

    def smallest(self, among: Sequence[str]) -> str:
        """The tenant of ``among`` with the least text in the tree (ties: the first of ``among``)."""
        return min(among, key=lambda t: self.chars.get(t, 0))

    def remove_tenant(self, tenant: str) -> None:
        """Forget ``tenant`` everywhere (a worker that left)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            stack.extend(node.children.values())
        self._prune(self.root)
        self.chars.pop(tenant, None)

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.tenants and not child.children:
                del node.children[key]

    def evict(self, max_chars: int) -> None:
        """Per tenant above ``max_chars``: drop its least recently used leaves until it fits
        (``evict_tenant_by_size``)."""
        if all(c <= max_chars for c in self.chars.values()):
            return
        heap: list[tuple[float, int, str, _Node]] = []
        seq = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tenant in self._leaf_tenants(node):
                seq += 1
                heap.append((node.tenants[tenant], seq, tenant, node))
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.chars.get(tenant, 0) <= max_chars or tenant not in node.tenants or node is self.root:
                continue
            del node.tenants[tenant]
            self.chars[tenant] -= len(node.text)
            parent = node.parent
            if not node.tenants and not node.children and parent is not None:
                del parent.children[node.text[0]]
            if parent is not None and parent is not self.root and tenant in self._leaf_tenants(parent):
                seq += 1
                heapq.heappush(heap, (parent.tenants[tenant], seq, tenant, parent))

    @staticmethod
    def _leaf_tenants(node: _Node) -> list[str]:
        """Tenants for which ``node`` is a leaf (no child of it holds them)."""
        below = {t for child in node.children.values() for t in child.tenants}
        return [t for t in node.tenants if t not in below]


class SglangCacheAware(ProxyPolicy):
    """SGLang router's ``cache_aware`` policy (see the module docstring for the source of each rule).

    Args:
        cache_threshold: the matched share of the text above which the matched worker wins (0.3).
        balance_abs_threshold, balance_rel_threshold: the imbalance test (64, 1.5).
        eviction_interval_s: how often oversized trees are cut (60 s).
        max_tree_size: characters per worker kept in the tree (2**26).
    """

    name = "sglang_cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_s: float = 60.0,
                 max_tree_size: int = 2 ** 26) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.trees: dict[str, RadixTree] = {}
        self._next_eviction = eviction_interval_s

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """The router's imbalance test on the workers' loads."""
        high, low = max(loads), min(loads)
        return high - low > self.abs_threshold and high > low * self.rel_threshold

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None and self.eds is not None
        now = self.ctx.clock()
        tree = self.trees.get(cluster)
        if tree is None:
            tree = self.trees[cluster] = RadixTree()
        members = [e.address for e in self.eds.clusters.get(cluster, ())]
        for address in members:
            if address not in tree.chars:
                tree.insert("", address, now)
        for gone in [t for t in tree.chars if t not in members]:
            tree.remove_tenant(gone)
        if now >= self._next_eviction:
            for t in self.trees.values():
                t.evict(self.max_tree_size)
            self._next_eviction = now + self.eviction_interval_s
        text = request.prompt.text
        by_address = {e.address: e for e in endpoints}
        if self.imbalanced([self.active.get(a, 0) for a in members]):
            chosen = min(endpoints, key=lambda e: self.active.get(e.address, 0))
            tree.insert(text, chosen.address, now)
            return chosen
        matched, tenant = tree.prefix_match(text, now)
        rate = matched / len(text) if text else 0.0
        selected = tenant if rate > self.cache_threshold and tenant is not None else tree.smallest(members)
        if selected in by_address:
            tree.insert(text, selected, now)
            return by_address[selected]
        return endpoints[0]  # the selected worker is unhealthy: the first healthy one (theirs)
