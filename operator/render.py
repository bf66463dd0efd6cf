"""`render(cluster) -> objects`: everything the operator applies for one MooncakeCluster.

Pure and deterministic (no clocks, no randomness, no API calls): the same input always yields
byte-identical objects, which is what makes server-side apply idempotent and lets GitOps users
run `mooncake render` themselves. The kopf handlers call it with the replica counts they
resolved from the MooncakeRoleScalers; the CLI calls it with the spec's own counts.

Not rendered (created once by the operator, see `reconcile.py`): the generated cluster-token
Secret and the scalers' `spec.replicas`, both of which must survive re-applies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.operator import (
    admission,
    corev1,
    naming,
    pods,
    pods_context,
    pods_sizing,
    pods_volumes,
)
from mooncake_k8s.operator.schema import GROUP, ROLES, VERSION

Obj = dict[str, Any]
API_VERSION = f"{GROUP}/{VERSION}"
STATEFUL_ROLES = ("prefill", "decode", "store", "master")
GATEWAY_GROUP = "gateway.networking.k8s.io"


class SpecError(ValueError):
    """The spec passed schema validation but cannot be rendered (a permanent error)."""


@dataclass
class Rendered:
    objects: list[Obj]
    revisions: dict[str, str]
    serving_revision: str
    replicas: dict[str, int] = field(default_factory=dict)

    def by_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj:
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                return o
        raise KeyError(f"{kind}/{name}")


def owner_reference(cluster: Obj) -> Obj | None:
    uid = cluster.get("metadata", {}).get("uid")
    if not uid:
        return None
    return {"apiVersion": API_VERSION, "kind": "MooncakeCluster",
            "name": cluster["metadata"]["name"], "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


class _Meta:
    def __init__(self, cluster: Obj, version: str | None) -> None:
        self.name: str = cluster["metadata"]["name"]
        self.namespace: str = cluster["metadata"].get("namespace") or "default"
        self.owner = owner_reference(cluster)
        self.version = version

    def __call__(self, name: str, role: str, annotations: Mapping[str, str] | None = None) -> Obj:
        meta: Obj = {"name": name, "namespace": self.namespace,
                     "labels": naming.labels(self.name, role, self.version)}
        if annotations:
            meta["annotations"] = dict(annotations)
        if self.owner:
            meta["ownerReferences"] = [self.owner]
        return meta


def _check(spec: Obj) -> None:
    # The API server in front of the operator knows the CRD, not these rules: without them a
    # bad toleration or quantity would only surface as a refused StatefulSet.
    errors = admission.spec_errors(spec)
    if errors:
        raise SpecError("; ".join(errors))
    for role in ("store", "decode", "prefill"):
        size = pods_sizing.shm_bytes(spec, role)
        limit = (spec["roles"][role].get("resources") or {}).get("limits", {}).get("memory")
        if size is not None and limit is not None and corev1.parse_quantity(limit) < size:
            raise SpecError(
                f"roles.{role}.resources.limits.memory ({limit}) is below the role's "
                f"Memory-backed /dev/shm ({naming.format_bytes(size)}), which counts against it")
    if spec["roles"]["decode"].get("shmSize") is not None and naming.parse_bytes(
            spec["roles"]["decode"]["shmSize"]) < naming.parse_bytes(
            spec["roles"]["decode"]["localSegmentSize"]):
        raise SpecError("roles.decode.shmSize must hold roles.decode.localSegmentSize")
    for role in ("prefill", "decode"):
        if spec["engine"].get("device") == "cpu" and pods_sizing.gpu_count(spec, role):
            raise SpecError(f"engine.device is cpu but roles.{role}.resources requests a GPU; "
                            "remove the GPU or set engine.device cuda")


def render(cluster: Obj, replicas: Mapping[str, int] | None = None) -> Rendered:
    """Render a defaulted, validated MooncakeCluster; `replicas` overrides per-role counts."""
    spec: Obj = cluster["spec"]
    _check(spec)
    meta = _Meta(cluster, naming.image_version(spec["image"]))
    name, ns = meta.name, meta.namespace
    counts = {r: int(spec["roles"][r]["replicas"]) for r in ROLES}
    counts.update(replicas or {})

    probe = pods_context.Ctx(name, ns, spec, "")
    serving = naming.digest(naming.serving_inputs(
        spec, probe.image("prefill"), probe.image("decode")))
    ctx = pods_context.Ctx(name, ns, spec, serving)
    templates: dict[str, Obj] = {}
    revisions: dict[str, str] = {}
    for role in ROLES:
        t = pods.pod_template(ctx, role)
        revisions[role] = naming.digest(t)
        t["metadata"]["labels"][naming.LABEL_REVISION] = revisions[role]
        templates[role] = t

    objects: list[Obj] = [_config_map(meta, spec, revisions, serving)]
    objects += [_headless_service(meta, r) for r in STATEFUL_ROLES]
    objects.append(_conductor_service(meta, spec))
    for role in STATEFUL_ROLES:
        objects.append(_stateful_set(meta, spec, role, counts[role], templates[role]))
    objects.append(_deployment(meta, counts["conductor"], templates["conductor"]))
    objects += [_pdb(meta, spec, r) for r in ROLES]
    objects += [_network_policy(meta, r) for r in ROLES]
    objects += [_scaler(meta, r, int(spec["roles"][r]["replicas"])) for r in ROLES]
    if spec.get("gateway"):
        objects.append(http_route(meta, spec))
    return Rendered(objects, revisions, serving, counts)


def _config_map(meta: _Meta, spec: Obj, revisions: dict[str, str], serving: str) -> Obj:
    # Mounted by the Conductor: `serving-revision` is the revision a rollout is heading to, so
    # it can prefer new pairs while old ones drain. Mounted files update without restarts.
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": meta(naming.name(meta.name, "config"), "cluster"),
        "data": {
            "serving-revision": serving,
            "revisions.json": json.dumps(revisions, sort_keys=True),
            "spec.json": json.dumps(spec, sort_keys=True, indent=1),
        },
    }


def _service_ports(role: str) -> list[Obj]:
    return [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
            for n, p in naming.PORTS[role].items()]


def _headless_service(meta: _Meta, role: str) -> Obj:
    # Governs the StatefulSet and lists ready pods in DNS: the Conductor resolves
    # `dns:<this service>:<port>` periodically to find prefill and decode instances.
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta(naming.name(meta.name, role), role),
        "spec": {"clusterIP": "None", "selector": naming.selector(meta.name, role),
                 "ports": _service_ports(role)},
    }


def _conductor_service(meta: _Meta, spec: Obj) -> Obj:
    svc = spec["roles"]["conductor"]["service"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta(naming.name(meta.name, "conductor"), "conductor",
                         svc.get("annotations")),
        "spec": {"type": svc["type"], "selector": naming.selector(meta.name, "conductor"),
                 "ports": [{"name": "http", "port": svc["port"], "targetPort": "http",
                            "protocol": "TCP"}]},
    }


def http_route(meta: _Meta, spec: Obj) -> Obj:
    """spec.gateway as a Gateway API v1 HTTPRoute: every path of the listed Gateways' listeners
    (and hostnames) to the Conductor Service's HTTP port. Streams stay open for minutes, so
    docs/gateway.md says which gateway timeouts to raise; the route sets none (timeouts are an
    extended feature not every implementation honours)."""
    gw = spec["gateway"]
    parents = []
    for ref in gw["parentRefs"]:
        parent: Obj = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": ref["name"]}
        parent.update({k: ref[k] for k in ("namespace", "sectionName", "port") if k in ref})
        parents.append(parent)
    route: Obj = {"parentRefs": parents}
    if gw.get("hostnames"):
        route["hostnames"] = list(gw["hostnames"])
    route["rules"] = [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "", "kind": "Service",
                         "name": naming.name(meta.name, "conductor"),
                         "port": spec["roles"]["conductor"]["service"]["port"], "weight": 1}],
    }]
    return {"apiVersion": f"{GATEWAY_GROUP}/v1", "kind": "HTTPRoute",
            "metadata": meta(naming.name(meta.name, "conductor"), "conductor"), "spec": route}


def _stateful_set(meta: _Meta, spec: Obj, role: str, replicas: int, template: Obj) -> Obj:
    sts: Obj = {
        "serviceName": naming.name(meta.name, role),
        "replicas": replicas,
        "selector": {"matchLabels": naming.selector(meta.name, role)},
        # Instances are interchangeable; nothing needs ordered start-up or shutdown.
        "podManagementPolicy": "Parallel",
        "updateStrategy": {"type": "RollingUpdate"},
        "revisionHistoryLimit": 5,
        "template": template,
    }
    if role == "store" and "ssd" in spec["store"]:
        ssd = spec["store"]["ssd"]
        storage = pods_volumes.quantity(ssd["size"])
        claim: Obj = {"accessModes": ["ReadWriteOnce"],
                      "resources": {"requests": {"storage": storage}}}
        if ssd.get("storageClassName"):
            claim["storageClassName"] = ssd["storageClassName"]
        sts["volumeClaimTemplates"] = [{"metadata": {"name": "ssd",
                                                     "labels": naming.selector(meta.name, role)},
                                        "spec": claim}]
        # The SSD tier is a cache: keeping claims after deletion or scale-down only costs money.
        sts["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete",
                                                       "whenScaled": "Delete"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": meta(naming.name(meta.name, role), role), "spec": sts}


def _deployment(meta: _Meta, replicas: int, template: Obj) -> Obj:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(naming.name(meta.name, "conductor"), "conductor"),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": naming.selector(meta.name, "conductor")},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            "template": template,
        },
    }


def _pdb(meta: _Meta, spec: Obj, role: str) -> Obj:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": meta(naming.name(meta.name, role), role),
        "spec": {"maxUnavailable": spec["roles"][role]["maxUnavailable"],
                 "selector": {"matchLabels": naming.selector(meta.name, role)},
                 # A crash-looping pod must never block a node drain.
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def _network_policy(meta: _Meta, role: str) -> Obj:
    metrics = naming.METRICS_PORT[role]
    ingress: list[Obj] = [
        # Anyone may scrape metrics (and call the Conductor's API: its `http` port).
        {"ports": [{"protocol": "TCP", "port": naming.PORTS[role][name]}
                   for name in (("http", metrics) if role == "conductor" else (metrics,))]},
    ]
    if role != "conductor":
        # Data and control ports: only pods of this cluster. All ports, because transfer
        # servers (decode's local segment) may listen beyond the named ones.
        ingress.append({"from": [{"podSelector": {
            "matchLabels": naming.cluster_selector(meta.name)}}]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": meta(naming.name(meta.name, role), role),
        "spec": {"podSelector": {"matchLabels": naming.selector(meta.name, role)},
                 "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _scaler(meta: _Meta, role: str, seed: int) -> Obj:
    # No spec.replicas: HPA/KEDA/the autoscaler own it through the scale subresource. The seed
    # annotation records which spec.roles.<role>.replicas value was last copied into it.
    return {
        "apiVersion": API_VERSION, "kind": "MooncakeRoleScaler",
        "metadata": meta(naming.name(meta.name, role), role,
                         {naming.ANNOTATION_SEED: str(seed)}),
        "spec": {"clusterName": meta.name, "role": role},
    }
