"""One reconcile of a MooncakeCluster against the API: the I/O around the pure functions.

`handlers.py` calls these; they call `render`, `status.aggregate` and `autoscaler.decide` and do
the reads and writes in between:

- replicas: each role's MooncakeRoleScaler holds the desired count (HPA, KEDA, `kubectl scale`
  or our autoscaler write it through the scale subresource). The operator copies
  `spec.roles.<role>.replicas` into it when the scaler is new or that spec value changed since
  it was last copied (recorded in an annotation): the latest deliberate change wins, and the
  operator remains the only writer of StatefulSet and Deployment replicas.
- apply: every rendered object with server-side apply and one field manager; the API server
  makes re-applying an unchanged object a no-op.
- the cluster token Secret is created once with a random value unless the spec names one.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from mooncake_k8s.operator import admission, autoscaler, groups, naming, render, status
from mooncake_k8s.operator.kube import ApiError, KubeClient
from mooncake_k8s.operator.metrics import StoreUsage, store_usage
from mooncake_k8s.operator.schema import ROLES

Obj = dict[str, Any]
SCALER = ("mooncake.io/v1alpha1", "MooncakeRoleScaler")
log = logging.getLogger(__name__)


@dataclass
class OperatorConfig:
    """Settings of one operator process (CLI flags); every field documents its unit."""

    namespaces: list[str] | None = None
    """Namespaces to watch; None watches the whole cluster."""
    sync_interval_s: float = 15.0
    """How often status is aggregated and the autoscaler runs, per cluster."""
    resync_interval_s: float = 300.0
    """How often every child is re-applied even without changes (repairs manual drift)."""
    scrape_timeout_s: float = 3.0
    """Timeout for reading one pod's /metrics."""
    peering: str | None = None
    """kopf peering name for HA (several replicas, one active); None runs standalone."""
    priority: int = 0
    """This replica's peering priority; the highest live one works, the others wait."""


@dataclass
class ClusterMemory:
    scaler: autoscaler.ScalerState = field(default_factory=autoscaler.ScalerState)
    last_apply: float = float("-inf")
    last_decision: float = float("-inf")
    last_counts: dict[str, int] = field(default_factory=dict)
    group_restarts: int = 0
    """Prefill groups restarted together since this process started (status.prefillGroups)."""


class Runtime:
    """What the handlers share for the life of the operator process."""

    def __init__(self, config: OperatorConfig, client: KubeClient) -> None:
        self.config = config
        self.client = client
        self.clusters: dict[tuple[str, str], ClusterMemory] = {}
        self.groups: dict[str, groups.GroupMemory] = {}  # namespace -> its prefill pods
        self._http: aiohttp.ClientSession | None = None
        self._stopped = False

    def memory(self, body: Mapping[str, Any]) -> ClusterMemory:
        key = (body["metadata"].get("namespace", ""), body["metadata"]["name"])
        return self.clusters.setdefault(key, ClusterMemory())

    def forget(self, body: Mapping[str, Any]) -> None:
        self.clusters.pop((body["metadata"].get("namespace", ""), body["metadata"]["name"]), None)

    async def scrape(self, urls: list[str]) -> list[str]:
        """GET each /metrics URL concurrently; unreachable ones are skipped."""
        if self._stopped:
            return []
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.scrape_timeout_s))
        http = self._http

        async def one(url: str) -> str | None:
            try:
                async with http.get(url) as r:
                    return await r.text() if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                return None

        return [t for t in await asyncio.gather(*(one(u) for u in urls)) if t is not None]

    async def conductor_reasons(self, pods: list[Obj]) -> list[str]:
        """What running but unready Conductor pods say about their model (`conductor_reasons`)."""
        if self._stopped:
            return []
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.scrape_timeout_s))
        return await conductor_reasons(self._http, pods)

    async def close(self) -> None:
        self._stopped = True
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()
        await self.client.stop()


