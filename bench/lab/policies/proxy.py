"""The common part of every router that sits on the response path: its own requests in flight.

Envoy's load balancers, SGLang's router, Dynamo's frontend and llm-d's endpoint picker each count
the requests they sent that have not ended yet, per endpoint (Envoy's ``rq_active``, SGLang's
worker ``load()``, Dynamo's active sequences): they see each response end as it ends, so their
progress arrives with no delay (:class:`bench.lab.policy.Needs` default). :class:`ProxyPolicy`
keeps those counts, resolves the request's cluster from the routes (a Gateway's header match:
the version header, else the body's ``model``, else the default version; 400 for an unknown
version) and hands the cluster's HEALTHY endpoints to :meth:`ProxyPolicy.choose`.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.lab.policy import Answer, Endpoint, Finished, PolicyBase, Progress, Reject, Request, Route

__all__ = ["ProxyPolicy"]


class ProxyPolicy(PolicyBase):
    """A router on the response path: subclasses implement :meth:`choose`.

    Attributes:
        active: ``{address: this router's requests in flight there}`` (zero entries removed).
        cluster_active: ``{cluster: this router's requests in flight there}``.
        routed: ``{request id: (address, cluster)}`` of the requests in flight.
    """

    def __init__(self) -> None:
        super().__init__()
        self.active: dict[str, int] = {}
        self.cluster_active: dict[str, int] = {}
        self.routed: dict[int, tuple[str, str]] = {}

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        """The endpoint for ``request`` among ``endpoints`` (the cluster's HEALTHY ones, non-empty)."""
        raise NotImplementedError

    def decide(self, request: Request) -> Answer:
        assert self.eds is not None and self.ctx is not None
        cluster = self.eds.cluster_of(request, self.ctx.version_header)
        if cluster is None:
            return Reject(400, "unknown-version")
        endpoints = self.eds.healthy(cluster)
        if not endpoints:
            return Reject(503, "no-healthy-endpoint")
        chosen = self.choose(request, cluster, endpoints)
        self.sent(request, chosen.address, cluster)
        return Route(chosen.address)

    def sent(self, request: Request, address: str, cluster: str) -> None:
        """Count ``request`` in flight at ``address`` (called for every routed request)."""
        self.active[address] = self.active.get(address, 0) + 1
        self.cluster_active[cluster] = self.cluster_active.get(cluster, 0) + 1
        self.routed[request.id] = (address, cluster)

    def on_progress(self, events: Sequence[Progress]) -> None:
        for event in events:
            if isinstance(event, Finished):
                self.ended(event)

    def ended(self, event: Finished) -> None:
        """Take a finished request off the counts (override to see it too, calling this)."""
        where = self.routed.pop(event.request_id, None)
        if where is None:
            return
        address, cluster = where
        n = self.active[address] - 1
        if n:
            self.active[address] = n
        else:
            del self.active[address]
        n = self.cluster_active[cluster] - 1
        if n:
            self.cluster_active[cluster] = n
        else:
            del self.cluster_active[cluster]
