"""What the picker is told: its routing table and process settings, from the config (pure).

The same objects configure the in-process picker (``inferlb serve``) and travel over CDS, in the
``inferlb_ext_proc`` cluster's metadata (:func:`picker_metadata`), to pickers that subscribe on
their own (``inferlb ext-proc --xds``). This is where the control plane's config meets the picker's
types: the only module that knows both.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ext_proc.prefix_events import PENDING_S
from ext_proc.scheduling import DEFAULT_STEPS, Profile, ProfileError, build_profile, import_plugins
from ext_proc.settings import METADATA_KEY, PickerSettings, to_wire
from ext_proc.view import DEFAULT_PROFILE, RequestClass, RoutingTable, ServiceRoute
from xds_server.config import Config, ConfigError, FieldProblem, ProfileStep, cluster_name


def routing_table(cfg: Config) -> RoutingTable:
    """The picker's routing table: services, their versions' clusters, header names."""
    return RoutingTable(
        version_header=cfg.headers.version,
        session_headers=tuple(cfg.headers.session),
        session_cookie=cfg.picker.session_cookie,
        body_max_bytes=cfg.picker.body_max_bytes,
        override_host_header=cfg.headers.override_host,
        cluster_header=cfg.headers.cluster,
        profiles=profiles(cfg),
        plugin_modules=tuple(cfg.picker.plugin_modules),
        spill_threshold=cfg.picker.spill_threshold,
        memory_margin=(cfg.picker.memory_margin if cfg.picker.memory_margin is not None
                       else cfg.engine.memory_margin),
        default_request_mib=cfg.engine.request_memory_mib,
        kv_mib_per_token=cfg.picker.kv_mib_per_token,
        default_max_tokens=cfg.picker.default_max_tokens,
        chars_per_token=cfg.picker.chars_per_token,
        request_memory_header=cfg.picker.request_memory_header,
        request_class_header=cfg.picker.request_class_header,
        request_classes={name: RequestClass(c.memory_mib, c.prompt_tokens, c.output_tokens)
                         for name, c in cfg.picker.request_classes.items()},
        prefix_messages=cfg.picker.prefix_messages,
        prefix_max_bytes=cfg.picker.prefix_max_bytes,
        prefix_cache_tokens=cfg.picker.prefix_cache_tokens,
        engine_block_size=cfg.picker.kv_events.block_size if cfg.picker.prefix_source == "kv_events" else 0,
        engine_tokenizer=cfg.picker.kv_events.tokenizer if cfg.picker.prefix_source == "kv_events" else None,
        engine_keys=cfg.picker.kv_events.keys if cfg.picker.prefix_source == "kv_events" else "sim",
        body_mode=cfg.picker.body_mode,
        protocol=cfg.picker.protocol,
        preallocated=frozenset(cluster_name(s.name, v.name) for s in cfg.services for v in s.versions
                               if cfg.preallocates(v)),
        per_request=frozenset(cluster_name(s.name, v.name) for s in cfg.services for v in s.versions
                              if not cfg.preallocates(v)),
        services=tuple(
            ServiceRoute(
                name=s.name,
                hosts=tuple(s.hosts),
                default_version=s.default,
                clusters=MappingProxyType({v.name: cluster_name(s.name, v.name) for v in s.versions}),
                mixes=s.mixes,
                models=frozenset(m.encode() for m in s.models),
                unavailable=frozenset(s.unavailable_versions),
                profile=s.picker_profile or DEFAULT_PROFILE,
                affinity=s.session_affinity,
            )
            for s in cfg.services
        ),
    )


def profiles(cfg: Config) -> dict[str, Profile]:
    """The picker's scheduling profiles: ``picker.profile`` as the default one (null: the built-in
    default, :data:`ext_proc.scheduling.DEFAULT_STEPS`) and ``picker.profiles`` by name, after
    importing ``picker.plugin_modules``.

    Raises:
        ConfigError: :func:`profile_problems` found a problem.
    """
    problems = profile_problems(cfg)
    if problems:
        raise ConfigError("\n".join(f"{'.'.join(map(str, p.loc))}: {p}" for p in problems))
    p = cfg.picker
    out = {DEFAULT_PROFILE: build_profile(_steps(p.profile) if p.profile is not None else DEFAULT_STEPS)}
    out.update((name, build_profile(_steps(steps), name)) for name, steps in p.profiles.items())
    return out


def _steps(steps: tuple[ProfileStep, ...]) -> list[dict[str, Any]]:
    return [step.model_dump() for step in steps]


def profile_problems(cfg: Config) -> list[FieldProblem]:
    """What is wrong with the picker's plugins: a ``picker.plugin_modules`` entry that cannot be
    imported; a profile step naming an unknown plugin, a weight on a plugin that is no scorer, params
    its plugin's model refuses, a plugin twice, not exactly one picker. Each problem names its field
    (``picker.profile[2].params.load_factor``). A check for :func:`xds_server.config.parse_config`."""
    p = cfg.picker
    for i, module in enumerate(p.plugin_modules):
        try:
            import_plugins([module])
        except ValueError as err:
            return [FieldProblem(("picker", "plugin_modules", i), str(err))]
    found = []
    named = [(("picker", "profile"), p.profile), *((("picker", "profiles", name), steps)
                                                   for name, steps in p.profiles.items())]
    for loc, steps in named:
        if steps is None:
            continue
        try:
            build_profile(_steps(steps), loc[-1])
        except ProfileError as err:
            found += [FieldProblem((*loc, *where), message) for where, message in err.problems]
    return found


#: The checks the app adds to the config model's own (:func:`xds_server.config.load_config`'s ``checks``).
CONFIG_CHECKS = (profile_problems,)


def picker_settings(cfg: Config) -> PickerSettings:
    """The picker's process settings (in-flight expiry, session table, admission) from the config."""
    p = cfg.picker
    return PickerSettings(
        inflight_expiry_s=p.inflight_expiry_s or cfg.envoy.route_timeout_s + 10,
        session_ttl_s=p.session_ttl_s,
        max_sessions=p.max_sessions,
        admission=p.admission,
        max_queue=p.max_queue,
        queue_timeout_s=p.queue_timeout_s,
        retry_after_s=p.retry_after_s,
        memory_queue=p.memory_queue,
        pin_move_after=p.pin_move_after,
        failure_hold_s=p.failure_hold_s,
        cost_forget=p.cost_forget,
        cost_min_samples=p.cost_min_samples,
        shared_view=p.shared_view,
        shared_view_interval_s=p.shared_view_interval_s,
        shared_view_expiry_s=p.shared_view_expiry_s,
        prefix_source=p.prefix_source,
        kv_events_endpoint=p.kv_events.endpoint,
        kv_events_topic=p.kv_events.topic,
        pending_s=PENDING_S if p.kv_events.pending_s is None else p.kv_events.pending_s,
    )


def picker_metadata(cfg: Config) -> dict[str, dict]:
    """The ``filter_metadata`` of the picker's cluster: ``{"inferlb.picker": routing table + settings}``."""
    return {METADATA_KEY: to_wire(routing_table(cfg), picker_settings(cfg))}
