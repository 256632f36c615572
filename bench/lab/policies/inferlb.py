"""``inferlb``: the picker (ext_proc) deciding in the lab, driven as ``inferlb serve`` drives it.

It runs the real decision code, the cluster config's scheduling profile included (``picker.profile``,
``picker.profiles``: :mod:`ext_proc.scheduling`; the default profile without them), and swaps only
the I/O around it.

- **The picker** is a real :class:`ext_proc.handler.PickerHandler` with its in-flight accounting
  (:class:`ext_proc.inflight.InFlight`), session table (:class:`ext_proc.sessions.SessionTable`) and
  cost model (:class:`ext_proc.costmodel.CostModel`), built from the cluster's inferlb config by
  inferlb's own functions (:func:`inferlb.picker_config.routing_table`,
  :func:`inferlb.picker_config.picker_settings`), on the lab's clock. Each request goes through the
  handler's own request path: the body fields as body routing reads them (:mod:`ext_proc.body`'s
  ``wants_body``, the handler's ``read_body``: the model, the session fields, the prefix key of the
  first messages unless a session header keys the request, the prompt's size), then its request
  control's ``route``
  (:class:`ext_proc.requestcontrol.RequestControl`; ``pick``: the service's scheduling profile, by
  default ring affinity, weighted bounded loads and memory admission; the too-large check; the
  no-memory fallback; ``commit``: the pick counted in flight, the session's pin moved or kept).
  Only the wire encoding is swapped: the request control's response encoder is replaced by one that
  hands back the :class:`~ext_proc.picker.Decision`.
- **Requests that wait** wait in the request control's own code: the admission queue (``picker.admission``,
  ``picker.memory_queue``: :class:`ext_proc.admission.Admission`, built as
  :meth:`PickerHandler.from_settings` builds it) and a memory grant's wait (``_confirm``), whose
  asyncio futures and timers run on a :class:`~bench.lab.virtual_loop.VirtualLoop` (the lab's clock;
  its due timers, a waiter's timeout, run when the harness calls the picker, and it asks to be
  called then: :meth:`Inferlb.next_wake_s`). The queue is released where the picker releases it
  (completions from the access log, memory samples, housekeeping); a request answered later is
  handed back through :meth:`Inferlb.poll`.
- **The endpoint view** is built from the lab's EDS as ``inferlb serve`` builds it from its
  snapshot: a ``ClusterLoadAssignment`` per cluster (:func:`xds_server.resources.endpoints.build_assignment`:
  weights, health, max concurrency and GPU class metadata, tiers as priorities) into
  :meth:`ext_proc.view.ViewHolder.update`.
- **Memory samples**: each slow-loop round's free GPU memory per engine, dated by the sample's age.
  With one gateway the picker gets them after each round as ``inferlb serve``'s in-process picker
  does (with ``picker.memory_count_in_sample`` also the requests each engine held).
- **Completions** reach it as Envoy's access log reports them: every flush
  (``picker.access_log_flush_s``) one serialized ``StreamAccessLogsMessage`` with an entry per
  finished request (the cluster and override-host headers the picker set, ``x-request-id``, the
  upstream address, status and connection-failure flags, and the times from the request's arrival:
  first upstream byte, last byte), fed to the handler's ``access_log`` (the real decoder and
  :func:`ext_proc.accesslog.record_completions`).
- **Housekeeping** (:meth:`RequestControl.tick`: expiries, session sweeps, the cost model's refit,
  a queue release) runs once a virtual second, on the first call after each second.

**The shared load view** (``picker.shared_view``, on by default). With one gateway the picker
decides on it as ``inferlb serve``'s in-process picker does: a :class:`ext_proc.shared_load.SharedLoad`
whose view, each round, counts no other picker (so the samples' held counts apply). With several
gateways (``multi_gateway``) the pickers are ``inferlb ext-proc`` processes on one control plane's
load view (:mod:`bench.lab.loadview`: the control plane's sum, each picker's report loop every
``picker.shared_view_interval_s``, the memory rounds through the view, memory grants decided by the
control plane's ledger), each a :class:`~bench.lab.loadview.PickerLink` whose work is done on the
picker's turns (:meth:`Inferlb._turn`). With ``picker.shared_view: false`` (a cluster's picker
settings) each picker decides on its own requests alone and gets the samples directly: the 1/N
comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

from envoy.service.accesslog.v3 import als_pb2

from bench.lab.loadview import ControlPlaneView, PickerLink
from bench.lab.policy import Answer, Context, Eds, Finished, Needs, PolicyBase, Progress, Reject, Request, Route, Wait
from bench.lab.virtual_loop import VirtualLoop
from ext_proc.admission import Admission
from ext_proc.body import NO_BODY, wants_body
from ext_proc.costmodel import CostModel
from ext_proc.handler import PickerHandler
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.picker import Decision
from ext_proc.sessions import SessionTable
from ext_proc.shared_load import Others, SharedLoad
from ext_proc.view import ViewHolder
from inferlb.picker_config import picker_settings, routing_table
from inferlb.serve import largest_memory
from xds_server.control import endpoint_specs
from xds_server.resources.endpoints import build_assignment

__all__ = ["Inferlb"]

_PHASE = "request_headers"
#: The picker's housekeeping period (:meth:`PickerHandler.maintain`'s default interval), s.
TICK_S = 1.0


class _Decisions:
    """A response encoder that hands back the decision instead of its ext_proc bytes."""

    def encode(self, decision: Decision, view: Any, present: Any, phase: str = _PHASE) -> Decision:
        return decision


def _ns(seconds: float) -> int:
    """A duration's nanoseconds, as Envoy logs it (never negative)."""
    return max(0, round(seconds * 1e9))


