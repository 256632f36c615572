"""The plugin contract of the per-request scheduler: filters, scorers and one picker over one request.

The shape of the Gateway API Inference Extension's endpoint picker (llm-d's router, its
``pkg/epp/scheduling``) and of this project's slow loop (:mod:`xds_server.engine.plugin`): per
request, a **scheduling profile** (:class:`ext_proc.scheduling.profile.Profile`) runs

- **filters**: each keeps or turns away each endpoint of the cluster;
- **scorers**: each gives each endpoint a score in [0, 1], times its weight in the profile, summed;
- **one picker**: chooses the endpoint from the endpoints the filters keep, by their scores (and,
  for :mod:`~ext_proc.scheduling.plugins.ring_affinity`, by the request's affinity key first).

Every plugin is an object built once per profile from its parameters (a frozen pydantic model, the
one place for its defaults) and is pure: per request it reads a :class:`Request` and answers, never
keeps state, never does I/O. A filter or scorer first *prepares* for the request (``prepare``): it
reads what it needs from the request once and returns the per-endpoint rule, or None when it has
nothing to say about this request (a memory filter for a request that needs no memory, a failure
filter while nothing fails), which then costs nothing per endpoint.

A prepared filter is a callable ``keep(endpoint) -> bool``. Two shapes are understood by the pickers
without a call per endpoint (the scan of a 64-endpoint pool runs once per request without a key):
:class:`Without` (turns away the endpoints of a container) and :class:`Floor` (turns away the
endpoints whose value is below a floor); both are callables too. A prepared scorer is a callable
``score(endpoints) -> [score, ...]`` (one call for the endpoints a picker compares; each score in
[0, 1], 1 = best), or a :class:`LoadPerShare` (the share-weighted least-load score, computed inline).

A filter is **hard** (an endpoint it turns away is never chosen by this run of the profile:
failing connections, memory) or **soft** (a preference of affinity: when it turns away every
endpoint, the picker chooses among those the hard filters keep; the bounded loads). A filter says
what its refusal means for a session's pin (``outcome``): ``"spilled"`` (a passing state: the
request goes elsewhere, the pin moves only when it persists) or ``"memory"`` (the same, counted
apart), and whether it ``repins`` (the endpoint is unusable: the session moves at once).

Sources: Gateway API Inference Extension, ``pkg/epp/framework/interface/scheduling`` (Filter,
Scorer, Picker; ``MaxScorePicker``; the decision-tree filter's fallback on an empty result is what a
soft filter does here); Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads"
(SODA 2018), for the soft filter the default profile runs.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ext_proc.view import ClusterEndpoints

__all__ = [
    "INF", "OUTCOMES", "SCAN_MAX", "Check", "Choice", "Filter", "Floor", "LoadPerShare", "NoParams", "PluginParams",
    "Picker", "Request", "Score", "Scorer", "Stage", "Without",
]

INF = float("inf")

#: Pools of up to this many endpoints are scanned per request where a rule needs every endpoint (the
#: least loaded of a request without a key, the affinity slack's least load); larger pools are
#: sampled (the power of two choices) or left to the rules that need no scan.
SCAN_MAX = 64

#: What a choice means for the request's session and its counters (a metrics label value), the
#: contract between the pickers and request control (:func:`ext_proc.sessions.pin_after`):
#: ``affinity`` (the endpoint the request's key prefers took it), ``spilled`` (a soft filter turned
#: it away: the next one), ``memory`` (a hard filter that counts apart turned it away, or every
#: endpoint a soft filter kept was turned away), ``repinned`` (the session's pinned endpoint is gone
#: or unusable), ``least-loaded`` (no key: chosen by the scores), ``no-memory`` (no endpoint left:
#: queue or 429).
OUTCOMES = ("affinity", "spilled", "memory", "repinned", "least-loaded", "no-memory")


class PluginParams(BaseModel):
    """Base of every plugin's parameters: frozen, unknown keys refused (the error names them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PluginParams):
    """For plugins without parameters."""


