"""The two session-affinity contracts: ``strict`` (a conversation's state lives on its endpoint) and
``soft`` (only its KV cache does), per service (``services[].session_affinity``; docs/picker.md,
"Session affinity: strict or soft").

- **soft**: the service's scheduling profile decides every request, a session's pinned endpoint
  first: the profile's soft filters (``bounded-load``, ``affinity-slack``) may turn the pin away
  under load and the request spills; the pin moves after ``picker.pin_move_after`` spills in a row
  (:func:`ext_proc.sessions.pin_after`). What a move costs is the conversation's KV cache: its whole
  history prefilled again elsewhere.
- **strict**: for backends that keep a conversation's state on the node, where a turn answered
  elsewhere has lost its context (issue 37, the seed's chat trap). A session with a pin goes to its
  pin while the pin is pinnable and every hard filter of the profile keeps it
  (:func:`strict_choice`): load never moves it, so the profile's soft filters and scorers are not
  asked. It moves only when its endpoint is no longer pinnable (unhealthy, ejected, draining,
  removed: not in :attr:`ext_proc.view.ClusterEndpoints.members`) or turned away by a hard filter
  that ``repins`` (connections failing: ``failed-endpoints``): the profile then chooses as for a
  soft session whose pin is gone (outcome ``repinned``). A hard filter that does not repin (memory
  admission, on engines that take GPU memory per request) makes the request wait for its pin
  (outcome ``no-memory``, endpoint None): the memory queue holds it until the pin has the memory
  (``picker.memory_queue``), else, or at the queue's timeout, a 429 with ``Retry-After``; never
  another endpoint. A session without a pin yet is placed by the profile as under ``soft``.

A strict decision names the contract in its plugins (:data:`STRICT_PLUGIN`, beside the hard filter
that made it wait), so ``inferlb_ext_proc_decisions_total{plugins}`` and the decision sampler show
strict pins apart from the profile's own affinity.

Source of the name: Envoy's stateful session filter has the same switch
(``envoy.extensions.filters.http.stateful_session.v3.StatefulSession.strict``: "the HTTP request must
be routed to the requested destination"; Envoy answers 503 when that host is not available, where
this contract moves the session to a healthy endpoint).
"""

from __future__ import annotations

from typing import Any

from ext_proc.scheduling.api import Choice, Request
from ext_proc.scheduling.scan import refusal

__all__ = ["CONTRACTS", "SOFT", "STRICT", "STRICT_PLUGIN", "strict_choice"]

STRICT, SOFT = "strict", "soft"
#: The contracts a service may name (``services[].session_affinity``).
CONTRACTS = (STRICT, SOFT)
#: The name a strict decision carries in :attr:`Choice.plugins` (a metrics label value).
STRICT_PLUGIN = "strict-affinity"

_new = tuple.__new__


def strict_choice(request: Request, profile: Any) -> Choice | None:
    """The strict contract's answer for ``request`` (whose ``pinned`` is not None), or None when the
    profile decides (the pin is gone, or a hard filter that repins turns it away: the session moves).

    Returns:
        ``Choice(pinned, "affinity", "strict-affinity")`` while the pin is pinnable and every hard
        filter keeps it, whatever its load; ``Choice(None, "no-memory", "<filter>+strict-affinity")``
        when a hard filter that does not repin turns it away (the request waits for its pin, or 429).
    """
    pinned = request.pinned
    if pinned not in request.pool.members:
        return None
    k = refusal(request, profile, pinned, hard_only=True)
    if k < 0:
        return _new(Choice, (pinned, "affinity", STRICT_PLUGIN))
    if profile.filters[k].repins:
        return None
    return _new(Choice, (None, "no-memory", f"{profile.label(profile.filter_bits[k])}+{STRICT_PLUGIN}"))
