"""``affinity-slack`` (filter, soft; not in the default profile): an endpoint is kept only while its
load after this request, per share, is within ``slack`` typical requests of the least loaded
admitted endpoint's: ``(load_i + work) / s_i <= min_j (load_j + work) / s_j + slack x n`` (``s_i`` its
share of the EDS weights, ``n`` endpoints; equal shares: at most ``slack`` more requests than the
least loaded; "admitted": not failing, memory for the request).

Bounded loads compare an endpoint with the *average*, so at a few requests per endpoint a pin may
hold two or three while another endpoint is idle, and every request running beside them decodes
slower. Keeping a conversation's KV cache is worth a prefill, joining a busy batch costs every
request in it a slower decode step; the slack says how many requests of imbalance a cache hit is
worth (the cost model behind Dynamo's KV router and llm-d's scorers: prefix overlap against load).
With ``cost_aware``, a request whose prompt is known gets the slack the cost model learned for its
cluster's GPU class (:meth:`ext_proc.costmodel.CostModel.affinity_slack`: the prefill a KV-cache
hit saves over twice what one more request in flight costs) once that class's fit can tell it,
else ``slack`` (None: no limit until it can). Applies to pools up to ``scan_max`` endpoints (the
least load is a scan); larger pools keep the bounded loads alone. Like ``bounded-load``, it bounds
affinity only: a request without a key is kept everywhere.
"""

from __future__ import annotations

from functools import partial

from pydantic import Field, model_validator

from ext_proc.scheduling.api import INF, SCAN_MAX, Check, PluginParams, Request

__all__ = ["AffinitySlack", "Params"]


class Params(PluginParams):
    """``slack``: typical requests of imbalance affinity may keep (>= 0; None: none until the cost
    model tells, with ``cost_aware``); ``cost_aware``: the cost model's learned slack first;
    ``scan_max``: larger pools are left alone."""

    slack: float | None = Field(1.0, ge=0, le=1_000_000)
    cost_aware: bool = False
    scan_max: int = Field(SCAN_MAX, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _something(self) -> Params:
        if self.slack is None and not self.cost_aware:
            raise ValueError("slack is null and cost_aware is false: the filter would keep every endpoint")
        return self


class AffinitySlack:
    """See the module docstring."""

    name = "affinity-slack"
    Params = Params
    soft = True
    outcome = "spilled"
    repins = False

    def __init__(self, params: Params) -> None:
        self.params = params
        self._memo: tuple[Request, float | None] | None = None

    def _cap(self, request: Request) -> float | None:
        """The cap on ``(load + work) / share`` for ``request`` (None: no slack): the lowest over the
        admitted endpoints (not failing, memory for the request), plus ``slack`` typical requests on
        an average endpoint. A scan of the pool, once per request (kept with the request it is of)."""
        memo = self._memo
        if memo is not None and memo[0] is request:
            return memo[1]
        p = self.params
        pool = request.pool
        slack = p.slack
        if p.cost_aware and request.costs is not None and request.prompt_tokens is not None:
            learned = request.costs.affinity_slack(pool.main_class, request.prompt_tokens)
            if learned is not None:
                slack = learned
        cap = None
        if slack is not None:
            work, shares, get = request.work, pool.shares, request.loads.get
            free, need, failed = request.free_mib, request.need_mib, request.failed
            low = INF
            for e in pool.endpoints:
                if e in failed or (free is not None and free.get(e, INF) < need):
                    continue
                r = (get(e, 0.0) + work) / shares[e]
                if r < low:
                    low = r
            cap = low + slack * len(pool.endpoints) + 1e-9
        self._memo = (request, cap)
        return cap

    def keep(self, request: Request, endpoint: str) -> bool:
        """``(load + work) / share <= cap``; True without a key, without a slack, or above
        ``scan_max`` endpoints."""
        if request.position is None or len(request.pool.endpoints) > self.params.scan_max:
            return True
        cap = self._cap(request)
        return cap is None or (request.loads.get(endpoint, 0.0) + request.work) / request.pool.shares[endpoint] <= cap

    def rule(self, request: Request) -> Check | None:
        """:meth:`keep` for ``request``; None where it keeps every endpoint."""
        if request.position is None or len(request.pool.endpoints) > self.params.scan_max:
            return None
        return None if self._cap(request) is None else partial(self.keep, request)
