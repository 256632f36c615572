"""The policies compared, and the configs that make them (pure: data in, YAML-able dicts out).

Baselines are what a user would otherwise run: one Envoy with a static listener and one cluster
over every node of the service, its endpoints from a file (Envoy's filesystem EDS subscription, so
scaling events reach it the way a discovery system would), equal weights, no version awareness
(v1 and v2 nodes under one service, as during a rolling upgrade), no retries:

- ``round_robin``: ``lb_policy: ROUND_ROBIN``;
- ``least_request``: ``LEAST_REQUEST`` (power of two choices on active requests);
- ``ring_hash``: ``RING_HASH`` with the route hashing the session header (consistent hashing);
- ``ring_hash_bounded``: the same with Envoy's bounded loads (``hash_balance_factor``
  :data:`HASH_BALANCE_FACTOR`: no host takes more than 1.5x the average of outstanding requests;
  the hash moves on to the next host on the ring; Envoy docs, ``ConsistentHashingLbConfig``,
  after Mirrokni et al., "Consistent Hashing with Bounded Loads").

A request without the session header hashes to nothing, and Envoy's ring hash then picks a host at
random (Envoy docs, "Ring hash": "If no hash policy... or the hash policy yields no hash").

inferlb runs as ``inferlb serve`` (its own process) and configures its Envoy over ADS:

- ``inferlb_eds``: EDS weights and health from the weight engine, version routes on the version
  header, no ext_proc picker (``envoy.picker: false``);
- ``inferlb_full``: the same plus the ext_proc picker (version routing, session pinning).

A scenario with several gateways (``Scenario.gateways`` > 1) runs standalone pickers (``inferlb
ext-proc``), each next to its own Envoy (:mod:`inferlb.devstack.gateway`), against one ``inferlb
serve`` (:data:`GATEWAY_POLICIES`):

- ``inferlb_one_gateway``: one Envoy + picker takes all the traffic (the bound one gateway achieves);
- ``inferlb_shared_view``: the traffic split over ``gateways`` pairs, the pickers sharing one load
  view (``picker.shared_view``, the default);
- ``inferlb_no_shared_view``: the same with ``picker.shared_view: false`` (each picker on its own load);
- ``inferlb_shared_view_100ms``: the shared view with a change reported at most every 100 ms instead
  of 10 ms (what the view's staleness costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.quality.scenarios import CONTROL, Node, Scenario
from bench.quality.trace import MEMORY_HEADER
from inferlb.devstack.loadgen import MODEL_NAME

BASELINES: tuple[str, ...] = ("round_robin", "least_request", "ring_hash", "ring_hash_bounded")
INFERLB: tuple[str, ...] = ("inferlb_eds", "inferlb_full")
POLICIES: tuple[str, ...] = (*BASELINES, *INFERLB)
GATEWAY_POLICIES: tuple[str, ...] = ("inferlb_one_gateway", "inferlb_shared_view", "inferlb_no_shared_view",
                                     "inferlb_shared_view_100ms")
#: ``picker.shared_view_interval_s`` of ``inferlb_shared_view_100ms`` (s).
SLOW_VIEW_INTERVAL_S = 0.1
ALL_POLICIES: tuple[str, ...] = (*POLICIES, *GATEWAY_POLICIES)


def policies_for(scenario: Scenario) -> tuple[str, ...]:
    """The policies a scenario runs: :data:`GATEWAY_POLICIES` with several gateways, else :data:`POLICIES`."""
    return GATEWAY_POLICIES if scenario.gateways > 1 else POLICIES


def gateway_count(scenario: Scenario, policy: str) -> int:
    """Envoy + picker pairs of ``policy`` in ``scenario`` (1 for every single-gateway policy)."""
    return 1 if policy == "inferlb_one_gateway" or policy not in GATEWAY_POLICIES else scenario.gateways

BASELINE_CLUSTER = "chat"
SERVICE = "chat"
SESSION_HEADER = "x-session-id"
VERSION_HEADER = "model-version"
_LB_POLICY = {"round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST", "ring_hash": "RING_HASH",
              "ring_hash_bounded": "RING_HASH"}
#: Envoy's ``hash_balance_factor`` of ``ring_hash_bounded`` (percent of the average load, >= 100).
HASH_BALANCE_FACTOR = 150
_T = "type.googleapis.com/"


def _socket(address: str) -> dict:
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def eds_document(addresses: Sequence[str]) -> dict:
    """A filesystem-EDS file: one DiscoveryResponse with the baseline cluster's endpoints (weight 1 each)."""
    return {
        "version_info": "+".join(addresses) or "empty",
        "resources": [{
            "@type": _T + "envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": BASELINE_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in addresses]}],
        }],
    }