def plain(body: Mapping[str, Any]) -> Obj:
    """A kopf body (or any mapping) as plain nested dicts."""
    def conv(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [conv(x) for x in v]
        return v
    return {k: conv(v) for k, v in body.items()}


@dataclass
class Replicas:
    effective: dict[str, int]
    seeds: dict[str, int]  # roles whose scaler must be (re)seeded with this count


def resolve_replicas(spec: Obj, scalers: Mapping[str, Obj]) -> Replicas:
    """Pure: each role's count from its scaler, or the spec when the spec changed last."""
    effective, seeds = {}, {}
    for role in ROLES:
        wanted = int(spec["roles"][role]["replicas"])
        sc = scalers.get(role)
        current = (sc or {}).get("spec", {}).get("replicas")
        seeded = (sc or {}).get("metadata", {}).get("annotations", {}).get(
            naming.ANNOTATION_SEED)
        if current is None or seeded != str(wanted):
            effective[role] = wanted
            seeds[role] = wanted
        else:
            effective[role] = int(current)
    if spec["metadataBackend"]["type"] != "redis" and effective["master"] > 1:
        effective["master"] = 1  # several masters need leader election (Redis)
    if spec["autoscaling"]["enabled"]:
        for role in ("prefill", "decode"):
            b = spec["autoscaling"][role]
            effective[role] = min(max(effective[role], b["minReplicas"]), b["maxReplicas"])
    # Prefill pipeline groups: a count HPA, KEDA or `kubectl scale` wrote that splits a group
    # gets the group's missing stages (a partial group would never be routed to).
    effective["prefill"] = autoscaler.whole_groups(effective["prefill"],
                                                   admission.group_size(spec))
    return Replicas(effective, seeds)


async def read_scalers(client: KubeClient, ns: str, cluster: str) -> dict[str, Obj]:
    items = await client.list(*SCALER, ns, naming.cluster_selector(cluster))
    return {o["spec"]["role"]: o for o in items if o.get("spec", {}).get("clusterName") == cluster}


async def ensure_token(client: KubeClient, cluster: Obj) -> bool:
    """Create `<name>-cluster-token` once (random) unless the spec names a Secret. Only
    `create` is called, never `get`: an existing token answers 409, so the operator's RBAC
    needs no read access to any Secret. Returns whether this call created it."""
    if cluster["spec"].get("clusterTokenSecret"):
        return False
    meta = cluster["metadata"]
    ns, name = meta.get("namespace") or "default", f"{meta['name']}-cluster-token"
    secret: Obj = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": ns,
                     "labels": naming.labels(meta["name"], "cluster")},
        "data": {"token": base64.b64encode(secrets.token_hex(32).encode()).decode()},
    }
    owner = render.owner_reference(cluster)
    if owner:
        secret["metadata"]["ownerReferences"] = [owner]
    try:
        await client.create(secret)
    except ApiError as e:
        if e.status != 409:  # it exists (an earlier pass or another replica made it): fine
            raise
        return False
    return True


async def apply(runtime: Runtime, cluster: Obj) -> tuple[render.Rendered, Replicas]:
    """Render and apply every child; seed scalers whose spec replicas changed."""
    client = runtime.client
    meta = cluster["metadata"]
    ns = meta.get("namespace") or "default"
    scalers = await read_scalers(client, ns, meta["name"])
    reps = resolve_replicas(cluster["spec"], scalers)
    rendered = render.render(cluster, reps.effective)
    # Remember the counts before writing: the scalers' own watch events then see nothing new.
    runtime.memory(cluster).last_counts = dict(rendered.replicas)
    await ensure_token(client, cluster)

    async def seed(roles: list[str]) -> None:
        for role in roles:
            await client.patch_merge(*SCALER, ns, naming.name(meta["name"], role),
                                     {"spec": {"replicas": reps.seeds[role]}},
                                     subresource="scale")

    # An existing scaler gets its new count before the seed annotation that records it: in
    # the other order a reader in between (the scaler's own watch event, the timer) sees the
    # annotation with the old count, takes the old count as the scaler's, and applies it.
    await seed([r for r in reps.seeds if r in scalers])
    for obj in rendered.objects:
        if obj["kind"] != "HTTPRoute":
            await client.apply(obj)
    await seed([r for r in reps.seeds if r not in scalers])  # created just above
    for route in rendered.by_kind("HTTPRoute"):
        await apply_route(client, route)
    return rendered, reps


