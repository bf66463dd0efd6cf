"""Status of a MooncakeCluster, aggregated from its children: a pure function.

Inputs are what the operator observed (workloads, pods, the master's metrics) plus what it
rendered; the output is the `status` body to patch. Conditions keep their lastTransitionTime
while their status is unchanged, so an unchanged cluster yields an identical status and the
operator's patch becomes a no-op.

KV transport: `KVTransport` (and `status.kvTransport`) say how KV really moves between pods. In
this release that is TCP: `auto` uses shared memory only inside a pod and never picks RDMA, and
admission refuses `transferProtocol: rdma`.

RDMA (EXPERIMENTAL): only when `rdma.enabled`, each data pod's `rdma-probe` init container writes
a JSON record to its termination message; the kubelet publishes it in the pod status, where this
module reads it for `RDMAReady`. That condition says which devices pods can see, not what KV
uses; a cluster that does not ask for RDMA has no RDMAReady condition at all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_k8s.operator import admission, groups, naming
from mooncake_k8s.operator.metrics import StoreUsage, TenantUsage
from mooncake_k8s.operator.render import Rendered
from mooncake_k8s.operator.schema import DATA_ROLES, ROLES

Obj = dict[str, Any]
CONDITIONS = ("Ready", "Progressing", "Degraded", "KVStoreReady", "KVTransport", "RDMAReady")
# transferProtocol -> (status.kvTransport, the KVTransport condition's reason)
_TRANSPORTS = {"auto": ("tcp", "Tcp"), "tcp": ("tcp", "Tcp"), "rdma": ("rdma", "Rdma")}
# kstatus' abnormal-true pair, read by Flux and other kstatus-based tools (see kstatus_conditions).
KSTATUS_CONDITIONS = ("Reconciling", "Stalled")
_BAD_WAITING = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                "CreateContainerConfigError", "CreateContainerError"}


@dataclass(frozen=True)
class Observed:
    """What the operator read from the API and the master for one cluster."""

    workloads: Mapping[str, Obj]  # role -> StatefulSet or Deployment (as read back)
    pods: Sequence[Obj]
    store: StoreUsage | None = None
    error: str | None = None  # a render/apply failure to report as Degraded
    conductor: Sequence[str] = ()
    """`pod: why` for Conductor pods whose tokenizer is not the workers' (their /readyz)."""
    group_restarts: int = 0
    """Prefill groups the operator restarted together (status.prefillGroups.restarts)."""


def _role_status(role: str, desired: int, wl: Obj | None, revision: str) -> Obj:
    st = (wl or {}).get("status", {})
    fresh = wl is not None and st.get("observedGeneration", 0) >= wl.get(
        "metadata", {}).get("generation", 0)
    return {
        "replicas": desired,
        "readyReplicas": int(st.get("readyReplicas", 0)),
        # A status from before the last template change says nothing about the new revision.
        "updatedReplicas": int(st.get("updatedReplicas", 0)) if fresh else 0,
        "revision": revision,
    }


def _ready(rs: Obj) -> bool:
    return bool(rs["readyReplicas"] >= rs["replicas"] and rs["updatedReplicas"] >= rs["replicas"])


def rdma_record(pod: Obj) -> Obj | None:
    """The probe's JSON record from a pod's status, if the probe has finished."""
    for cs in pod.get("status", {}).get("initContainerStatuses", []) or []:
        if cs.get("name") != "rdma-probe":
            continue
        for key in ("state", "lastState"):
            msg = (cs.get(key) or {}).get("terminated", {}).get("message")
            if msg:
                try:
                    rec = json.loads(msg)
                except ValueError:
                    return {"usable": False, "devices": [], "reason": "unreadable probe record"}
                return rec if isinstance(rec, dict) else None
    return None


