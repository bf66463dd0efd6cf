"""GitOps health of a MooncakeCluster: the kstatus conditions Flux reads (`Reconciling`,
`Stalled`) and the Argo CD health check (deploy/gitops/argocd-health.lua), run in a real Lua 5.1
interpreter (lupa; Argo CD embeds gopher-lua, a Lua 5.1) against status objects the operator's
own status aggregation produces.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import lupa.lua51 as lua51  # type: ignore[import-untyped]
import pytest
import yaml

from mooncake_k8s.operator import admission, naming, schema
from mooncake_k8s.operator.render import Rendered, render
from mooncake_k8s.operator.schema import ROLES
from mooncake_k8s.operator.schema_status import cluster_status_schema
from mooncake_k8s.operator.status import Observed, aggregate
from mooncake_k8s.operator.validation import InvalidResource, validate, validate_cluster

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[3]
LUA = REPO / "deploy" / "gitops" / "argocd-health.lua"
ARGOCD_CM = REPO / "deploy" / "gitops" / "argocd-cm.yaml"
HEALTH_KEY = "resource.customizations.health.mooncake.io_MooncakeCluster"
T0 = "2026-01-01T00:00:00Z"
GEN = 4


def _workload(role: str, want: int, ready: int, updated: int | None = None) -> Obj:
    return {"metadata": {"name": f"demo-{role}", "generation": 1,
                         "labels": {naming.LABEL_COMPONENT: role}},
            "status": {"observedGeneration": 1, "replicas": want, "readyReplicas": ready,
                       "updatedReplicas": ready if updated is None else updated}}


def _healthy(r: Rendered) -> dict[str, Obj]:
    return {role: _workload(role, r.replicas[role], r.replicas[role]) for role in ROLES}


def _crashing(role: str) -> Obj:
    return {"metadata": {"name": f"demo-{role}-0", "labels": {naming.LABEL_COMPONENT: role}},
            "status": {"containerStatuses": [{"name": role, "state": {
                "waiting": {"reason": "CrashLoopBackOff"}}}]}}


@pytest.fixture
def cluster(make_cluster: Callable[..., Obj]) -> tuple[Obj, Rendered]:
    c = validate_cluster(make_cluster())
    c["metadata"]["generation"] = GEN
    return c, render(c)


def _states(c: Obj, r: Rendered) -> dict[str, Obj]:
    """Named MooncakeClusters with the status the operator writes in each situation."""
    rolling = _healthy(r)
    rolling["decode"] = _workload("decode", 1, 1, updated=0)
    starting = _healthy(r)
    starting["store"] = _workload("store", 1, 0, updated=1)
    crashing = _healthy(r)
    crashing["decode"] = _workload("decode", 1, 0, updated=1)
    parked = render(c, {"prefill": 0, "decode": 0})
    observed = {
        "ready": (r, Observed(_healthy(r), [])),
        "rolling-out": (r, Observed(rolling, [])),
        "starting": (r, Observed(starting, [])),
        "crash-looping": (r, Observed(crashing, [_crashing("decode")])),
        "invalid-spec": (r, Observed({}, [], error="spec.roles.decode.nodeSelector[Bad Key]: "
                                                  "name part must consist of ...")),
        "scaled-to-zero": (parked, Observed(_healthy(parked), [])),
    }
    return {name: {**c, "status": aggregate(c, rr, o, T0)} for name, (rr, o) in observed.items()}


def _cond(obj: Obj, typ: str) -> Obj:
    found: Obj = next(c for c in obj["status"]["conditions"] if c["type"] == typ)
    return found


def kstatus(obj: Obj) -> str:
    """kstatus' reading of a custom resource with standard conditions (what Flux's
    healthChecks and `flux get` show): a stale observedGeneration or Reconciling=True is
    InProgress, Stalled=True is Failed, anything else Current."""
    st = obj.get("status") or {}
    if st.get("observedGeneration", 0) < obj["metadata"].get("generation", 0):
        return "InProgress"
    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
    if conds.get("Reconciling") == "True":
        return "InProgress"
    if conds.get("Stalled") == "True":
        return "Failed"
    return "Current"


@pytest.mark.parametrize(("state", "reconciling", "stalled", "flux"), [
    ("ready", ("False", "Reconciled"), ("False", "AsExpected"), "Current"),
    ("rolling-out", ("True", "RollingOut"), ("False", "AsExpected"), "InProgress"),
    ("starting", ("True", "RolesNotReady"), ("False", "AsExpected"), "InProgress"),
    # A crash loop may end (a Secret or an image appears): Flux's timeout decides, Argo CD
    # shows Degraded at once.
    ("crash-looping", ("True", "RolesNotReady"), ("False", "AsExpected"), "InProgress"),
    ("invalid-spec", ("False", "InvalidSpec"), ("True", "InvalidSpec"), "Failed"),
    ("scaled-to-zero", ("False", "Reconciled"), ("False", "AsExpected"), "Current"),
])
def test_kstatus_conditions(cluster: tuple[Obj, Rendered], state: str,
                            reconciling: tuple[str, str], stalled: tuple[str, str],
                            flux: str) -> None:
    obj = _states(*cluster)[state]
    for typ, (status, reason) in (("Reconciling", reconciling), ("Stalled", stalled)):
        c = _cond(obj, typ)
        assert (c["status"], c["reason"]) == (status, reason), typ
        assert c["observedGeneration"] == GEN and c["lastTransitionTime"] == T0
    assert kstatus(obj) == flux
    validate(cluster_status_schema(ROLES), obj["status"])  # the CRD accepts what is written
    if state == "invalid-spec":
        assert _cond(obj, "Stalled")["message"].startswith("spec.roles.decode.nodeSelector")


def test_a_new_generation_is_in_progress_until_observed(cluster: tuple[Obj, Rendered]) -> None:
    obj = _states(*cluster)["ready"]
    newer = {**obj, "metadata": {**obj["metadata"], "generation": GEN + 1}}
    assert kstatus(newer) == "InProgress"
    assert health(newer)["status"] == "Progressing"


# ---- Argo CD


def health(obj: Obj) -> dict[str, str]:
    """Run the health check as Argo CD does: `obj` a global, the chunk returns `hs`."""
    rt = lua51.LuaRuntime(unpack_returned_tuples=True)
    rt.globals().obj = rt.table_from(obj, recursive=True)
    hs = rt.execute(LUA.read_text())
    return {"status": hs["status"], "message": hs["message"]}


@pytest.mark.parametrize(("state", "status", "says"), [
    ("ready", "Healthy", "Ready (AllRolesReady)"),
    ("rolling-out", "Progressing", "Progressing (RollingOut): updating decode"),
    ("starting", "Progressing", "Ready (RolesNotReady): store 0/1 ready"),
    ("crash-looping", "Degraded", "demo-decode-0/decode: CrashLoopBackOff"),
    ("invalid-spec", "Degraded", "Stalled (InvalidSpec): spec.roles.decode.nodeSelector"),
    ("scaled-to-zero", "Suspended", "ScaledToZero"),
])
def test_argocd_health_of_operator_status(cluster: tuple[Obj, Rendered], state: str,
                                          status: str, says: str) -> None:
    hs = health(_states(*cluster)[state])
    assert hs["status"] == status
    assert says in hs["message"]


def test_argocd_health_without_status(make_cluster: Callable[..., Obj]) -> None:
    fresh = make_cluster()
    assert health(fresh) == {"status": "Progressing",
                             "message": "Waiting for the Mooncake operator to report status"}
    assert health({**fresh, "status": {"observedGeneration": 1}})["status"] == "Progressing"


def test_argocd_cm_carries_the_script(repo: Path) -> None:
    cm = yaml.safe_load(ARGOCD_CM.read_text())
    kubernetes_validate.validate(cm, "1.30", strict=True)
    assert (cm["metadata"]["name"], cm["metadata"]["namespace"]) == ("argocd-cm", "argocd")
    assert cm["data"] == {HEALTH_KEY: LUA.read_text()}


# ---- rules moved from the operator into the CRD (operator/schema_cel.py)

MOVED = {  # spec -> the field the rule names; admission.py refuses the same spec in code
    "dram-zero": ({"store": {"dramPerNode": 0}}, "spec.store.dramPerNode"),
    "dram-512Ki": ({"store": {"dramPerNode": "512Ki"}}, "spec.store.dramPerNode"),
    "dram-bytes": ({"store": {"dramPerNode": 1048575}}, "spec.store.dramPerNode"),
    "ssd-zero": ({"store": {"ssd": {"size": "0Gi"}}}, "spec.store.ssd.size"),
    "prefill-shm-zero": ({"roles": {"prefill": {"shmSize": 0}}}, "spec.roles.prefill.shmSize"),
    "decode-shm-zero": ({"roles": {"decode": {"shmSize": "0.0Mi"}}},
                        "spec.roles.decode.shmSize"),
    "staging-zero": ({"engine": {"kind": "sglang", "sidecar": {"stagingSize": 0}},
                      "model": {"pvc": {"claimName": "weights"}}},
                     "spec.engine.sidecar.stagingSize"),
    "hf-cache-zero": ({"model": {"huggingFace": {"id": "org/m", "cacheSize": "0"}}},
                      "spec.model.huggingFace.cacheSize"),
    "rdma-resource-unprefixed": ({"rdma": {"resourceName": "rdma"}}, "spec.rdma.resourceName"),
    "rdma-resource-kubernetes-io": ({"rdma": {"resourceName": "kubernetes.io/rdma"}},
                                    "spec.rdma.resourceName"),
    "rdma-resource-sub-kubernetes-io": ({"rdma": {"resourceName": "x.kubernetes.io/rdma"}},
                                        "spec.rdma.resourceName"),
    "rdma-protocol": ({"transferProtocol": "rdma", "rdma": {"enabled": True}},
                      "spec.transferProtocol"),
    "prefill-segment-512Ki": ({"roles": {"prefill": {"localSegmentSize": "512Ki"}}},
                              "spec.roles.prefill.localSegmentSize"),
    "decode-segment-bytes": ({"roles": {"decode": {"localSegmentSize": 1048575}}},
                             "spec.roles.decode.localSegmentSize"),
}
ADMITTED = {  # next to each boundary: both the CRD and the operator take these
    "dram-1Mi": {"store": {"dramPerNode": "1Mi"}},
    "dram-bytes": {"store": {"dramPerNode": 1048576}},
    "dram-decimal": {"store": {"dramPerNode": "1.1M"}},
    "ssd-tiny": {"store": {"ssd": {"size": "1"}}},
    "shm-fraction": {"roles": {"prefill": {"shmSize": "0.5Gi"}, "decode": {"shmSize": 1}}},
    "hf-cache": {"model": {"huggingFace": {"id": "org/m", "cacheSize": "1k"}}},
    "rdma-resource": {"rdma": {"resourceName": "example.com/rdma-kubernetes.io"}},
    "protocol-auto": {"transferProtocol": "auto", "rdma": {"enabled": True}},
    "segments-none": {"roles": {"prefill": {"localSegmentSize": 0},
                                "decode": {"localSegmentSize": "0Gi"}}},
    "segments-1Mi": {"roles": {"prefill": {"localSegmentSize": "1Mi"},
                               "decode": {"localSegmentSize": 1048576}}},
}


@pytest.mark.parametrize(("spec", "field"), MOVED.values(), ids=MOVED.keys())
def test_the_crd_refuses_what_only_the_operator_refused(make_cluster: Callable[..., Obj],
                                                        spec: Obj, field: str) -> None:
    """The CRD alone (what the API server runs on `kubectl apply` or a sync) now refuses the
    spec, with the operator's own message, field first; the operator still refuses it too."""
    with pytest.raises(InvalidResource) as crd:
        validate(schema.cluster_schema(), make_cluster(spec))
    from_crd = [e for e in crd.value.errors if e.startswith(field + ": ")]
    assert from_crd, crd.value.errors
    bad = validate(_without_cel(schema.cluster_schema()), make_cluster(spec))
    from_operator = [e for e in admission.spec_errors(bad["spec"]) if e.startswith(field + ": ")]
    assert from_crd == from_operator
    with pytest.raises(InvalidResource) as both:
        validate_cluster(make_cluster(spec))
    assert [e for e in both.value.errors if e.startswith(field + ": ")] == from_crd  # once


@pytest.mark.parametrize("spec", ADMITTED.values(), ids=ADMITTED.keys())
def test_the_crd_rules_admit_the_boundaries(make_cluster: Callable[..., Obj], spec: Obj) -> None:
    validate_cluster(make_cluster(spec))


def _without_cel(s: Obj) -> Obj:
    """The schema with every x-kubernetes-validations removed (the structure and defaults only),
    to hand admission.py a defaulted spec the CEL rules would have refused."""
    if isinstance(s, dict):
        return {k: _without_cel(v) for k, v in s.items() if k != "x-kubernetes-validations"}
    if isinstance(s, list):
        return [_without_cel(v) for v in s]
    return s
