"""Prefill pipeline groups in the CR (`roles.prefill.pipelineGroupSize`): validation by the CRD's
CEL rules and by admission (same words), the rendered stage settings (golden), whole-group
autoscaling and replica resolution, status.prefillGroups, and the restart-together decision.

Regenerate the golden with `MOONCAKE_UPDATE_GOLDEN=1 pytest tests/unit/operator/
test_operator_pipeline.py` after an intended change and review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from mooncake_k8s.operator import admission, groups, naming, schema, status
from mooncake_k8s.operator.autoscaler import (
    MetricsSample,
    Policy,
    ScalerState,
    clamp,
    decide,
)
from mooncake_k8s.operator.reconcile import resolve_replicas
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import InvalidResource, validate, validate_cluster

Obj = dict[str, Any]
GOLDEN = Path(__file__).parent / "golden" / "prefill-group.yaml"
GROUP2 = {"roles": {"prefill": {"replicas": 4, "pipelineGroupSize": 2}}}


def _without_cel(s: Any) -> Any:
    if isinstance(s, dict):
        return {k: _without_cel(v) for k, v in s.items() if k != "x-kubernetes-validations"}
    if isinstance(s, list):
        return [_without_cel(v) for v in s]
    return s


REFUSED = {  # spec -> (field named first, words the message must carry)
    "replicas-3-of-2": ({"roles": {"prefill": {"replicas": 3, "pipelineGroupSize": 2}}},
                        "spec.roles.prefill.replicas",
                        "roles.prefill.replicas 3 must be a multiple of "
                        "roles.prefill.pipelineGroupSize 2"),
    "replicas-2-of-3": ({"roles": {"prefill": {"replicas": 2, "pipelineGroupSize": 3}}},
                        "spec.roles.prefill.replicas", "replicas 2 must be a multiple"),
    "vllm": ({"roles": {"prefill": {"replicas": 2, "pipelineGroupSize": 2}},
              "engine": {"kind": "vllm"}, "model": {"pvc": {"claimName": "w"}}},
             "spec.roles.prefill.pipelineGroupSize",
             "pipelineGroupSize 2 with engine.kind vllm needs engine.kind embedded"),
    "sglang": ({"roles": {"prefill": {"replicas": 2, "pipelineGroupSize": 2}},
                "engine": {"kind": "sglang"}, "model": {"pvc": {"claimName": "w"}}},
               "spec.roles.prefill.pipelineGroupSize", "with engine.kind sglang"),
    "autoscaling-min": ({**GROUP2, "autoscaling": {"enabled": True, "prefill": {
        "minReplicas": 1, "maxReplicas": 8}}}, "spec.autoscaling.prefill.minReplicas",
        "autoscaling.prefill.minReplicas 1 must be a multiple"),
    "autoscaling-max": ({**GROUP2, "autoscaling": {"enabled": True, "prefill": {
        "minReplicas": 2, "maxReplicas": 7}}}, "spec.autoscaling.prefill.maxReplicas",
        "autoscaling.prefill.maxReplicas 7 must be a multiple"),
}


@pytest.mark.parametrize(("spec", "field", "words"), REFUSED.values(), ids=REFUSED.keys())
def test_crd_and_admission_refuse_partial_groups(make_cluster: Callable[..., Obj], spec: Obj,
                                                 field: str, words: str) -> None:
    """The CRD's CEL rule (what `kubectl apply` meets) and the operator's admission (clusters
    with an older CRD) refuse it with one message, naming the field."""
    with pytest.raises(InvalidResource) as crd:
        validate(schema.cluster_schema(), make_cluster(spec))
    from_crd = [e for e in crd.value.errors if e.startswith(field + ": ")]
    assert len(from_crd) == 1 and words in from_crd[0], crd.value.errors
    bad = validate(_without_cel(schema.cluster_schema()), make_cluster(spec))
    from_operator = [e for e in admission.spec_errors(bad["spec"]) if e.startswith(field + ": ")]
    assert from_operator == from_crd
    with pytest.raises(InvalidResource) as both:
        validate_cluster(make_cluster(spec))
    assert [e for e in both.value.errors if e.startswith(field + ": ")] == from_crd  # once


@pytest.mark.parametrize("spec", [
    GROUP2,
    {"roles": {"prefill": {"replicas": 0, "pipelineGroupSize": 2},
               "decode": {"replicas": 0}}},  # parked
    {"roles": {"prefill": {"replicas": 3}}},  # group size 1: any count
    {**GROUP2, "autoscaling": {"enabled": True, "prefill": {"minReplicas": 2, "maxReplicas": 6}}},
    {**GROUP2, "autoscaling": {"prefill": {"minReplicas": 1, "maxReplicas": 5}}},
], ids=["group-of-2", "parked", "size-1", "autoscaling-whole", "bounds-while-off"])
def test_whole_groups_are_admitted(make_cluster: Callable[..., Obj], spec: Obj) -> None:
    """Bounds of a disabled autoscaler are not read, so they need not be whole groups."""
    assert validate_cluster(make_cluster(spec))["spec"]["roles"]["prefill"][
        "pipelineGroupSize"] == spec["roles"]["prefill"].get("pipelineGroupSize", 1)


def test_group_size_is_at_least_1(make_cluster: Callable[..., Obj]) -> None:
    with pytest.raises(InvalidResource) as e:
        validate_cluster(make_cluster({"roles": {"prefill": {"pipelineGroupSize": 0}}}))
    assert any(x.startswith("spec.roles.prefill.pipelineGroupSize: ") for x in e.value.errors)


# ---- render


def _prefill(make_cluster: Callable[..., Obj], spec: Obj) -> Obj:
    sts: Obj = render(validate_cluster(make_cluster(spec))).get(
        "StatefulSet", naming.name("demo", "prefill"))
    return sts


def test_group_of_2_matches_golden(make_cluster: Callable[..., Obj]) -> None:
    """The whole rendered output of a cluster with two groups of two stages, valid for
    Kubernetes."""
    rendered = render(validate_cluster(make_cluster(GROUP2)))
    for o in rendered.objects:
        if o["kind"] != "MooncakeRoleScaler":
            kubernetes_validate.validate(o, "1.33", strict=True)
    text = yaml.safe_dump_all(rendered.objects, sort_keys=False)
    if os.environ.get("MOONCAKE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_each_pod_finds_its_stage_group_and_next_stage(make_cluster: Callable[..., Obj]) -> None:
    sts = _prefill(make_cluster, GROUP2)
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # a group's pods start together
    pod = sts["spec"]["template"]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["MOONCAKE_POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']")
    assert env["MOONCAKE_PIPELINE_STAGE"]["value"] == "auto"
    assert env["MOONCAKE_PIPELINE_GROUP_SIZE"]["value"] == "2"
    assert env["MOONCAKE_PIPELINE_GROUP"]["value"] == "g{group}"
    # Pod 0's next stage is pod 1, by its stable name under the governing headless Service.
    nxt = env["MOONCAKE_PIPELINE_NEXT"]["value"]
    assert sts["spec"]["serviceName"] == "demo-prefill"
    assert nxt.format(index=1) == (
        f"demo-prefill-1.demo-prefill.ml.svc.cluster.local:{naming.PORTS['prefill']['grpc']}")
    assert pod["metadata"]["labels"][groups.LABEL_GROUP_SIZE] == "2"
    anti = pod["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == naming.selector(
        "demo", "prefill")


def test_user_affinity_is_kept_beside_the_group_spreading(
        make_cluster: Callable[..., Obj]) -> None:
    mine = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 5, "podAffinityTerm": {"topologyKey": "topology.kubernetes.io/zone",
                                          "labelSelector": {"matchLabels": {"a": "b"}}}}]}}
    spec = {"roles": {"prefill": {**GROUP2["roles"]["prefill"], "affinity": mine}}}
    terms = _prefill(make_cluster, spec)["spec"]["template"]["spec"]["affinity"][
        "podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [t["weight"] for t in terms] == [5, 100]


def test_group_size_1_renders_no_stage_settings(make_cluster: Callable[..., Obj]) -> None:
    pod = _prefill(make_cluster, {})["spec"]["template"]
    names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert not {n for n in names if n.startswith("MOONCAKE_PIPELINE")} | (
        names & {"MOONCAKE_POD_INDEX"})
    assert groups.LABEL_GROUP_SIZE not in pod["metadata"]["labels"]


# ---- replicas and autoscaling move whole groups


def _policy(**kw: Any) -> Policy:
    base: Obj = dict(prefill_min=2, prefill_max=8, decode_min=1, decode_max=8, ratio_min=0.25,
                     ratio_max=4.0, target_prefill_tokens=1000, target_decode_tokens=2000,
                     max_rejection_rate=0.01, up_window_s=0.0, down_window_s=0.0,
                     ttft_slo_ms=2000.0, prefill_step=2)
    base.update(kw)
    return Policy(**base)


def test_policy_reads_the_group_size(make_cluster: Callable[..., Obj]) -> None:
    spec = validate_cluster(make_cluster(GROUP2))["spec"]
    assert Policy.from_spec(spec).prefill_step == 2


@pytest.mark.parametrize(("p", "d", "kw", "want"), [
    (3, 2, {}, (4, 2)),                   # 3 pods of load: a whole second group
    (1, 1, {}, (2, 1)),                   # the least is one group
    (9, 4, {}, (8, 4)),                   # the most is four groups
    (2, 8, {"ratio_min": 0.375}, (4, 8)),  # the ratio asks for 3: a whole group more
])
def test_clamp_keeps_whole_groups(p: int, d: int, kw: Obj, want: tuple[int, int]) -> None:
    assert clamp(p, d, _policy(**kw)) == want


def test_clamp_rounds_down_under_the_ratio_cap() -> None:
    # decode is at its max (1), ratio max 3: prefill 6 -> 3 allowed -> 2 (one whole group)
    assert clamp(6, 1, _policy(decode_max=1, ratio_max=3.0)) == (2, 1)


def test_queue_growth_adds_a_whole_group() -> None:
    pol = _policy()
    state = ScalerState()
    # 2 pods, 3000 queued tokens at 1000 per pod: 3 pods of work -> 4 (two groups)
    got = decide(pol, (2, 2), state, MetricsSample(0.0, 3000, 4000, 800, 0, 0))
    assert (got.prefill, got.decode) == (4, 2)


@pytest.mark.parametrize(("written", "want"), [(3, 4), (4, 4), (1, 2), (0, 0)])
def test_a_scale_that_splits_a_group_gets_the_whole_group(
        make_cluster: Callable[..., Obj], written: int, want: int) -> None:
    spec = validate_cluster(make_cluster(GROUP2))["spec"]
    scaler = {"spec": {"replicas": written}, "metadata": {"annotations": {
        naming.ANNOTATION_SEED: "4"}}}
    assert resolve_replicas(spec, {"prefill": scaler}).effective["prefill"] == want


# ---- status.prefillGroups


def _pod(index: int, ready: bool = True, *, uid: str = "", restarts: int = 0,
         created: str = "2026-01-01T00:00:00Z", started: str | None = None,
         size: int = 2) -> Obj:
    running = {"running": {"startedAt": started}} if started else {}
    return {"metadata": {"name": f"demo-prefill-{index}", "namespace": "ml",
                         "uid": uid or f"u{index}", "creationTimestamp": created,
                         "labels": {**naming.labels("demo", "prefill"),
                                    groups.POD_INDEX_LABEL: str(index),
                                    groups.LABEL_GROUP_SIZE: str(size)}},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}],
                       "containerStatuses": [{"name": "prefill", "restartCount": restarts,
                                              "state": running}]}}


def test_status_counts_whole_groups(make_cluster: Callable[..., Obj]) -> None:
    c = validate_cluster(make_cluster(GROUP2))
    rendered = render(c)
    pods = [_pod(0), _pod(1), _pod(2), _pod(3, ready=False)]
    st = status.aggregate(c, rendered, status.Observed({}, pods, group_restarts=1), "now")
    assert st["prefillGroups"] == {"size": 2, "total": 2, "whole": 1, "restarts": 1}
    plain = validate_cluster(make_cluster({}))
    assert "prefillGroups" not in status.aggregate(plain, render(plain),
                                                   status.Observed({}, pods), "now")


def test_status_schema_has_prefill_groups() -> None:
    props = schema.cluster_schema()["properties"]["status"]["properties"]
    assert set(props["prefillGroups"]["properties"]) == {"size", "total", "whole", "restarts"}


# ---- restart together


T0 = 1767225600.0  # 2026-01-01T00:00:00Z


def _iso(t: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _group(mem: groups.GroupMemory, *pods: Obj, now: float) -> None:
    for p in pods:
        assert not groups.restarted(mem, p, now)  # first sight: nothing to compare with


def test_a_stage_container_restart_deletes_its_group_peers_only() -> None:
    mem = groups.GroupMemory()
    pods = [_pod(i) for i in range(4)]
    _group(mem, *pods, now=T0 + 100)
    again = _pod(1, restarts=1, started=_iso(T0 + 200))
    assert groups.restarted(mem, again, T0 + 200)
    gone = groups.peers_to_delete(mem, again, [pods[0], again, pods[2], pods[3]], T0 + 200)
    assert [p["metadata"]["name"] for p in gone] == ["demo-prefill-0"]  # group g0 only
    assert groups.group_name(again) == "g0"
    # The deleted peer comes back as a new pod: expected, no restart of the group again.
    back = _pod(0, uid="u0-new", created=_iso(T0 + 203))
    assert not groups.restarted(mem, back, T0 + 203)
    # A later, unrelated event of the restarted stage is no restart either.
    assert not groups.restarted(mem, again, T0 + 210)


def test_a_recreated_stage_deletes_its_peers() -> None:
    mem = groups.GroupMemory()
    pods = [_pod(2), _pod(3)]
    _group(mem, *pods, now=T0 + 100)
    new = _pod(3, uid="u3-new", created=_iso(T0 + 300))  # evicted, the StatefulSet made it again
    assert groups.restarted(mem, new, T0 + 300)
    assert [p["metadata"]["name"] for p in groups.peers_to_delete(
        mem, new, [pods[0], new], T0 + 300)] == ["demo-prefill-2"]


def test_peers_that_started_with_it_are_left_alone() -> None:
    """A scale-up creates a group's pods together: the second one's arrival is no restart of
    the first, even where the operator remembers older pods of those names."""
    mem = groups.GroupMemory()
    _group(mem, _pod(2, uid="old2"), _pod(3, uid="old3"), now=T0)
    a = _pod(2, uid="new2", created=_iso(T0 + 1000))
    b = _pod(3, uid="new3", created=_iso(T0 + 1001))
    assert groups.restarted(mem, b, T0 + 1002)
    assert groups.peers_to_delete(mem, b, [a, b], T0 + 1002) == []


def test_pods_outside_groups_and_terminating_peers_are_ignored() -> None:
    mem = groups.GroupMemory()
    single = _pod(0, size=1)
    _group(mem, single, now=T0)
    assert not groups.restarted(mem, _pod(0, size=1, restarts=3), T0 + 100)
    mem = groups.GroupMemory()
    pods = [_pod(0), _pod(1)]
    _group(mem, *pods, now=T0)
    pods[0]["metadata"]["deletionTimestamp"] = _iso(T0 + 99)
    again = _pod(1, restarts=1, started=_iso(T0 + 100))
    assert groups.restarted(mem, again, T0 + 100)
    assert groups.peers_to_delete(mem, again, pods, T0 + 100) == []


def test_pod_index_from_label_or_name() -> None:
    assert groups.pod_index(_pod(5)) == 5
    assert groups.pod_index({"metadata": {"name": "demo-prefill-7"}}) == 7
    assert groups.pod_index({"metadata": {"name": "conductor"}}) is None
