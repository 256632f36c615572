"""The picker's side of memory grants (:mod:`xds_server.loadview.grants`): requests to send, answers awaited.

With other pickers deciding on the same endpoints, an admission (whose room another picker could take
before either sees the other's request) is asked of the control plane first (``GrantRequest`` on the
load-view stream, answered in the next view). This module keeps that bookkeeping (no I/O, event loop
only): the requests waiting to be sent, the ones waiting for an answer (their memory counts against
the endpoint meanwhile, so the picker's next decisions do not promise it twice), what refusals told
of the others' unseen grants (until the next view), and the largest grant the picker's load counts.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Answer", "Grants"]

#: ``(grant number, 0 = refused; None = no answer: the stream is gone; the others' unseen MiB)``.
Answer = Callable[[int | None, float], None]


class Grants:
    """Grant requests of one picker.

    Attributes:
        outbox: ``[(id, cluster, endpoint, MiB, room MiB)]`` to send with the next report.
        applied: the largest grant number whose request this picker counts (``LoadReport.grants_applied``).
        view: the last ``LoadView.view`` applied (``LoadReport.view_applied`` of a report without
            grant requests).
        asked_on: the view applied when the outbox's first request was asked (the outbox's oldest:
            ``LoadReport.view_applied`` of the report that carries them). A view applied between
            the ask and the report does not count: the request's room was reckoned without it, and
            the ledger, told the newer one, took a grant it showed as in the room (an OOM in a
            ``multi_gateway`` round).
        granted: a request was granted since the last report (:func:`~ext_proc.load_client.report_message`
            clears it): its pick is news to the other pickers, so the report loop sends it at once, as
            a grant request, not at its next tick (they would route onto its endpoint meanwhile).
        wake: called when a request is queued or granted (the report loop sends at once); None: nobody listens.
        waited: ``{id: how long the request had waited for memory when asked, s}`` of the outbox's requests.
        queue: the picker's memory queue for its reports, ``() -> [(waiter id, cluster, MiB, waited s)]``
            oldest first (:meth:`ext_proc.admission.Admission.memory_waiters`); None: no queue.
    """

    __slots__ = ("_next", "_waiting", "applied", "asked_on", "granted", "outbox", "pending", "pending_mib",
                 "queue", "refused_mib", "view", "waited", "wake")

    def __init__(self) -> None:
        self.outbox: list[tuple[int, str, str, float, float]] = []
        self._waiting: dict[int, tuple[str, float, Answer, str]] = {}
        self.pending: dict[str, int] = {}
        """``{cluster: requests asked for and not answered yet}`` (they take a concurrency slot)."""
        self.pending_mib: dict[str, float] = {}
        """``{endpoint: MiB asked for and not answered yet}``."""
        self.refused_mib: dict[str, float] = {}
        """``{endpoint: the others' unseen MiB a refusal reported}``, until the next view."""
        self.applied = 0
        self.view = 0
        self.asked_on = 0
        self.granted = False
        self.wake: Callable[[], None] | None = None
        self.waited: dict[int, float] = {}
        self.queue: Callable[[], list[tuple[int, str, float, float]]] | None = None
        self._next = 0

    def held(self, endpoint: str) -> float:
        """MiB the picker's free-memory estimate of ``endpoint`` must leave aside: asked, or refused."""
        return self.pending_mib.get(endpoint, 0.0) + self.refused_mib.get(endpoint, 0.0)

    def ask(self, cluster: str, endpoint: str, mib: float, room_mib: float, answer: Answer,
            waited_s: float = 0.0) -> int:
        """Queue a request for ``mib`` MiB on ``endpoint`` (``room_mib``: the estimate's room once it
        is there; ``waited_s``: how long it has waited for memory); ``answer`` is called once, with the
        answer or with None. Returns its id."""
        self._next += 1
        request_id = self._next
        if waited_s > 0:
            self.waited[request_id] = waited_s
        if not self.outbox:
            self.asked_on = self.view
        self.outbox.append((request_id, cluster, endpoint, mib, room_mib))
        self._waiting[request_id] = (endpoint, mib, answer, cluster)
        self.pending[cluster] = self.pending.get(cluster, 0) + 1
        self.pending_mib[endpoint] = self.pending_mib.get(endpoint, 0.0) + mib
        if self.wake is not None:
            self.wake()
        return request_id

    def take_outbox(self) -> list[tuple[int, str, str, float, float]]:
        """The requests to send now (the outbox is emptied)."""
        out, self.outbox = self.outbox, []
        return out

    def take_waited(self, request_id: int) -> float:
        """How long the outbox's request ``request_id`` had waited when asked (s; 0: not at all), forgotten."""
        return self.waited.pop(request_id, 0.0) if self.waited else 0.0

    def viewed(self, view: int) -> None:
        """A new view was applied: it shows the others' load as of now, so refusals' notes go."""
        self.view = view
        self.refused_mib.clear()

    def answer(self, request_id: int, grant: int, unseen_mib: float) -> None:
        """The control plane's answer to request ``request_id`` (one it no longer waits for is ignored,
        but a grant still counts as applied: its request was decided locally, or went away)."""
        if grant > self.applied:
            self.applied = grant
        waiting = self._forget(request_id)
        if waiting is None:
            return
        endpoint, _, answer, _ = waiting
        if not grant:
            self.refused_mib[endpoint] = max(self.refused_mib.get(endpoint, 0.0), unseen_mib)
        answer(grant, unseen_mib)
        if grant:
            self.granted = True
            if self.wake is not None:
                self.wake()

    def drop(self, request_id: int) -> None:
        """Stop waiting for ``request_id`` (its answer came too late): its callback is not called."""
        self._forget(request_id)

    def lost(self) -> None:
        """The stream is gone: every waiting request is answered with None (decided locally), and what
        the stream told goes: refusals' notes (the others' load is dropped too), the view number (the
        next stream numbers its views from 1) and the grant number applied (a restarted control plane
        numbers its grants from 1: an old, larger number would show its new grants to this picker as
        counted by it; reset, this picker's grants count as unseen until its reports apply new ones)."""
        self.outbox.clear()
        self.waited.clear()
        self.refused_mib.clear()
        self.applied = self.view = 0
        for request_id in list(self._waiting):
            waiting = self._forget(request_id)
            if waiting is not None:
                waiting[2](None, 0.0)

    def _forget(self, request_id: int) -> tuple[str, float, Answer, str] | None:
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            endpoint, mib, _, cluster = waiting
            if self.pending[cluster] > 1:
                self.pending[cluster] -= 1
            else:
                del self.pending[cluster]
            left = self.pending_mib.get(endpoint, 0.0) - mib
            if left > 1e-6:
                self.pending_mib[endpoint] = left
            else:
                self.pending_mib.pop(endpoint, None)
        return waiting
