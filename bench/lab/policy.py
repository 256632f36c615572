"""The policy lab's Policy protocol: what a routing policy is given and what it answers.

This module is the contract between the lab's harness (:mod:`bench.lab.harness`) and every policy
it compares (``bench/lab/policies/``, one module each: Envoy's, the peers' published algorithms,
the oracle, and inferlb's own decision code). It holds data types and the protocol only, so a
policy module needs nothing else of the lab. It is kept stable: a change here is a change to
every policy.

**What a policy is given** is what the real system it stands for gets, no more, each with the
real delay:

- **The request** (:class:`Request`) when it arrives: its headers as Envoy's ext_proc hands them
  (lower-case names, raw bytes: ``x-request-id``, ``:authority``, ``content-type``, a session
  header such as ``x-session-id``, a version header such as ``model-version``, a declared memory
  header), the OpenAI body's bytes (built on first use) or the parsed prompt (chat messages, their
  text and their token ids, as the engine's tokenizer makes them), and the output hint
  (``max_tokens``). Never the output length the engine will actually produce.
- **The cluster's endpoints** (:class:`Eds`): per cluster, each endpoint's EDS
  ``load_balancing_weight`` and health status as of the slow loop's last round (inferlb's weight
  engine fed with the engines' metrics as Prometheus scrapes and windows them), the windowed
  stats that round used (:class:`xds_server.metrics.stats.EndpointStats`, with their sample age),
  and the routes (model version -> cluster). Every policy sees the same EDS; a policy that stands
  for a system without EDS may ignore the weights, never the membership.
- **Progress of its own requests** (:class:`FirstToken`, :class:`Finished`) with the delay the
  real system learns of them (:attr:`Needs.completion_flush_s`): a proxy on the response path
  (Envoy's own load balancers, SGLang's router, Dynamo's frontend) sees the response as it ends
  (``0``); inferlb's picker learns of it from Envoy's access log, flushed every
  ``picker.access_log_flush_s``.
- **Metric samples as scraped** (:class:`Sample`) at the policy's own scrape interval
  (:attr:`Needs.scrape_interval_s`: llm-d's endpoint picker scrapes every model server itself),
  each carrying the time it was taken. The values are the names the engines expose (vLLM's
  ``vllm:`` metrics; the ``job`` engine's GPU memory).
- **KV events** (:class:`KvEvents`) for policies that consume them (:attr:`Needs.kv_events`:
  Dynamo's KV router, llm-d's precise prefix scorer), as the engines publish them, delayed by
  :attr:`Needs.kv_event_delay_s`.
- **An injected clock** (:attr:`Context.clock`, virtual seconds) and a seeded random generator
  (:attr:`Context.rng`): a policy never reads the wall clock nor a global random source, so the
  same seed gives the same run bit for bit.
- Only the ``oracle`` gets the engines themselves (:attr:`Needs.engines`, :attr:`Context.engines`:
  read-only, instant, perfect knowledge).

**What a policy answers** for each request (:meth:`Policy.decide`): :class:`Route` (an endpoint of
the request's cluster), :class:`Wait` (the policy holds the request in its own queue and answers it
later through :meth:`Policy.poll`), or :class:`Reject` (an immediate 429 or 503, the status and
``Retry-After`` the client sees). A routed request is sent to its endpoint at once (virtual time:
deciding costs nothing).

**Call order** (all on one thread, in virtual time, never re-entrant): :meth:`Policy.start` once;
:meth:`Policy.on_eds` once before the first request and after every slow-loop round (its stats are
new each round; :attr:`Eds.version` grows when a weight, a health or the membership changed); then,
in time order, :meth:`Policy.decide` per arriving request and the deliveries
(:meth:`Policy.on_progress`, :meth:`Policy.on_samples`, :meth:`Policy.on_kv_events`) as they fall
due. The harness calls :meth:`Policy.poll` after every delivery, after every ``decide`` that
answered :class:`Wait`, and at :meth:`Policy.next_wake_s` (a held request's timeout), and sends or
answers what it returns. With several gateways, every instance's :meth:`Policy.next_wake_s` is asked
after any instance was called (one can change another's state through :attr:`Context.shared`).
Before ``decide`` at time ``t``, everything due at or before ``t`` has been delivered. At the end of
a run :meth:`Policy.poll` is called once more with ``final=True``: a request still held then is
counted as an error.

A policy module exports one class implementing :class:`Policy` whose constructor takes keyword
parameters only (each with its default and its source in the docstring); the registry
(:mod:`bench.lab.policies`) names it. :class:`PolicyBase` gives the no-op defaults.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

import orjson

from xds_server.metrics.stats import EndpointStats

__all__ = [
    "CACHE_BLOCKS", "CACHE_BLOCK_SIZE", "GPU_FREE_MIB", "HELD", "KV_USAGE", "PREEMPTIONS", "PREFIX_HITS",
    "PREFIX_QUERIES", "RUNNING", "WAITING",
    "Answer", "Context", "Eds", "Endpoint", "Finished", "FirstToken", "KvEvents", "Message", "Needs", "Policy",
    "PolicyBase", "Progress", "Prompt", "Reject", "Request", "Route", "Sample", "Wait",
]

# --- metric names a Sample carries (the engines' own names, as a scrape of their /metrics gives them) ---
#: Requests in the running batch (vLLM V1 gauge).
RUNNING = "vllm:num_requests_running"
#: Requests waiting for a slot or KV blocks (vLLM V1 gauge).
WAITING = "vllm:num_requests_waiting"
#: Share of the KV cache's blocks in use, 0-1 (vLLM V1 gauge).
KV_USAGE = "vllm:kv_cache_usage_perc"
#: Prompt tokens looked up in the prefix cache, cumulative (vLLM V1 counter).
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
#: Prompt tokens found in the prefix cache, cumulative (vLLM V1 counter).
PREFIX_HITS = "vllm:prefix_cache_hits_total"
#: Requests preempted, cumulative (vLLM V1 counter).
PREEMPTIONS = "vllm:num_preemptions_total"
#: KV blocks of the engine's cache (the ``num_gpu_blocks`` label of vLLM's ``vllm:cache_config_info``).
CACHE_BLOCKS = "vllm:cache_config_info:num_gpu_blocks"
#: Tokens per KV block (the ``block_size`` label of ``vllm:cache_config_info``).
CACHE_BLOCK_SIZE = "vllm:cache_config_info:block_size"
#: Free GPU memory, MiB (NVIDIA DCGM exporter's gauge; the ``job`` engine's memory).
GPU_FREE_MIB = "DCGM_FI_DEV_FB_FREE"
#: Requests the engine holds (running + waiting) in the same sample as its free memory (the simulator's page).
HELD = "inferlb_sim_requests_held"


# --- the request ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)
class Message:
    """One chat message (or a completion's whole prompt, ``role`` None) with its token ids.

    Messages are shared between requests (a system prompt, a conversation's history), so their text
    and tokens are made once: a prompt is a tuple of messages, never a copy of their text.

    Attributes:
        role: ``system``, ``user`` or ``assistant``; None for a piece of a completion prompt.
        text: the message's content.
        tokens: its token ids, as the engines' tokenizer makes them (a tuple of ints; a prompt's
            ids are its messages' ids in order, with no template tokens between them).
    """

    role: str | None
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Prompt:
    """A request's prompt: chat messages in order, or a completion prompt's pieces (role None).

    Attributes:
        messages: the messages (a completion prompt: pieces with role None, their texts joined).

    The token ids, the text length and the OpenAI body are derived on first use and kept.
    """

    messages: tuple[Message, ...]

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        """Every token id of the prompt, messages in order (what the engine prefills)."""
        if len(self.messages) == 1:
            return self.messages[0].tokens
        out: list[int] = []
        for m in self.messages:
            out.extend(m.tokens)
        return tuple(out)

    @cached_property
    def tokens(self) -> int:
        """The prompt's length in tokens."""
        return sum(len(m.tokens) for m in self.messages)

    @property
    def chat(self) -> bool:
        """True for chat messages, False for a completion prompt."""
        return self.messages[0].role is not None

    @cached_property
    def text(self) -> str:
        """The prompt's text as a router that reads text sees it: the messages' contents joined
        (``role: content`` lines for chat, as a chat template would join them)."""
        if not self.chat:
            return "".join(m.text for m in self.messages)
        return "".join(f"{m.role}: {m.text}\n" for m in self.messages)


@dataclass(frozen=True, eq=False)
class Request:
    """One request as the router receives it.

    Attributes:
        id: unique in the run (the harness's key; also in ``headers["x-request-id"]``).
        arrival_s: when it arrived (virtual s).
        headers: lower-case header names -> raw value bytes, as Envoy's ext_proc sends them,
            pseudo-headers included (``:authority``, ``:path``, ``:method``); read-only.
        prompt: the prompt (messages, their text and token ids).
        max_tokens: the body's ``max_tokens`` (the output hint), None when the body names none.
        model: the body's ``model`` field (None: absent).
        user: the body's ``user`` field (a session key some clients send; None: absent).
        stream: the body's ``stream`` field.
        memory_mib: the declared GPU memory of a ``job`` request (also in its header), None otherwise.
    """

    id: int
    arrival_s: float
    headers: Mapping[str, bytes]
    prompt: Prompt
    max_tokens: int | None = None
    model: str | None = None
    user: str | None = None
    stream: bool = True
    memory_mib: float | None = None

    @cached_property
    def body(self) -> bytes:
        """The OpenAI request body (``/v1/chat/completions`` or ``/v1/completions``), JSON bytes,
        built on first use (a policy that reads only headers and tokens never pays for it)."""
        doc: dict[str, Any] = {}
        if self.model is not None:
            doc["model"] = self.model
        if self.prompt.chat:
            doc["messages"] = [{"role": m.role, "content": m.text} for m in self.prompt.messages]
        else:
            doc["prompt"] = self.prompt.text
        if self.max_tokens is not None:
            doc["max_tokens"] = self.max_tokens
        if self.user is not None:
            doc["user"] = self.user
        doc["stream"] = self.stream
        return orjson.dumps(doc)


# --- what the policy sees of the cluster ----------------------------------------------------------

class Endpoint(NamedTuple):
    """One endpoint of one cluster as EDS gives it.

    Attributes:
        address: ``"HOST:PORT"`` (unique in the lab).
        cluster: the cluster it belongs to.
        weight: its EDS ``load_balancing_weight`` (>= 1).
        health: ``HEALTHY``, ``UNHEALTHY`` or ``DRAINING`` (Envoy's health status).
        gpu_class: its GPU class (``a100``, ``h100``, ...).
        tier: ``edge`` or ``cloud`` (EDS priority 0 or 1).
        max_concurrency: the max concurrency the config gives it (requests).
        memory_mib: its GPU memory (MiB).
    """

    address: str
    cluster: str
    weight: int
    health: str
    gpu_class: str
    tier: str = "edge"
    max_concurrency: int = 0
    memory_mib: float = 0.0


@dataclass(frozen=True)
class Eds:
    """The slow loop's view of every cluster after one round.

    Attributes:
        version: increases by one per round that changed a weight, a health or the membership.
        at_s: when the round ran (virtual s).
        clusters: cluster name -> its endpoints (removed ones absent), sorted by address.
        routes: model version -> cluster name (the version header's or the body's ``model`` values).
        default_version: the version of a request that names none.
        stats: ``{address: EndpointStats}`` the round used (windowed over the scrapes, as
            Prometheus gives them; ``sample_age_s`` is their age at ``at_s``).
    """

    version: int
    at_s: float
    clusters: Mapping[str, tuple[Endpoint, ...]]
    routes: Mapping[str, str]
    default_version: str
    stats: Mapping[str, EndpointStats] = field(default_factory=lambda: MappingProxyType({}))

    def healthy(self, cluster: str) -> tuple[Endpoint, ...]:
        """The endpoints of ``cluster`` that may take new requests (HEALTHY), in address order."""
        return self._healthy.get(cluster, ())

    @cached_property
    def _healthy(self) -> dict[str, tuple[Endpoint, ...]]:
        """Each cluster's HEALTHY endpoints, found once per EDS (every proxy policy asks per request)."""
        return {c: tuple(e for e in eps if e.health == "HEALTHY") for c, eps in self.clusters.items()}

    def cluster_of(self, request: Request, version_header: str = "model-version") -> str | None:
        """The cluster of ``request``: its version header, else its body's ``model`` when that names
        a version, else the default version (a Gateway's header-matched routes). None for an
        unknown version."""
        raw = request.headers.get(version_header)
        if raw:
            return self.routes.get(raw.decode("utf-8", "replace"))
        if request.model is not None and request.model in self.routes:
            return self.routes[request.model]
        return self.routes.get(self.default_version)


# --- deliveries -----------------------------------------------------------------------------------

class FirstToken(NamedTuple):
    """A request's first output token left its endpoint (the end of its prefill).

    ``cached_tokens``: its prompt tokens the endpoint found in its prefix cache
    (``usage.prompt_tokens_details.cached_tokens``)."""

    request_id: int
    endpoint: str
    at_s: float
    cached_tokens: int


class Finished(NamedTuple):
    """A request ended at its endpoint, as the access log reports it.

    Attributes:
        request_id, endpoint: which request, where.
        at_s: when its last byte left the endpoint (virtual s).
        status: HTTP status (200; 500 for an engine failure such as an OOM).
        ttft_s: arrival at the endpoint to first token (s), None when it failed first.
        duration_s: arrival at the endpoint to its end (s).
        prompt_tokens, output_tokens, cached_tokens: its usage.
    """

    request_id: int
    endpoint: str
    at_s: float
    status: int
    ttft_s: float | None
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


Progress = FirstToken | Finished


class Sample(NamedTuple):
    """One scrape of one endpoint's metrics: ``values`` maps the engine's metric names (see
    :data:`RUNNING` and the other constants) to their values at ``taken_at_s``."""

    endpoint: str
    taken_at_s: float
    values: Mapping[str, float]


class KvEvents(NamedTuple):
    """KV-cache events one endpoint published (the engines' event values, in order: blocks stored,
    blocks removed, all blocks cleared, keyed by the block hashes the engine computes), at ``at_s``."""

    endpoint: str
    at_s: float
    events: Sequence[object]


# --- answers -------------------------------------------------------------------------------------

class Route(NamedTuple):
    """Send the request to ``endpoint`` (an address of its cluster, HEALTHY in the last EDS)."""

    endpoint: str


class Wait(NamedTuple):
    """The policy holds the request in its queue; it answers it later through :meth:`Policy.poll`."""


class Reject(NamedTuple):
    """Answer the request at once with ``status`` (429: overloaded, retry after ``retry_after_s``;
    503: cannot be served; 4xx: a bad request) and ``reason`` (a short label counted in the figures)."""

    status: int
    reason: str
    retry_after_s: int | None = None


Answer = Route | Wait | Reject


# --- what the policy is started with --------------------------------------------------------------

@dataclass(frozen=True)
class Needs:
    """What a policy consumes and with which delays (the attribute ``needs`` of each policy: ``kv_events``
    and ``engines`` are read before :meth:`Policy.start`, the delays after it, so a policy may set
    them from its :class:`Context`).

    Attributes:
        completion_flush_s: progress of its requests (:class:`FirstToken`, :class:`Finished`) is
            delivered in batches every this many s (an access log's ``buffer_flush_interval``); 0:
            as each happens (a proxy on the response path); None: never.
        completion_lag_s: added to each batch's delivery (the trip of the log to the policy, s).
        scrape_interval_s: the policy scrapes every endpoint's metrics itself this often (s; None:
            never). The first scrape is at a random phase drawn from the run's seed.
        kv_events: KV events are delivered (:meth:`Policy.on_kv_events`).
        kv_event_delay_s: how late they arrive (s; the event publisher's trip).
        engines: the policy reads the engines directly (:attr:`Context.engines`; the oracle only).
    """

    completion_flush_s: float | None = 0.0
    completion_lag_s: float = 0.0
    scrape_interval_s: float | None = None
    kv_events: bool = False
    kv_event_delay_s: float = 0.0
    engines: bool = False


@dataclass(frozen=True)
class Context:
    """What :meth:`Policy.start` gets.

    Attributes:
        clock: the virtual clock (s); the only time a policy may read.
        rng: a random generator seeded from the run's seed and the policy's name (the only random
            source a policy may use).
        block_size: the engines' KV block size (tokens).
        version_header: the header naming the model version.
        session_headers: the headers a session key comes in, in order.
        gateway: this instance's index when the scenario runs several gateways (0 otherwise), and
            ``gateways`` how many there are; each instance sees only its own requests' progress.
        engines: ``{address: engine}`` for a policy whose :attr:`Needs.engines` is set (read only:
            the oracle); empty for every other policy.
        config: inferlb's config for this cluster (:class:`xds_server.config.Config`: the one the
            slow loop runs with), for the ``inferlb`` policy; every other policy ignores it.
        shared: one dict per run, the same for every gateway's instance: what the real system shares
            between its gateways, keyed by the policy (``inferlb``: the control plane's load view,
            :mod:`bench.lab.loadview`); empty at the start of a run.
    """

    clock: Callable[[], float]
    rng: random.Random
    block_size: int = 16
    version_header: str = "model-version"
    session_headers: tuple[str, ...] = ("x-session-id",)
    gateway: int = 0
    gateways: int = 1
    engines: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    config: Any = None
    shared: dict[str, Any] = field(default_factory=dict)


# --- the protocol ---------------------------------------------------------------------------------

@runtime_checkable
class Policy(Protocol):
    """A routing policy in the lab (see the module docstring for what it gets and when).

    Attributes:
        name: the policy's name in the figures (``round_robin``, ``llm_d``, ``inferlb``, ...).
        needs: what it consumes (:class:`Needs`).
    """

    name: str
    needs: Needs

    def start(self, ctx: Context) -> None:
        """Called once before anything else."""
        ...

    def on_eds(self, eds: Eds) -> None:
        """The slow loop's EDS after a round (membership, weights, health, stats)."""
        ...

    def decide(self, request: Request) -> Answer:
        """Route, hold or reject ``request`` (now = ``ctx.clock()`` = ``request.arrival_s``).

        A :class:`Route` must name a HEALTHY endpoint of the request's cluster in the last EDS
        (the harness counts anything else as an error, ``bad-route``)."""
        ...

    def on_progress(self, events: Sequence[Progress]) -> None:
        """First tokens and completions of this policy's requests, oldest first (with the delay of
        :attr:`Needs.completion_flush_s`)."""
        ...

    def on_samples(self, samples: Sequence[Sample]) -> None:
        """One scrape round of every endpoint (with :attr:`Needs.scrape_interval_s`)."""
        ...

    def on_kv_events(self, events: Sequence[KvEvents]) -> None:
        """KV events of the endpoints, oldest first (with :attr:`Needs.kv_events`)."""
        ...

    def poll(self, final: bool = False) -> Sequence[tuple[Request, Answer]]:
        """Held requests answered now (:class:`Route` or :class:`Reject`; never :class:`Wait`),
        oldest first; ``final``: the run is over (anything still held stays unanswered)."""
        ...

    def next_wake_s(self) -> float | None:
        """When the policy next wants :meth:`poll` called without a delivery (a held request's
        timeout, virtual s), None when it holds nothing."""
        ...


class PolicyBase:
    """No-op defaults for the optional parts of :class:`Policy` (a policy overrides what it uses).

    ``self.ctx`` is the :class:`Context` and ``self.eds`` the last :class:`Eds` (None before the first).
    """

    name = "base"
    needs = Needs()

    def __init__(self) -> None:
        self.ctx: Context | None = None
        self.eds: Eds | None = None

    def start(self, ctx: Context) -> None:
        self.ctx = ctx

    def on_eds(self, eds: Eds) -> None:
        self.eds = eds

    def decide(self, request: Request) -> Answer:
        raise NotImplementedError

    def on_progress(self, events: Sequence[Progress]) -> None:
        return None

    def on_samples(self, samples: Sequence[Sample]) -> None:
        return None

    def on_kv_events(self, events: Sequence[KvEvents]) -> None:
        return None

    def poll(self, final: bool = False) -> Sequence[tuple[Request, Answer]]:
        return ()

    def next_wake_s(self) -> float | None:
        return None