def kv_transport(spec: Obj) -> tuple[str, Obj]:
    """How KV moves between the cluster's pods (`status.kvTransport`) and the condition that
    says so. Derived from the spec because it is decided there: workers never choose RDMA by
    themselves, and pods have separate /dev/shm, so `auto` means TCP between pods."""
    proto = str(spec.get("transferProtocol", "auto"))
    transport, reason = _TRANSPORTS.get(proto, ("tcp", "Tcp"))
    if transport == "rdma":
        msg = "transferProtocol rdma: KV moves over RDMA (EXPERIMENTAL, untested on hardware)"
    elif proto == "tcp":
        msg = "transferProtocol tcp: KV moves between pods over TCP"
    else:
        msg = ("transferProtocol auto: KV moves between pods over TCP (shared memory only "
               "inside a pod; RDMA is never chosen)")
    if transport != "rdma" and spec["rdma"]["enabled"]:
        msg += "; rdma.enabled (EXPERIMENTAL) only gives pods the devices, KV does not use them"
    return transport, {"type": "KVTransport", "status": "True", "reason": reason,
                       "message": msg}


def _rdma(spec: Obj, pods: Sequence[Obj]) -> tuple[Obj | None, Obj]:
    """RDMAReady and status.rdma when rdma.enabled (EXPERIMENTAL), else neither."""
    if not spec["rdma"]["enabled"]:
        return None, {}
    with_dev, without, pending = 0, 0, 0
    names: set[str] = set()
    for pod in pods:
        role = pod.get("metadata", {}).get("labels", {}).get(naming.LABEL_COMPONENT)
        if role not in DATA_ROLES:
            continue
        rec = rdma_record(pod)
        if rec is None:
            pending += 1
        elif rec.get("usable"):
            with_dev += 1
            names.update(str(d.get("name")) for d in rec.get("devices", []) if d.get("name"))
        else:
            without += 1
    summary = {"podsWithDevices": with_dev, "podsWithoutDevices": without,
               "devices": sorted(names)}
    if without:
        if spec["rdma"]["required"]:
            cond = {"status": "False", "reason": "DeviceMissing",
                    "message": f"{without} data pod(s) found no usable RDMA device and "
                               "rdma.required is set; they cannot start"}
        else:
            cond = {"status": "False", "reason": "NoDevice",
                    "message": f"{without} of {with_dev + without} data pods found no usable "
                               "RDMA device (KV moves over TCP either way, see KVTransport)"}
    elif with_dev and not pending:
        cond = {"status": "True", "reason": "DevicesFound",
                "message": f"{with_dev} data pods see {', '.join(sorted(names))} (EXPERIMENTAL: "
                           "KV still moves over TCP, see KVTransport)"}
    else:
        cond = {"status": "Unknown", "reason": "ProbePending",
                "message": f"waiting for the rdma-probe of {pending or 'every'} data pod(s)"}
    return {"type": "RDMAReady", **cond}, summary


def _pod_problems(pods: Sequence[Obj]) -> list[str]:
    out = []
    for pod in pods:
        st = pod.get("status", {})
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            reason = (cs.get("state") or {}).get("waiting", {}).get("reason")
            if reason in _BAD_WAITING:
                out.append(f"{pod['metadata']['name']}/{cs.get('name')}: {reason}")
    return sorted(out)


def _merge_conditions(old: Sequence[Obj], new: list[Obj], now: str, gen: int) -> list[Obj]:
    prev = {c.get("type"): c for c in old}
    out = []
    for c in new:
        p = prev.get(c["type"])
        same = p is not None and p.get("status") == c["status"]
        c = {**c, "observedGeneration": gen,
             "lastTransitionTime": p.get("lastTransitionTime", now) if same and p else now}
        c.setdefault("message", "")
        out.append(c)
    return out


