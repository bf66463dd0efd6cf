"""The kopf handlers end to end against KMock, an in-memory Kubernetes API emulator.

KMock merges PATCH bodies as plain dicts and does not create objects on server-side apply, so
`ApplyingEmulator` adds what the operator relies on: apply creates or updates (fields applied
earlier by the same manager and now absent are removed, everything else is kept, as with real
SSA), an apply that changes nothing creates no new version (the API server's no-op), and
created objects get a uid. Everything else (watch streams, finalizers, merge patches of status
and scale, events) is KMock's own behaviour. The operator runs in namespace-restricted mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import kmock
import kopf
import pytest

from mooncake_k8s.operator.handlers import build_registry
from mooncake_k8s.operator.reconcile import OperatorConfig
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.schema import cluster_schema
from mooncake_k8s.operator.validation import validate, validate_cluster

Obj = dict[str, Any]
NS = "ml"
MCC = "mooncake.io/v1alpha1/mooncakeclusters"
MCRS = "mooncake.io/v1alpha1/mooncakerolescalers"
RESOURCES = {
    MCC: ("MooncakeCluster", {"status"}),
    MCRS: ("MooncakeRoleScaler", {"status", "scale"}),
    "v1/events": ("Event", set()), "v1/configmaps": ("ConfigMap", set()),
    "v1/services": ("Service", set()), "v1/secrets": ("Secret", set()),
    "v1/pods": ("Pod", set()),
    "apps/v1/statefulsets": ("StatefulSet", {"status"}),
    "apps/v1/deployments": ("Deployment", {"status"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", set()),
}
PLURAL = {kind: res for res, (kind, _) in RESOURCES.items()}
pytestmark = [pytest.mark.timeout(60)]


def _ssa_merge(current: Any, applied: Any, last: Any) -> Any:
    if isinstance(current, dict) and isinstance(applied, dict):
        out = dict(current)
        for k, v in applied.items():
            out[k] = _ssa_merge(current.get(k), v, (last or {}).get(k))
        for k in (last or {}):
            if k not in applied:
                out.pop(k, None)
        return out
    return copy.deepcopy(applied)


@attrs.define(kw_only=True)
class ApplyingEmulator(kmock.KubernetesEmulator):
    _applied: dict[Any, Obj] = attrs.field(factory=dict, init=False)
    _ids: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    absent: set[Any] = attrs.field(factory=set, init=False)
    """Resources this API server does not serve (their CRDs not installed): 404."""

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.resource in self.absent:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message="the server could not find the requested "
                                                "resource")
        ctype = {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
        if request.resource is not None and request.method == "PATCH" and ctype.startswith(
                "application/apply-patch") and not request.subresource:
            return await self._apply(request)
        n = next(self._ids)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", f"uid-{n}")
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = str(n)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{n}"
        elif request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = str(n)
            if ("spec" in request.data and not request.subresource
                    and request.resource is not None and request.name is not None):
                # The API server bumps generation on a spec change; the operator's timer waits
                # for the change handler on it (without, the two raced on replica counts).
                current = self._objects[request.resource, request.namespace, request.name]
                gen = int(current.raw.get("metadata", {}).get("generation") or 1)
                request.data["metadata"]["generation"] = gen + 1
        elif request.action == kmock.action.UPDATE and isinstance(request.data, list):
            # kopf's JSON patches test metadata.resourceVersion first, like optimistic locking.
            request.data.append({"op": "add", "path": "/metadata/resourceVersion",
                                 "value": str(n)})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:  # a stale resourceVersion: 422, not 500
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e

    def _live(self, request: kmock.Request) -> list[Obj]:
        return [o.raw for (res, ns, _), o in self._objects.items()
                if res == request.resource and not o.deleted
                and (request.namespace is None or ns == request.namespace)]

    async def _serve_list(self, request: kmock.Request) -> Any:
        # A real list carries the resourceVersion a watch continues from (KMock sends '...').
        async with self._lock:
            items = self._live(request)
            rv = str(next(self._ids))
        return {"metadata": {"resourceVersion": rv}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        # A watch from a list's resourceVersion must not replay what that list returned;
        # KMock re-sends every object as ADDED, which makes kopf act on stale copies.
        since = request.params.get("resourceVersion", "")
        event: Any
        async for event in super()._serve_watch(request):
            o = event.get("object", {}) if isinstance(event, dict) else {}
            rv = o.get("metadata", {}).get("resourceVersion", "")
            if (since.isdigit() and rv.isdigit() and event.get("type") == "ADDED"
                    and int(rv) <= int(since)):
                continue
            yield event

    async def _apply(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        assert request.resource is not None and request.name is not None
        key: Any = (request.resource, request.namespace, request.name)
        async with self._lock:
            applied = request.data
            if key not in self._objects or self._objects[key].deleted:
                new = copy.deepcopy(applied)
                n = next(self._ids)
                new["metadata"]["uid"] = f"uid-{n}"
                new["metadata"]["resourceVersion"] = str(n)
                if key in self._objects:
                    self._objects[key].create(new)
                else:
                    self._objects[key] = new
                event = "ADDED"
            else:
                current = self._objects[key].raw
                new = _ssa_merge(current, applied, self._applied.get(key))
                event = "MODIFIED" if new != current else ""
                if event:
                    new["metadata"]["resourceVersion"] = str(next(self._ids))
                    self._objects[key].history.append(kmock.ObjectVersion(new))
            self._applied[key] = copy.deepcopy(applied)
            if event:
                await self._buses[request.resource].put({"type": event, "object": new})
        return aiohttp.web.json_response(new)


@contextlib.asynccontextmanager
async def emulator() -> AsyncIterator[ApplyingEmulator]:
    async with ApplyingEmulator() as emu, kmock.Server(emu):
        verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
        for res, (kind, subs) in RESOURCES.items():
            emu.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=True,
                                                    subresources=subs, verbs=verbs)
        # kopf waits for these two in discovery even when it neither scans nor lists them.
        emu.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False,
                                                            verbs=verbs)
        emu.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs=verbs)
        yield emu


def scenario(fn: Callable[[ApplyingEmulator], Awaitable[None]]) -> Callable[[], None]:
    """A plain test running `fn` against a fresh emulator in its own, properly closed loop."""
    def test() -> None:
        async def main() -> None:
            async with emulator() as k8s:
                await fn(k8s)
        asyncio.run(main())
    # Not functools.wraps: pytest would read fn's signature and look for a `k8s` fixture.
    test.__name__, test.__doc__ = fn.__name__, fn.__doc__
    return test


@contextlib.asynccontextmanager
async def operator(k8s: ApplyingEmulator, clock: Callable[[], float] | None = None
                   ) -> AsyncIterator[None]:
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(k8s.url).rstrip("/"))

    config = OperatorConfig(namespaces=[NS], sync_interval_s=0.5, resync_interval_s=3600)
    registry = build_registry(config, login, **({"clock": clock} if clock else {}))
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.1
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        registry=registry, settings=settings, standalone=True, namespaces=[NS],
        stop_flag=stop, ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    last: BaseException | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            got = check()
            if got:
                return got
        except (KeyError, ValueError, AssertionError, StopIteration, TypeError) as e:
            last = e
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met in {timeout}s (last error: {last!r})")


def obj(k8s: ApplyingEmulator, kind: str, name: str) -> Obj:
    o = k8s.objects[PLURAL[kind], NS, name]
    if o.deleted:
        raise KeyError(name)
    raw: Obj = o.raw
    return raw


def versions(k8s: ApplyingEmulator, kind: str, name: str) -> int:
    return len([v for v in k8s.objects[PLURAL[kind], NS, name].history if v is not None])


def cond(status: Obj, typ: str) -> Obj:
    c: Obj = next(c for c in status["conditions"] if c["type"] == typ)
    return c


async def api(k8s: ApplyingEmulator, method: str, path: str, body: Any = None,
              ctype: str = "application/merge-patch+json") -> Any:
    async with aiohttp.ClientSession() as s, s.request(
            method, str(k8s.url).rstrip("/") + path, json=body,
            headers={"Content-Type": ctype}) as r:
        assert r.status < 400, await r.text()
        return await r.json()


CLUSTERS = f"/apis/mooncake.io/v1alpha1/namespaces/{NS}/mooncakeclusters"


def manifest(spec: Obj | None = None) -> Obj:
    return {"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
            "metadata": {"name": "demo", "namespace": NS}, "spec": spec or {}}


async def create(k8s: ApplyingEmulator, spec: Obj | None = None) -> Obj:
    # The API server would default the object before storing it; so does the test.
    body = validate_cluster(manifest(spec))
    out: Obj = await api(k8s, "POST", CLUSTERS, body, "application/json")
    return out


def events(k8s: ApplyingEmulator, reason: str) -> list[Obj]:
    return [o.raw for (res, _, _), o in k8s.objects.items()
            if res == kmock.resource("v1/events") and not o.deleted and o.get("reason") == reason]


@scenario
async def test_create_applies_every_child_and_reports_status(k8s: ApplyingEmulator) -> None:
    async with operator(k8s):
        cr = await create(k8s, {"roles": {"prefill": {"replicas": 2}}})
        status = await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]["roles"]
                                  and obj(k8s, "MooncakeCluster", "demo")["status"])
        expected = render(validate_cluster(cr), {"prefill": 2})
        for o in expected.objects:
            live = obj(k8s, o["kind"], o["metadata"]["name"])
            for key in ("spec", "data"):
                assert live.get(key) == o.get(key) or o["kind"] == "MooncakeRoleScaler", (
                    o["kind"], o["metadata"]["name"])
            assert live["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
        # Scalers: applied without replicas, then seeded through the scale subresource.
        assert obj(k8s, "MooncakeRoleScaler", "demo-prefill")["spec"]["replicas"] == 2
        token = obj(k8s, "Secret", "demo-cluster-token")
        assert len(token["data"]["token"]) > 40
        assert status["servingRevision"] == expected.serving_revision
        assert status["roles"]["prefill"]["revision"] == expected.revisions["prefill"]
        assert cond(status, "Ready")["status"] == "False"  # nothing runs pods in KMock
        assert cond(status, "KVStoreReady")["reason"] == "StoreNotReady"
        await eventually(lambda: events(k8s, "Applied"))
        assert "mooncake.io/finalizer" in obj(k8s, "MooncakeCluster", "demo")["metadata"][
            "finalizers"]
        # The timer publishes what an HPA reads from the scale subresource.
        sel = await eventually(lambda: obj(k8s, "MooncakeRoleScaler", "demo-decode")["status"][
            "selector"])
        assert sel == ("app.kubernetes.io/component=decode,app.kubernetes.io/instance=demo,"
                       "app.kubernetes.io/name=mooncake")


@scenario
async def test_spec_change_patches_only_what_changed(k8s: ApplyingEmulator) -> None:
    async with operator(k8s):
        await create(k8s)
        await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]["roles"])
        before = {k: versions(k8s, k, f"demo-{r}") for k, r in (
            ("StatefulSet", "prefill"), ("StatefulSet", "master"), ("Deployment", "conductor"))}
        old_decode = obj(k8s, "StatefulSet", "demo-decode")["spec"]["template"]
        await api(k8s, "PATCH", f"{CLUSTERS}/demo", {"spec": {
            "roles": {"decode": {"resources": {"requests": {"cpu": "3"}}},
                      "prefill": {"replicas": 3}}}})
        new_decode = await eventually(
            lambda: obj(k8s, "StatefulSet", "demo-decode")["spec"]["template"] != old_decode
            and obj(k8s, "StatefulSet", "demo-decode")["spec"]["template"])
        assert new_decode["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "3"
        await eventually(lambda: obj(k8s, "StatefulSet", "demo-prefill")["spec"]["replicas"] == 3)
        await eventually(lambda: obj(k8s, "MooncakeRoleScaler", "demo-prefill")["spec"][
            "replicas"] == 3)
        await eventually(lambda: events(k8s, "RolloutStarted"))
        assert "decode" in events(k8s, "RolloutStarted")[0]["message"]
        assert "prefill" not in events(k8s, "RolloutStarted")[0]["message"]
        # Unchanged workloads were re-applied but not modified (server-side apply no-ops).
        assert versions(k8s, "StatefulSet", "demo-master") == before["StatefulSet"]
        assert versions(k8s, "Deployment", "demo-conductor") == before["Deployment"]
        assert versions(k8s, "StatefulSet", "demo-prefill") == before["StatefulSet"] + 1


@scenario
async def test_gateway_route_waits_for_the_gateway_api(k8s: ApplyingEmulator) -> None:
    """spec.gateway on an API server without the Gateway API (the route's apply answers 404):
    every other child is applied and status reported. With the CRDs installed, the next apply
    creates the route, owned by the cluster (garbage-collected with it)."""
    route = "gateway.networking.k8s.io/v1/httproutes"
    k8s.absent.add(kmock.resource(route))
    async with operator(k8s):
        cr = await create(k8s, {"gateway": {"parentRefs": [{"name": "public"}]}})
        await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]["roles"])
        assert obj(k8s, "StatefulSet", "demo-decode")
        assert obj(k8s, "MooncakeRoleScaler", "demo-decode")["spec"]["replicas"] == 1
        assert (kmock.resource(route), NS, "demo-conductor") not in k8s.objects
        k8s.absent.clear()  # the Gateway API CRDs are installed
        await api(k8s, "PATCH", f"{CLUSTERS}/demo", {"spec": {"gateway": {
            "hostnames": ["llm.example.com"]}}})
        live = await eventually(lambda: k8s.objects[kmock.resource(route), NS,
                                                     "demo-conductor"].raw)
        assert live["spec"]["hostnames"] == ["llm.example.com"]
        assert live["spec"]["rules"][0]["backendRefs"][0]["name"] == "demo-conductor"
        assert live["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]


@scenario
async def test_scaling_the_scaler_resizes_the_workload(k8s: ApplyingEmulator) -> None:
    async with operator(k8s):
        await create(k8s)
        await eventually(lambda: obj(k8s, "MooncakeRoleScaler", "demo-decode")["spec"]
                         ["replicas"] == 1)
        # What `kubectl scale mcrs/demo-decode --replicas 4` or an HPA does.
        scale = f"/apis/mooncake.io/v1alpha1/namespaces/{NS}/mooncakerolescalers/demo-decode/scale"
        await api(k8s, "PATCH", scale, {"spec": {"replicas": 4}})
        await eventually(lambda: obj(k8s, "StatefulSet", "demo-decode")["spec"]["replicas"] == 4)
        await eventually(lambda: events(k8s, "Scaled"))
        await asyncio.sleep(1.2)  # a couple of timer passes: nothing may reset the count
        assert obj(k8s, "MooncakeRoleScaler", "demo-decode")["spec"]["replicas"] == 4
        assert obj(k8s, "StatefulSet", "demo-decode")["spec"]["replicas"] == 4
        assert obj(k8s, "MooncakeCluster", "demo")["spec"]["roles"]["decode"]["replicas"] == 1


@scenario
async def test_restart_reapplies_without_changing_anything(k8s: ApplyingEmulator) -> None:
    async with operator(k8s):
        await create(k8s)
        await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]["roles"])
        await asyncio.sleep(0.6)
    children = [(o["kind"], o["metadata"]["name"])
                for o in render(validate_cluster(manifest())).objects]
    before = {c: versions(k8s, *c) for c in children}
    def applies() -> int:
        return len([r for r in k8s if r.method == "PATCH"
                    and "apply-patch" in r.headers.get("Content-Type", "")])

    before_applies = applies()
    async with operator(k8s):  # on.resume re-applies every child
        await eventually(lambda: applies() >= before_applies + len(children))
        await asyncio.sleep(0.6)
    assert {c: versions(k8s, *c) for c in children} == before


@scenario
async def test_invalid_spec_is_reported_not_applied(k8s: ApplyingEmulator) -> None:
    async with operator(k8s):
        await create(k8s, {"store": {"dramPerNode": "8Gi"},
                           "roles": {"store": {"resources": {"limits": {"memory": "2Gi"}}}}})
        status = await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"])
        assert cond(status, "Degraded")["reason"] == "InvalidSpec"
        assert "limits.memory (2Gi)" in cond(status, "Degraded")["message"]
        assert cond(status, "Ready")["reason"] == "InvalidSpec"
        await eventually(lambda: events(k8s, "InvalidSpec"))
        with pytest.raises(KeyError):
            obj(k8s, "StatefulSet", "demo-store")


@scenario
async def test_pod_rules_the_crd_cannot_state_are_reported_not_applied(
        k8s: ApplyingEmulator) -> None:
    """The API server admits what the CRD allows (schema and CEL): a nodeSelector key is not
    checked there. The operator must still refuse to render pods the API server would refuse."""
    async with operator(k8s):
        body = validate(cluster_schema(), manifest({"roles": {"decode": {
            "nodeSelector": {"gpu type": "a100"}}}}))  # what the API server stores
        await api(k8s, "POST", CLUSTERS, body, "application/json")
        status = await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"])
        message = cond(status, "Degraded")["message"]
        assert cond(status, "Degraded")["reason"] == "InvalidSpec"
        assert "spec.roles.decode.nodeSelector[gpu type]: 'gpu type' must be a qualified " \
               "name" in message
        with pytest.raises(KeyError):
            obj(k8s, "StatefulSet", "demo-decode")


@scenario
async def test_delete_releases_the_cluster_and_leaves_children_to_gc(
        k8s: ApplyingEmulator) -> None:
    async with operator(k8s):
        cr = await create(k8s)
        await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["metadata"]["finalizers"])
        await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]["roles"])
        await api(k8s, "DELETE", f"{CLUSTERS}/demo")
        await eventually(lambda: k8s.objects[MCC, NS, "demo"].deleted)
        # The API server's garbage collector deletes what the cluster controls.
        for o in render(validate_cluster(cr)).objects:
            refs = obj(k8s, o["kind"], o["metadata"]["name"])["metadata"]["ownerReferences"]
            assert refs == [{"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
                             "name": "demo", "uid": cr["metadata"]["uid"], "controller": True,
                             "blockOwnerDeletion": True}]


@scenario
async def test_autoscaler_reads_conductor_metrics_and_scales(k8s: ApplyingEmulator) -> None:
    text = ('mooncake_conductor_queue_tokens{role="prefill"} 40000\n'
            'mooncake_conductor_queue_tokens{role="decode"} 100\n'
            "mooncake_conductor_predicted_ttft_headroom_ms -50\n")
    master = ('mooncake_store_capacity_bytes{segment="s",tier="dram"} 1000\n'
              'mooncake_store_used_bytes{segment="s",tier="dram"} 250\n')
    async def conductor_metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=text)

    async def master_metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=master)

    app = aiohttp.web.Application()
    app.router.add_get("/c/metrics", conductor_metrics)
    app.router.add_get("/m/metrics", master_metrics)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        for role, port_name in (("conductor", "metrics"), ("master", "metrics")):
            # Pods as the kubelet would report them, declaring where their metrics are (the
            # Conductor's on its own `metrics` port, apart from the API's `http`).
            k8s.objects["v1/pods", NS, f"demo-{role}-0"] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"demo-{role}-0", "namespace": NS, "labels": {
                    "app.kubernetes.io/name": "mooncake", "app.kubernetes.io/instance": "demo",
                    "app.kubernetes.io/component": role}},
                "spec": {"containers": [{"name": role, "ports": [
                    {"name": port_name, "containerPort": port}]}]},
                "status": {"podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True"}]}}
        # Pod ports are per pod; point each at its own path on the shared test server.
        app_paths = {"conductor": "/c/metrics", "master": "/m/metrics"}
        from mooncake_k8s.operator import reconcile

        orig = reconcile._pod_urls
        reconcile._pod_urls = lambda pods, role: [  # type: ignore[assignment]
            u.replace("/metrics", app_paths.get(role, "/metrics")) for u in orig(pods, role)]
        try:
            async with operator(k8s):
                await create(k8s, {"autoscaling": {"enabled": True, "intervalSeconds": 5,
                                                   "scaleUpStabilizationSeconds": 0,
                                                   "targetQueueTokensPerPrefill": 8192}})
                await eventually(lambda: obj(k8s, "StatefulSet", "demo-prefill")["spec"][
                    "replicas"] == 5, timeout=15)
                assert obj(k8s, "MooncakeRoleScaler", "demo-prefill")["spec"]["replicas"] == 5
                # ratio.max 4: decode follows to 2 (the same apply, one object later)
                await eventually(lambda: obj(k8s, "StatefulSet", "demo-decode")["spec"][
                    "replicas"] == 2, timeout=15)
                st = await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]
                                      .get("autoscaling"))
                assert (st["prefill"], st["decode"]) == (5, 2)
                assert "TTFT headroom -50ms" in st["reason"]
                await eventually(lambda: events(k8s, "Autoscaled"))
                store = await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"]
                                         ["store"].get("usedBytes") is not None and
                                         obj(k8s, "MooncakeCluster", "demo")["status"]["store"])
                assert store == {"capacityBytes": 1000, "usedBytes": 250}
        finally:
            reconcile._pod_urls = orig
    finally:
        await runner.cleanup()


PODS = f"/api/v1/namespaces/{NS}/pods"


def _stage_pod(template: Obj, index: int) -> Obj:
    """A prefill pod as the StatefulSet would create it from `template`, running for an hour."""
    labels = {**template["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(index)}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"demo-prefill-{index}", "namespace": NS, "labels": labels,
                         "creationTimestamp": "2020-01-01T00:00:00Z"},
            "spec": {"containers": [{"name": "prefill", "image": "x"}]},
            "status": {"containerStatuses": [{"name": "prefill", "restartCount": 0}]}}


@scenario
async def test_a_stage_that_restarts_alone_restarts_its_group(k8s: ApplyingEmulator) -> None:
    """Two groups of two stages: stage 1 of g0 restarts (its restartCount grows), so the
    operator deletes stage 0 of g0 (the StatefulSet would start it again) and nothing of g1,
    posts GroupRestarted and counts it in status.prefillGroups."""
    async with operator(k8s):
        await create(k8s, {"roles": {"prefill": {"replicas": 4, "pipelineGroupSize": 2}}})
        template = await eventually(
            lambda: obj(k8s, "StatefulSet", "demo-prefill")["spec"]["template"])
        for i in range(4):
            await api(k8s, "POST", PODS, _stage_pod(template, i), "application/json")
        # Until the operator has seen the pod once, a restart is its first sight: restart it
        # again until the operator acts (each restart is an increase it can compare with).
        stage_0 = k8s.objects[PLURAL["Pod"], NS, "demo-prefill-0"]
        deadline = asyncio.get_running_loop().time() + 10
        restarts = 0
        while not stage_0.deleted:
            assert asyncio.get_running_loop().time() < deadline, "stage 0 was never restarted"
            restarts += 1
            await api(k8s, "PATCH", f"{PODS}/demo-prefill-1", {"status": {
                "containerStatuses": [{"name": "prefill", "restartCount": restarts}]}})
            await asyncio.sleep(0.2)
        for name in ("demo-prefill-1", "demo-prefill-2", "demo-prefill-3"):
            assert obj(k8s, "Pod", name)  # the restarted stage itself and the other group stay
        event = await eventually(lambda: events(k8s, "GroupRestarted"))
        assert "g0" in event[0]["message"] and "demo-prefill-0" in event[0]["message"]
        groups = await eventually(lambda: obj(k8s, "MooncakeCluster", "demo")["status"][
            "prefillGroups"]["restarts"] == 1 and obj(k8s, "MooncakeCluster", "demo")[
            "status"]["prefillGroups"])
        assert groups["size"] == 2 and groups["total"] == 2
