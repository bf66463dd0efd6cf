"""Pod templates for each role, configured through `mooncake` CLI environment variables (SGLang
workers and their transfer sidecar also get their own options as flags, see `pods_env`).

Pure: a defaulted spec in, plain dicts out. `render.py` wraps these templates into workloads and
hashes them into per-role revisions, so anything that must not restart a role (replica counts,
the ConfigMap's content, status) never reaches a template.

This module assembles the pod and places it (probes, ports, RDMA node affinity, spreading, the
user's podTemplate override); the parts come from the modules beside it, lowest first:
`pods_sizing` (devices, CPUs, memory, /dev/shm: spec in, numbers out), `pods_context` (`Ctx`
and the pod's filesystem layout), `pods_volumes` (volumes, mounts, init containers) and
`pods_env` (each role's arguments and environment).

Servers bind the pod IP from the downward API (the CLI refuses 0.0.0.0 unless told), except the
Conductor, whose HTTP API is the front door and must also answer `kubectl port-forward`.
The cluster token only ever comes from a Secret reference.
"""

from __future__ import annotations

import copy
from typing import Any

from mooncake_k8s.common import defaults
from mooncake_k8s.operator import (
    admission,
    naming,
    pods_env,
    pods_sizing,
    pods_volumes,
    schema_gateway,
)
from mooncake_k8s.operator.groups import LABEL_GROUP_SIZE
from mooncake_k8s.operator.pods_context import Ctx, security

Obj = dict[str, Any]


def _http_probe(path: str, port: str, period: int, failures: int, timeout: int = 5) -> Obj:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


def _tcp_probe(port: str, period: int, failures: int) -> Obj:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _ports(role: str, engine: str = "embedded") -> list[Obj]:
    ports = dict(naming.PORTS[role])
    if engine == "sglang":
        ports.update(naming.SGLANG_PORTS.get(role, {}))
    return [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()]


def _rdma_affinity(ctx: Ctx, role: str, affinity: Obj) -> Obj:
    if not ctx.rdma_on(role):
        return affinity
    out = copy.deepcopy(affinity)
    expr = {"key": ctx.spec["rdma"]["nodeLabel"], "operator": "In", "values": ["true"]}
    node = out.setdefault("nodeAffinity", {})
    if ctx.spec["rdma"]["required"]:
        req = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution",
                              {"nodeSelectorTerms": []})
        terms = req.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({"matchExpressions": []})
        for t in terms:  # terms are ORed: every alternative must also be RDMA-capable
            t.setdefault("matchExpressions", []).append(expr)
    else:
        node.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "preference": {"matchExpressions": [expr]}})
    return out


def _group_affinity(ctx: Ctx, role: str, affinity: Obj) -> Obj:
    """Prefill pipeline groups: prefer a node with no other prefill pod of this cluster, so a
    group's stages (which each compute their share of every prompt at once) do not share
    cores. A pod template cannot name its group (one template serves every pod), so this
    keeps all prefill pods apart, which keeps each group apart; soft, so a small cluster still
    schedules. The user's own affinity is added to, never replaced."""
    if role != "prefill" or admission.group_size(ctx.spec) == 1:
        return affinity
    out = copy.deepcopy(affinity)
    anti = out.setdefault("podAntiAffinity", {})
    anti.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append({
        "weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": naming.selector(ctx.cluster, role)}}})
    return out


def _probes(role: str, engine: str = "embedded") -> Obj:
    if role in ("prefill", "decode") and engine in pods_sizing.SERVER_ENGINES:
        # vLLM and SGLang start in ~40 s on a CPU and in minutes on a GPU (weights,
        # torch.compile, CUDA graphs); /readyz says 503 meanwhile. The startup probe allows an
        # hour before liveness counts, and both probes allow 10 s answers: the engine keeps
        # every core busy while it loads and serves, and the worker's health thread shares them.
        return {"startupProbe": _http_probe("/healthz", "metrics", 10, 360, timeout=10),
                "livenessProbe": _http_probe("/healthz", "metrics", 10, 6, timeout=10),
                "readinessProbe": _http_probe("/readyz", "metrics", 5, 6, timeout=10)}
    if role in ("prefill", "decode"):
        # Loading weights can take many minutes; the startup probe holds liveness off meanwhile.
        return {"startupProbe": _http_probe("/healthz", "metrics", 10, 180),
                "livenessProbe": _http_probe("/healthz", "metrics", 10, 6),
                "readinessProbe": _http_probe("/readyz", "metrics", 5, 3)}
    if role == "conductor":
        # Liveness on the metrics port: it answers until the process exits, while the API
        # listener is closed during a drain (which a liveness failure must not cut short).
        return {"livenessProbe": _http_probe("/healthz", "metrics", 10, 6),
                "readinessProbe": _http_probe("/readyz", "http", 5, 3)}
    port = "grpc" if role == "master" else "transfer"
    return {"startupProbe": _tcp_probe(port, 5, 60), "livenessProbe": _tcp_probe(port, 10, 6),
            "readinessProbe": _tcp_probe(port, 5, 3)}


