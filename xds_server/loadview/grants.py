"""Memory grants: the control plane as the one ledger of the pickers' memory admissions (pure; clock passed in).

With several pickers sharing one load view, each admits a request on its estimate of an endpoint's
free GPU memory: the last sample, less every pick since that it knows of. It learns another
picker's pick one report and one view later (milliseconds, tens of them on a loaded machine), so
two pickers can fill the same room before either sees the other's request: an OOM that no
estimate can avoid. While another picker decides, each admission asks first
(``GrantRequest``, with the room its estimate leaves once the request is on the endpoint); the
ledger grants it unless the grants it gave the *other* pickers that this picker's view did not
show yet take more than that room. A grant is shown by a view once the view holds its picker's
report that counts the request in flight (``LoadReport.grants_applied``), so each grant is
counted exactly once: by the ledger until the view holds it, by the picker's estimate after.

The ledger also keeps the pickers' memory queues in one order, the oldest first, as one picker's
queue does: each report lists the requests waiting in its picker's queue (``LoadReport.waiting``), and
a grant request says how long its request waited. A room is refused to a request while another
picker's waiter in the same cluster has waited longer (by :data:`ORDER_S`) and needs no more than the
room (the asker's estimate of the endpoint's free memory before its request): that waiter's picker
hears of the room in the view the asker's report sets off and asks for it. Without this, the
picker whose request ended learned of the freed memory first (its own access log) and gave it to
its own waiter or a new request, while an older waiter at another gateway timed out (the lab's
``multi_gateway``: in 16 of the 21 429s of 27 with a room freed during their wait, a younger request
of another gateway took it; 19 429s with this, 28 without). A waiter holds rooms for at most
:data:`DEFER_S` from its first: its picker may not see the room (its estimate is its own), and the
asker must not wait on it for long.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["DEFER_S", "Grant", "GrantLedger", "ORDER_S"]

#: A waiter of another picker comes first when it has waited this much longer than the asking request
#: (s): about the same moment is no order worth a refusal.
ORDER_S = 0.001
#: How long one waiter may hold rooms from the first it was given (s): the views to its picker take
#: a report and a push (milliseconds); longer, its picker did not see the room as free.
DEFER_S = 0.02


class Grant(NamedTuple):
    """One grant: its number (increasing over all pickers), who asked, the endpoint's MiB, when (s)."""

    number: int
    picker: str
    mib: float
    at: float


class GrantLedger:
    """The grants of the last ``keep_s`` seconds, per endpoint.

    Args:
        keep_s: how long a grant is kept (s, > 0); longer than a view takes to show it (a report
            interval and a push; the load view's expiry, 1 s, by default).

    Raises:
        ValueError: ``keep_s`` is not positive.
    """

    def __init__(self, keep_s: float = 1.0) -> None:
        if keep_s <= 0:
            raise ValueError(f"grant keep_s must be > 0, got {keep_s}")
        self.keep_s = keep_s
        self.last = 0
        """The number of the latest grant (0: none yet)."""
        self._grants: dict[str, deque[Grant]] = {}
        self._order: deque[tuple[float, str]] = deque()  # (when, endpoint) of every grant kept, oldest first
        self._held_for: dict[tuple[str, int], float] = {}  # (picker, waiter id) -> when it first held a room

    def decide(self, picker: str, endpoint: str, mib: float, room_mib: float, seen: Mapping[str, int],
               now: float, cluster: str = "", waited_s: float = 0.0,
               waiters: Sequence[tuple[str, int, str, float, float]] = ()) -> tuple[int, float]:
        """Grant or refuse ``picker`` one request of ``mib`` MiB on ``endpoint``.

        Args:
            picker: who asks.
            endpoint: ``"HOST:PORT"``.
            mib: the request's GPU memory need (MiB, >= 0).
            room_mib: the picker's estimate of the endpoint's free memory once the request is on it
                (MiB; its view's picks and its own included).
            seen: ``{picker: the largest grant number its report in the asker's last view counts}``
                (:meth:`LoadTable.grants_seen`): grants up to it are in the asker's estimate.
            now: monotonic s.
            cluster: the request's cluster; ``waited_s``: how long it has waited for memory (s).
            waiters: the other pickers' memory queues, ``[(picker, waiter id, cluster, MiB, waited s
                by now)]`` (:meth:`LoadTable.waiters <xds_server.loadview.table.LoadTable.waiters>`).

        Returns:
            ``(grant number, 0 when refused; MiB of the other pickers' grants on ``endpoint`` the
            asker's view did not show)``. Refused when that MiB exceeds ``room_mib``, and when an
            older waiter of another picker in ``cluster`` fits in ``room_mib + mib`` and has held
            rooms for less than :data:`DEFER_S` (then the MiB is that whole room: the asker leaves
            the endpoint aside until its next view).
        """
        self.expire(now)
        held_for = self._held_for
        for name, waiter, where, need, waited in waiters:
            if where == cluster and name != picker and waited > waited_s + ORDER_S and need <= room_mib + mib:
                first = held_for.setdefault((name, waiter), now)
                if now - first < DEFER_S:
                    return 0, room_mib + mib
        grants = self._grants.get(endpoint, ())
        unseen = sum(g.mib for g in grants if g.picker != picker and g.number > seen.get(g.picker, 0))
        if unseen > room_mib:
            return 0, unseen
        self.last += 1
        self._grants.setdefault(endpoint, deque()).append(Grant(self.last, picker, mib, now))
        self._order.append((now, endpoint))
        return self.last, unseen

    def expire(self, now: float) -> None:
        """Forget the grants older than ``keep_s`` (``now``: monotonic s)."""
        limit = now - self.keep_s
        if self._held_for:
            for key in [k for k, first in self._held_for.items() if first <= limit]:
                del self._held_for[key]
        order = self._order
        while order and order[0][0] <= limit:  # grants are kept in time order, overall and per endpoint
            endpoint = order.popleft()[1]
            grants = self._grants[endpoint]
            grants.popleft()
            if not grants:
                del self._grants[endpoint]
