"""The per-request picker: an Envoy ext_proc server choosing cluster and session endpoint.

Modules: ``ring`` (consistent hashing with bounded loads), ``view`` (routing rules and the
immutable endpoint view), ``picker`` (the pure decision), ``responses`` (ext_proc messages),
``telemetry`` (metrics, rate-limited error log), ``sampler`` (a sample of decisions for
operators), ``server`` (the grpc.aio transport).
Never imports ``xds_server``: endpoints arrive as Envoy ``ClusterLoadAssignment`` protos.
"""
