"""deploy/kubernetes: the manifests fit together, the ConfigMap is a valid inferlb config, and real
Envoy accepts the bootstrap that names both replicas."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from inferlb.devstack.stack import envoy_binary
from xds_server.config import parse_config, split_hostport
from xds_server.resources.bootstrap import render_bootstrap

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"


def docs() -> list[dict]:
    return [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def one(kind: str, name: str) -> dict:
    found = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def test_everything_lives_in_one_namespace():
    assert {d["metadata"]["namespace"] for d in docs()} == {"inference"}


def test_two_replicas_with_probes_on_health_and_readiness():
    dep = one("Deployment", "inferlb")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["serviceAccountName"] == one("ServiceAccount", "inferlb")["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for svc in ("inferlb", "inferlb-headless"):
        for p in one("Service", svc)["spec"]["ports"]:
            assert p["targetPort"] in ports
    assert one("Service", "inferlb-headless")["spec"]["clusterIP"] == "None"


def test_rbac_allows_exactly_what_discovery_reads():
    rules = one("Role", "inferlb-discovery")["rules"]
    grants = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants == {("discovery.k8s.io", "endpointslices"): {"list", "watch"}, ("", "pods"): {"list"}}
    binding = one("RoleBinding", "inferlb-discovery")
    assert binding["subjects"][0]["name"] == "inferlb" and binding["roleRef"]["name"] == "inferlb-discovery"


def test_the_configmap_is_a_valid_config_that_matches_the_manifests():
    cm = one("ConfigMap", "inferlb-config")
    cfg = parse_config(cm["data"]["inferlb.yaml"], "configmap inferlb.yaml")
    k8s = cfg.discovery.kubernetes
    assert k8s is not None and k8s.namespace == "inference"
    host, port = split_hostport(cfg.envoy.ext_proc_address)
    assert host.startswith("inferlb-headless.inference.") and port == 18080
    args = one("Deployment", "inferlb")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("-c") + 1] == "/etc/inferlb/inferlb.yaml"
    assert split_hostport(cfg.listen.admin)[1] == 18090


def test_the_bootstrap_is_what_inferlb_bootstrap_renders():
    """With the settings docs/xds.md asks of a hand-written bootstrap (max_receive_message_length,
    retry_back_off); a host name makes the xDS cluster STRICT_DNS."""
    bootstrap = yaml.safe_load(one("ConfigMap", "envoy-bootstrap")["data"]["envoy.yaml"])
    rendered = yaml.safe_load(render_bootstrap(xds_address="inferlb-headless.inference.svc.cluster.local:18000",
                                               node_id="envoy", admin_port=9901))
    assert bootstrap == rendered
    grpc = bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]["envoy_grpc"]
    assert grpc["max_receive_message_length"] == 64 * 1024 * 1024
    assert grpc["retry_policy"]["retry_back_off"] == {"base_interval": "0.25s", "max_interval": "2s"}


@pytest.mark.integration
def test_real_envoy_accepts_the_bootstrap_naming_both_replicas(tmp_path):
    bootstrap = yaml.safe_load(one("ConfigMap", "envoy-bootstrap")["data"]["envoy.yaml"])
    xds = bootstrap["static_resources"]["clusters"][0]
    assert xds["type"] == "STRICT_DNS"   # the headless Service: one host per ready replica
    addr = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr["address"].startswith("inferlb-headless.") and addr["port_value"] == 18000
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]


def test_the_image_has_the_k8s_extra_the_configmap_needs():
    cm = one("ConfigMap", "inferlb-config")
    assert parse_config(cm["data"]["inferlb.yaml"]).discovery.kubernetes is not None
    [install] = [line for line in (DEPLOY.parents[1] / "Dockerfile").read_text().splitlines()
                 if line.startswith("RUN pip install") and "/wheels/*.whl" in line]
    assert '"$(ls /wheels/*.whl)[k8s]"' in install


GATEWAY_API = DEPLOY / "gateway-api"


def gateway_api_docs() -> dict[tuple[str, str], dict]:
    found = [d for f in sorted(GATEWAY_API.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert {d["metadata"]["namespace"] for d in found} == {"inference"}
    return {(d["kind"], d["metadata"]["name"]): d for d in found}


def test_the_inference_pool_points_its_picker_at_inferlb_and_inferlb_watches_that_pool():
    d = gateway_api_docs()
    pool = d[("InferencePool", "vllm-chat")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] and [p["number"] for p in pool["spec"]["targetPorts"]] == [8000]
    ref = pool["spec"]["endpointPickerRef"]
    svc = one("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"] if p["name"] == "ext-proc"}
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    route = d[("HTTPRoute", "chat")]
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-chat"}
    cfg = parse_config(d[("ConfigMap", "inferlb-config")]["data"]["inferlb.yaml"], "gateway-api inferlb.yaml")
    k8s = cfg.discovery.kubernetes
    assert k8s is not None and k8s.namespace == "inference"
    assert [p.pool for p in k8s.inference_pools] == ["vllm-chat"] and not k8s.services
    assert cfg.picker.protocol == "gateway-api"
    rules = d[("Role", "inferlb-inferencepools")]["rules"]
    grants = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants == {("inference.networking.k8s.io", "inferencepools"): {"list", "watch"},
                      ("", "pods"): {"list", "watch"}}
    binding = d[("RoleBinding", "inferlb-inferencepools")]
    assert binding["subjects"][0]["name"] == one("ServiceAccount", "inferlb")["metadata"]["name"]
    assert binding["roleRef"]["name"] == "inferlb-inferencepools"
