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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["Grant", "GrantLedger"]


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

    def decide(self, picker: str, endpoint: str, mib: float, room_mib: float, seen: Mapping[str, int],
               now: float) -> tuple[int, float]:
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

        Returns:
            ``(grant number, 0 when refused; MiB of the other pickers' grants on ``endpoint`` the
            asker's view did not show)``. Refused when that MiB exceeds ``room_mib``.
        """
        self.expire(now)
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
        order = self._order
        while order and order[0][0] <= limit:  # grants are kept in time order, overall and per endpoint
            endpoint = order.popleft()[1]
            grants = self._grants[endpoint]
            grants.popleft()
            if not grants:
                del self._grants[endpoint]