async def apply_route(client: KubeClient, route: Obj) -> bool:
    """spec.gateway's HTTPRoute, applied last and never fatal: without the Gateway API CRDs
    (404) or the RBAC for httproutes (403, an older chart) the cluster still serves through
    its Service, the operator logs why, and the periodic re-apply tries again (so installing
    the CRDs later is enough). Other API errors propagate as usual."""
    try:
        await client.apply(route)
    except ApiError as e:
        if e.status not in (403, 404):
            raise
        log.warning("spec.gateway: HTTPRoute %s/%s not applied (%s); install the Gateway API "
                    "CRDs (gateway.networking.k8s.io/v1) and let the operator write "
                    "httproutes", route["metadata"]["namespace"], route["metadata"]["name"], e)
        return False
    return True


async def observe(runtime: Runtime, cluster: Obj, error: str | None = None) -> status.Observed:
    client = runtime.client
    meta = cluster["metadata"]
    ns, name = meta.get("namespace") or "default", meta["name"]
    sel = naming.cluster_selector(name)
    sts, deps, pods = await asyncio.gather(
        client.list("apps/v1", "StatefulSet", ns, sel),
        client.list("apps/v1", "Deployment", ns, sel),
        client.list("v1", "Pod", ns, sel))
    workloads = {o["metadata"]["labels"][naming.LABEL_COMPONENT]: o for o in sts + deps}
    usage, conductor = await asyncio.gather(_master_usage(runtime, pods),
                                            runtime.conductor_reasons(pods))
    return status.Observed(workloads, pods, usage, error, conductor=conductor,
                           group_restarts=runtime.memory(cluster).group_restarts)


async def conductor_reasons(http: aiohttp.ClientSession, pods: list[Obj]) -> list[str]:
    """`pod: message` for each Conductor pod that runs but is not ready because its tokenizer
    is not the workers' (the `TokenizerMatchesWorkers` condition of its /readyz JSON, on the
    metrics port): status reports it as Degraded, where a readiness probe says only 503."""
    targets = [(p["metadata"]["name"],
                f"http://{p['status']['podIP']}:{_metrics_port(p, 'conductor')}/readyz")
               for p in pods
               if p.get("metadata", {}).get("labels", {}).get(naming.LABEL_COMPONENT)
               == "conductor" and p.get("status", {}).get("podIP") and not _pod_ready(p)]

    async def one(url: str) -> Any:
        try:
            async with http.get(url, headers={"Accept": "application/json"}) as r:
                return await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    docs = await asyncio.gather(*(one(u) for _, u in targets))
    out = []
    for (name, _), doc in zip(targets, docs, strict=True):
        conds = doc.get("conditions") if isinstance(doc, dict) else None
        for c in conds if isinstance(conds, list) else []:
            if (isinstance(c, dict) and c.get("type") == "TokenizerMatchesWorkers"
                    and c.get("status") == "False"):
                out.append(f"{name}: {str(c.get('message', ''))[:400]}")
    return sorted(out)


def _metrics_port(pod: Obj, role: str) -> int:
    """The pod's own declaration of its metrics port (a podTemplate override may move it)."""
    name = naming.METRICS_PORT[role]
    for c in pod.get("spec", {}).get("containers", []) or []:
        for p in c.get("ports", []) or []:
            if p.get("name") == name:
                return int(p["containerPort"])
    return naming.PORTS[role][name]


