"""The scenarios: one classic load-balancing trap each (nodes, traffic, events). Pure data.

All times are wall-clock seconds on the benchmark machine. The simulated backends run
time-compressed (``time_scale``: every model time x ``time_scale``), and inferlb's control loop is
compressed the same way (see :data:`CONTROL`), so a scenario of tens of seconds plays what would be
minutes in the field.

Engines (:mod:`sim.engines`): the LLM scenarios run ``llm`` nodes (continuous batching, Llama-3.1-8B
on BLIS's fitted step times: an A100 decode step is 16.4 ms plus 18 µs per running request, a
prompt token costs 48 µs of prefill); ``uneven`` and ``multi_gateway`` tell the seed's per-request
memory trap and run ``job`` nodes (memory per request, OOM). The loads were kept from the
per-request engine: on ``llm`` nodes they do not saturate decoding (a node runs a few to a few tens
of requests, far under its 256 slots), but prefill does when the prefix cache misses: a session
turn of ~1 000 prompt tokens costs ~50 ms of prefill on a miss and ~5 ms on a hit, so at 20 requests
per second per node misses alone fill most of a node's time and every running request's decode
steps stretch with them. That is the trade the LLM scenarios measure.

The workload is OpenAI chat traffic: most requests streamed, prompts made of a system prompt
(shared by a tenant's requests, or by the whole app) and the conversation so far, which the client
resends every turn as chat apps do, so the backends' prefix caches see real shared prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from sim.engines.hardware import (
    ACTIVATION_RESERVE_GIB,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MODEL,
    GIB,
    GPU_CLASSES,
    MODELS,
)

#: inferlb's control loop in every scenario: Prometheus scrape interval and the inferlb config's
#: ``prometheus`` and ``engine`` settings (s). The field defaults are 5-15 s scrapes, a 60 s window,
#: 5 s rounds and 15 s staleness; here everything runs about 10x faster, like the backends.
CONTROL: Mapping[str, float] = MappingProxyType({
    "scrape_interval_s": 0.5,
    "window_s": 2.0,
    "interval_s": 0.5,
    "query_timeout_s": 1.0,
    "stale_after_s": 2.0,
    "hysteresis": 0.05,
})

#: GPU memory (MiB) of a node with 24 GB free for requests next to the sim's 14 GB of model weights.
GPU_24GB_FREE_MIB = 14336.0 + 24576.0


def llm_memory_mib(kv_tokens: int, model: str = DEFAULT_MODEL) -> float:
    """GPU memory (MiB) that leaves an ``llm`` node running ``model`` a KV cache of about
    ``kv_tokens`` tokens (:func:`sim.engines.hardware.kv_cache_blocks` solved for the memory)."""
    m = MODELS[model]
    need_gib = m.weights_gib + ACTIVATION_RESERVE_GIB + kv_tokens * m.kv_bytes_per_token / GIB
    return need_gib * 1024 / DEFAULT_GPU_MEMORY_UTILIZATION


#: An llm node whose KV cache holds about 22 000 tokens: ten of the shared_prefix scenario's 2 000-token
#: system prompts (the requests of one tenant share its blocks) and the few requests running beside them.
SHARED_PREFIX_KV_MIB = llm_memory_mib(22_000)

#: Options every simulated backend of the benchmark runs with: sessions carry their real history in
#: the prompt (no virtual session history).
SIM_ARGS: tuple[str, ...] = ("--session-history-tokens", "0")


@dataclass(frozen=True)
class Node:
    """One simulated backend.

    ``gpu_class``: the sim's class (``a100``, ``a10``, ...). ``gpu_memory_mib``: total GPU memory (None =
    the class default). ``present``: False for a node that an ``add`` event brings in. ``tier``:
    ``edge`` or ``cloud`` (inferlb's endpoint tier: EDS priority 0 or 1; the baselines see one flat
    pool). ``engine``: the sim's engine kind (``llm`` or ``job``). ``max_concurrency``: the
    ``max_concurrency`` inferlb's config states for its endpoint (None: inferlb's default, 8).
    """

    gpu_class: str = "a100"
    version: str = "v1"
    gpu_memory_mib: float | None = None
    present: bool = True
    tier: Literal["edge", "cloud"] = "edge"
    engine: Literal["llm", "job"] = "llm"
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Event:
    """Something that happens to one node during the measured window.

    ``at``: position in the measured window, 0-1 (0 = end of warm-up, 1 = end of the trace).
    ``kind``: ``fault`` (POST ``patch`` to the sim's ``/sim/fault``), ``add`` (the node joins
    discovery and becomes ready), ``remove`` (the node leaves discovery and its process is stopped).
    """

    at: float
    kind: Literal["fault", "add", "remove"]
    node: int
    patch: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Traffic:
    """The request mix (see :mod:`bench.quality.trace`).

    ``rps``: mean requests per second. ``anon_share``: share of requests without a session (single
    requests). Sessions have ``turns`` (min, max) turns, ``think_s`` mean seconds between them.
    ``versions``: (version or None = no header, share) per session. ``memory_mib``: (MiB or None =
    no ``x-sim-memory-mib`` header, share) per request. ``burst``: (period s, burst s, rate factor):
    arrivals run ``factor`` times faster for ``burst s`` of every ``period s`` (mean rate kept).

    Prompts: ``system_tokens`` of system prompt, one per tenant when ``tenants`` > 0 (each session
    or single request belongs to a tenant drawn uniformly), else one for the whole app (0 = none);
    each turn adds a user message of ``user_tokens`` (the first one, of a session or a single request,
    ``opening_tokens`` when > 0: the conversation's own context, such as the document or code a chat
    opens with, which no other conversation shares) and, when ``resend``, the prompt carries every
    earlier turn of the session (its user messages and ``max_tokens``-token replies).
    ``session_header``: sessions send ``x-session-id`` (False: only the prompt tells them apart).
    ``stream_share``: requests streamed (SSE, with the usage chunk). ``max_tokens``: output tokens.
    """

    rps: float
    anon_share: float = 0.0
    turns: tuple[int, int] = (4, 12)
    think_s: float = 0.6
    versions: tuple[tuple[str | None, float], ...] = (("v1", 1.0),)
    memory_mib: tuple[tuple[float | None, float], ...] = ((None, 1.0),)
    burst: tuple[float, float, float] | None = None
    max_tokens: int = 16
    stream_share: float = 0.9
    system_tokens: int = 300
    tenants: int = 0
    user_tokens: int = 40
    opening_tokens: int = 0
    resend: bool = True
    session_header: bool = True


@dataclass(frozen=True)
class Scenario:
    """One trap. ``warmup_s`` + ``measure_s`` (full) or ``quick_warmup_s`` + ``quick_measure_s``
    (``--quick``) make the trace; only requests sent after the warm-up count. ``timeout_s``: the
    client's per-request timeout (a longer request is a timeout error). ``engine``: inferlb
    ``engine`` settings for this scenario (on top of :data:`CONTROL`). ``gateways``: Envoy + picker
    pairs the traffic is split over (> 1: the scenario runs the multi-gateway policies,
    :data:`bench.quality.policies.GATEWAY_POLICIES`, instead of the usual ones). ``envoy``: inferlb
    ``envoy`` settings for this scenario."""

    name: str
    title: str
    trap: str
    nodes: tuple[Node, ...]
    traffic: Traffic
    time_scale: float = 0.5
    warmup_s: float = 8.0
    measure_s: float = 30.0
    quick_warmup_s: float = 1.0
    quick_measure_s: float = 2.0
    timeout_s: float = 2.0
    events: tuple[Event, ...] = ()
    engine: Mapping[str, Any] = field(default_factory=dict)
    gateways: int = 1
    envoy: Mapping[str, Any] = field(default_factory=dict)

    def durations(self, quick: bool) -> tuple[float, float]:
        """``(warmup_s, measure_s)`` for the mode."""
        return (self.quick_warmup_s, self.quick_measure_s) if quick else (self.warmup_s, self.measure_s)

    @property
    def versions(self) -> tuple[str, ...]:
        """The model versions the nodes serve, sorted."""
        return tuple(sorted({n.version for n in self.nodes}))

    @property
    def default_version(self) -> str:
        """The version a request without a version header should get (the first one)."""
        return self.versions[0]


def _long_tail_episodes(node: int, p: float, spans: tuple[tuple[float, float], ...]) -> tuple[Event, ...]:
    out: list[Event] = []
    for start, end in spans:
        out += [Event(start, "fault", node, {"long_tail": p}), Event(end, "fault", node, {"long_tail": 0.0})]
    return tuple(out)


SCENARIOS: Mapping[str, Scenario] = MappingProxyType({s.name: s for s in (
    Scenario(
        name="uneven",
        title="Uneven request weight",
        trap="small (8 GB) and large (18 GB) requests on GPUs with 24 GB free: a policy blind to "
             "memory puts a large request next to another and the GPU runs out of memory (HTTP 500 OOM)",
        nodes=tuple(Node("a10", engine="job", gpu_memory_mib=GPU_24GB_FREE_MIB) for _ in range(4)),
        traffic=Traffic(rps=50.0, anon_share=0.2, memory_mib=((8192.0, 0.7), (18432.0, 0.3))),
        time_scale=0.25,
        engine={"request_memory_mib": 8192.0},
    ),
    Scenario(
        name="sessions",
        title="Multi-turn sessions",
        trap="a chat's next turn lands on a node without its KV cache and pays the prefill again",
        nodes=tuple(Node("a100") for _ in range(4)),
        traffic=Traffic(rps=80.0, turns=(6, 16), think_s=0.5),
    ),
    Scenario(
        name="long_tail",
        title="Long-tail node",
        trap="one node intermittently answers 10x slower (the sim's long_tail fault on half its "
             "requests); policies that keep feeding it raise mean and p95 latency and time out",
        nodes=tuple(Node("a100") for _ in range(4)),
        traffic=Traffic(rps=70.0, anon_share=0.2),
        events=_long_tail_episodes(0, 0.5, ((0.0, 0.4), (0.55, 0.95))),
        timeout_s=1.0,
    ),
    Scenario(
        name="scaling",
        title="Elastic scaling",
        trap="a 5th node joins mid-run and later one of the first four leaves: a policy that rehashes "
             "everything moves every session's KV cache; one that keeps sending to a gone node errors",
        nodes=(*(Node("a100") for _ in range(4)), Node("a100", present=False)),
        traffic=Traffic(rps=70.0, turns=(20, 40), think_s=0.5),
        warmup_s=8.0,
        measure_s=36.0,
        quick_warmup_s=2.1,  # > stale_after_s: inferlb must have excluded the node yet to join
        quick_measure_s=1.6,
        events=(Event(0.3, "add", 4), Event(0.65, "remove", 1)),
    ),
    Scenario(
        name="versions",
        title="Model versions",
        trap="v1 and v2 of a model serve side by side (a rolling upgrade); a client that asked for "
             "one version must never get the other",
        nodes=(Node("a100", "v1"), Node("a100", "v1"), Node("a100", "v2"), Node("a100", "v2")),
        traffic=Traffic(rps=70.0, anon_share=0.2, versions=(("v1", 0.45), ("v2", 0.45), (None, 0.1))),
    ),
    Scenario(
        name="heterogeneous",
        title="Heterogeneous GPUs and bursts",
        trap="A100- and A10-class nodes (an A10 decodes 2x and prefills 2.9x slower) under bursty arrivals: "
             "equal shares overload the A10s and the bursts queue behind them",
        nodes=(Node("a100"), Node("a100"), Node("a10"), Node("a10"), Node("a10")),
        traffic=Traffic(rps=60.0, anon_share=0.2, burst=(4.0, 1.0, 2.5)),
    ),
    Scenario(
        name="shared_prefix",
        title="Shared prefixes",
        trap="30 tenants, each with its own 2 000-token system prompt shared by all its requests, no session "
             "header; the four nodes' KV caches together hold every prefix but one node holds about a third "
             "of them: a router blind to the prompt misses the cache two times out of three and pays the "
             "whole prefill (96 ms of A100 time) each time",
        nodes=tuple(Node("a100", gpu_memory_mib=SHARED_PREFIX_KV_MIB) for _ in range(4)),
        traffic=Traffic(rps=40.0, anon_share=1.0, system_tokens=2000, tenants=30, user_tokens=50, resend=False,
                        session_header=False),
    ),
    Scenario(
        name="chat_resend",
        title="Chat clients that resend the conversation",
        trap="OpenAI-style clients resend the whole conversation every turn and send no session header (most "
             "real apps); each conversation opens with its own 1 000-token context (the document or code it is "
             "about) and grows by an 80-token question and a 64-token reply a turn, so its own history is most "
             "of every prompt beside the app's 200-token system prompt: only the prompt tells where its KV cache "
             "is, and a turn sent to a node that has not seen the conversation for a few turns prefills all it "
             "missed there (the whole conversation on a first visit: 61-190 ms of A100 time at 1 300-4 000 "
             "tokens)",
        # inferlb configured for vLLM-like engines: an endpoint runs as many requests as vLLM's max_num_seqs (the
        # sim's batch); with inferlb's default of 8 the picker's admission counted the cluster full at 32 requests
        # in flight (about 43 here on average: 57.8 req/s x 0.74 s) and answered 16 % of the requests 429.
        nodes=tuple(Node("a100", max_concurrency=GPU_CLASSES["a100"].max_num_seqs) for _ in range(4)),
        # Turns as KubeAI's prefix-aware benchmark picks its ShareGPT conversations (>= 16 messages). The nodes
        # stay below saturation under every policy: no error or timeout on the real path (commit 9ec0de1), TTFT
        # p99 at most 121 ms of wall time in the lab mirror (ring_hash_bounded).
        traffic=Traffic(rps=60.0, turns=(8, 20), think_s=0.5, system_tokens=200, opening_tokens=1000,
                        user_tokens=80, max_tokens=64, session_header=False),
    ),
    Scenario(
        name="multi_gateway",
        title="Three gateways, one pool",
        trap="three Envoys (one per zone), each with its own picker, share four GPUs: a picker that sees only "
             "its own Envoy's requests bounds loads, concurrency and memory on a third of the load, so "
             "together they send up to three times what an endpoint should take (the uneven mix: OOMs)",
        nodes=tuple(Node("a10", engine="job", gpu_memory_mib=GPU_24GB_FREE_MIB) for _ in range(4)),
        traffic=Traffic(rps=50.0, anon_share=0.2, memory_mib=((8192.0, 0.7), (18432.0, 0.3))),
        time_scale=0.25,
        engine={"request_memory_mib": 8192.0},
        # No retries, as the baselines: a retried OOM (HTTP 500) would mark its endpoint as failing in
        # the picker and hide the OOMs this scenario counts.
        envoy={"retries": 0},
        gateways=3,
    ),
    Scenario(
        name="edge_cloud",
        title="Edge nodes that spill to the cloud",
        trap="three edge nodes (A10-class llm engines: half an A100's decode speed, a third of its prefill) should "
             "take the calm traffic; bursts at 5x the rate need the two cloud nodes too: a flat pool sends the "
             "cloud its share all the time and overloads the slower edge; a health-only failover (Envoy's "
             "priority levels) keeps everything on the edge, where the bursts queue behind each other's "
             "prefills and time out, since an engine that is merely slow never fails a health check",
        nodes=(*(Node("a10") for _ in range(3)), Node("a100", tier="cloud"), Node("a100", tier="cloud")),
        traffic=Traffic(rps=24.0, anon_share=0.7, turns=(2, 4), burst=(6.0, 1.5, 5.0)),
    ),
)})

SCENARIO_NAMES: tuple[str, ...] = tuple(SCENARIOS)