def pod_template(ctx: Ctx, role: str) -> Obj:
    """The role's PodTemplateSpec before the user's podTemplate override is merged in."""
    spec, rspec = ctx.spec, ctx.spec["roles"][role]
    env, args = pods_env.role_env(ctx, role)
    vols = pods_volumes.pod_volumes(ctx, role)
    container: Obj = {
        "name": role,
        "image": ctx.image(role),
        "imagePullPolicy": spec["imagePullPolicy"],
        "args": args,
        "env": pods_env.base_env(ctx) + env,
        "ports": _ports(role, spec["engine"]["kind"]),
        "volumeMounts": vols.mounts,
        "securityContext": security(ctx.rdma_on(role)),
        **_probes(role, spec["engine"]["kind"]),
    }
    res = pods_sizing.container_resources(spec, role)
    if res:
        container["resources"] = res
    if role == "conductor":
        # Endpoints drop a terminating pod a moment after it is marked so; SIGTERM (which
        # closes the listener, see conductor.service) waits this long, so no client is refused.
        container["lifecycle"] = {"preStop": {"exec": {"command": [
            "sleep", str(defaults.CONDUCTOR_PRESTOP_S)]}}}
    if role in ("prefill", "decode"):
        container["lifecycle"] = {"preStop": {"exec": {"command": worker_pre_stop(
            schema_gateway.drain_seconds(spec, role))}}}
    labels = naming.labels(ctx.cluster, role)
    if role in ("prefill", "decode"):
        labels[naming.LABEL_SERVING_REVISION] = ctx.serving_revision
    if role == "prefill" and admission.group_size(spec) > 1:
        # The restart-together handler reads the group size from the pod (groups.py).
        labels[LABEL_GROUP_SIZE] = str(admission.group_size(spec))
    pod: Obj = {
        "serviceAccountName": spec.get("serviceAccountName") or None,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": _grace(spec, role),
        "securityContext": pod_security(spec),
        "initContainers": vols.init_containers or None,
        "containers": [container],
        "volumes": vols.volumes,
        "nodeSelector": rspec.get("nodeSelector") or None,
        "tolerations": rspec.get("tolerations") or None,
        "affinity": _group_affinity(ctx, role, _rdma_affinity(
            ctx, role, rspec.get("affinity") or {})) or None,
        "priorityClassName": rspec.get("priorityClassName") or None,
        "imagePullSecrets": pull_secrets(spec),
        # Every role spreads over nodes where it can (two masters or two Conductors on one node
        # would fall together) but still schedules where it cannot. Replace the list through
        # roles.<role>.podTemplate to change it.
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": naming.selector(ctx.cluster, role)}}],
    }
    template = {"metadata": {"labels": labels},
                "spec": {k: v for k, v in pod.items() if v is not None}}
    merged: Obj = merge_override(template, rspec.get("podTemplate") or {})
    return merged


def _grace(spec: Obj, role: str) -> int:
    """The pod's terminationGracePeriodSeconds: a worker's drain plus a margin for stopping;
    the Conductor's own field; 30 s (Kubernetes' default) for the store and master."""
    if role in ("prefill", "decode"):
        return schema_gateway.grace_seconds(schema_gateway.drain_seconds(spec, role))
    return int(spec["roles"][role].get("terminationGracePeriodSeconds") or 30)


def worker_pre_stop(drain_s: int) -> list[str]:
    """A worker's preStop: start the drain (SIGTERM to the worker, PID 1 of its container:
    it turns unready, refuses new work and hands over or finishes what runs) and return once
    the worker has exited or the drain time has passed. The kubelet's own SIGTERM after the
    hook then finds nothing left to stop, so the drain never waits on the hook's timing."""
    return ["/bin/sh", "-c",
            f"kill -TERM 1; i=0; while [ $i -lt {drain_s} ] && kill -0 1 2>/dev/null; "
            "do sleep 1; i=$((i+1)); done"]


def pod_security(spec: Obj) -> Obj:
    """The pod's securityContext: never root and RuntimeDefault seccomp always; a UID, GID or
    fsGroup only where spec.podSecurityContext pins one (OpenShift assigns its own)."""
    ids = {k: v for k, v in (spec.get("podSecurityContext") or {}).items()
           if k in ("runAsUser", "runAsGroup", "fsGroup")}
    return {"runAsNonRoot": True, **ids, "seccompProfile": {"type": "RuntimeDefault"}}


def pull_secrets(spec: Obj) -> list[Obj] | None:
    """spec.imagePullSecrets as the pod lists them. Plain names are still read here: objects
    stored before the schema took `{name: ...}` keep rendering until they are next edited."""
    out = [{"name": s} if isinstance(s, str) else {"name": s["name"]}
           for s in spec.get("imagePullSecrets") or []]
    return out or None


_NAMED_LISTS = {"containers", "initContainers", "env", "volumes", "volumeMounts", "ports",
                "imagePullSecrets"}


def merge_override(base: Any, override: Any, key: str = "") -> Any:
    """Merge a user's partial template: maps recurse, named lists merge by name, else replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge_override(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if (key in _NAMED_LISTS and isinstance(base, list) and isinstance(override, list)
            and all(isinstance(i, dict) and "name" in i for i in base + override)):
        merged = [copy.deepcopy(i) for i in base]
        index = {i["name"]: n for n, i in enumerate(merged)}
        for item in override:
            if item["name"] in index:
                merged[index[item["name"]]] = merge_override(merged[index[item["name"]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(override)
