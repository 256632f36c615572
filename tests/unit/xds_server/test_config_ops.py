"""The operations-related config: TLS sections, admin token, Envoy resilience knobs and what they become."""

from __future__ import annotations

import pytest

from tests.support.factories import config, service, version
from xds_server.config import ConfigError, TlsConfig
from xds_server.resources.build import build_snapshot
from xds_server.snapshot import CLUSTER_TYPE
from xds_server.tls import server_credentials

SERVICES = [service("chat", [version("v1", 2)])]


@pytest.mark.parametrize("sections,needle", [
    ({"tls": {"cert": "c.pem", "key": "k.pem"}}, "envoy.tls"),
    ({"tls": {"cert": "c.pem", "key": "k.pem", "require_client_cert": True}, "envoy": {"tls": {"ca": "ca"}}},
     "require_client_cert needs ca"),
    ({"tls": {"cert": "c", "key": "k", "ca": "ca", "require_client_cert": True}, "envoy": {"tls": {"ca": "ca"}}},
     "envoy.tls has no cert/key"),
    ({"envoy": {"tls": {"ca": "ca", "cert": "c"}}}, "cert and key go together"),
    ({"admin": {"token": "short"}}, "admin.token"),
    ({"envoy": {"retries": 11}}, "envoy.retries"),
    ({"envoy": {"outlier_detection": {"max_ejection_percent": 101}}}, "envoy.outlier_detection.max_ejection_percent"),
    ({"listen": {"max_xds_streams": 0}}, "listen.max_xds_streams"),
])
def test_bad_operations_config_is_refused_naming_the_field(sections, needle):
    with pytest.raises(ConfigError) as err:
        config(SERVICES, **sections)
    assert needle in str(err.value)


def test_unreadable_tls_file_names_the_field_and_path(tmp_path):
    (tmp_path / "k").write_text("key")
    with pytest.raises(ConfigError, match=r"tls\.cert: cannot read .*missing\.pem"):
        server_credentials(TlsConfig(cert=str(tmp_path / "missing.pem"), key=str(tmp_path / "k")))


def test_clusters_carry_outlier_detection_and_a_retry_budget():
    cfg = config(SERVICES, envoy={"outlier_detection": {"consecutive_gateway_failure": 2, "base_ejection_time_s": 3},
                                  "min_retry_concurrency": 7})
    from envoy.config.cluster.v3 import cluster_pb2

    c = cluster_pb2.Cluster()
    build_snapshot(cfg, [], "127.0.0.1:1").of(CLUSTER_TYPE)["chat-v1"].packed.Unpack(c)
    assert c.outlier_detection.consecutive_gateway_failure.value == 2
    assert c.outlier_detection.base_ejection_time.seconds == 3
    assert c.outlier_detection.max_ejection_percent.value == 50
    # A backend's own 5xx (a GPU out of memory) does not eject it; gateway failures do.
    assert c.outlier_detection.enforcing_consecutive_5xx.value == 0
    assert c.outlier_detection.enforcing_consecutive_gateway_failure.value == 100
    budget = c.circuit_breakers.thresholds[0].retry_budget
    assert budget.min_retry_concurrency.value == 7 and budget.budget_percent.value == 25


@pytest.mark.parametrize(("setting", "flat", "tiered"), [(None, 0, 100), (30, 30, 30), (0, 0, 0)])
def test_a_backends_own_5xx_ejects_by_default_only_where_envoy_spills_between_tiers_by_health(setting, flat, tiered):
    from envoy.config.cluster.v3 import cluster_pb2

    edge_cloud = version("e1", [{"address": "10.9.0.1:8000"}, {"address": "10.9.0.2:8000", "tier": "cloud"}])
    od = {} if setting is None else {"enforcing_consecutive_5xx": setting}
    cfg = config([service("chat", [version("v1", 2)], hosts=["chat"]), service("edge", [edge_cloud], hosts=["edge"])],
                 envoy={"outlier_detection": od})
    got = {}
    for name in ("chat-v1", "edge-e1"):
        c = cluster_pb2.Cluster()
        build_snapshot(cfg, [], "127.0.0.1:1").of(CLUSTER_TYPE)[name].packed.Unpack(c)
        got[name] = c.outlier_detection.enforcing_consecutive_5xx.value
    assert got == {"chat-v1": flat, "edge-e1": tiered}


def test_ext_proc_cluster_dials_the_picker_over_tls_when_configured():
    cfg = config(SERVICES, tls={"cert": "c", "key": "k"}, envoy={"tls": {"ca": "/etc/ca.pem", "server_name": "lb"}})
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.extensions.transport_sockets.tls.v3 import tls_pb2

    c = cluster_pb2.Cluster()
    build_snapshot(cfg, [], "127.0.0.1:1").of(CLUSTER_TYPE)["inferlb_ext_proc"].packed.Unpack(c)
    ctx = tls_pb2.UpstreamTlsContext()
    c.transport_socket.typed_config.Unpack(ctx)
    assert ctx.sni == "lb" and ctx.common_tls_context.validation_context.trusted_ca.filename == "/etc/ca.pem"
    assert ctx.common_tls_context.alpn_protocols == ["h2"] and not ctx.common_tls_context.tls_certificates


def test_ext_proc_cluster_resolves_a_dns_name_to_every_replica():
    from envoy.config.cluster.v3 import cluster_pb2

    for address, kind in (("inferlb-headless.inference.svc.cluster.local:18080", cluster_pb2.Cluster.STRICT_DNS),
                          ("10.0.0.9:18080", cluster_pb2.Cluster.STATIC)):
        cfg = config(SERVICES, envoy={"ext_proc_address": address})
        c = cluster_pb2.Cluster()
        build_snapshot(cfg, [], cfg.envoy.ext_proc_address).of(CLUSTER_TYPE)["inferlb_ext_proc"].packed.Unpack(c)
        assert c.type == kind
