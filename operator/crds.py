"""CustomResourceDefinitions built from `schema.py`, and the writer that checks them in.

`crds/` and the `mooncake-crds` chart hold the output of `write_all()`; a unit test regenerates
them and fails on any difference, so the schema module stays the single source. Run
`python -m mooncake_k8s.operator.crds` (or `mooncake crds --write`) after changing the schema.

The kopf peering CRDs are here too: operator HA needs them installed, and shipping our own copy
pins what the operator was tested with.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from mooncake_k8s.operator import schema

KEEP_ANNOTATION = {"helm.sh/resource-policy": "keep"}
_HEADER = "# Generated from operator/schema.py by `mooncake crds --write`; do not edit.\n"


def _crd(*, kind: str, plural: str, short: list[str], desc: str, openapi: dict[str, Any],
         columns: list[dict[str, Any]], subresources: dict[str, Any],
         group: str = schema.GROUP, version: str = schema.VERSION,
         scope: str = "Namespaced", categories: list[str] | None = None) -> dict[str, Any]:
    names: dict[str, Any] = {
        "kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
    }
    if short:
        names["shortNames"] = short
    if categories:
        names["categories"] = categories
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{group}",
            "labels": {"app.kubernetes.io/part-of": "mooncake"},
            "annotations": {"mooncake.io/description": desc},
        },
        "spec": {
            "group": group,
            "names": names,
            "scope": scope,
            "versions": [{
                "name": version,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi},
                "subresources": subresources,
                "additionalPrinterColumns": columns,
            }],
        },
    }


def _col(name: str, path: str, typ: str = "string", priority: int = 0,
         desc: str = "") -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "type": typ, "jsonPath": path}
    if priority:
        c["priority"] = priority
    if desc:
        c["description"] = desc
    return c


def cluster_crd() -> dict[str, Any]:
    def cond(t: str) -> str:
        return f'.status.conditions[?(@.type=="{t}")].status'

    return _crd(
        kind="MooncakeCluster", plural="mooncakeclusters", short=["mcc"],
        categories=["mooncake"],
        desc="A KV-cache-centric disaggregated LLM serving cluster.",
        openapi=schema.cluster_schema(),
        subresources={"status": {}},
        columns=[
            _col("Ready", cond("Ready"), desc="All roles ready at the current revision."),
            _col("Prefill", ".status.roles.prefill.readyReplicas", "integer",
                 desc="Ready prefill pods."),
            _col("Decode", ".status.roles.decode.readyReplicas", "integer",
                 desc="Ready decode pods."),
            _col("Store", ".status.roles.store.readyReplicas", "integer",
                 desc="Ready storage nodes."),
            _col("KVStore", cond("KVStoreReady"), desc="Master and storage nodes ready."),
            _col("Transport", ".status.kvTransport",
                 desc="How KV moves between pods (tcp; rdma is EXPERIMENTAL)."),
            _col("Endpoint", ".status.endpoint", priority=1, desc="OpenAI-compatible API."),
            _col("Revision", ".status.servingRevision", priority=1,
                 desc="Revision prefill and decode pair on."),
            _col("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def scaler_crd() -> dict[str, Any]:
    return _crd(
        kind="MooncakeRoleScaler", plural="mooncakerolescalers", short=["mcrs"],
        categories=["mooncake"],
        desc="Scale subresource adapter for one role of a MooncakeCluster.",
        openapi=schema.scaler_schema(),
        subresources={"status": {}, "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }},
        columns=[
            _col("Cluster", ".spec.clusterName"),
            _col("Role", ".spec.role"),
            _col("Desired", ".spec.replicas", "integer"),
            _col("Ready", ".status.readyReplicas", "integer"),
            _col("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def _peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    free = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return _crd(
        kind=kind, plural=plural, short=[], group="kopf.dev", version="v1", scope=scope,
        desc="kopf peering: lets operator replicas see each other (HA by priority).",
        openapi={"type": "object", "properties": {"spec": free, "status": free},
                 "description": "kopf's peering object; the operators write its status."},
        subresources={},
        columns=[_col("Age", ".metadata.creationTimestamp", "date")],
    )


def all_crds() -> dict[str, dict[str, Any]]:
    """File name -> CRD, in the order they are written."""
    return {
        "mooncake.io_mooncakeclusters.yaml": cluster_crd(),
        "mooncake.io_mooncakerolescalers.yaml": scaler_crd(),
        "kopf.dev_kopfpeerings.yaml": _peering_crd("KopfPeering", "kopfpeerings", "Namespaced"),
        "kopf.dev_clusterkopfpeerings.yaml": _peering_crd(
            "ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
    }


def dump(obj: dict[str, Any]) -> str:
    return yaml.safe_dump(obj, sort_keys=False, width=100)


def chart_crd(crd: dict[str, Any]) -> dict[str, Any]:
    """The chart's copy: kept on `helm uninstall` so deleting the chart never deletes CRs."""
    out = copy.deepcopy(crd)
    out["metadata"]["annotations"].update(KEEP_ANNOTATION)
    return out


# The chart installs kopf's peering CRDs only when asked: another kopf operator's Helm release
# may already own them, and Helm refuses to adopt an object another release owns.
PEERING_VALUE = ".Values.kopfPeering.installCRDs"


def rendered_files(repo: Path) -> dict[Path, str]:
    """Every generated file and its exact content."""
    files: dict[Path, str] = {}
    for fname, crd in all_crds().items():
        files[repo / "crds" / fname] = _HEADER + dump(crd)
        text = _HEADER + dump(chart_crd(crd))
        if crd["spec"]["group"] == "kopf.dev":
            text = f"{{{{- if {PEERING_VALUE} }}}}\n{text}{{{{- end }}}}\n"
        files[repo / "charts" / "mooncake-crds" / "templates" / fname] = text
    return files


def write_all(repo: Path) -> list[Path]:
    written = []
    for path, text in rendered_files(repo).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def main() -> None:
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    for p in write_all(repo):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
