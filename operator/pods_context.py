"""What every pod builder shares: `Ctx` (the cluster's addresses, images and switches, resolved
once per render), the pod's filesystem layout, and the few dict builders all containers use.

The layout lives here because two builders must agree on it: `pods_env.py` points programs
at paths (MOONCAKE_MODEL, the sidecar's socket, the SSD folder) that `pods_volumes.py` mounts.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.operator import naming, pods_sizing

Obj = dict[str, Any]
MODEL_DIR = "/models"
RUN_DIR = "/var/run/mooncake"
RDMA_RECORD = f"{RUN_DIR}/rdma.json"
# The transfer sidecar's socket folder (sglang pods). On Debian images /var/run is a link to
# /run, so this is RUN_DIR's folder too: pods with a sidecar mount the one `run` volume here.
SIDECAR_DIR = "/run/mooncake"
SIDECAR_SOCKET = f"{SIDECAR_DIR}/sidecar.sock"
SSD_DIR = "/var/lib/mooncake/ssd"
CACHE_DIR = "/var/cache/mooncake"


class Ctx:
    """Everything a role's template depends on, resolved once per render."""

    def __init__(self, cluster: str, namespace: str, spec: Obj, serving_revision: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.spec = spec
        self.serving_revision = serving_revision
        domain = spec["clusterDomain"]
        svc = naming.service_fqdn(naming.name(cluster, 'master'), namespace, domain)
        port = naming.PORTS['master']['grpc']
        masters = int(spec["roles"]["master"]["replicas"])
        self.master_svc = svc
        if masters > 1:
            # HA (metadataBackend redis): every master by its stable StatefulSet pod name;
            # clients and nodes follow whichever leads (store.masterlink).
            self.master_addr = ",".join(
                f"{naming.name(cluster, 'master')}-{i}.{svc}:{port}" for i in range(masters))
        else:
            self.master_addr = f"{svc}:{port}"
        self.domain = domain

    def image(self, role: str) -> str:
        override: str | None = self.spec["roles"][role].get("image")
        if override:
            return override
        engine = self.spec["engine"]
        if role in ("prefill", "decode"):
            if engine.get("image"):
                return str(engine["image"])
            if engine["kind"] != "embedded":
                return naming.image_variant(str(self.spec["image"]),
                                            pods_sizing.image_suffix(self.spec))
        return str(self.spec["image"])

    def sidecar_on(self, role: str) -> bool:
        """The role's pods get a transfer sidecar (sglang prefill and decode)."""
        return self.spec["engine"]["kind"] == "sglang" and role in ("prefill", "decode")

    def token_env(self) -> Obj:
        ref = self.spec.get("clusterTokenSecret") or {
            "name": f"{self.cluster}-cluster-token", "key": "token"}
        return {"name": "MOONCAKE_CLUSTER_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}

    def rdma_on(self, role: str) -> bool:
        return pods_sizing.rdma_on(self.spec, role)


def env_var(name: str, value: Any) -> Obj:
    """A literal environment variable (every value a string, as the API requires)."""
    return {"name": name, "value": str(value)}


def field_env_var(name: str, path: str) -> Obj:
    """An environment variable from the downward API (`status.podIP`, `metadata.name`)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def security(ipc_lock: bool = False) -> Obj:
    """A container's securityContext: no privilege escalation, a read-only root filesystem, not
    root, and no capabilities but IPC_LOCK where RDMA must pin memory."""
    caps: Obj = {"drop": ["ALL"]}
    if ipc_lock:
        caps["add"] = ["IPC_LOCK"]  # RDMA memory registration pins pages
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": caps}