def aggregate(cluster: Obj, rendered: Rendered, observed: Observed, now: str) -> Obj:
    """The status body for `cluster` (conditions merged with the ones it already has)."""
    spec, meta = cluster["spec"], cluster["metadata"]
    gen = int(meta.get("generation", 0))
    roles = {r: _role_status(r, rendered.replicas[r], observed.workloads.get(r),
                             rendered.revisions[r]) for r in ROLES}
    not_ready = [f"{r} {s['readyReplicas']}/{s['replicas']} ready"
                 + (f", {s['updatedReplicas']} updated" if s["updatedReplicas"] < s["replicas"]
                    else "")
                 for r, s in roles.items() if not _ready(s)]
    zero = [r for r in ("conductor", "prefill", "decode") if roles[r]["replicas"] == 0]
    rdma_cond, rdma_summary = _rdma(spec, observed.pods)
    problems = _pod_problems(observed.pods)
    conds: list[Obj] = []

    if observed.error:
        conds.append({"type": "Ready", "status": "False", "reason": "InvalidSpec",
                      "message": observed.error})
    elif zero:
        conds.append({"type": "Ready", "status": "False", "reason": "ScaledToZero",
                      "message": f"{', '.join(zero)} scaled to zero; requests cannot be served"})
    elif not_ready:
        conds.append({"type": "Ready", "status": "False", "reason": "RolesNotReady",
                      "message": "; ".join(not_ready)})
    else:
        conds.append({"type": "Ready", "status": "True", "reason": "AllRolesReady",
                      "message": "every role is ready at its current revision"})

    rolling = [r for r, s in roles.items() if s["updatedReplicas"] < s["replicas"]]
    scaling = [r for r, s in roles.items() if r not in rolling and _count(observed, r) != s[
        "replicas"]]
    if rolling:
        conds.append({"type": "Progressing", "status": "True", "reason": "RollingOut",
                      "message": f"updating {', '.join(rolling)}"})
    elif scaling:
        conds.append({"type": "Progressing", "status": "True", "reason": "Scaling",
                      "message": f"scaling {', '.join(scaling)}"})
    else:
        conds.append({"type": "Progressing", "status": "False", "reason": "Stable",
                      "message": "no rollout or scaling in progress"})

    degraded = ([observed.error] if observed.error else []) + problems + list(observed.conductor)
    if rdma_cond is not None and rdma_cond["reason"] == "DeviceMissing":
        degraded.append(rdma_cond["message"])
    conds.append({"type": "Degraded", "status": "True" if degraded else "False",
                  "reason": ("InvalidSpec" if observed.error else "PodsFailing" if problems
                             else "TokenizerMismatch" if observed.conductor
                             else "RDMADeviceMissing") if degraded else "AsExpected",
                  "message": "; ".join(degraded)[:1000]})

    kv_ready = _ready(roles["master"]) and _ready(roles["store"]) and roles["store"][
        "replicas"] > 0
    usage = observed.store
    if kv_ready:
        detail = (f"{usage.used_bytes} of {usage.capacity_bytes} bytes used"
                  if usage else "master metrics not read yet")
        conds.append({"type": "KVStoreReady", "status": "True", "reason": "StoreReady",
                      "message": detail})
    else:
        conds.append({"type": "KVStoreReady", "status": "False", "reason": "StoreNotReady",
                      "message": f"master {roles['master']['readyReplicas']}/"
                                 f"{roles['master']['replicas']}, store "
                                 f"{roles['store']['readyReplicas']}/"
                                 f"{roles['store']['replicas']} ready"})
    transport, transport_cond = kv_transport(spec)
    conds.append(transport_cond)
    if rdma_cond is not None:
        conds.append(rdma_cond)

    conds += kstatus_conditions(conds[0], conds[1])

    old = (cluster.get("status") or {}).get("conditions") or []
    ns = meta.get("namespace") or "default"
    port = spec["roles"]["conductor"]["service"]["port"]
    host = naming.service_fqdn(naming.name(meta["name"], "conductor"), ns, spec["clusterDomain"])
    status: Obj = {
        "observedGeneration": gen,
        "conditions": _merge_conditions(old, conds, now, gen),
        "roles": roles,
        "servingRevision": rendered.serving_revision,
        "endpoint": f"http://{host}:{port}/v1",
        "store": _store(spec, rendered, usage),
        "kvTransport": transport,
    }
    if rdma_summary:
        status["rdma"] = rdma_summary
    status.update(_prefill_groups(spec, rendered, observed))
    return status


