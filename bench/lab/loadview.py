"""inferlb's shared load view in the lab: ``inferlb serve``'s load-view service and each standalone
picker's side of it (``inferlb ext-proc``), in virtual time.

With several gateways each Envoy has its own picker; the pickers share one load view through the
control plane (``picker.shared_view``, on by default). The real code runs on both sides; only the
gRPC stream and the asyncio tasks around it are swapped:

- **The control plane** (:class:`ControlPlaneView`): one :class:`~xds_server.loadview.table.LoadTable`
  (the sum of every picker's latest report, expiry ``picker.shared_view_expiry_s``), one
  :class:`~xds_server.loadview.grants.GrantLedger`, and a :class:`~xds_server.loadview.exchange.Stream`
  per picker, driven by :mod:`xds_server.loadview.exchange` as the service drives it: each report is
  taken (:func:`~xds_server.loadview.exchange.take_report`: kept, its grant requests decided) and
  every picker gets the view of now (:func:`~xds_server.loadview.exchange.next_view`: its own as
  the answer, the others' pushed). Each slow-loop round's memory samples are set on the table
  (``inferlb serve``'s ``_feed_picker``, with the engines' held counts under
  ``picker.memory_count_in_sample``); once ready (:attr:`LoadTable.memory_ready_at`: 0.1 s after
  the newest sample) the round is counted (:meth:`LoadTable.round_counter`) and each picker's next
  view carries its part (:func:`~xds_server.loadview.exchange.memory_message`).
- **Each picker** (:class:`PickerLink`): the report loop of :func:`ext_proc.load_client.run_load_view`
  on the virtual clock: a ``LoadReport`` (:func:`~ext_proc.load_client.report_message`) first when
  it starts, then at the loop's ticks (every ``picker.shared_view_interval_s`` after the last report)
  when :func:`~ext_proc.load_client.report_due` says so (its load changed and other pickers decide,
  or the keep-alive), and at once when a memory grant request waits or a request was granted (its
  pick). Each view goes into its :class:`~ext_proc.shared_load.SharedLoad`
  (:func:`~ext_proc.load_client.apply_view`: the others' load, the grant answers), a memory round
  as ``run_load_view`` takes it (the capacities, the others' share as the baseline, the samples to
  the picker: :func:`~ext_proc.load_client.memory_of`), and the picker is told what the others'
  load was before it (:meth:`~ext_proc.requestcontrol.RequestControl.others_changed`) on its next turn: a
  view set off by another picker's report arrives in that picker's turn, and the harness wakes this
  one at the same virtual instant when its requests wait.

Not modelled: the stream's transit (a report is taken, and the views it sets off arrive, in the
same virtual instant: on one host it is well under the 10 ms report interval); views coalesced
while a stream is busy (every report sends every picker a view); a lost stream or a stale view (the
control plane never fails here); and ``inferlb serve``'s own in-process picker, which no Envoy sends
traffic in this setup (in production it reports too, and the others count it idle).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ext_proc.inflight import MemorySamples
from ext_proc.load_client import apply_view, memory_of, report_due, report_message, view_capacities
from ext_proc.shared_load import Others, SharedLoad
from protos import load_view_pb2
from xds_server.loadview.exchange import Stream, memory_message, next_view, take_report
from xds_server.loadview.grants import GrantLedger
from xds_server.loadview.table import LoadTable

__all__ = ["ControlPlaneView", "PickerLink"]

#: Where the pickers of one run find the control plane in :attr:`bench.lab.policy.Context.shared`.
SHARED_KEY = "inferlb.load_view"


class ControlPlaneView:
    """The control plane's load-view service, for the pickers of one lab run (see the module docstring).

    Args:
        expiry_s: ``picker.shared_view_expiry_s`` (s): the table's expiry and how long the ledger keeps a grant.
        clock: the run's virtual clock (s).
    """

    def __init__(self, expiry_s: float, clock: Callable[[], float]) -> None:
        self.table = LoadTable(expiry_s)
        self.ledger = GrantLedger(expiry_s)
        self._clock = clock
        self._streams: dict[str, tuple[Stream, Callable[[load_view_pb2.LoadView], None]]] = {}
        self._rounds: dict[str, int] = {}   # picker -> the memory round its views carried last
        self._round_at: float | None = None  # the slow-loop round whose samples the table has

    @classmethod
    def of(cls, shared: dict, expiry_s: float, clock: Callable[[], float]) -> ControlPlaneView:
        """The run's control plane in ``shared`` (:attr:`~bench.lab.policy.Context.shared`), made by the
        first picker that asks."""
        plane = shared.get(SHARED_KEY)
        if plane is None:
            plane = shared[SHARED_KEY] = cls(expiry_s, clock)
        return plane

    def open(self, picker: str, deliver: Callable[[load_view_pb2.LoadView], None]) -> None:
        """A picker's stream opens: its views go to ``deliver`` (called at once, in the reporting picker's turn)."""
        self._streams[picker] = (Stream(), deliver)
        self._rounds[picker] = 0

    def report(self, picker: str, msg: load_view_pb2.LoadReport) -> list[tuple[int, int, float]]:
        """Take ``picker``'s report now and send every picker (in the order they opened) the view of now.

        Returns:
            The answers to its grant requests (:func:`~xds_server.loadview.exchange.take_report`).

        Raises:
            ValueError: a bad report (the service would refuse it; here it is a bug of the caller).
        """
        now = self._clock()
        answers = take_report(self.table, self.ledger, self._streams[picker][0], msg, now)
        for stream, deliver in self._streams.values():
            view = next_view(self.table, stream, now)
            if view is not None:
                deliver(view)
        return answers

    def set_memory(self, at: float, samples: Mapping[str, tuple[float, float]],
                   held: Mapping[str, float] | None = None) -> None:
        """The slow loop's round at ``at`` (virtual s), its samples ``{"HOST:PORT": (free MiB, taken at)}``
        and the requests each engine held in them (None: not read) (:meth:`LoadTable.set_memory`; the
        first picker to see a round sets it, the others' calls are no-ops)."""
        if at != self._round_at:
            self._round_at = at
            self.table.set_memory(samples, held)

    def memory_due(self, picker: str) -> float | None:
        """When ``picker`` is due its part of the latest memory round (virtual s), None: it has it (or none yet)."""
        table = self.table
        return table.memory_ready_at if table.memory_round > self._rounds[picker] else None

    def send_memory(self, picker: str) -> None:
        """If ``picker`` is due its part of a memory round that is ready now: count the round (once for every
        picker) and send ``picker`` a view of now that carries it."""
        table, now = self.table, self._clock()
        if table.memory_round <= self._rounds[picker] or now < table.memory_ready_at:
            return
        if table.counted.round != table.memory_round:
            table.take_counts(table.round_counter()())
        stream, deliver = self._streams[picker]
        view = next_view(table, stream, now)
        self._rounds[picker] = table.counted.round
        if view is None:   # no report yet: nothing to answer (its first view will carry the next round)
            return
        view.MergeFrom(memory_message(table.counted, picker, now))
        deliver(view)


class PickerLink:
    """One picker's side of the shared load view in the lab (see the module docstring).

    Args:
        name: the picker's name in the control plane.
        shared: the picker's :class:`~ext_proc.shared_load.SharedLoad` (``RequestControl.share_load()``).
        plane: the run's control plane.
        interval_s: ``picker.shared_view_interval_s`` (s): the report loop's tick.
        expiry_s: ``picker.shared_view_expiry_s`` (s): the keep-alive is a quarter of it.
        on_samples: the picker's :meth:`~ext_proc.requestcontrol.RequestControl.set_samples`.
        on_view: the picker's :meth:`~ext_proc.requestcontrol.RequestControl.others_changed`, called on the
            picker's next turn (:meth:`catch_up`) with the others' load before the first view it
            missed: a view comes in another picker's turn, whose report set it off.
    """

    def __init__(self, name: str, shared: SharedLoad, plane: ControlPlaneView, interval_s: float, expiry_s: float,
                 on_samples: Callable[[MemorySamples], None], on_view: Callable[[Others], None]) -> None:
        self.name = name
        self.shared = shared
        self.plane = plane
        self.interval_s = interval_s
        self.keepalive_s = expiry_s / 4
        # The keep-alive's tick: the first whose time since the report reaches it.
        self._keepalive_tick = max(1, math.ceil(self.keepalive_s / interval_s - 1e-9))
        self._on_samples = on_samples
        self._on_view = on_view
        self.viewed: Others | None = None
        """The others' load before the first view taken since the picker's last turn (None: no view since)."""
        self.reports = 0
        self._since = self._anchor = shared.inflight.now()
        self._tick = 1   # the next tick not yet checked: at _anchor + _tick x interval_s
        self._reported = shared.inflight.changes
        plane.open(name, self._take)

    def start(self) -> None:
        """The stream opens: the first report goes at once (``run_load_view`` does not wait for a tick)."""
        self._report()

    def _report(self) -> None:
        inflight = self.shared.inflight
        now = inflight.now()
        self.reports += 1
        self._reported = inflight.changes
        msg = report_message(inflight, self.name, self.reports, self._since, self.shared.grants)
        self._since = self._anchor = now
        self._tick = 1
        self.plane.report(self.name, msg)

    def _take(self, view: load_view_pb2.LoadView) -> None:
        """One view into the picker, as ``run_load_view`` takes it (without its worker threads)."""
        shared = self.shared
        if self.viewed is None:
            self.viewed = shared.others
        apply_view(shared, view)
        if view.memory_round:
            shared.free.capacity = view_capacities(view)
            baseline, samples = memory_of(view, shared.inflight.now())
            shared.free.rebase(baseline)
            self._on_samples(samples)

    def catch_up(self) -> None:
        """What the report loop did up to now: each tick passed is checked (a report when due), and a
        memory round that is ready comes in."""
        now = self.shared.inflight.now()
        while self._anchor + self._tick * self.interval_s <= now:
            if report_due(self.shared, self._reported, self._tick * self.interval_s, self.keepalive_s):
                self._report()
                break
            self._tick += 1
        self.plane.send_memory(self.name)
        if self.viewed is not None:
            before, self.viewed = self.viewed, None
            self._on_view(before)

    def flush(self) -> None:
        """Send the grant requests waiting and the picks of granted requests (a report each time: the
        answers in a view can set off new ones, a refused request decided again)."""
        grants = self.shared.grants
        while grants.outbox or grants.granted:
            self._report()

    def next_wake_s(self) -> float | None:
        """When the loop next has something to do (virtual s): the next tick while its load changed since
        the last report, else the keep-alive's tick; or a memory round's ready time, if earlier."""
        tick = self._tick if self.shared.inflight.changes != self._reported else max(self._tick, self._keepalive_tick)
        wake = self._anchor + tick * self.interval_s
        due = self.plane.memory_due(self.name)
        return wake if due is None else min(wake, due)
