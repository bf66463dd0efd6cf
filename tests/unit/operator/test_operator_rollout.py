"""Version-coherent rollout: an upgrade replaces exactly the pods that must change.

Each case renders an old and a new spec and compares what Kubernetes would do with the diff:
a changed pod template rolls that role's pods; a changed immutable field (selector,
serviceName, volumeClaimTemplates) would force deleting and recreating the workload, which must
never happen for an in-place upgrade.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from mooncake_k8s.operator import naming
from mooncake_k8s.operator.render import Rendered, render
from mooncake_k8s.operator.schema import ROLES
from mooncake_k8s.operator.validation import validate_cluster

Obj = dict[str, Any]
IMMUTABLE = ("selector", "serviceName", "volumeClaimTemplates", "podManagementPolicy")


def _workload(r: Rendered, role: str) -> Obj:
    return r.get("Deployment" if role == "conductor" else "StatefulSet", f"demo-{role}")


def _rolled(old: Rendered, new: Rendered) -> set[str]:
    """Roles whose pod template differs, i.e. whose pods Kubernetes would replace."""
    return {r for r in ROLES
            if _workload(old, r)["spec"]["template"] != _workload(new, r)["spec"]["template"]}


def _assert_no_recreate(old: Rendered, new: Rendered) -> None:
    for role in ROLES:
        a, b = _workload(old, role)["spec"], _workload(new, role)["spec"]
        for f in IMMUTABLE:
            assert a.get(f) == b.get(f), f"{role}.{f} changed: the workload would be recreated"
    old_names = {(o["kind"], o["metadata"]["name"]) for o in old.objects}
    assert old_names == {(o["kind"], o["metadata"]["name"]) for o in new.objects}


BASE: Obj = {"model": {"huggingFace": {"id": "Qwen/Qwen2.5-0.5B", "revision": "v1"}},
             "store": {"ssd": {"size": "100Gi"}},
             "autoscaling": {"enabled": True}}


def _set(spec: Obj, path: str, value: Any) -> Obj:
    out = copy.deepcopy(spec)
    node = out
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


CASES: list[tuple[str, str, Any, set[str], bool]] = [
    # (id, field, new value, roles that must roll, serving revision changes)
    ("decode-resources", "roles.decode.resources", {"requests": {"cpu": "4"}}, {"decode"}, False),
    ("prefill-node-selector", "roles.prefill.nodeSelector", {"pool": "a"}, {"prefill"}, False),
    # The Conductor tokenises with the model's tokenizer (issue 18): it rolls with the model.
    ("model-revision", "model.huggingFace.revision", "v2", {"prefill", "decode", "conductor"},
     True),
    ("engine-args", "engine.args", ["--tp", "2"], {"prefill", "decode"}, True),
    ("block-size", "store.blockTokens", 128, {"prefill", "decode"}, True),
    ("decode-image", "roles.decode.image", "mooncake-k8s:0.1.1", {"prefill", "decode"}, True),
    ("slo", "slo.ttftMs", 900, {"conductor"}, False),
    ("watermarks", "store.lowWatermark", 0.7, {"master"}, False),
    ("dram", "store.dramPerNode", "8Gi", {"store"}, False),
    ("local-segment", "roles.decode.localSegmentSize", "4Gi", {"decode"}, False),
    ("prefill-segment", "roles.prefill.localSegmentSize", "4Gi", {"prefill"}, False),
    ("autoscaler-bounds", "autoscaling.decode.maxReplicas", 16, set(), False),
    ("autoscaler-windows", "autoscaling.scaleDownStabilizationSeconds", 60, set(), False),
    ("pdb", "roles.store.maxUnavailable", 2, set(), False),
    ("service-type", "roles.conductor.service.type", "LoadBalancer", set(), False),
    ("image", "image", "mooncake-k8s:0.2.0", set(ROLES), True),
]


@pytest.mark.parametrize(("field", "value", "rolled", "serving"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_upgrade_rolls_only_what_changed(make_cluster: Callable[..., Obj], field: str,
                                         value: Any, rolled: set[str], serving: bool) -> None:
    old = render(validate_cluster(make_cluster(BASE)))
    new = render(validate_cluster(make_cluster(_set(BASE, field, value))))
    assert _rolled(old, new) == rolled
    assert {r for r in ROLES if old.revisions[r] != new.revisions[r]} == rolled
    assert (old.serving_revision != new.serving_revision) is serving
    _assert_no_recreate(old, new)


def test_scaling_changes_no_pod_template(make_cluster: Callable[..., Obj]) -> None:
    c = validate_cluster(make_cluster(BASE))
    old = render(c)
    new = render(c, {"prefill": 4, "decode": 3, "store": 5, "conductor": 2})
    assert _rolled(old, new) == set() and old.revisions == new.revisions
    assert _workload(new, "prefill")["spec"]["replicas"] == 4
    _assert_no_recreate(old, new)
    spec_scaled = render(validate_cluster(make_cluster(_set(BASE, "roles.prefill.replicas", 4))))
    assert _rolled(old, spec_scaled) == set()


def test_prefill_and_decode_always_share_a_serving_revision(
        make_cluster: Callable[..., Obj]) -> None:
    for _, field, value, _, _ in CASES:
        r = render(validate_cluster(make_cluster(_set(BASE, field, value))))
        labels = {role: _workload(r, role)["spec"]["template"]["metadata"]["labels"][
            naming.LABEL_SERVING_REVISION] for role in ("prefill", "decode")}
        assert labels["prefill"] == labels["decode"] == r.serving_revision
        # The conductor learns the target revision from the mounted ConfigMap.
        assert r.get("ConfigMap", "demo-config")["data"]["serving-revision"] == r.serving_revision