class Inferlb(PolicyBase):
    """inferlb's picker (see the module docstring for what runs for real and what is swapped)."""

    name = "inferlb"

    def __init__(self) -> None:
        super().__init__()
        self.needs = Needs(completion_flush_s=0.005)
        self.handler: PickerHandler | None = None
        self._sent: dict[int, tuple[Request, str, str, float]] = {}  # request -> (request, cluster, endpoint, sent)
        self._next_tick = TICK_S
        self._view_version = -1
        self._shared: SharedLoad | None = None
        self._link: PickerLink | None = None
        self._loop: VirtualLoop | None = None
        self._waiting: dict[int, tuple[Request, asyncio.Future]] = {}  # request -> its answer (queue, grant)

    def start(self, ctx: Context) -> None:
        super().start(ctx)
        cfg = ctx.config
        if cfg is None:
            raise ValueError("the inferlb policy needs the cluster's inferlb config (Context.config)")
        self.routing = routing_table(cfg)
        s = picker_settings(cfg)
        self.settings = s
        self.needs = Needs(completion_flush_s=cfg.picker.access_log_flush_s)
        queues = s.admission or s.memory_queue
        self.handler = PickerHandler(
            ViewHolder(), InFlight(s.inflight_expiry_s, clock=ctx.clock, failure_hold_s=s.failure_hold_s),
            SessionTable(s.session_ttl_s, s.max_sessions, clock=ctx.clock),
            Admission(s.max_queue, s.queue_timeout_s, s.retry_after_s) if queues else None,
            costs=CostModel(s.cost_forget, s.cost_min_samples), pin_move_after=s.pin_move_after,
            limit_concurrency=s.admission, memory_queue=s.memory_queue, retry_after_s=s.retry_after_s)
        self.handler.control.encoder = _Decisions()  # type: ignore[assignment]
        self.handler.access_log_opened()  # Envoy's access-log stream is up: completions can arrive
        self.handler.control.set_largest_memory(largest_memory(endpoint_specs(cfg)))
        self._loop = VirtualLoop(ctx.clock)
        self._memory_count = cfg.picker.memory_count_in_sample
        if not s.shared_view:
            return
        self._shared = self.handler.control.share_load()
        if ctx.gateways == 1:
            # One picker with the shared load view on (inferlb serve's default): it decides on a SharedLoad
            # whose view, each round, counts no other picker (the control plane sums its report alone).
            return
        # Several gateways: standalone pickers on the control plane's load view (bench.lab.loadview).
        plane = ControlPlaneView.of(ctx.shared, s.shared_view_expiry_s, ctx.clock)
        self._link = PickerLink(f"gateway-{ctx.gateway}", self._shared, plane, s.shared_view_interval_s,
                                s.shared_view_expiry_s, self.handler.control.set_samples,
                                self.handler.control.others_changed)
        with self._turn():
            self._link.start()

    # --- the slow loop's rounds --------------------------------------------------------------------

    def on_eds(self, eds: Eds) -> None:
        with self._turn():
            self._on_eds(eds)

    def _on_eds(self, eds: Eds) -> None:
        super().on_eds(eds)
        handler = self.handler
        assert handler is not None
        self._tick()
        if eds.version != self._view_version:
            assignments = {
                cluster: build_assignment(cluster, eps, {e.address: e.max_concurrency for e in eps},
                                          {e.address: e.gpu_class for e in eps}, {e.address: e.tier for e in eps})
                for cluster, eps in eds.clusters.items()}
            handler.holder.update(assignments, self.routing)
            self._view_version = eds.version
        samples: dict[str, tuple[float, float]] = {}
        held: dict[str, float] = {}
        for address, st in eds.stats.items():
            if st.sample_age_s is None:
                continue
            free = st.gpu_mem_free_mib
            if free is None and st.gpu_mem_used_mib is not None:
                memory = next((e.memory_mib for eps in eds.clusters.values() for e in eps if e.address == address),
                              None)
                free = None if memory is None else max(0.0, memory - st.gpu_mem_used_mib)
            if free is None:
                continue
            samples[address] = (free, eds.at_s - st.sample_age_s)
            if st.in_flight is not None:
                held[address] = st.in_flight
        if self._link is not None:
            # inferlb serve hands the round's samples to the load view; each picker gets them in a view.
            self._link.plane.set_memory(eds.at_s, samples, held if self._memory_count else None)
            self._link.catch_up()
            return
        if self._shared is not None:
            self._shared.set_others(Others(pickers=1), at=eds.at_s)
        handler.control.set_samples(MemorySamples.of(samples, held if self._memory_count else None))

    # --- requests ----------------------------------------------------------------------------------

    def _body(self, request: Request) -> Any:
        handler = self.handler
        assert handler is not None
        view = handler.holder.current
        if view.routing.body_max_bytes and wants_body(request.headers, view.routing):
            return handler.read_body(request.headers, view, request.body, True)  # type: ignore[arg-type]
        return NO_BODY

    def decide(self, request: Request) -> Answer:
        with self._turn():
            return self._decide(request)

    def _decide(self, request: Request) -> Answer:
        handler = self.handler
        assert handler is not None
        self._tick()
        view = handler.holder.current
        body = self._body(request)
        headers = request.headers
        answer = handler.control.route(headers, view, body, _PHASE)  # type: ignore[arg-type]
        if isinstance(answer, asyncio.Future):  # queued, or waiting for a memory grant
            self._settle()
            if not answer.done():
                self._waiting[request.id] = (request, answer)
                return Wait()
            answer = answer.result()
        return self._answer(request, answer)

    def _answer(self, request: Request, decision: Any) -> Answer:
        assert isinstance(decision, Decision)
        if decision.status is not None:
            return Reject(decision.status, decision.reason, decision.retry_after_s)
        if decision.cluster is None or decision.endpoint is None:
            return Reject(503, decision.reason)  # not ready, or no healthy endpoint: nothing to pin
        assert self.ctx is not None
        self._sent[request.id] = (request, decision.cluster, decision.endpoint, self.ctx.clock())
        return Route(decision.endpoint)

    # --- requests that wait: the admission queue, a memory grant ---------------------------------------

    def poll(self, final: bool = False) -> Sequence[tuple[Request, Answer]]:
        with self._turn():
            out = []
            for rid in [rid for rid, (_, future) in self._waiting.items() if final or future.done()]:
                request, future = self._waiting.pop(rid)
                if future.done():
                    out.append((request, self._answer(request, future.result())))
                else:  # the run is over: still waiting, it is refused as its time would have run out
                    future.cancel()
                    out.append((request, Reject(429, "overloaded", self.settings.retry_after_s)))
            return out

    def next_wake_s(self) -> float | None:
        assert self._loop is not None and self.ctx is not None
        link, admission = self._link, self.handler.control.admission if self.handler is not None else None
        wakes = [] if link is None else [link.next_wake_s()]
        if link is not None and link.viewed is not None and admission is not None and admission.waiting():
            wakes.append(self.ctx.clock())  # a view came in another picker's turn: requests wait for it
        if any(future.done() for _, future in self._waiting.values()):
            # answered in a call that returned another request's answer (a waiter released and granted
            # while a new request was decided): the picker answers Envoy at once, so poll now
            wakes.append(self.ctx.clock())
        timer = self._loop.next_timer_s()
        if timer is not None:
            wakes.append(timer)
        return min(wakes) if wakes else None

    # --- several gateways: the shared load view (bench.lab.loadview) ---------------------------------

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """One call of the harness into this picker: its code runs on its virtual event loop, after what
        fell due since the last call (timers: a queued request's timeout; with several gateways on the
        shared view, the report loop's ticks and a ready memory round), and grant requests it asked go
        out at the end."""
        loop = self._loop
        assert loop is not None
        with loop.running():
            if self._link is not None:
                self._link.catch_up()
            loop.run_due()
            yield
            self._settle()

    def _settle(self) -> None:
        """Send the waiting grant requests and run what their answers set off (commits, new decisions)."""
        assert self._loop is not None
        if self._link is not None:
            self._link.flush()
        self._loop.run_due()

    # --- completions, as Envoy's access log reports them --------------------------------------------

    def on_progress(self, events: Sequence[Progress]) -> None:
        with self._turn():
            self._on_progress(events)

    def _on_progress(self, events: Sequence[Progress]) -> None:
        handler = self.handler
        assert handler is not None
        self._tick()
        message = als_pb2.StreamAccessLogsMessage()
        routing = handler.holder.current.routing
        for event in events:
            if not isinstance(event, Finished):
                continue
            sent = self._sent.pop(event.request_id, None)
            if sent is None:
                continue
            request, cluster, endpoint, sent_at = sent
            entry = message.http_logs.log_entry.add()
            entry.request.request_id = request.headers["x-request-id"].decode()
            entry.request.request_headers[routing.cluster_header] = cluster
            entry.request.request_headers[routing.override_host_header] = endpoint
            props = entry.common_properties
            host, _, port = endpoint.rpartition(":")
            upstream = props.upstream_remote_address.socket_address
            upstream.address = host
            upstream.port_value = int(port)
            props.upstream_request_attempt_count = 1
            waited = sent_at - request.arrival_s  # time in Envoy before it went upstream (the picker's queue)
            props.time_to_first_upstream_tx_byte.FromNanoseconds(_ns(waited))
            end = waited + event.duration_s
            props.time_to_last_upstream_rx_byte.FromNanoseconds(_ns(end))
            props.time_to_last_downstream_tx_byte.FromNanoseconds(_ns(end))
            if event.ttft_s is not None:
                props.time_to_first_upstream_rx_byte.FromNanoseconds(_ns(waited + event.ttft_s))
            if event.status == 503:
                props.response_flags.upstream_connection_failure = True
            entry.response.response_code.value = event.status
        if message.http_logs.log_entry:
            handler.access_log(message.SerializeToString())

    def _tick(self) -> None:
        """The request control's housekeeping, once per virtual second (on the first call after it)."""
        assert self.ctx is not None and self.handler is not None
        now = self.ctx.clock()
        if now >= self._next_tick:
            self.handler.control.tick()
            self._next_tick = (math.floor(now / TICK_S) + 1) * TICK_S