def baseline_bootstrap(policy: str, *, listener_port: int, admin_port: int, eds_path: str, eds_dir: str,
                       route_timeout_s: float) -> dict:
    """The whole static Envoy bootstrap of one baseline policy.

    ``eds_path``: the EDS file (see :func:`eds_document`) inside ``eds_dir``; Envoy reloads it when a
    new file is moved into ``eds_dir``. Raises ``KeyError`` for a policy that is not a baseline.
    """
    route: dict[str, Any] = {"cluster": BASELINE_CLUSTER, "timeout": f"{route_timeout_s:.3f}s"}
    cluster: dict[str, Any] = {
        "name": BASELINE_CLUSTER,
        "type": "EDS",
        "connect_timeout": "1s",
        "lb_policy": _LB_POLICY[policy],
        "eds_cluster_config": {"eds_config": {
            "path_config_source": {"path": eds_path, "watched_directory": {"path": eds_dir}},
            "resource_api_version": "V3",
        }},
    }
    if policy in ("ring_hash", "ring_hash_bounded"):
        route["hash_policy"] = [{"header": {"header_name": SESSION_HEADER}}]
        cluster["ring_hash_lb_config"] = {"minimum_ring_size": 1024}
    if policy == "ring_hash_bounded":
        cluster["common_lb_config"] = {"consistent_hashing_lb_config": {"hash_balance_factor": HASH_BALANCE_FACTOR}}
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "bench",
        "route_config": {"name": "bench", "virtual_hosts": [
            {"name": SERVICE, "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}]},
        ]},
        "http_filters": [{"name": "envoy.filters.http.router",
                          "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "node": {"id": f"bench-{policy}", "cluster": "bench"},
        "admin": {"address": _socket(f"127.0.0.1:{admin_port}")},
        "static_resources": {
            "listeners": [{
                "name": "bench",
                "address": _socket(f"127.0.0.1:{listener_port}"),
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": [cluster],
        },
    }


#: The picker settings inferlb runs with in the benchmarks (``inferlb bench quality`` and ``bench lab``): the
#: picker reads each request's memory need from the trace's header and the prompt from the OpenAI body
#: (prefix keys); a request no endpoint can hold waits, then gets a 429. The simulator reports its
#: requests held and its free GPU memory on one page, so one scrape.
PICKER: dict[str, Any] = {"request_memory_header": MEMORY_HEADER, "admission": True, "memory_queue": True,
                          "memory_count_in_sample": True, "body_max_bytes": 1 << 20}

#: The session-affinity contract of the benchmarks' service (``services[].session_affinity``; ``bench quality`` and
#: ``bench lab``): ``soft``. The simulated engines keep no conversation state: a session's clients resend its
#: history (or its turns stand alone), so a turn answered elsewhere loses only its KV cache, the contract
#: ``soft`` is for; the default ``strict`` is for backends that keep the conversation on the node.
SESSION_AFFINITY = "soft"


def inferlb_config(scenario: Scenario, addresses: Sequence[str], *, picker: bool, prometheus_url: str,
                   xds_port: int, admin_port: int, listener_port: int, route_timeout_s: float,
                   shared_view: bool = True, view_interval_s: float = 0.01) -> dict:
    """inferlb's YAML config (as a dict) for ``scenario`` with node ``i`` at ``addresses[i]``;
    ``shared_view``: the pickers' one load view (``picker.shared_view``), a change reported at most every
    ``view_interval_s``.

    Every node is listed, including one that joins later: inferlb has no discovery source yet, so a
    node counts as present while its metrics are fresh (an absent node's ``/metrics`` answers 503).
    """
    versions: dict[str, list[dict]] = {}
    for node, address in zip(scenario.nodes, addresses, strict=True):
        versions.setdefault(node.version, []).append(_endpoint(node, address))
    return {
        "listen": {"xds": f"127.0.0.1:{xds_port}", "ext_proc": "127.0.0.1:0", "admin": f"127.0.0.1:{admin_port}"},
        "envoy": {"listener": f"127.0.0.1:{listener_port}", "route_timeout_s": route_timeout_s, "picker": picker,
                  **scenario.envoy},
        "loop": {"interval_s": CONTROL["interval_s"], "timeout_s": CONTROL["query_timeout_s"]},
        "prometheus": {"url": prometheus_url, "window_s": CONTROL["window_s"]},
        "headers": {"version": VERSION_HEADER, "session": [SESSION_HEADER]},
        "engine": {"stale_after_s": CONTROL["stale_after_s"], "hysteresis": CONTROL["hysteresis"], **scenario.engine},
        "picker": {**PICKER, "shared_view": shared_view, "shared_view_interval_s": view_interval_s},
        "services": [{"name": SERVICE, "default_version": scenario.default_version, "models": [MODEL_NAME],
                      "session_affinity": SESSION_AFFINITY,
                      "versions": [{"name": v, "endpoints": eps, **_gpu_memory(scenario.nodes, v)}
                                   for v, eps in sorted(versions.items())]}],
    }


def _gpu_memory(nodes: Sequence[Node], version: str) -> dict[str, str]:
    """A version of job engines says its servers take GPU memory per request (the simulator speaks vLLM's
    metric names, and the ``vllm`` preset means a preallocated KV-cache pool, as the llm engines have)."""
    return {"gpu_memory": "per_request"} if all(n.engine == "job" for n in nodes if n.version == version) else {}


def _endpoint(node: Node, address: str) -> dict:
    out: dict[str, Any] = {"address": address, "gpu_class": node.gpu_class}
    if node.gpu_memory_mib is not None:
        out["gpu_memory_mib"] = node.gpu_memory_mib
    if node.max_concurrency is not None:
        out["max_concurrency"] = node.max_concurrency
    if node.tier != "edge":
        out["tier"] = node.tier
    return out
