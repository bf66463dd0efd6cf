"""kopf handlers: thin shells over `reconcile` (I/O) and the pure render/status/autoscaler.

`build_registry` returns a fresh `kopf.OperatorRegistry` instead of decorating module globals,
so the CLI and each test get their own handlers, runtime and login.

- create / update / resume of a MooncakeCluster: render, apply, patch status, post an event
  when a role's revision changes. A spec that cannot be rendered is a permanent error reported
  as Degraded/InvalidSpec; API failures are retried.
- a timer per cluster: aggregate status from the children, run the SLO autoscaler, re-apply
  when the replica counts moved or the drift-repair interval passed.
- events on MooncakeRoleScalers: re-apply the owning cluster as soon as HPA/KEDA/`kubectl
  scale` changes a count, without writing anything to the scaler itself.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import kopf
from prometheus_client import Counter, Histogram

from mooncake_k8s.operator import autoscaler, groups, render, status
from mooncake_k8s.operator import reconcile as rc
from mooncake_k8s.operator.kube import ApiError, KubeClient
from mooncake_k8s.operator.schema import GROUP, ROLES, VERSION

Login = Callable[..., Awaitable[kopf.ConnectionInfo | None] | kopf.ConnectionInfo | None]
CLUSTERS = (GROUP, VERSION, "mooncakeclusters")
SCALERS = (GROUP, VERSION, "mooncakerolescalers")

log = logging.getLogger(__name__)
RECONCILES = Counter("mooncake_operator_reconciles", "Cluster applies by trigger and result",
                     ["trigger", "result"])
APPLY_SECONDS = Histogram("mooncake_operator_apply_seconds", "Time to apply one cluster")
DECISIONS = Counter("mooncake_operator_autoscaler_decisions",
                    "Autoscaler decisions that changed replicas", ["role", "direction"])


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def build_registry(config: rc.OperatorConfig, login: Login = _default_login,
                   clock: Callable[[], float] = time.monotonic) -> kopf.OperatorRegistry:
    """A fresh registry with every handler bound to one `_Handlers` (one runtime, one login)."""
    registry = kopf.OperatorRegistry()
    h = _Handlers(config, login, clock)
    kopf.on.startup(registry=registry)(_configure)
    kopf.on.login(registry=registry)(h.do_login)
    kopf.on.cleanup(registry=registry)(h.cleanup)
    kopf.on.create(*CLUSTERS, registry=registry)(h.on_create)
    kopf.on.update(*CLUSTERS, registry=registry)(h.on_update)
    kopf.on.resume(*CLUSTERS, registry=registry)(h.on_resume)
    kopf.on.delete(*CLUSTERS, registry=registry, optional=True)(h.on_delete)
    kopf.timer(*CLUSTERS, registry=registry, interval=config.sync_interval_s,
               initial_delay=min(5.0, config.sync_interval_s))(h.sync)
    kopf.on.event(*SCALERS, registry=registry)(h.scaler_event)
    kopf.on.event("v1", "pods", registry=registry,
                  labels={groups.LABEL_GROUP_SIZE: kopf.PRESENT})(h.pod_event)
    return registry


async def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Handler log lines stay logs; the events users see are the ones posted below.
    settings.posting.level = logging.WARNING
    # One discovery at start-up: the CRDs are installed before the operator (their chart
    # comes first), and watching CRDs would need cluster-wide RBAC in namespaced mode.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60


class _Handlers:
    """The handlers of one registry and what they share: the runtime (client, per-cluster
    memory), the current login and the clock. Each method is one kopf handler or a step of one."""

    def __init__(self, config: rc.OperatorConfig, login: Login,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.login = login
        self.clock = clock
        self.info: dict[str, kopf.ConnectionInfo] = {}
        self.runtime = rc.Runtime(config, KubeClient(self.connection))

    async def connection(self) -> kopf.ConnectionInfo:
        return self.info["current"]

    async def do_login(self, **kwargs: Any) -> kopf.ConnectionInfo | None:
        got = self.login(**kwargs)
        result = await got if isinstance(got, Awaitable) else got
        if result is not None:
            self.info["current"] = result
            await self.runtime.client.close()  # reconnect with the new credentials
        return result

    async def cleanup(self, **_: Any) -> None:
        await self.runtime.close()

    async def on_create(self, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await self.apply_and_report(body, patch, "create")

    async def on_update(self, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await self.apply_and_report(body, patch, "update")

    async def on_resume(self, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        await self.apply_and_report(body, patch, "resume")

    async def on_delete(self, body: kopf.Body, **_: Any) -> None:
        # Children carry controller ownerReferences: the API server's garbage collector
        # deletes them. Only our in-memory state is ours to drop.
        self.runtime.forget(body)
        log.info("cluster %s deleted; its children are garbage-collected through "
                 "ownerReferences", body["metadata"]["name"])

    async def apply_and_report(self, body: kopf.Body, patch: kopf.Patch, trigger: str) -> None:
        """Apply on a change of the cluster; an unrenderable spec is a permanent error."""
        cluster = rc.plain(body)
        old_status = cluster.get("status") or {}
        started = time.perf_counter()
        try:
            rendered, _ = await rc.apply(self.runtime, cluster)
        except render.SpecError as e:
            RECONCILES.labels(trigger, "invalid").inc()
            await _report_invalid(self.runtime, cluster, patch, str(e))
            kopf.warn(body, reason="InvalidSpec", message=str(e))
            raise kopf.PermanentError(str(e)) from e
        except ApiError as e:
            RECONCILES.labels(trigger, "error").inc()
            if e.retryable:
                raise kopf.TemporaryError(str(e), delay=10) from e
            raise kopf.PermanentError(str(e)) from e
        APPLY_SECONDS.observe(time.perf_counter() - started)
        RECONCILES.labels(trigger, "applied").inc()
        mem = self.runtime.memory(cluster)
        mem.last_apply = self.clock()
        mem.last_counts = dict(rendered.replicas)
        _announce(body, old_status, rendered)
        observed = await rc.observe(self.runtime, cluster)
        new = status.aggregate(cluster, rendered, observed, _now())
        patch.status.update(rc.status_patch(old_status, new))

    async def sync(self, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        """The timer: status from the children, the autoscaler, re-apply when due."""
        cluster = rc.plain(body)
        meta = cluster["metadata"]
        mem = self.runtime.memory(cluster)
        status_gen = (cluster.get("status") or {}).get("observedGeneration")
        if mem.last_apply == float("-inf") or status_gen != meta.get("generation", 0):
            return  # the change handlers have not applied this generation yet: theirs to do
        try:
            new = await self._sync(cluster, body, patch, mem)
        except render.SpecError:
            return  # reported by the change handlers; nothing to sync until the spec changes
        except ApiError as e:
            raise kopf.TemporaryError(str(e), delay=10) from e
        patch.status.update(rc.status_patch(cluster.get("status") or {}, new))

    async def _sync(self, cluster: dict[str, Any], body: kopf.Body, patch: kopf.Patch,
                    mem: rc.ClusterMemory) -> dict[str, Any]:
        meta, spec = cluster["metadata"], cluster["spec"]
        ns = meta.get("namespace") or "default"
        runtime = self.runtime
        scalers = await rc.read_scalers(runtime.client, ns, meta["name"])
        reps = rc.resolve_replicas(spec, scalers)
        observed = await rc.observe(runtime, cluster)
        now = self.clock()
        if spec["autoscaling"]["enabled"]:
            decision = await rc.autoscale(
                runtime, cluster, observed,
                (reps.effective["prefill"], reps.effective["decode"]), now)
            if decision is not None:
                _record(body, patch, reps.effective, decision)
                reps.effective["prefill"], reps.effective["decode"] = (
                    decision.prefill, decision.decode)
        due = now - mem.last_apply >= self.config.resync_interval_s
        if due or reps.seeds or reps.effective != mem.last_counts:
            rendered, reps = await rc.apply(runtime, cluster)
            mem.last_apply, mem.last_counts = now, dict(rendered.replicas)
            observed = await rc.observe(runtime, cluster)
        else:
            rendered = render.render(cluster, reps.effective)
        new = status.aggregate(cluster, rendered, observed, _now())
        scalers = await rc.read_scalers(runtime.client, ns, meta["name"])
        await rc.publish_scaler_status(runtime, cluster, new, scalers)
        return new

    async def scaler_event(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        """A MooncakeRoleScaler moved a count: re-apply its cluster at once."""
        if type not in ("ADDED", "MODIFIED"):
            return
        spec = body.get("spec", {})
        ns = body["metadata"].get("namespace") or "default"
        key = (ns, spec.get("clusterName", ""))
        mem = self.runtime.clusters.get(key)
        wanted = spec.get("replicas")
        if (mem is None or mem.last_apply == float("-inf") or wanted is None
                or mem.last_counts.get(spec.get("role")) == wanted):
            return  # not applied by this process yet, or nothing moved
        cluster = await self.runtime.client.get(GROUP + "/" + VERSION, "MooncakeCluster", *key)
        if cluster is None or cluster["metadata"].get("deletionTimestamp"):
            return
        try:
            rendered, _reps = await rc.apply(self.runtime, cluster)
        except render.SpecError:
            return
        mem.last_apply, mem.last_counts = self.clock(), dict(rendered.replicas)
        RECONCILES.labels("scale", "applied").inc()
        kopf.event(kopf.Body(cast(kopf.RawBody, cluster)), type="Normal", reason="Scaled",
                   message=f"{spec.get('role')} -> {rendered.replicas[spec['role']]} replicas")


    async def pod_event(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        """A prefill pipeline stage changed: when it restarted alone, restart its group."""
        if type == "DELETED":
            return  # its next incarnation (a new uid) is what tells
        pod = rc.plain(body)
        ns = pod["metadata"].get("namespace") or "default"
        now = time.time()  # pod timestamps are wall-clock times
        if not groups.restarted(self.runtime.groups.setdefault(ns, groups.GroupMemory()),
                                pod, now):
            return
        try:
            gone = await rc.restart_group(self.runtime, pod, now)
        except ApiError as e:
            log.warning("prefill group of %s: could not restart its peers: %s",
                        pod["metadata"].get("name"), e)
            return
        if gone:
            kopf.event(body, type="Normal", reason="GroupRestarted",
                       message=f"{groups.group_name(pod)}: restarted alone; deleted "
                               f"{', '.join(gone)} so the group restarts together")


def _announce(body: kopf.Body, old_status: dict[str, Any], rendered: render.Rendered) -> None:
    """The user-facing event of an apply: the first one, or the roles whose revision moved."""
    old_revs = {r: (old_status.get("roles") or {}).get(r, {}).get("revision") for r in ROLES}
    changed = [r for r in ROLES if old_revs[r] and old_revs[r] != rendered.revisions[r]]
    if not old_status.get("roles"):
        kopf.event(body, type="Normal", reason="Applied",
                   message=f"applied {len(rendered.objects)} objects")
    elif changed:
        kopf.event(body, type="Normal", reason="RolloutStarted",
                   message=f"new revision for {', '.join(changed)} (serving revision "
                           f"{rendered.serving_revision})")


def _record(body: kopf.Body, patch: kopf.Patch, current: dict[str, int],
            decision: autoscaler.Decision) -> None:
    """Count and announce an autoscaler decision that changed replicas."""
    for role, new in (("prefill", decision.prefill), ("decode", decision.decode)):
        if new != current[role]:
            DECISIONS.labels(role, "up" if new > current[role] else "down").inc()
    if (decision.prefill, decision.decode) != (current["prefill"], current["decode"]):
        kopf.event(body, type="Normal", reason="Autoscaled", message=decision.reason)
        patch.status["autoscaling"] = {"prefill": decision.prefill,
                                       "decode": decision.decode,
                                       "reason": decision.reason[:500], "time": _now()}


async def _report_invalid(runtime: rc.Runtime, cluster: dict[str, Any], patch: kopf.Patch,
                          error: str) -> None:
    """Degraded/InvalidSpec in status, with whatever the children look like right now."""
    spec = cluster["spec"]
    counts = {r: int(spec["roles"][r]["replicas"]) for r in ROLES}
    rendered = render.Rendered([], {r: "" for r in ROLES}, "", counts)
    try:
        observed = await rc.observe(runtime, cluster, error)
    except ApiError:
        observed = status.Observed({}, [], None, error)
    new = status.aggregate(cluster, rendered, observed, _now())
    new.pop("servingRevision", None)
    for r in new["roles"].values():
        r.pop("revision", None)
    patch.status.update(rc.status_patch(cluster.get("status") or {}, new))
