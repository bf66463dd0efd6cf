"""The manifests shown in the Kubernetes and GitOps guides are valid as printed: each ```yaml
block parses, a MooncakeCluster passes the CRD's schema and rules (`validate_cluster`), and
every other object passes the Kubernetes 1.30 schemas strictly (unknown fields fail). Flux
and Argo CD objects, which those schemas do not cover, are checked for their shape, and a
Flux CEL health expression must compile and judge the operator's statuses as the guide says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from celpy.adapter import json_to_cel

from mooncake_k8s.operator.validation import _program, validate_cluster

REPO = Path(__file__).resolve().parents[3]
GUIDES = ("docs/kubernetes.md", "docs/gitops.md")
# Kinds of tools the Kubernetes schemas do not describe: checked for their shape only.
TOOL_GROUPS = ("kustomize.toolkit.fluxcd.io", "argoproj.io")


def yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)


def _docs(guide: str) -> list[dict[str, Any]]:
    return [d for block in yaml_blocks(REPO / guide) for d in yaml.safe_load_all(block) if d]


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_manifests_are_valid(guide: str) -> None:
    docs = _docs(guide)
    assert docs, f"{guide} shows no manifest"
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), d
        if d["kind"] == "MooncakeCluster":
            validate_cluster(d)
        elif d["apiVersion"].split("/")[0] in TOOL_GROUPS:
            assert d["metadata"]["name"] and isinstance(d["spec"], dict), d
        else:
            kubernetes_validate.validate(d, "1.30", strict=True)


def test_kubernetes_guide_shows_redis_and_a_model_job() -> None:
    kinds = [d["kind"] for d in _docs("docs/kubernetes.md")]
    assert {"StatefulSet", "Service", "PersistentVolumeClaim", "Job",
            "MooncakeCluster"} <= set(kinds)


def test_flux_health_expressions_read_the_operator_conditions() -> None:
    """The guide's healthCheckExprs, evaluated with CEL against condition lists the operator
    writes: Stalled or Degraded fail, Ready is current."""
    (expr,) = [d["spec"]["healthCheckExprs"][0] for d in _docs("docs/gitops.md")
               if d["kind"] == "Kustomization" and "healthCheckExprs" in d["spec"]]

    def judge(conds: dict[str, str]) -> tuple[bool, bool]:
        status = json_to_cel({"conditions": [{"type": t, "status": s} for t, s in conds.items()]})
        return (bool(_program(expr["failed"]).evaluate({"status": status})),
                bool(_program(expr["current"]).evaluate({"status": status})))

    assert judge({"Ready": "True", "Stalled": "False", "Degraded": "False"}) == (False, True)
    assert judge({"Ready": "False", "Stalled": "True", "Degraded": "True"}) == (True, False)
    assert judge({"Ready": "False", "Stalled": "False", "Degraded": "True"}) == (True, False)
    assert judge({"Ready": "False", "Reconciling": "True", "Stalled": "False"}) == (False, False)
