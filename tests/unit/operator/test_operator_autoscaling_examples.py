"""The HPA and KEDA examples (deploy/examples/autoscaling/) fit what the project really serves:
valid objects (the HPA and the KEDA behaviour against the Kubernetes 1.30 schemas, strictly),
aimed at the per-role scaler the operator renders and whose CRD has the scale subresource, on
the metric the Conductor exports under the labels the chart's PodMonitor gives it, with the
built-in autoscaler's default target and windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from prometheus_client import generate_latest

from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import validate_cluster

Obj = dict[str, Any]
METRIC = "mooncake_conductor_decode_load_tokens"


def _load(repo: Path, name: str) -> Obj:
    doc: Obj = yaml.safe_load((repo / "deploy/examples/autoscaling" / name).read_text())
    return doc


@pytest.fixture(scope="module")
def hpa(repo: Path) -> Obj:
    return _load(repo, "hpa-decode.yaml")


@pytest.fixture(scope="module")
def keda(repo: Path) -> Obj:
    return _load(repo, "keda-decode.yaml")


def _defaults(name: str, namespace: str) -> Obj:
    spec: Obj = validate_cluster({"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
                                  "metadata": {"name": name, "namespace": namespace},
                                  "spec": {}})["spec"]["autoscaling"]
    return spec


def _scaler_target(repo: Path, ref: Obj, namespace: str) -> str:
    """The role `ref` scales, after checking the operator renders that scaler and its CRD
    serves /scale (the MooncakeCluster's does not: it has five roles)."""
    assert (ref["apiVersion"], ref["kind"]) == ("mooncake.io/v1alpha1", "MooncakeRoleScaler")
    cluster_name = ref["name"].rsplit("-", 1)[0]
    cluster = validate_cluster({"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
                                "metadata": {"name": cluster_name, "namespace": namespace,
                                             "uid": "00000000-0000-4000-8000-000000000001"},
                                "spec": {}})
    scalers = {o["metadata"]["name"]: o for o in render(cluster).objects
               if o["kind"] == "MooncakeRoleScaler"}
    assert ref["name"] in scalers
    crd = yaml.safe_load((repo / "crds/mooncake.io_mooncakerolescalers.yaml").read_text())
    assert crd["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    mcc = yaml.safe_load((repo / "crds/mooncake.io_mooncakeclusters.yaml").read_text())
    assert "scale" not in mcc["spec"]["versions"][0]["subresources"]
    role: str = scalers[ref["name"]]["spec"]["role"]
    return role


def test_the_conductor_exports_the_metric_and_the_pod_monitor_adds_its_labels(
        repo: Path) -> None:
    assert f"# TYPE {METRIC} gauge" in generate_latest(ConductorMetrics().registry).decode()
    monitor = (repo / "charts/mooncake-operator/templates/podmonitor.yaml").read_text()
    assert "targetLabel: mooncake_cluster" in monitor


def test_hpa_scales_the_decode_scaler_on_the_decode_load(repo: Path, hpa: Obj) -> None:
    kubernetes_validate.validate(hpa, "1.30", strict=True)
    ns = hpa["metadata"]["namespace"]
    spec = hpa["spec"]
    assert _scaler_target(repo, spec["scaleTargetRef"], ns) == "decode"
    (m,) = spec["metrics"]
    assert m["type"] == "External" and m["external"]["metric"]["name"] == METRIC
    cluster = spec["scaleTargetRef"]["name"].rsplit("-", 1)[0]
    assert m["external"]["metric"]["selector"]["matchLabels"] == {"mooncake_cluster": cluster}
    auto = _defaults(cluster, ns)
    assert m["external"]["target"] == {"type": "AverageValue",
                                       "averageValue": str(auto["targetQueueTokensPerDecode"])}
    assert spec["minReplicas"] >= 1
    b = spec["behavior"]
    assert b["scaleUp"]["stabilizationWindowSeconds"] == auto["scaleUpStabilizationSeconds"]
    assert b["scaleDown"]["stabilizationWindowSeconds"] == auto["scaleDownStabilizationSeconds"]


def test_prometheus_adapter_serves_the_metric_the_hpa_reads(repo: Path, hpa: Obj) -> None:
    values = _load(repo, "prometheus-adapter-values.yaml")
    (rule,) = values["rules"]["external"]
    assert METRIC in rule["seriesQuery"] and "mooncake_cluster" in rule["seriesQuery"]
    assert rule["name"]["as"] == hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    # Conductor pods report the same decode instances: combine with max, never sum.
    assert rule["metricsQuery"].startswith("max(") and "by (mooncake_cluster)" in rule[
        "metricsQuery"]


def test_keda_scales_the_decode_scaler_on_the_decode_load(repo: Path, keda: Obj,
                                                          hpa: Obj) -> None:
    assert (keda["apiVersion"], keda["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    ns = keda["metadata"]["namespace"]
    spec = keda["spec"]
    assert _scaler_target(repo, spec["scaleTargetRef"], ns) == "decode"
    assert spec["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]
    assert spec["minReplicaCount"] >= 1  # decode at 0 leaves the Conductor unready
    (t,) = spec["triggers"]
    assert t["type"] == "prometheus" and t.get("metricType", "AverageValue") == "AverageValue"
    # The ScaledObject CRD types trigger metadata as map[string]string.
    assert all(isinstance(v, str) for v in t["metadata"].values()), t["metadata"]
    cluster = spec["scaleTargetRef"]["name"].rsplit("-", 1)[0]
    q = t["metadata"]["query"]
    assert q.startswith(f"max({METRIC}{{")
    assert f'namespace="{ns}"' in q and f'mooncake_cluster="{cluster}"' in q
    auto = _defaults(cluster, ns)
    assert t["metadata"]["threshold"] == str(auto["targetQueueTokensPerDecode"])
    # KEDA hands `behavior` to the HPA it creates: it must be a valid HPA behaviour.
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    kubernetes_validate.validate({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa-demo-decode", "namespace": ns},
        "spec": {"scaleTargetRef": spec["scaleTargetRef"], "minReplicas": spec["minReplicaCount"],
                 "maxReplicas": spec["maxReplicaCount"], "behavior": behavior}}, "1.30",
        strict=True)
    assert behavior == hpa["spec"]["behavior"]
