"""Observability packaging in the operator chart: the PodMonitor toggle and the Grafana dashboard
ConfigMap, rendered offline with helm-python-sdk (as in test_operator_charts.py), and the
dashboard's `namespace` and `cluster` variables used by every query.

No Prometheus Operator or Grafana runs here: the PodMonitor is checked for what the Prometheus
Operator reads (selector, namespaces, the `metrics` port) against the pods the operator
really renders for every example.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import validate_cluster

Obj = dict[str, Any]
CHART = "charts/mooncake-operator"
DASHBOARD = Path("deploy/grafana/mooncake-dashboard.json")


def _render(repo: Path, values: Obj) -> list[Obj]:
    out = helm.Chart.load(repo / CHART).render(values, name="mc", namespace="mooncake-system")
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _kind(docs: list[Obj], kind: str) -> list[Obj]:
    return [d for d in docs if d["kind"] == kind]


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_monitoring_is_off_by_default(repo: Path) -> None:
    docs = _render(repo, {})
    assert _kind(docs, "PodMonitor") == []
    assert not [d for d in _kind(docs, "ConfigMap")
                if "grafana_dashboard" in d["metadata"]["labels"]]


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]], ids=["cluster-wide", "namespaced"])
def test_chart_renders_a_pod_monitor_when_asked(repo: Path, examples: dict[str, Obj],
                                               watch: list[str]) -> None:
    docs = _render(repo, {"watchNamespaces": watch, "monitoring": {"podMonitor": {
        "enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "15s"}}})
    (pm,) = _kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["namespace"] == "mooncake-system"
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = pm["spec"]
    assert spec["namespaceSelector"] == ({"matchNames": watch} if watch else {"any": True})
    (ep,) = spec["podMetricsEndpoints"]
    assert (ep["port"], ep["path"], ep["interval"]) == ("metrics", "/metrics", "15s")
    targets = {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"]}
    assert targets["mooncake_cluster"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    # Every pod the operator renders is selected, and the roles that export metrics do so on a
    # port named `metrics` (the one the PodMonitor scrapes).
    with_metrics = set()
    for name, example in examples.items():
        for o in render(validate_cluster(example)).objects:
            if o["kind"] not in ("StatefulSet", "Deployment"):
                continue
            tpl = o["spec"]["template"]
            assert _selects(spec["selector"], tpl["metadata"]["labels"]), (name, o["kind"])
            ports = [p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])]
            if "metrics" in ports:
                with_metrics.add(tpl["metadata"]["labels"]["app.kubernetes.io/component"])
    assert {"prefill", "decode", "store", "master"} <= with_metrics
    # The operator's own pod is not a Mooncake serving pod: its metrics have their Service.
    dep = _kind(docs, "Deployment")[0]
    assert not _selects(spec["selector"], dep["spec"]["template"]["metadata"]["labels"])


def test_dashboard_config_map_carries_the_dashboard_file(repo: Path) -> None:
    docs = _render(repo, {"monitoring": {"dashboard": {
        "enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}}}})
    (cm,) = [d for d in _kind(docs, "ConfigMap")
             if d["metadata"]["name"] == "mc-mooncake-operator-dashboard"]
    kubernetes_validate.validate(cm, "1.30", strict=True)
    meta = cm["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["namespace"] == "monitoring"
    assert meta["annotations"] == {"grafana_folder": "LLM"}
    text = cm["data"]["mooncake-dashboard.json"]
    source = (repo / DASHBOARD).read_text()
    assert json.loads(text) == json.loads(source)
    assert text.strip() == source.strip()  # the chart's copy is the file, byte for byte
    assert len(text.encode()) < 1 << 20  # a ConfigMap holds at most 1 MiB


@pytest.mark.parametrize("bad", [
    {"monitoring": {"podMonitor": {"enabled": "yes"}}},
    {"monitoring": {"podMonitor": {"interval": "30"}}},
    {"monitoring": {"podMonitor": {"scrape": True}}},
    {"monitoring": {"dashboard": {"namespace": "Not_A_Namespace"}}},
    {"monitoring": {"grafana": {}}},
])
def test_values_schema_rejects_bad_monitoring_values(repo: Path, bad: Obj) -> None:
    chart = helm.Chart.load(repo / CHART)
    chart.validate_schema({"monitoring": {"podMonitor": {"enabled": True, "interval": "1m30s"},
                                          "dashboard": {"enabled": True}}})
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)


# ---- the dashboard's variables

_SELECTOR = re.compile(r"\b(mooncake_[A-Za-z0-9_:]+)(\{[^}]*\})?")


def test_every_dashboard_query_filters_on_namespace_and_cluster(repo: Path) -> None:
    d = json.loads((repo / DASHBOARD).read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    for name, label in (("namespace", "namespace"), ("cluster", "mooncake_cluster")):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*"
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert re.fullmatch(rf"label_values\(mooncake_\w+(\{{.*\}})?, {label}\)",
                            v["query"]["query"]), v["query"]
    # The cluster list follows the chosen namespaces.
    assert '$namespace' in variables["cluster"]["query"]["query"]

    def panels(items: list[Obj]) -> list[Obj]:
        return [q for p in items for q in [p, *panels(p.get("panels", []))]]

    exprs = [t["expr"] for p in panels(d["panels"]) for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        selectors = _SELECTOR.findall(expr)
        assert selectors, expr
        for metric, sel in selectors:
            assert 'namespace=~"$namespace"' in sel, (metric, expr)
            assert 'mooncake_cluster=~"$cluster"' in sel, (metric, expr)