def _prefill_groups(spec: Obj, rendered: Rendered, observed: Observed) -> Obj:
    """status.prefillGroups (only with pipeline groups): whole groups of the prefill pods
    observed, and restarts."""
    if admission.group_size(spec) == 1:
        return {}
    pods = [p for p in observed.pods
            if p.get("metadata", {}).get("labels", {}).get(naming.LABEL_COMPONENT) == "prefill"]
    out: Obj = groups.summary(pods, rendered.replicas["prefill"], admission.group_size(spec))
    out["restarts"] = observed.group_restarts
    return {"prefillGroups": out}


def kstatus_conditions(ready: Obj, progressing: Obj) -> list[Obj]:
    """`Reconciling` and `Stalled`, the abnormal-true pair kstatus reads (Flux's health checks,
    kstatus-based tools): Stalled while only a spec change can help (an invalid spec), so Flux
    fails at once instead of waiting for its timeout; Reconciling while the operator is still
    moving the cluster toward its spec. Both False once it got there (Ready, or deliberately
    scaled to zero). Pods that crash keep Reconciling True: a missing Secret or image may
    appear, so the health check's timeout decides."""
    if ready["reason"] == "InvalidSpec":
        return [{"type": "Reconciling", "status": "False", "reason": "InvalidSpec",
                 "message": "nothing is applied until the spec is fixed"},
                {"type": "Stalled", "status": "True", "reason": "InvalidSpec",
                 "message": ready["message"]}]
    stalled = {"type": "Stalled", "status": "False", "reason": "AsExpected", "message": ""}
    if progressing["status"] == "True":
        busy = progressing
    elif ready["status"] != "True" and ready["reason"] != "ScaledToZero":
        busy = ready
    else:
        return [{"type": "Reconciling", "status": "False", "reason": "Reconciled",
                 "message": "the cluster matches its spec"}, stalled]
    return [{"type": "Reconciling", "status": "True", "reason": busy["reason"],
             "message": busy["message"]}, stalled]


def _count(observed: Observed, role: str) -> int | None:
    wl = observed.workloads.get(role)
    return None if wl is None else int(wl.get("status", {}).get("replicas", 0))


def _tenant(t: TenantUsage) -> Obj:
    row: Obj = {"tenant": t.tenant, "dramUsedBytes": t.dram_used, "ssdUsedBytes": t.ssd_used,
                "evictions": t.evictions, "refusals": t.refusals}
    if t.dram_quota is not None:
        row["dramQuotaBytes"] = t.dram_quota
    if t.ssd_quota is not None:
        row["ssdQuotaBytes"] = t.ssd_quota
    return row


def _store(spec: Obj, rendered: Rendered, usage: StoreUsage | None) -> Obj:
    if usage is not None:
        out: Obj = {"capacityBytes": usage.capacity_bytes, "usedBytes": usage.used_bytes}
        if usage.hit_rate is not None:
            out["hitRate"] = round(usage.hit_rate, 4)
        if usage.tenants:
            out["tenants"] = [_tenant(t) for t in usage.tenants]
        return out
    # Until the master answers, report the configured capacity so the column is never empty.
    per_node = naming.parse_bytes(spec["store"]["dramPerNode"])
    if "ssd" in spec["store"]:
        per_node += naming.parse_bytes(spec["store"]["ssd"]["size"]) * 95 // 100
    return {"capacityBytes": per_node * rendered.replicas["store"]}
