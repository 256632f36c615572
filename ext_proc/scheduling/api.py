"""The plugin contract of the per-request scheduler: filters, scorers and one picker over one request.

The shape of the Gateway API Inference Extension's endpoint picker (llm-d's router, its
``pkg/epp/scheduling``) and of this project's slow loop (:mod:`xds_server.engine.plugin`): per
request, a **scheduling profile** (:class:`ext_proc.scheduling.profile.Profile`) runs

- **filters**: each keeps or turns away each endpoint of the cluster;
- **scorers**: each gives each endpoint a score in [0, 1], times its weight in the profile, summed;
- **one picker**: chooses the endpoint from the endpoints the filters keep, by their scores (and,
  for :mod:`~ext_proc.scheduling.plugins.ring_affinity`, by the request's affinity key first).

Every plugin is an object built once per profile from its parameters (a frozen pydantic model, the
one place for its defaults) and is pure: it reads a :class:`Request` and answers, never does I/O,
and keeps nothing that changes a decision.

- A filter's rule is ``keep(request, endpoint) -> bool``. Pickers ask it of the few endpoints an
  affinity walk visits. For the pickers that test every endpoint of a pool (the scan of a request
  without a key: once per request on up to 64 endpoints), a filter may also give the rule for one
  request at once, ``rule(request)``: a :class:`Without` (turns away the endpoints of a container)
  or a :class:`Floor` (turns away the endpoints whose value is below a floor), both tested inline
  without a call per endpoint, or any ``check(endpoint) -> bool``; None when it keeps every
  endpoint for this request. Without ``rule``, ``keep`` is asked per endpoint.
- A scorer's rule is ``score(request, endpoints) -> [score in [0, 1], ...]`` (1 = best). It may also
  give ``rule(request)``: a :class:`LoadPerShare` (computed inline), any ``score(endpoints)``, or
  None when every endpoint scores alike for this request (it then costs nothing).

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

from ext_proc.ring import key_hash

if TYPE_CHECKING:
    from ext_proc.view import ClusterEndpoints

__all__ = [
    "INF", "OUTCOMES", "SCAN_MAX", "Check", "Choice", "Filter", "Floor", "LoadPerShare", "NoParams", "PluginParams",
    "Picker", "Request", "Score", "Scorer", "Without", "spin",
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
        request_id: without a key, the request's ``x-request-id`` (b"" with a key or without one):
            :func:`spin` hashes it when a picker draws.
        work: the request's predicted work (> 0; 1 = a typical request of the cluster's main class).
        need_mib: its GPU memory need with the admission margin (MiB; 0: admitted everywhere).
        loads: ``{endpoint: work in flight}`` (missing = 0), this tier's and the others'.
        total: this tier's work in flight (the sum of ``loads`` over ``pool.endpoints``).
        free_mib: ``{endpoint: estimated free GPU memory, MiB}`` (missing = unknown), or None when
            nothing is known or the request needs none.
        failed: endpoints whose connections failed lately (``e in failed``).
        prompt_tokens: the prompt's tokens (None: unknown).
        costs: the request cost model (:class:`ext_proc.costmodel.CostModel`), None without one.
        blocks: the prompt's chained block keys (:func:`ext_proc.prefix_index.block_hashes`; empty:
            unknown).
        prefixes: the picker's prefix-cache index (:class:`ext_proc.prefix_index.PrefixIndex`), None
            without one.
        continued: for a conversation the index follows (``key`` ``"prefix"``, ``position`` its
            prefix key), the share of the prompt before its newest message (0-1,
            :attr:`ext_proc.picker.BodyFields.continued`); None otherwise.
    """

    cluster: str
    pool: ClusterEndpoints
    position: int | None
    key: str
    pinned: str | None
    request_id: bytes
    work: float
    need_mib: float
    loads: Mapping[str, float]
    total: float
    free_mib: Mapping[str, float] | None
    failed: Container[str]
    prompt_tokens: float | None
    costs: Any
    blocks: tuple[int, ...] = ()
    prefixes: Any = None
    continued: float | None = None