class Request(NamedTuple):
    """One request of one cluster, as every plugin of a profile sees it (built once per request and
    per tier; a named tuple: ~0.4 µs to build, C-level attribute reads).

    Attributes:
        cluster: the cluster's name.
        pool: the cluster's pinnable endpoints of this tier (:class:`ext_proc.view.ClusterEndpoints`:
            ``endpoints``, ``ring``, ``members``, ``shares`` = EDS weight / sum, ``cumulative``,
            ``classes``, ``main_class``). Only healthy (or unknown-health) endpoints are in it.
        position: the affinity key's ring position (64-bit hash), None without a key.
        key: what the key is: ``"session"``, ``"prefix"`` or ``"none"``.
        pinned: the session's pinned endpoint (None: no session, or no pin yet).
        spin: without a key, a 64-bit hash of the request id (its two 32-bit halves are two
            independent draws); 0 with a key.
        work: the request's predicted work (> 0; 1 = a typical request of the cluster's main class).
        need_mib: its GPU memory need with the admission margin (MiB; 0: admitted everywhere).
        loads: ``{endpoint: work in flight}`` (missing = 0), this tier's and the others'.
        total: this tier's work in flight (the sum of ``loads`` over ``pool.endpoints``).
        free_mib: ``{endpoint: estimated free GPU memory, MiB}`` (missing = unknown), or None when
            nothing is known or the request needs none.
        failed: endpoints whose connections failed lately (``e in failed``).
        prompt_tokens: the prompt's tokens (None: unknown).
        costs: the request cost model (:class:`ext_proc.costmodel.CostModel`), None without one.
    """

    cluster: str
    pool: ClusterEndpoints
    position: int | None
    key: str
    pinned: str | None
    spin: int
    work: float
    need_mib: float
    loads: Mapping[str, float]
    total: float
    free_mib: Mapping[str, float] | None
    failed: Container[str]
    prompt_tokens: float | None
    costs: Any


class Without(NamedTuple):
    """A prepared filter that turns away the endpoints in ``endpoints`` (a container)."""

    endpoints: Container[str]

    def __call__(self, endpoint: str) -> bool:
        """True when ``endpoint`` is kept."""
        return endpoint not in self.endpoints


class Floor(NamedTuple):
    """A prepared filter that turns away an endpoint whose ``values`` entry is below ``floor``
    (an endpoint without an entry is kept: unknown)."""

    values: Mapping[str, float]
    floor: float

    def __call__(self, endpoint: str) -> bool:
        """True when ``endpoint`` is kept."""
        return self.values.get(endpoint, INF) >= self.floor


class LoadPerShare(NamedTuple):
    """A prepared scorer: ``1 / (1 + load / share)`` per endpoint (1 idle; lower as its work in flight
    per share of the cluster's weight grows; ``loads`` missing = 0)."""

    loads: Mapping[str, float]
    shares: Mapping[str, float]

    def __call__(self, endpoints: Sequence[str]) -> list[float]:
        """The scores of ``endpoints``, in order."""
        get, shares = self.loads.get, self.shares
        return [1.0 / (1.0 + get(e, 0.0) / shares[e]) for e in endpoints]


#: A prepared filter: ``keep(endpoint) -> bool``.
Check = Callable[[str], bool]
#: A prepared scorer: ``score(endpoints) -> [score in [0, 1], ...]``.
Score = Callable[[Sequence[str]], Sequence[float]]


@runtime_checkable
class Filter(Protocol):
    """A filter plugin (an instance per profile, built with its parameters).

    Class attributes: ``name`` (its registry name), ``Params`` (its parameter model), ``soft``,
    ``outcome`` (``"spilled"`` or ``"memory"``) and ``repins`` (see the module
    docstring)."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]
    soft: ClassVar[bool]
    outcome: ClassVar[Literal["spilled", "memory"]]
    repins: ClassVar[bool]

    def prepare(self, request: Request) -> Check | None:
        """The rule for this request (``keep(endpoint) -> bool``), None: keeps every endpoint."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """A scorer plugin; its weight comes from the profile (``default_weight`` when none is given)."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]
    default_weight: ClassVar[float]

    def prepare(self, request: Request) -> Score | None:
        """The scores for this request (``score(endpoints)``), None: every endpoint alike."""
        ...


class Stage(NamedTuple):
    """A profile prepared for one request, as its picker gets it.

    Attributes:
        checks: each filter's prepared check, aligned with ``profile.filters`` (None: the filter keeps
            every endpoint for this request, and costs nothing per endpoint).
        profile: the :class:`~ext_proc.scheduling.profile.Profile` (its filters, their bits and
            flags, :meth:`~ext_proc.scheduling.profile.Profile.scores` to prepare the scorers when
            the picker needs them, :meth:`~ext_proc.scheduling.profile.Profile.label`).
        request: the request.
    """

    checks: list[Check | None]
    profile: Any
    request: Request


class Choice(NamedTuple):
    """A picker's answer: ``endpoint`` (None: none left), ``outcome`` (one of :data:`OUTCOMES`) and
    ``plugins`` (the names of the plugins that decided it, joined with ``+``: a metrics label)."""

    endpoint: str | None
    outcome: str
    plugins: str


@runtime_checkable
class Picker(Protocol):
    """The picker plugin of a profile: chooses one endpoint of ``request.pool`` from a prepared
    :class:`Stage`."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]

    def pick(self, request: Request, stage: Stage) -> Choice:
        """The endpoint for ``request`` (None with outcome ``no-memory`` when none is left)."""
        ...
