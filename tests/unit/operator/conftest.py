"""Shared inputs for the operator tests: example clusters and a minimal cluster builder."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))


def load_example(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def cluster(spec: dict[str, Any] | None = None, *, name: str = "demo", namespace: str = "ml",
            uid: str | None = "00000000-0000-4000-8000-000000000001") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
            "metadata": meta, "spec": copy.deepcopy(spec or {})}


@pytest.fixture
def make_cluster() -> Callable[..., dict[str, Any]]:
    return cluster


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def examples() -> dict[str, dict[str, Any]]:
    """Every deploy/examples manifest by file stem."""
    return {p.stem: load_example(p) for p in EXAMPLES}