def spin(request: Request) -> int:
    """The request id's 64-bit hash (:func:`ext_proc.ring.key_hash`; its two 32-bit halves are two
    independent draws, the same in every process), 0 without one. Hashed only when a picker draws
    (ties, two choices): ~0.5 µs a request otherwise spent."""
    rid = request.request_id
    return key_hash(rid) if rid else 0


class Without(NamedTuple):
    """A filter's rule for one request: turns away the endpoints in ``endpoints`` (a container)."""

    endpoints: Container[str]

    def __call__(self, endpoint: str) -> bool:
        """True when ``endpoint`` is kept."""
        return endpoint not in self.endpoints


class Floor(NamedTuple):
    """A filter's rule for one request: turns away an endpoint whose ``values`` entry is below
    ``floor`` (an endpoint without an entry is kept: unknown)."""

    values: Mapping[str, float]
    floor: float

    def __call__(self, endpoint: str) -> bool:
        """True when ``endpoint`` is kept."""
        return self.values.get(endpoint, INF) >= self.floor


class LoadPerShare(NamedTuple):
    """A scorer's rule for one request: ``1 / (1 + load / share)`` per endpoint (1 idle; lower as its work in flight
    per share of the cluster's weight grows; ``loads`` missing = 0)."""

    loads: Mapping[str, float]
    shares: Mapping[str, float]

    def __call__(self, endpoints: Sequence[str]) -> list[float]:
        """The scores of ``endpoints``, in order."""
        get, shares = self.loads.get, self.shares
        return [1.0 / (1.0 + get(e, 0.0) / shares[e]) for e in endpoints]


#: A filter's rule for one request (``Filter.rule``): ``check(endpoint) -> bool``.
Check = Callable[[str], bool]
#: A scorer's rule for one request (``Scorer.rule``): ``score(endpoints) -> [score in [0, 1], ...]``.
Score = Callable[[Sequence[str]], Sequence[float]]


@runtime_checkable
class Filter(Protocol):
    """A filter plugin (an instance per profile, built with its parameters).

    Class attributes: ``name`` (its registry name), ``Params`` (its parameter model), ``soft``,
    ``outcome`` (``"spilled"`` or ``"memory"``) and ``repins`` (see the module docstring). Optional:
    ``rule(request) -> Check | None``, the same rule for one request at once."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]
    soft: ClassVar[bool]
    outcome: ClassVar[Literal["spilled", "memory"]]
    repins: ClassVar[bool]

    def keep(self, request: Request, endpoint: str) -> bool:
        """True when ``endpoint`` may take ``request``."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """A scorer plugin; its weight comes from the profile (``default_weight`` when none is given).
    Optional: ``rule(request) -> Score | None``, the same scores for one request."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]
    default_weight: ClassVar[float]

    def score(self, request: Request, endpoints: Sequence[str]) -> Sequence[float]:
        """Each endpoint's score for ``request``, in [0, 1] (1 = best), in order."""
        ...


class Choice(NamedTuple):
    """A picker's answer: ``endpoint`` (None: none left), ``outcome`` (one of :data:`OUTCOMES`) and
    ``plugins`` (the names of the plugins that decided it, joined with ``+``: a metrics label)."""

    endpoint: str | None
    outcome: str
    plugins: str


@runtime_checkable
class Picker(Protocol):
    """The picker plugin of a profile: chooses one endpoint of ``request.pool``, asking the profile's
    filters and scorers (:class:`~ext_proc.scheduling.profile.Profile`: ``filters``, ``keeps``,
    ``rules``, ``scores``, ``label``)."""

    name: ClassVar[str]
    Params: ClassVar[type[PluginParams]]

    def pick(self, request: Request, profile: Any) -> Choice:
        """The endpoint for ``request`` (None with outcome ``no-memory`` when none is left)."""
        ...
