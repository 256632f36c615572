"""Request control: one request's headers and body fields in, its serialized answer out.

:class:`RequestControl` picks an endpoint (:func:`ext_proc.picker.pick`), holds or refuses the
request for admission (the admission queue, the control plane's memory grants, the no-memory path),
commits it (in flight, session pin, prefix-cache index, decision sample) and encodes the answer; it
keeps the state that path reads and writes (requests in flight, sessions, the cost model, the
prefix-cache index). The stream protocol (:class:`ext_proc.handler.PickerHandler`) hands it each
request's headers and :class:`~ext_proc.body.BodyFields`. Everything here runs on the picker's single
event loop and takes no locks; the state it keeps is only touched from that loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ext_proc.admission import ADMISSION, Admission, admit, settle
from ext_proc.body import BodyFields
from ext_proc.costmodel import CostModel
from ext_proc.gateway import SUBSET_EMPTY, Within, settle_destination
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.picker import Decision, overloaded, pick, too_large
from ext_proc.prefix_events import EventIndex
from ext_proc.prefix_index import PrefixIndex
from ext_proc.recent import RecentEndpoints, pinnable
from ext_proc.responses import GATEWAY_API, ResponseEncoder
from ext_proc.sampler import DecisionSampler
from ext_proc.scheduling.affinity import STRICT_PLUGIN
from ext_proc.sessions import SessionTable, pin_after
from ext_proc.shared_load import Others, SharedLoad, freed
from ext_proc.telemetry import DECISION_SECONDS, OUTCOMES, SAMPLE_EVERY
from ext_proc.view import EndpointView, ViewHolder

__all__ = ["GRANT_TIMEOUT_S", "GRANT_TRIES", "RequestControl"]

log = logging.getLogger(__name__)

#: Without the memory queue, how long a request waits for the control plane's memory grant before
#: it is decided locally (s). With it (``memory_queue`` and admission), a request waits until its
#: deadline (``queue_timeout_s`` from its first grant request), then is refused like one the memory
#: queue could not place: committed before the ledger heard of it, it would be one the ledger grants
#: others' room against (in two ``multi_gateway`` rounds where every request waited 50 ms and then
#: committed, such a commit came in the 250 ms before 35 of 55 OOMs). Without the queue there is no
#: memory 429 to give (waited out, the request would be pinned blind all the same, only later).
GRANT_TIMEOUT_S = 0.05
#: Grant refusals one request takes (each steering it off the refused endpoint) before it waits in
#: the memory queue like a request no endpoint has room for.
GRANT_TRIES = 3


class RequestControl:
    """Decides, admits and commits requests, and keeps the live state decisions read.

    Args:
        holder: where the current view is read, once per request.
        inflight: the live load, fed by picks and completions (default: a fresh one). It counts
            from the very first pick, before any access-log stream is open.
        sessions: the session table (default: 30 min idle TTL, 1 000 000 sessions).
        admission: admission control (None: requests are never held or refused for load or
            memory). Its max-concurrency rule acts only while an access-log stream is open
            (completions can arrive) and on clusters whose endpoints carry a max concurrency; a
            request no endpoint has memory for waits in the queue (then 429) whenever it is on.
        sampler: where a sample of decisions is kept for operators (None: no sampling).
        costs: the request cost model, learned from the completions (default: a fresh one).
        pin_move_after: spills in a row that move a session's pin (>= 1).
        limit_concurrency: with ``admission``, also hold requests for a cluster at its max
            concurrency (False: the queue only holds requests no endpoint has memory for).
        memory_queue: with ``admission``, a request no endpoint has memory for waits in the queue
            (then 429); False, or without ``admission``: it is pinned to the endpoint with the most
            estimated free memory.
        retry_after_s: the ``Retry-After`` (s) of the 429 a strict session whose pinned endpoint
            has no memory for its request gets without the memory queue
            (:mod:`ext_proc.scheduling.affinity`); with the queue, the queue's.

    Raises:
        ValueError: ``pin_move_after`` is below 1.
    """

    def __init__(self, holder: ViewHolder, inflight: InFlight | None = None,
                 sessions: SessionTable | None = None, admission: Admission | None = None,
                 sampler: DecisionSampler | None = None, costs: CostModel | None = None,
                 pin_move_after: int = 3, limit_concurrency: bool = True, memory_queue: bool = True,
                 retry_after_s: int = 1) -> None:
        if pin_move_after < 1:
            raise ValueError(f"pin_move_after must be >= 1, got {pin_move_after}")
        self.holder = holder
        self.inflight = inflight if inflight is not None else InFlight()
        self._recent = RecentEndpoints(clock=self.inflight.now)  # whose prefix-cache state housekeeping keeps
        self.loads: InFlight | SharedLoad = self.inflight
        """What decisions read as the live load: ``inflight``, or with :meth:`share_load` the shared view."""
        self.shared: SharedLoad | None = None
        """The shared load view once :meth:`share_load` made it ``loads`` (its grants, its others); None: none."""
        self.sessions = sessions if sessions is not None else SessionTable()
        self.admission = admission
        self.encoder = ResponseEncoder()
        """Turns a decision into the serialized ext_proc answer (:class:`~ext_proc.responses.ResponseEncoder`)."""
        self._sample = sampler.offer if sampler is not None else None
        self.costs = costs if costs is not None else CostModel()
        self.pin_move_after = pin_move_after
        self.limit_concurrency = limit_concurrency
        self.memory_queue = memory_queue
        self.retry_after_s = retry_after_s
        self.spills: dict[int, int] = {}
        """Session slot -> spills in a row (only sessions spilling now)."""
        self.largest_memory: dict[str, float] = {}
        """``{cluster: its largest endpoint's whole GPU memory, MiB}`` (:meth:`set_largest_memory`)."""
        self._timed = 0
        self.prefixes: PrefixIndex | EventIndex = PrefixIndex()
        """The prefix-cache index: the prompt blocks each endpoint was sent (:mod:`ext_proc.prefix_index`),
        or, with ``prefix_source: kv_events``, the blocks each engine's KV events say it holds
        (:mod:`ext_proc.prefix_events`; :meth:`ext_proc.handler.PickerHandler.from_settings`)."""

    @staticmethod
    def _count(reason: str, plugins: str = "") -> None:
        key = (reason, plugins)
        OUTCOMES[key] = OUTCOMES.get(key, 0) + 1

    def refused(self, refusal: Decision, view: EndpointView, headers: dict[str, bytes], phase: str) -> bytes:
        """The serialized answer (for ``phase``) to a request refused before it was picked (``refusal``:
        its rejection, e.g. :func:`~ext_proc.picker.too_deep`), counted under the refusal's reason."""
        self._count(refusal.reason)
        return self.encoder.encode(refusal, view, headers, phase)

    def release(self) -> None:
        """Let waiting requests that now fit go (after load was freed or samples came; nothing
        without admission)."""
        if self.admission is not None:
            self.admission.release(self._room)

    def completed(self, request_id: bytes | None) -> None:
        """The request with this ``x-request-id`` ended (its response did, seen on the ext_proc stream:
        :mod:`ext_proc.gateway`): its pick leaves the load, and waiting requests that now fit go."""
        routed = self.inflight.routed(request_id) if request_id else None
        if routed is None:
            return
        self.inflight.pop(routed[0], routed[1], request_id)
        self.release()

    def pick(self, headers: dict[str, bytes], view: EndpointView, body: BodyFields) -> Decision:
        """The decision for one request on ``view`` and the live load, nothing committed
        (:func:`ext_proc.picker.pick`; within the gateway's subset hint when ``body.subset`` is set, and
        under the Gateway API protocol settled as it answers: :func:`~ext_proc.gateway.settle_destination`).
        One pick in :data:`~ext_proc.telemetry.SAMPLE_EVERY` is timed (``DECISION_SECONDS``)."""
        loads = self.loads if body.subset is None else Within(self.loads, body.subset)
        self._timed += 1
        if self._timed < SAMPLE_EVERY:
            decision = pick(headers, view, loads, self.sessions, body, self.costs, self.prefixes)
        else:
            self._timed = 0
            start = time.perf_counter()
            decision = pick(headers, view, loads, self.sessions, body, self.costs, self.prefixes)
            DECISION_SECONDS.observe(time.perf_counter() - start)
        return decision if view.routing.protocol != GATEWAY_API else settle_destination(decision, body.subset)

    def commit(self, decision: Decision, view: EndpointView, headers: dict[str, bytes], phase: str) -> bytes:
        """Count the pick in flight, move or refresh the session's pin, record the prompt's blocks (and
        where its conversation's turn went) in the prefix index, and encode the answer."""
        endpoint = decision.endpoint
        blocks = decision.blocks
        uncached = None
        if blocks and endpoint is not None:
            # The share of the prompt the endpoint did not hold, for the cost model's TTFT fit.
            uncached = 1.0 - self.prefixes.matched(blocks, (endpoint,)).get(endpoint, 0) / len(blocks)
            self.prefixes.insert(endpoint, blocks, view.routing.prefix_blocks)
        if decision.conversation is not None and endpoint is not None:
            self.prefixes.sent_turn(decision.conversation, endpoint)
        if decision.cluster is not None:
            # A KV-cache hit, as far as the picker knows: kept on the session's pin, or on its prefix's owner.
            hit = decision.reason == "affinity" and (decision.key == "prefix" or decision.pinned == endpoint)
            self.inflight.picked(decision.cluster, endpoint, decision.work, decision.mib, decision.prompt_tokens,
                                 decision.output_tokens, decision.gpu_class, headers.get("x-request-id"), not hit,
                                 uncached)
            slot = decision.session
            if slot is not None and endpoint is not None:
                spills = self.spills.pop(slot, 0) if self.spills else 0
                if decision.pinned == endpoint:  # kept (the common case)
                    pin = endpoint
                else:
                    pin, spills, moved = pin_after(decision.pinned, endpoint, decision.reason, spills,
                                                   self.pin_move_after)
                    if spills:
                        self.spills[slot] = spills
                    if moved and decision.reason != "repinned":
                        self._count("pin-moved")
                self.sessions.touch(slot, pin)
        self._count(decision.reason, decision.plugins)
        if self._sample is not None:
            self._sample(headers, view.routing, decision)
        return self.encoder.encode(decision, view, headers, phase)

    def _capacity(self, view: EndpointView, cluster: str) -> int:
        """The cluster's max concurrency: of both tiers when it has two (0 = unknown: one of them is)."""
        pool = view.clusters.get(cluster)
        if pool is None:
            return 0
        spill = pool.spill
        if spill is None or pool.capacity <= 0 or spill.capacity <= 0:
            return pool.capacity if spill is None else 0
        return pool.capacity + spill.capacity

    def _taken(self, cluster: str) -> int:
        """``cluster``'s slots taken: its requests in flight and those waiting for a memory grant
        (admitted: they commit once answered, and a slot counted only then let every request in
        those milliseconds through)."""
        taken = self.loads.clusters.get(cluster, 0)
        shared = self.shared
        if shared is not None and shared.grants.pending:
            taken += shared.grants.pending.get(cluster, 0)
        return taken

    def _room(self, cluster: str) -> bool:
        """A slot for one more request of ``cluster`` (always, when its concurrency is not limited)."""
        capacity = self._capacity(self.holder.current, cluster)
        return not self.limit_concurrency or capacity <= 0 or self._taken(cluster) < capacity

    def route(self, headers: dict[str, bytes], view: EndpointView, body: BodyFields,
              phase: str, tries: int = 0, deadline: float | None = None) -> bytes | asyncio.Future[bytes]:
        """Decide one request and answer it: the serialized answer for ``phase`` (the ext_proc message
        it answers), committed (:meth:`commit`) or refused at once (too large for any endpoint, the
        queue full), or a future of it while the request waits for admission or a memory grant.
        ``body``: the fields read from its body (:data:`~ext_proc.body.NO_BODY`: none read); ``tries``:
        memory grant refusals so far; ``deadline``: the event loop's time its wait ends (None: not
        waiting yet)."""
        decision = self.pick(headers, view, body)
        cluster = decision.cluster
        admission = self.admission
        if cluster is None:
            return self.commit(decision, view, headers, phase)
        largest = self.largest_memory.get(cluster)
        if largest is not None and decision.mib > largest:  # no endpoint could ever hold it
            return self.refused(too_large(cluster, decision.mib, largest), view, headers, phase)
        if decision.reason == "no-memory":
            return self._no_memory(decision, headers, view, body, phase, deadline)
        if admission is None or not self.limit_concurrency or not self.inflight.streams:
            return self._confirm(decision, view, headers, body, phase, tries, deadline=deadline)
        verdict = admit(self._taken(cluster), self._capacity(view, cluster),
                        admission.queued(cluster), admission.max_queue)
        if verdict == "admit":
            return self._confirm(decision, view, headers, body, phase, tries, deadline=deadline)

        def refuse() -> bytes:
            return self.refused(overloaded(cluster, admission.retry_after_s), view, headers, phase)

        if verdict == "reject":
            ADMISSION.labels(cluster, "rejected_full").inc()
            return refuse()
        return self._enqueue(cluster, headers, body, phase, refuse, deadline)

    def _enqueue(self, cluster: str, headers: dict[str, bytes], body: BodyFields, phase: str,
                 refuse: Callable[[], bytes], deadline: float | None = None, mib: float = 0.0) -> asyncio.Future[bytes]:
        """Queue a request that must wait, for a slot or for memory: it goes once its cluster has a
        slot (when its concurrency is limited) *and* an endpoint has memory for it, whichever it
        waited for (a slot freed by a small request is no room for a large one: resumed on the slot
        alone, a request without memory was forwarded unpinned and Envoy's choice ran out of
        memory), decided again on the view and loads of then; else ``refuse`` at the timeout. A
        waiter that does not fit yet lets a later one that does go by (:meth:`Admission.release`).
        A request released whose memory grant is refused waits again, for what is left of its time
        (``deadline``: the event loop's time its wait ends; None: the queue's timeout from now).
        ``mib``: its GPU memory need when it waits for memory (0: for a slot), listed with its wait in the
        shared load view's reports (:meth:`Admission.memory_waiters`)."""
        admission = self.admission
        assert admission is not None
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + admission.timeout_s
        decided: Decision | None = None

        def fits() -> bool:
            nonlocal decided
            decided = self.pick(headers, self.holder.current, body)
            return decided.reason != "no-memory"

        def again() -> bytes | asyncio.Future[bytes]:
            if loop.time() >= deadline or admission.queued(cluster) >= admission.max_queue:
                return refuse()
            return self._enqueue(cluster, headers, body, phase, refuse, deadline, mib)

        def resume() -> bytes | asyncio.Future[bytes]:  # right after fits() said yes: its decision
            assert decided is not None
            return self._confirm(decided, self.holder.current, headers, body, phase, GRANT_TRIES - 1, again,
                                 deadline)

        return admission.enqueue(cluster, resume, refuse, fits, deadline - loop.time(), mib,
                                 deadline - admission.timeout_s)

    def _confirm(self, decision: Decision, view: EndpointView, headers: dict[str, bytes], body: BodyFields,
                 phase: str, tries: int, give_up: Callable[[], bytes | asyncio.Future[bytes]] | None = None,
                 deadline: float | None = None) -> bytes | asyncio.Future[bytes]:
        """Commit ``decision``, or first ask the control plane for a memory grant while another picker
        decides on the same endpoints (:meth:`SharedLoad.grant_room`; :mod:`xds_server.loadview.grants`):
        two pickers could fill the same room before either sees the other's request.

        Granted, or the view lost, or (without the memory queue) no answer within
        :data:`GRANT_TIMEOUT_S`: committed as decided. With the memory queue (``memory_queue`` and
        admission), no answer by the request's ``deadline`` (``queue_timeout_s`` from its first
        grant request): ``give_up()``.
        Refused: decided again with the others' unseen memory left aside on that endpoint, until
        :data:`GRANT_TRIES` refusals (``tries``: refusals so far); then ``give_up()`` (default: queued
        for memory like a request no endpoint has room for).
        """
        shared = self.shared
        endpoint = decision.endpoint
        # The need with the margin admission kept: the others' unseen grants may not take the margin.
        if endpoint is None or shared is None:
            return self.commit(decision, view, headers, phase)
        room = shared.grant_room(endpoint, decision.mib * (1.0 + decision.margin))
        if room is None:
            return self.commit(decision, view, headers, phase)
        grants = shared.grants
        loop = asyncio.get_running_loop()
        if deadline is None and self.admission is not None:
            # The request's whole wait (grant waits, refusals, the queue) ends within the queue's
            # timeout from its first grant request: Envoy's message timeout is above that alone.
            deadline = loop.time() + self.admission.timeout_s
        # Unanswered by the deadline, refused (a 429) only where the picker refuses for memory at all.
        refusable = deadline is not None and self.admission is not None and self.memory_queue
        future: asyncio.Future[bytes] = loop.create_future()

        def answered(grant: int | None, unseen_mib: float) -> None:
            timer.cancel()
            if future.done():  # the stream ended first
                return
            if grant is None or grant:
                self._count("grant-granted" if grant else "grant-unanswered")
                current = self.holder.current
                if current is not view and not self._pinnable(current, decision.cluster, endpoint):
                    # an EDS update meanwhile removed (or made unpinnable) its endpoint: decided again
                    settle(future, lambda: self.route(headers, current, body, phase, tries + 1, deadline))
                    return
                settle(future, lambda: self.commit(decision, current, headers, phase))
                return
            self._count("grant-refused")
            if tries + 1 >= GRANT_TRIES:
                settle(future, give_up or (lambda: self._no_memory(decision._replace(reason="no-memory"), headers,
                                                                   self.holder.current, body, phase, deadline)))
            else:
                settle(future, lambda: self.route(headers, self.holder.current, body, phase, tries + 1, deadline))

        def late() -> None:
            grants.drop(request_id)
            if not refusable:
                answered(None, 0.0)
            elif not future.done():
                # Its time is up and the ledger has not answered: committed now, it would be one the
                # ledger grants others' room against (it hears of it later). Refused like a request
                # the memory queue could not place in its time.
                self._count("grant-unanswered")
                settle(future, give_up or (lambda: self._no_memory(decision._replace(reason="no-memory"), headers,
                                                                   self.holder.current, body, phase, deadline)))

        # How long it has waited for memory: the memory ledger serves the oldest waiter of all pickers first.
        waited = 0.0 if self.admission is None or deadline is None else \
            max(0.0, loop.time() - (deadline - self.admission.timeout_s))
        request_id = grants.ask(decision.cluster, endpoint, decision.mib, room, answered, waited)
        left = GRANT_TIMEOUT_S if deadline is None else max(0.0, deadline - loop.time())
        wait = left if refusable else min(GRANT_TIMEOUT_S, left)
        timer = loop.call_later(wait, late)
        return future

    @staticmethod
    def _pinnable(view: EndpointView, cluster: str | None, endpoint: str) -> bool:
        """Whether ``endpoint`` is still a pinnable endpoint of ``cluster`` (either tier) in ``view``."""
        pool = view.clusters.get(cluster) if cluster is not None else None
        if pool is None:
            return False
        return endpoint in pool.members or (pool.spill is not None and endpoint in pool.spill.members)

    def _no_memory(self, decision: Decision, headers: dict[str, bytes], view: EndpointView, body: BodyFields,
                   phase: str, deadline: float | None = None) -> bytes | asyncio.Future[bytes]:
        """No endpoint can hold the request: queue it (with admission on) until one can, then 429.

        Without the queue (``memory_queue`` off) the request is pinned to the endpoint with the
        most estimated free memory (best effort: the estimate may be stale; Envoy's fallback would
        choose blind), unless it is a strict session waiting for its pinned endpoint
        (:data:`~ext_proc.scheduling.affinity.STRICT_PLUGIN` in its plugins): it gets a 429 with
        ``Retry-After``, never another endpoint.
        """
        cluster = decision.cluster
        assert cluster is not None
        pool = view.clusters[cluster]
        admission = self.admission
        if admission is None or not self.memory_queue:
            if decision.plugins.endswith(STRICT_PLUGIN):
                rejection = overloaded(cluster, self.retry_after_s,
                                       f"has no GPU memory free for this request on the endpoint of its session "
                                       f"({decision.mib:.0f} MiB; session_affinity: strict)")
                self._count("no-memory", decision.plugins)
                return self.encoder.encode(rejection, view, headers, phase)
            loads = self.loads
            allowed = [e for e in pool.endpoints if body.subset is None or e in body.subset]
            candidates = [e for e in allowed if e not in loads.failed] or allowed
            if not candidates:  # the gateway's subset hint left none (ext_proc.gateway)
                return self.commit(SUBSET_EMPTY, view, headers, phase)
            best = max(candidates, key=lambda e: (loads.free.get(e, float("inf")), e))
            return self.commit(decision._replace(endpoint=best, gpu_class=pool.classes.get(best, "")), view,
                               headers, phase)

        def refuse() -> bytes:
            why = f"has no endpoint with {decision.mib:.0f} MiB of GPU memory free for this request"
            rejection = overloaded(cluster, admission.retry_after_s, why)
            self._count("no-memory")
            return self.encoder.encode(rejection, view, headers, phase)

        if admission.queued(cluster) >= admission.max_queue:
            ADMISSION.labels(cluster, "rejected_full").inc()
            return refuse()
        return self._enqueue(cluster, headers, body, phase, refuse, deadline, decision.mib)

    def set_largest_memory(self, largest: dict[str, float]) -> None:
        """``{cluster: the whole GPU memory of its largest endpoint, MiB}`` (from the config): a
        request needing more gets a 503 at once that says so (issue 15 item 4: forwarded, it
        could only fail on a backend, and those failures took the endpoints out of the cluster).
        A cluster absent is unknown: nothing is refused as too large for it."""
        self.largest_memory = largest

    def share_load(self) -> SharedLoad:
        """Decide on the shared load view from now on: the loads every decision reads become this
        picker's own plus the other pickers' (:mod:`ext_proc.shared_load`; fed by
        :func:`ext_proc.load_client.run_load_view`). Returns the :class:`SharedLoad` to feed."""
        if self.shared is None:
            self.loads = self.shared = SharedLoad(self.inflight)
            if self.admission is not None and self.memory_queue:
                # its reports list the memory queue: the ledger serves the oldest waiter of all pickers first
                self.shared.grants.queue = self.admission.memory_waiters
        return self.shared

    def others_changed(self, before: Others) -> None:
        """The shared load view's others' load changed from ``before`` (:func:`ext_proc.load_client.run_load_view`
        calls it after each view): while requests wait in the queue, they are tried again when it went
        down (:func:`ext_proc.shared_load.freed`: another picker's request ended and freed memory or a
        slot), as the picker's own completions do. Without this a waiter was retried only on this
        picker's own completions, samples and housekeeping: the lab's ``multi_gateway`` (three pickers,
        16 engines, 48 QPS) had 301 memory-queue timeouts (1.2 % of its requests), 209 with it."""
        shared = self.shared
        admission = self.admission
        if admission is not None and shared is not None and admission.waiting() \
                and freed(before, shared.others):
            admission.release(self._room)

    def set_samples(self, samples: MemorySamples) -> None:
        """Fresh GPU memory samples from the slow loop (:class:`~ext_proc.inflight.MemorySamples`,
        see :meth:`InFlight.set_samples`); waiting requests that now fit are admitted. The backends'
        whole counts of held requests are used only while the shared load view shows no other picker
        deciding: a count that includes another picker's requests would credit this one's doubtful
        requests with room those hold. Counts of this picker's own requests (``samples.own``: the
        control plane took the others' out) are used whoever decides."""
        shared = self.shared
        if samples.held is not None and not samples.own and not (
                shared is not None and shared.viewed_at is not None and shared.alone()):
            samples = samples._replace(held=None)
        self.inflight.set_samples(samples)
        self.release()

    def failed(self, endpoint: str, certain: bool = True) -> None:
        """Connections to ``endpoint`` (``HOST:PORT``) failed (``certain``: Envoy flagged the failure; else a
        retry went to another host), as :func:`ext_proc.accesslog.record_completions` reports it. Once
        :meth:`InFlight.failed_now` holds the endpoint out of picks, counted (``endpoint-failed``) and logged."""
        if self.inflight.failed_now(endpoint, certain):
            self._count("endpoint-failed")
            log.warning("picker: connections to %s fail; not pinning to it for %g s", endpoint,
                        self.inflight.failure_hold_s)

    def tick(self) -> None:
        """Housekeeping, about once a second: expire lost picks and failure holds, forget idle
        sessions, refit the cost model, forget the prefix index of endpoints not pinnable for
        :data:`ext_proc.recent.KEEP_S` (a health flap keeps it)."""
        if len(self.prefixes):
            self.prefixes.retain(self._recent.update(pinnable(self.holder.current)))
        self.inflight.expire()
        self.sessions.sweep()
        self.costs.refit()
        if self.spills and len(self.spills) > 100_000:
            self.spills.clear()
        self.release()