def _pod_urls(pods: list[Obj], role: str) -> list[str]:
    return [f"http://{p['status']['podIP']}:{_metrics_port(p, role)}/metrics" for p in pods
            if p.get("metadata", {}).get("labels", {}).get(naming.LABEL_COMPONENT) == role
            and p.get("status", {}).get("podIP") and _pod_ready(p)]


def _pod_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []) or [])


async def _master_usage(runtime: Runtime, pods: list[Obj]) -> StoreUsage | None:
    for text in await runtime.scrape(_pod_urls(pods, "master")):
        usage = store_usage(text)
        if usage is not None:
            return usage
    return None


async def autoscale(runtime: Runtime, cluster: Obj, observed: status.Observed,
                    current: tuple[int, int], now: float) -> autoscaler.Decision | None:
    """Run one autoscaler step if due; write the scalers when the decision changes counts."""
    spec = cluster["spec"]
    mem = runtime.memory(cluster)
    if now - mem.last_decision < spec["autoscaling"]["intervalSeconds"] - 1e-6:
        return None
    texts = await runtime.scrape(_pod_urls(list(observed.pods), "conductor"))
    sample = autoscaler.sample_from_texts(texts, now)
    if sample is None:
        return None
    mem.last_decision = now
    decision = autoscaler.decide(autoscaler.Policy.from_spec(spec), current, mem.scaler, sample,
                                 autoscaler.ready_counts(observed.workloads))
    meta = cluster["metadata"]
    ns = meta.get("namespace") or "default"
    for role, count, old in (("prefill", decision.prefill, current[0]),
                             ("decode", decision.decode, current[1])):
        if count != old:
            await runtime.client.patch_merge(*SCALER, ns, naming.name(meta["name"], role),
                                             {"spec": {"replicas": count}}, subresource="scale")
    return decision


async def publish_scaler_status(runtime: Runtime, cluster: Obj, st: Obj,
                                scalers: Mapping[str, Obj]) -> None:
    """What HPA reads: the role's pod count and label selector (status.selector)."""
    meta = cluster["metadata"]
    ns = meta.get("namespace") or "default"
    for role in ROLES:
        want = {"replicas": st["roles"][role]["replicas"],
                "readyReplicas": st["roles"][role]["readyReplicas"],
                "selector": naming.selector_string(naming.selector(meta["name"], role))}
        have = (scalers.get(role) or {}).get("status") or {}
        if role in scalers and any(have.get(k) != v for k, v in want.items()):
            await runtime.client.patch_merge(*SCALER, ns, naming.name(meta["name"], role),
                                             {"status": want}, subresource="status")


async def restart_group(runtime: Runtime, pod: Obj, now: float) -> list[str]:
    """`pod`, a prefill pipeline stage, restarted alone: delete its group's other pods so the
    StatefulSet starts them again beside it (see `groups`). Returns the deleted pods' names."""
    meta = pod["metadata"]
    ns = meta.get("namespace") or "default"
    cluster = (meta.get("labels") or {}).get(naming.LABEL_INSTANCE, "")
    peers = await runtime.client.list("v1", "Pod", ns, groups.prefill_selector(cluster))
    memory = runtime.groups.setdefault(ns, groups.GroupMemory())
    gone = []
    for p in groups.peers_to_delete(memory, pod, peers, now):
        if await runtime.client.delete("v1", "Pod", ns, p["metadata"]["name"],
                                       uid=p["metadata"].get("uid")):
            gone.append(p["metadata"]["name"])
    if gone:
        runtime.clusters.setdefault((ns, cluster), ClusterMemory()).group_restarts += 1
        log.info("prefill group %s of %s/%s: %s restarted alone; deleted %s so the group "
                 "restarts together", groups.group_name(pod), ns, cluster, meta.get("name"),
                 ", ".join(gone))
    return gone


def status_patch(old: Mapping[str, Any], new: Obj) -> Obj:
    """Only the top-level status keys that changed, so an unchanged cluster writes nothing."""
    return {k: v for k, v in new.items() if old.get(k) != v}
