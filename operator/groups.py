"""Prefill pipeline groups (roles.prefill.pipelineGroupSize): which pod is in which group, how
many groups are whole, and which pods to delete so a group restarts together.

A group is G consecutive pods of the prefill StatefulSet (pod index // G); each is one stage of
one pipeline. A stage that restarts alone comes back with none of the prompt state its peers
hold, so when one restarts (its container's restartCount grows, or the pod is deleted and the
StatefulSet creates it again) the operator deletes the group's other pods and the StatefulSet
(Parallel pod management) starts them again beside it. Two guards keep that from cascading:
pods the operator deleted itself are expected back (`GroupMemory.pending`), and a peer whose
current incarnation began within `TOGETHER_S` of the restart already restarted with it (a new
group's pods created together on a scale-up are not restarts of one another).

Pure: the kopf handler in `handlers.py` feeds pod events in and deletes what comes out.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.operator import naming

Obj = Mapping[str, Any]
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
# Set on prefill pods when pipelineGroupSize > 1 (the pod template's only group fact).
LABEL_GROUP_SIZE = "mooncake.io/pipeline-group-size"
TOGETHER_S = 30.0
"""Peers whose current incarnation began this recently count as restarted together."""
PENDING_S = 600.0
"""How long a pod the operator deleted is expected back (then forgotten)."""


def pod_index(pod: Obj) -> int | None:
    """The pod's ordinal: the StatefulSet's pod-index label, else its name's `-<n>` suffix."""
    meta = pod.get("metadata") or {}
    text = (meta.get("labels") or {}).get(POD_INDEX_LABEL)
    if text is None:
        m = re.search(r"-(\d+)$", str(meta.get("name", "")))
        text = m.group(1) if m else None
    return int(text) if text is not None and str(text).isdigit() else None


def group_size(pod: Obj) -> int:
    """The group size the pod was rendered with (1: not in a pipeline group)."""
    text = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_GROUP_SIZE, "1")
    return int(text) if str(text).isdigit() and int(text) >= 1 else 1


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def summary(pods: Iterable[Obj], replicas: int, size: int) -> dict[str, int]:
    """`status.prefillGroups`: groups wanted and groups whose every stage is ready (the
    Conductor routes only to those)."""
    ready: dict[int, set[int]] = {}
    for p in pods:
        index = pod_index(p)
        if index is not None and index < replicas and _ready(p) and not (
                p.get("metadata") or {}).get("deletionTimestamp"):
            ready.setdefault(index // size, set()).add(index % size)
    total = replicas // size
    whole = sum(1 for g in range(total) if len(ready.get(g, ())) == size)
    return {"size": size, "total": total, "whole": whole}


def _time(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _restarts(pod: Obj) -> int:
    return sum(int(c.get("restartCount") or 0)
               for c in (pod.get("status") or {}).get("containerStatuses") or [])


def began(pod: Obj) -> float | None:
    """When the pod's current incarnation began: its creation, or its containers' latest
    start when later (a container restart)."""
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    times = [_time(meta.get("creationTimestamp"))]
    for c in st.get("containerStatuses") or []:
        times.append(_time(((c.get("state") or {}).get("running") or {}).get("startedAt")))
    known = [t for t in times if t is not None]
    return max(known) if known else None


@dataclass
class Seen:
    uid: str
    restarts: int


@dataclass
class GroupMemory:
    """What the operator remembers between pod events (per process; lost on restart, which
    only means the first event of each pod after it is not a restart)."""

    seen: dict[str, Seen] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)


def restarted(memory: GroupMemory, pod: Obj, now: float) -> bool:
    """Record `pod` and say whether it restarted alone since last seen: a new incarnation
    (another uid) the operator did not cause, or a container restart."""
    meta = pod.get("metadata") or {}
    name, uid = str(meta.get("name", "")), str(meta.get("uid", ""))
    for old in [n for n, t in memory.pending.items() if now - t > PENDING_S]:
        del memory.pending[old]
    prev = memory.seen.get(name)
    memory.seen[name] = Seen(uid, _restarts(pod))
    if prev is None or group_size(pod) == 1 or meta.get("deletionTimestamp"):
        return False
    if prev.uid != uid:
        return memory.pending.pop(name, None) is None
    return _restarts(pod) > prev.restarts


def peers_to_delete(memory: GroupMemory, pod: Obj, peers: Iterable[Obj], now: float,
                    together_s: float = TOGETHER_S) -> list[Obj]:
    """The other pods of `pod`'s group that did not restart with it (call after `restarted`
    said True); they are remembered as pending, so their own return is no restart."""
    size, index = group_size(pod), pod_index(pod)
    if index is None or size == 1:
        return []
    name = (pod.get("metadata") or {}).get("name")
    out = []
    for p in peers:
        meta = p.get("metadata") or {}
        other = pod_index(p)
        if (other is None or other // size != index // size or meta.get("name") == name
                or meta.get("deletionTimestamp")):
            continue
        start = began(p)
        if start is not None and now - start <= together_s:
            continue  # it (re)started with this one
        memory.pending[str(meta.get("name"))] = now
        out.append(p)
    return sorted(out, key=lambda p: str(p["metadata"]["name"]))


def group_name(pod: Obj) -> str:
    """`g<index // size>`, the worker's group name (`MOONCAKE_PIPELINE_GROUP` `g{group}`)."""
    index = pod_index(pod)
    return "" if index is None else f"g{index // group_size(pod)}"


def prefill_selector(cluster: str) -> dict[str, str]:
    """The prefill pods of one cluster."""
    return naming.selector(cluster, "prefill")
