"""Pods that come and go, as the operator renders them: spec.gateway's HTTPRoute (rendered,
schema-checked, validated by CEL and admission) and the workers' drain (flag, grace period,
preStop, readiness) with the autoscaler's scale-down waiting for it.

No Gateway API schema ships offline (kubernetes_validate knows only the core API), so
`_check_http_route` checks by hand what Gateway API v1's HTTPRoute schema requires of the fields
we render: shapes, required fields, patterns and list bounds.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from mooncake_k8s.operator import admission, kube, naming, schema_gateway
from mooncake_k8s.operator.autoscaler import MetricsSample, Policy, ScalerState, decide
from mooncake_k8s.operator.crds import cluster_crd
from mooncake_k8s.operator.render import Rendered, SpecError, render
from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

Obj = dict[str, Any]
GATEWAY = {"parentRefs": [{"name": "public", "namespace": "gateways", "sectionName": "https"}],
           "hostnames": ["llm.example.com", "*.llm.example.com"]}
# Gateway API v1 (standard channel) patterns and bounds for the fields an HTTPRoute of ours has.
GW_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
GW_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*"
                         r"[a-z0-9])?)*$")
GW_GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
GW_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")


def _render(spec: Obj, make_cluster: Callable[..., Obj]) -> Rendered:
    return render(validate_cluster(make_cluster(spec)))


def _route(r: Rendered) -> Obj:
    (route,) = r.by_kind("HTTPRoute")
    return route


def _check_http_route(o: Obj) -> None:
    """What Gateway API v1's HTTPRoute schema requires of the fields we render."""
    assert o["apiVersion"] == "gateway.networking.k8s.io/v1" and o["kind"] == "HTTPRoute"
    assert set(o) == {"apiVersion", "kind", "metadata", "spec"}
    assert GW_NAME.match(o["metadata"]["name"]) and len(o["metadata"]["name"]) <= 253
    spec = o["spec"]
    assert set(spec) <= {"parentRefs", "hostnames", "rules"}
    assert 1 <= len(spec["parentRefs"]) <= 32
    for p in spec["parentRefs"]:
        assert set(p) <= {"group", "kind", "namespace", "name", "sectionName", "port"}
        assert GW_GROUP.match(p["group"]) and GW_KIND.match(p["kind"])
        assert 1 <= len(p["name"]) <= 253
        if "namespace" in p:
            assert re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", p["namespace"])
        if "sectionName" in p:
            assert GW_NAME.match(p["sectionName"])
        if "port" in p:
            assert isinstance(p["port"], int) and 1 <= p["port"] <= 65535
    assert len(spec.get("hostnames", [])) <= 16
    for h in spec.get("hostnames", []):
        assert GW_HOSTNAME.match(h) and len(h) <= 253
    assert 1 <= len(spec["rules"]) <= 16
    for rule in spec["rules"]:
        assert set(rule) <= {"matches", "backendRefs"}
        for m in rule["matches"]:
            assert m["path"]["type"] in ("Exact", "PathPrefix", "RegularExpression")
            assert m["path"]["value"].startswith("/")
        assert 1 <= len(rule["backendRefs"]) <= 16
        for b in rule["backendRefs"]:
            assert set(b) <= {"group", "kind", "name", "namespace", "port", "weight"}
            assert GW_GROUP.match(b["group"]) and GW_KIND.match(b["kind"])
            # A Service backend needs its port (a CEL rule of the HTTPRoute CRD).
            assert b["kind"] != "Service" or 1 <= b["port"] <= 65535
            assert 0 <= b.get("weight", 1) <= 1000000


