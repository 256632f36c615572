"""deploy/kubernetes/autoscaling: the HPA, the KEDA ScaledObject and the prometheus-adapter rules are
valid against their published schemas and name the autoscaling metrics inferlb exports."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes.client import models
from pydantic import ValidationError

from xds_server.admin.exposition import AUTOSCALING

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "deploy" / "kubernetes" / "autoscaling"
KEDA_CRD = Path(__file__).parent / "schemas" / "keda.sh_scaledobjects.yaml"


def example(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return doc


def keda_schema() -> dict:
    """The v1alpha1 ScaledObject schema, with unknown fields refused where the API server would prune
    them (a misspelt field would otherwise vanish silently on apply)."""
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (v1alpha1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = copy.deepcopy(v1alpha1["schema"]["openAPIV3Schema"])

    def closed(node: dict) -> None:
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            closed(child)
        if isinstance(node.get("items"), dict):
            closed(node["items"])

    closed(schema)
    schema["properties"]["metadata"] = {"type": "object"}   # ObjectMeta: checked by the API server itself
    return schema


def test_the_hpa_is_a_valid_autoscaling_v2_object():
    doc = example("hpa.yaml")
    hpa = models.V2HorizontalPodAutoscaler.model_validate(doc)
    assert hpa.api_version == "autoscaling/v2" and hpa.kind == "HorizontalPodAutoscaler"
    (metric,) = hpa.spec.metrics
    assert metric.type == "External" and metric.external.metric.name in AUTOSCALING
    assert metric.external.target.type == "AverageValue" and metric.external.target.average_value == "1"
    assert metric.external.metric.selector.match_labels == {"cluster": "chat-v1"}


def test_the_hpa_check_refuses_a_misspelt_field():
    doc = example("hpa.yaml")
    doc["spec"]["metrics"][0]["external"]["target"]["averagevalue"] = doc["spec"]["metrics"][0]["external"][
        "target"].pop("averageValue")
    with pytest.raises(ValidationError, match="averagevalue"):
        models.V2HorizontalPodAutoscaler.model_validate(doc)


def test_the_scaled_object_is_valid_against_kedas_crd():
    doc = example("keda-scaledobject.yaml")
    jsonschema.validate(doc, keda_schema())
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    (trigger,) = doc["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert re.search(r"\binferlb_cluster_desired_replicas\{cluster=\"chat-v1\"\}", trigger["metadata"]["query"])
    # The same scaled Deployment as the HPA's (use one of the two, not both).
    assert doc["spec"]["scaleTargetRef"]["name"] == example("hpa.yaml")["spec"]["scaleTargetRef"]["name"]


@pytest.mark.parametrize("broken", ["unknown field", "threshold as a number", "no trigger type"])
def test_the_keda_check_refuses_a_broken_object(broken):
    doc = example("keda-scaledobject.yaml")
    trigger = doc["spec"]["triggers"][0]
    if broken == "unknown field":
        trigger["metadatas"] = trigger.pop("metadata")
    elif broken == "threshold as a number":
        trigger["metadata"]["threshold"] = 1
    else:
        del trigger["type"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, keda_schema())


def test_the_adapter_rules_serve_exported_metrics_under_their_own_names():
    doc = example("prometheus-adapter.yaml")
    rules = yaml.safe_load(doc["data"]["config.yaml"])["externalRules"]
    names = set()
    for rule in rules:
        series = re.match(r"^([a-z_:]+)\{", rule["seriesQuery"]).group(1)
        assert series in AUTOSCALING and rule["name"]["as"] == series
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        names.add(series)
    hpa_metric = example("hpa.yaml")["spec"]["metrics"][0]["external"]["metric"]["name"]
    assert hpa_metric in names