def test_http_route_to_the_conductor(make_cluster: Callable[..., Obj]) -> None:
    r = _render({"gateway": GATEWAY, "roles": {"conductor": {"service": {"port": 8080}}}},
                make_cluster)
    route = _route(r)
    _check_http_route(route)
    svc = r.get("Service", naming.name("demo", "conductor"))
    assert route["metadata"]["name"] == svc["metadata"]["name"]
    assert route["metadata"]["namespace"] == "ml"
    # Owned by the cluster: garbage-collected with it.
    (owner,) = route["metadata"]["ownerReferences"]
    assert owner["kind"] == "MooncakeCluster" and owner["controller"] is True
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "public",
         "namespace": "gateways", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == GATEWAY["hostnames"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend["name"] == svc["metadata"]["name"]
    assert backend["port"] == svc["spec"]["ports"][0]["port"] == 8080
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    # Every other object stays valid for Kubernetes itself.
    for o in r.objects:
        if o["kind"] not in ("HTTPRoute", "MooncakeRoleScaler"):
            kubernetes_validate.validate(o, "1.33", strict=True)


def test_no_gateway_no_route_and_hostnames_optional(make_cluster: Callable[..., Obj]) -> None:
    assert not _render({}, make_cluster).by_kind("HTTPRoute")
    route = _route(_render({"gateway": {"parentRefs": [{"name": "gw", "port": 443}]}},
                           make_cluster))
    _check_http_route(route)
    assert "hostnames" not in route["spec"]
    assert route["spec"]["parentRefs"][0]["port"] == 443


@pytest.mark.parametrize(("gateway", "message"), [
    ({}, "spec.gateway: 'parentRefs' is a required property"),
    ({"parentRefs": []}, "spec.gateway.parentRefs: [] should be non-empty"),
    ({"parentRefs": [{"namespace": "x"}]}, "spec.gateway.parentRefs[0]: 'name' is a required"),
    ({"parentRefs": [{"name": "Public_GW"}]}, "spec.gateway.parentRefs[0].name: 'Public_GW'"),
    ({"parentRefs": [{"name": "gw", "port": 70000}]},
     "spec.gateway.parentRefs[0].port: 70000 is greater than the maximum of 65535"),
    ({"parentRefs": [{"name": "gw", "namespace": "a.b"}]},
     "spec.gateway.parentRefs[0].namespace: 'a.b' does not match"),
    ({"parentRefs": [{"name": "gw"}], "hostnames": ["bad_host"]},
     "spec.gateway.hostnames[0]: 'bad_host' does not match"),
    ({"parentRefs": [{"name": "gw"}], "hostnames": ["a.*.example.com"]},
     "spec.gateway.hostnames[0]: 'a.*.example.com' does not match"),
    ({"parentRefs": [{"name": "gw"}, {"name": "gw"}]},
     f"spec.gateway.parentRefs: {schema_gateway.DUPLICATE_PARENT}"),
    ({"parentRefs": [{"name": "gw"}], "hostnames": ["a.example.com", "a.example.com"]},
     f"spec.gateway.hostnames: {schema_gateway.DUPLICATE_HOSTNAME}"),
    ({"parentRefs": [{"name": "gw"}], "hostnames": ["10.0.0.1"]},
     "spec.gateway.hostnames[0]: '10.0.0.1' is an IP address"),
    ({"parentRefs": [{"name": "gw"}], "paths": ["/v1"]},
     "spec.gateway.paths: unknown field"),
])
def test_bad_gateway_is_refused_naming_the_field(make_cluster: Callable[..., Obj],
                                                 gateway: Obj, message: str) -> None:
    with pytest.raises(InvalidResource) as err:
        validate_cluster(make_cluster({"gateway": gateway}))
    assert any(e.startswith(message) for e in err.value.errors), err.value.errors
    # CEL and admission word a duplicate the same: it is listed once.
    assert len(err.value.errors) == len(set(err.value.errors)) == 1, err.value.errors


def test_one_gateway_twice_needs_a_listener_each(make_cluster: Callable[..., Obj]) -> None:
    """Gateway API's own rule: entries naming one Gateway (the port does not count) each name
    a different listener."""
    refs = [{"name": "gw", "sectionName": "http"}, {"name": "gw", "sectionName": "https"},
            {"name": "gw", "namespace": "other"}, {"name": "gw2", "port": 443}]
    route = _route(_render({"gateway": {"parentRefs": refs}}, make_cluster))
    assert len(route["spec"]["parentRefs"]) == 4
    for bad in ([{"name": "gw"}, {"name": "gw", "sectionName": "https"}],
                [{"name": "gw", "port": 80}, {"name": "gw", "port": 443}],
                [{"name": "gw", "sectionName": "a"}, {"name": "gw", "sectionName": "a",
                                                       "port": 443}]):
        with pytest.raises(InvalidResource) as err:
            validate_cluster(make_cluster({"gateway": {"parentRefs": bad}}))
        assert err.value.errors == [
            f"spec.gateway.parentRefs: {schema_gateway.DUPLICATE_PARENT}"], bad


def test_admission_catches_what_an_older_crd_let_through(
        make_cluster: Callable[..., Obj]) -> None:
    """The operator renders specs the API server admitted; a CRD without the CEL rules admits
    duplicates, so render refuses them with the same message."""
    good = validate_cluster(make_cluster({"gateway": {"parentRefs": [{"name": "gw"}]}}))
    bad = copy.deepcopy(good)
    bad["spec"]["gateway"]["parentRefs"].append({"name": "gw"})
    bad["spec"]["gateway"]["hostnames"] = ["192.168.0.1"]
    errors = admission.spec_errors(bad["spec"])
    assert f"spec.gateway.parentRefs: {schema_gateway.DUPLICATE_PARENT}" in errors
    assert any(e.startswith("spec.gateway.hostnames[0]: '192.168.0.1' is an IP") for e in errors)
    with pytest.raises(SpecError, match=re.escape("spec.gateway.parentRefs")):
        render(bad)


def test_the_crd_carries_the_gateway_and_drain_fields() -> None:
    spec = cluster_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    gw = spec["properties"]["gateway"]
    assert gw["required"] == ["parentRefs"]
    for field, message in (("parentRefs", schema_gateway.DUPLICATE_PARENT),
                           ("hostnames", schema_gateway.DUPLICATE_HOSTNAME)):
        (r,) = gw["properties"][field]["x-kubernetes-validations"]
        assert r["message"] == message
    for role in ("prefill", "decode"):
        drain = spec["properties"]["roles"]["properties"][role]["properties"][
            "drainTimeoutSeconds"]
        assert drain["default"] == 30 and drain["minimum"] == 0


def _worker(r: Rendered, role: str) -> tuple[Obj, Obj]:
    pod = r.get("StatefulSet", naming.name("demo", role))["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == role]
    return pod, c


def _drain_flag(c: Obj) -> int:
    """The worker's --drain-timeout, as its environment variable sets it."""
    (value,) = [e["value"] for e in c["env"] if e["name"] == "MOONCAKE_DRAIN_TIMEOUT"]
    return int(value)


@pytest.mark.parametrize("engine", [{}, {"kind": "vllm", "device": "cpu"},
                                    {"kind": "sglang", "device": "cpu"}])
def test_drain_renders_flag_grace_prestop_and_readiness(
        make_cluster: Callable[..., Obj], engine: Obj) -> None:
    spec: Obj = {"roles": {"decode": {"drainTimeoutSeconds": 120}}}
    if engine:
        spec.update(engine=engine, model={"pvc": {"claimName": "weights"}})
    r = _render(spec, make_cluster)
    for role, drain in (("prefill", 30), ("decode", 120)):
        pod, c = _worker(r, role)
        assert _drain_flag(c) == drain
        assert pod["terminationGracePeriodSeconds"] == drain + schema_gateway.DRAIN_MARGIN_S
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        # The hook starts the drain (SIGTERM to the worker) and waits at most the drain.
        assert command[:2] == ["/bin/sh", "-c"] and "kill -TERM 1" in command[2]
        assert f"-lt {drain} " in command[2]
        # Readiness reads /readyz, which a draining worker answers 503.
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for role in ("store", "master"):
        assert "lifecycle" not in r.get("StatefulSet", naming.name("demo", role))["spec"][
            "template"]["spec"]["containers"][0]


def test_drain_zero_stops_at_once_and_changes_the_revision(
        make_cluster: Callable[..., Obj]) -> None:
    base = _render({}, make_cluster)
    quick = _render({"roles": {"prefill": {"drainTimeoutSeconds": 0}}}, make_cluster)
    pod, c = _worker(quick, "prefill")
    assert _drain_flag(c) == 0
    assert pod["terminationGracePeriodSeconds"] == schema_gateway.DRAIN_MARGIN_S
    # A new drain time is a new pod template: the role rolls (and only that role).
    assert quick.revisions["prefill"] != base.revisions["prefill"]
    assert quick.revisions["decode"] == base.revisions["decode"]
    with pytest.raises(InvalidResource, match="drainTimeoutSeconds: -1 is less than"):
        validate_cluster(make_cluster({"roles": {"decode": {"drainTimeoutSeconds": -1}}}))


def test_pod_template_can_still_override_the_grace(make_cluster: Callable[..., Obj]) -> None:
    r = _render({"roles": {"decode": {"podTemplate": {
        "spec": {"terminationGracePeriodSeconds": 600}}}}}, make_cluster)
    assert _worker(r, "decode")[0]["terminationGracePeriodSeconds"] == 600


def _policy(decode_grace: float) -> Policy:
    return Policy(prefill_min=1, prefill_max=8, decode_min=1, decode_max=8, ratio_min=0.25,
                  ratio_max=4.0, target_prefill_tokens=1000, target_decode_tokens=1000,
                  max_rejection_rate=0.01, up_window_s=0.0, down_window_s=0.0,
                  ttft_slo_ms=2000.0, prefill_grace_s=15.0, decode_grace_s=decode_grace)


def test_autoscaler_scales_down_one_drain_at_a_time() -> None:
    """Decode load falls: a scale-down within the last one's drain (the pods' grace) is held;
    one after it goes through; a scale-up never waits."""
    pol, state = _policy(decode_grace=60.0), ScalerState()
    current = (2, 6)
    for t, load, expect, held in ((0, 5000, 5, False), (15, 3000, 5, True), (45, 3000, 5, True),
                                  (60, 3000, 3, False), (75, 1000, 3, True),
                                  (120, 1000, 1, False), (130, 8000, 8, False)):
        d = decide(pol, current, state, MetricsSample(float(t), 2000, float(load), 800, 0, 0))
        assert (d.decode, "decode scale-down held" in d.reason) == (expect, held), (t, d)
        assert d.prefill == 2  # the other role is untouched
        current = (d.prefill, d.decode)


def test_policy_reads_the_drain_from_the_spec(make_cluster: Callable[..., Obj]) -> None:
    spec = validate_cluster(make_cluster({
        "autoscaling": {"enabled": True},
        "roles": {"decode": {"drainTimeoutSeconds": 90}}}))["spec"]
    pol = Policy.from_spec(spec)
    assert pol.decode_grace_s == 90 + schema_gateway.DRAIN_MARGIN_S
    assert pol.prefill_grace_s == 30 + schema_gateway.DRAIN_MARGIN_S


def test_the_gateway_guide_manifest_renders_a_valid_route(repo: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", (repo / "docs/gateway.md").read_text(), re.S)
    (doc,) = [d for b in blocks for d in yaml.safe_load_all(b) if d]
    route = _route(render(validate_cluster(doc)))
    _check_http_route(route)
    assert route["spec"]["hostnames"] == ["llm.example.com"]


def test_the_operator_knows_where_to_apply_the_route(make_cluster: Callable[..., Obj]) -> None:
    route = _route(_render({"gateway": {"parentRefs": [{"name": "gw"}]}}, make_cluster))
    path = kube.object_path(route["apiVersion"], route["kind"], "ml", "demo-conductor")
    assert path == "/apis/gateway.networking.k8s.io/v1/namespaces/ml/httproutes/demo-conductor"
