"""Admission of MooncakeClusters that cannot run: every one is rejected by `validate_cluster`
(what `mooncake render` runs) with a message that starts with the offending field's path, and
the ones the API server would let through (the rules outside the CRD) are also refused by
`render` itself, which is what the operator reports as InvalidSpec.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from mooncake_k8s.operator import corev1, schema, schema_dsl
from mooncake_k8s.operator.render import SpecError, render
from mooncake_k8s.operator.validation import InvalidResource, validate, validate_cluster

Obj = dict[str, Any]
K8S_VERSION = "1.33"
SGLANG = {"engine": {"kind": "sglang"}, "model": {"pvc": {"claimName": "weights"}}}
AFF = "spec.roles.prefill.affinity.nodeAffinity"
TERM0 = f"{AFF}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"


def _res(role: str, requests: Obj | None = None, limits: Obj | None = None) -> Obj:
    res: Obj = {}
    if requests is not None:
        res["requests"] = requests
    if limits is not None:
        res["limits"] = limits
    return {"roles": {role: {"resources": res}}}


def _role(role: str, **fields: Any) -> Obj:
    return {"roles": {role: fields}}


def _tol(*tolerations: Any, role: str = "prefill") -> Obj:
    return _role(role, tolerations=list(tolerations))


def _required(*exprs: Obj) -> Obj:
    return _role("prefill", affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": list(exprs)}]}}})


def _meta(**fields: Any) -> Callable[[Obj], None]:
    def mutate(doc: Obj) -> None:
        doc["metadata"].update(fields)
    return mutate


def _doc(key: str, value: Any) -> Callable[[Obj], None]:
    def mutate(doc: Obj) -> None:
        doc[key] = value
    return mutate


# (id, spec or a mutation of a whole valid resource, the message's start: field path first)
INVALID: list[tuple[str, Obj | Callable[[Obj], None], str]] = [
    # --- resources: quantities, signs, requests <= limits, resource names
    ("cpu-negative", _res("prefill", {"cpu": "-1"}),
     "spec.roles.prefill.resources.requests.cpu: '-1' must be greater than or equal to 0"),
    ("cpu-negative-integer", _res("decode", {"cpu": -2}),
     "spec.roles.decode.resources.requests.cpu: -2 must be greater than or equal to 0"),
    ("memory-not-a-quantity", _res("conductor", limits={"memory": "lots"}),
     "spec.roles.conductor.resources.limits.memory: 'lots' is not a quantity"),
    ("memory-dangling-exponent", _res("master", {"memory": "1e"}),
     "spec.roles.master.resources.requests.memory: '1e' is not a quantity"),
    ("memory-with-space", _res("master", {"memory": "1 Gi"}),
     "spec.roles.master.resources.requests.memory: '1 Gi' is not a quantity"),
    ("memory-request-above-limit", _res("conductor", {"memory": "2Gi"}, {"memory": "1Gi"}),
     "spec.roles.conductor.resources.requests.memory: '2Gi' must be less than or equal to the "
     "memory limit ('1Gi')"),
    ("cpu-request-above-limit", _res("master", {"cpu": "2"}, {"cpu": "500m"}),
     "spec.roles.master.resources.requests.cpu: '2' must be less than or equal to the cpu "
     "limit ('500m')"),
    ("cpu-yaml-float", _res("conductor", {"cpu": 0.5}),
     "spec.roles.conductor.resources.requests.cpu: 0.5 must be an integer or a quoted "
     "quantity"),
    ("unprefixed-resource", _res("prefill", limits={"gpu": 1}),
     "spec.roles.prefill.resources.limits.gpu: 'gpu' is not a container resource"),
    ("kubernetes-io-resource", _res("prefill", limits={"kubernetes.io/widget": 1}),
     "spec.roles.prefill.resources.limits[kubernetes.io/widget]: 'kubernetes.io/widget' is a "
     "kubernetes.io resource"),
    ("rdma-protocol-untested",
     {"transferProtocol": "rdma", "rdma": {"enabled": True}},
     "spec.transferProtocol: rdma is not deployed by the operator in this release: the RDMA "
     "transport is untested on hardware"),
    ("fractional-gpu", _res("decode", limits={"nvidia.com/gpu": "0.5"}),
     "spec.roles.decode.resources.limits[nvidia.com/gpu]: '0.5' must be an integer"),
    ("extended-request-not-limit", _res("store", {"example.com/fpga": 1},
                                        {"example.com/fpga": 2}),
     "spec.roles.store.resources.requests[example.com/fpga]: 1 must equal the "
     "example.com/fpga limit (2)"),
    ("extended-request-without-limit", _res("store", {"example.com/fpga": 1}),
     "spec.roles.store.resources.requests[example.com/fpga]: example.com/fpga cannot be "
     "overcommitted"),
    ("resources-typo", {"roles": {"prefill": {"resources": {"request": {"cpu": "1"}}}}},
     "spec.roles.prefill.resources.request: unknown field"),
    # --- nodeSelector
    ("node-selector-key-with-space", _role("prefill", nodeSelector={"gpu type": "a100"}),
     "spec.roles.prefill.nodeSelector[gpu type]: 'gpu type' must be a qualified name"),
    ("node-selector-key-two-slashes", _role("decode", nodeSelector={"a/b/c": "x"}),
     "spec.roles.decode.nodeSelector[a/b/c]: 'a/b/c' must be a qualified name"),
    ("node-selector-key-uppercase-prefix", _role("store", nodeSelector={"Example.com/x": "1"}),
     "spec.roles.store.nodeSelector[Example.com/x]: 'Example.com/x' must be a qualified name"),
    ("node-selector-key-name-too-long", _role("store", nodeSelector={"k" * 64: "1"}),
     f"spec.roles.store.nodeSelector.{'k' * 64}: '{'k' * 64}' must be a qualified name"),
    ("node-selector-key-prefix-too-long",
     _role("master", nodeSelector={"a." * 127 + "a/x": "1"}),
     f"spec.roles.master.nodeSelector[{'a.' * 127}a/x]: "),
    ("node-selector-value-with-space", _role("decode", nodeSelector={"disk": "fast ssd"}),
     "spec.roles.decode.nodeSelector.disk: 'fast ssd' must be a label value"),
    ("node-selector-value-too-long", _role("decode", nodeSelector={"disk": "v" * 64}),
     f"spec.roles.decode.nodeSelector.disk: '{'v' * 64}' is too long"),
    ("node-selector-value-not-string", _role("decode", nodeSelector={"disk": 1}),
     "spec.roles.decode.nodeSelector.disk: 1 is not of type 'string'"),
    # --- tolerations
    ("toleration-operator", _tol({"key": "k", "operator": "Sometimes"}),
     "spec.roles.prefill.tolerations[0].operator: 'Sometimes' is not one of"),
    ("toleration-effect", _tol({"key": "k", "operator": "Exists", "effect": "NoRun"}),
     "spec.roles.prefill.tolerations[0].effect: 'NoRun' is not one of"),
    ("toleration-exists-with-value", _tol({"key": "k"}, {"key": "k", "operator": "Exists",
                                                         "value": "v"}, role="decode"),
     "spec.roles.decode.tolerations[1].value: value must be empty when operator is Exists"),
    ("toleration-empty-key-equal", _tol({"operator": "Equal", "value": "x"}),
     "spec.roles.prefill.tolerations[0].operator: operator must be Exists when key is empty"),
    ("toleration-seconds-without-no-execute",
     _tol({"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}),
     "spec.roles.prefill.tolerations[0].effect: effect must be NoExecute when "
     "tolerationSeconds is set"),
    ("toleration-key", _tol({"key": "bad key", "operator": "Exists"}),
     "spec.roles.prefill.tolerations[0].key: 'bad key' must be a qualified name"),
    ("toleration-value", _tol({"key": "k", "value": "a b"}),
     "spec.roles.prefill.tolerations[0].value: 'a b' must be a label value"),
    ("toleration-typo", _tol({"key": "k", "operater": "Exists"}),
     "spec.roles.prefill.tolerations[0].operater: unknown field"),
    ("toleration-not-a-mapping", _tol("node-role.kubernetes.io/gpu"),
     "spec.roles.prefill.tolerations[0]: 'node-role.kubernetes.io/gpu' is not of type "
     "'object'"),
    # --- affinity
    ("affinity-operator", _required({"key": "zone", "operator": "Near", "values": ["a"]}),
     f"{TERM0}.matchExpressions[0].operator: 'Near' is not one of In, NotIn"),
    ("affinity-in-without-values", _required({"key": "zone", "operator": "In"}),
     f"{TERM0}.matchExpressions[0].values: operator In needs at least one value"),
    ("affinity-exists-with-values", _required({"key": "zone", "operator": "Exists",
                                               "values": ["a"]}),
     f"{TERM0}.matchExpressions[0].values: operator Exists takes no values, got 1"),
    ("affinity-gt-two-values", _required({"key": "cores", "operator": "Gt",
                                          "values": ["8", "16"]}),
     f"{TERM0}.matchExpressions[0].values: operator Gt takes exactly one value, got 2"),
    ("affinity-lt-not-integer", _required({"key": "cores", "operator": "Lt",
                                           "values": ["ten"]}),
     f"{TERM0}.matchExpressions[0].values[0]: operator Lt compares integers; 'ten' is not one"),
    ("affinity-key", _required({"key": "bad key", "operator": "Exists"}),
     f"{TERM0}.matchExpressions[0].key: 'bad key' must be a qualified name"),
    ("affinity-no-terms", _role("prefill", affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}),
     f"{AFF}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: must list at "
     "least one node selector term"),
    ("affinity-empty-term", _role("prefill", affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}),
     f"{TERM0}: an empty term matches no node"),
    ("affinity-match-fields-key", _role("prefill", affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchFields": [{"key": "metadata.labels", "operator": "In",
                             "values": ["x"]}]}]}}}),
     f"{TERM0}.matchFields[0].key: 'metadata.labels' is not supported"),
    ("affinity-weight", _role("prefill", affinity={"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 0, "preference": {"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]}]}}]}}),
     f"{AFF}.preferredDuringSchedulingIgnoredDuringExecution[0].weight: must be an integer "
     "from 1 to 100, got 0"),
    ("pod-anti-affinity-without-topology-key", _role("decode", affinity={"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"app": "x"}}}]}}),
     "spec.roles.decode.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution"
     "[0].topologyKey: required"),
    ("pod-affinity-label-operator", _role("decode", affinity={"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchExpressions": [
                {"key": "app", "operator": "Gt", "values": ["1"]}]}}]}}),
     "spec.roles.decode.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
     ".labelSelector.matchExpressions[0].operator: 'Gt' is not one of In, NotIn, Exists, "
     "DoesNotExist"),
    ("pod-affinity-namespace", _role("decode", affinity={"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "topologyKey": "kubernetes.io/hostname", "namespaces": ["Team_A"]}]}}),
     "spec.roles.decode.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
     ".namespaces[0]: 'Team_A' must be a lowercase RFC 1123 label"),
    ("affinity-typo", _role("store", affinity={"nodeAfinity": {}}),
     "spec.roles.store.affinity.nodeAfinity: unknown field"),
    # --- names
    ("service-account", {"serviceAccountName": "My_SA"},
     "spec.serviceAccountName: 'My_SA' must be a lowercase RFC 1123 subdomain"),
    ("priority-class", _role("prefill", priorityClassName="High Priority"),
     "spec.roles.prefill.priorityClassName: 'High Priority' must be a lowercase RFC 1123 "
     "subdomain"),
    ("cluster-domain", {"clusterDomain": "cluster_local"},
     "spec.clusterDomain: 'cluster_local' must be a lowercase RFC 1123 subdomain"),
    ("secret-name-double-dot", {"clusterTokenSecret": {"name": "a..b"}},
     "spec.clusterTokenSecret.name: 'a..b' must be a lowercase RFC 1123 subdomain"),
    ("namespace", _meta(namespace="Team A"),
     "metadata.namespace: 'Team A' must be a lowercase RFC 1123 label"),
    ("name-uppercase", _meta(name="Demo"),
     "metadata.name: 'Demo' must be a lowercase RFC 1123 label"),
    ("name-missing", _meta(name=None), "metadata.name: required"),
    ("label-key", _meta(labels={"team name": "ml"}),
     "metadata.labels[team name]: 'team name' must be a qualified name"),
    ("metadata-null", _doc("metadata", None), "metadata: must be a mapping"),
    ("spec-null", _doc("spec", None), "spec: null is not of type 'object'"),
    ("spec-a-list", _doc("spec", ["image"]), "spec: ['image'] is not of type 'object'"),
    ("api-version", _doc("apiVersion", "mooncake.io/v1"),
     "apiVersion: 'mooncake.io/v1' is not served here"),
    ("kind", _doc("kind", "Pod"), "kind: 'Pod' is not served here"),
    ("rdma-resource-unprefixed", {"rdma": {"resourceName": "rdma"}},
     "spec.rdma.resourceName: 'rdma' is not an extended resource name"),
    ("rdma-node-label", {"rdma": {"nodeLabel": "rdma capable"}},
     "spec.rdma.nodeLabel: 'rdma capable' must be a qualified name"),
    ("service-annotation-key", {"roles": {"conductor": {"service": {
        "annotations": {"lb type": "nlb"}}}}},
     "spec.roles.conductor.service.annotations[lb type]: 'lb type' must be a qualified name"),
    # --- the pod template override's pod fields
    ("pod-template-resources", _role("decode", podTemplate={"spec": {"containers": [
        {"name": "decode", "resources": {"limits": {"cpu": "-1"}}}]}}),
     "spec.roles.decode.podTemplate.spec.containers[0].resources.limits.cpu: '-1' must be "
     "greater than or equal to 0"),
    ("pod-template-toleration", _role("store", podTemplate={"spec": {"tolerations": [
        {"key": "k", "operator": "Maybe"}]}}),
     "spec.roles.store.podTemplate.spec.tolerations[0].operator: 'Maybe' is not one of"),
    ("pod-template-node-selector", _role("store", podTemplate={"spec": {
        "nodeSelector": {"bad key": "x"}}}),
     "spec.roles.store.podTemplate.spec.nodeSelector[bad key]: 'bad key' must be a qualified "
     "name"),
    ("pod-template-not-a-template", _role("store", podTemplate={"containers": []}),
     "spec.roles.store.podTemplate.containers: unknown field (known: metadata, spec)"),
    ("pod-template-spec-typo", _role("prefill", podTemplate={"spec": {
        "nodeSelecter": {"disk": "ssd"}}}),
     "spec.roles.prefill.podTemplate.spec.nodeSelecter: unknown field of a PodSpec"),
    ("pod-template-metadata-typo", _role("prefill", podTemplate={"metadata": {
        "label": {"team": "ml"}}}),
     "spec.roles.prefill.podTemplate.metadata.label: unknown field of an ObjectMeta"),
    ("pod-template-null-containers", _role("prefill", podTemplate={"spec": {
        "containers": None}}),
     "spec.roles.prefill.podTemplate.spec.containers: must be a list, got null"),
    ("pod-template-null-metadata", _role("prefill", podTemplate={"metadata": None}),
     "spec.roles.prefill.podTemplate.metadata: must be a mapping, got null"),
    # --- across fields, and what the programs refuse
    ("dram-zero", {"store": {"dramPerNode": 0}},
     "spec.store.dramPerNode: 0 is below 1Mi, the least a store node serves"),
    ("dram-below-a-mebibyte", {"store": {"dramPerNode": "512Ki"}},
     "spec.store.dramPerNode: '512Ki' is below 1Mi"),
    ("replication-above-store-nodes", {"store": {"replicationFactor": 3},
                                       "roles": {"store": {"replicas": 2}}},
     "spec.store.replicationFactor: store.replicationFactor 3 is above roles.store.replicas 2"),
    ("replication-without-store-nodes", {"roles": {"store": {"replicas": 0}}},
     "spec.store.replicationFactor: store.replicationFactor 1 is above roles.store.replicas 0"),
    ("prefill-zero-decode-some", {"roles": {"prefill": {"replicas": 0},
                                            "decode": {"replicas": 2}}},
     "spec.roles.prefill.replicas: roles.prefill.replicas is 0 but roles.decode.replicas is "
     "not"),
    ("decode-zero-prefill-some", {"roles": {"decode": {"replicas": 0}}},
     "spec.roles.decode.replicas: roles.decode.replicas is 0 but roles.prefill.replicas is not"),
    ("served-name-empty", {"model": {"servedName": ""}},
     "spec.model.servedName: '' should be non-empty"),
    ("shm-zero", _role("prefill", shmSize=0),
     "spec.roles.prefill.shmSize: must be greater than 0"),
    ("ssd-zero", {"store": {"ssd": {"size": "0Gi"}}},
     "spec.store.ssd.size: must be greater than 0"),
    ("staging-zero", {**SGLANG, "engine": {"kind": "sglang", "sidecar": {"stagingSize": 0}}},
     "spec.engine.sidecar.stagingSize: must be greater than 0"),
    ("hf-cache-zero", {"model": {"huggingFace": {"id": "org/model", "cacheSize": "0"}}},
     "spec.model.huggingFace.cacheSize: must be greater than 0"),
]

FIELD_PATH = re.compile(r"^(apiVersion|kind|metadata|spec)([.\[][^:]*)?: ")


def _resource(case: Obj | Callable[[Obj], None], make_cluster: Callable[..., Obj]) -> Obj:
    if callable(case):
        doc = make_cluster({})
        case(doc)
        return doc
    return make_cluster(case)


@pytest.mark.parametrize(("case", "expected"), [(c, e) for _, c, e in INVALID],
                         ids=[i for i, _, _ in INVALID])
def test_resource_that_cannot_run_is_rejected_naming_the_field(
        make_cluster: Callable[..., Obj], case: Obj | Callable[[Obj], None],
        expected: str) -> None:
    with pytest.raises(InvalidResource) as err:
        validate_cluster(_resource(case, make_cluster))
    assert any(m.startswith(expected) for m in err.value.errors), err.value.errors
    for m in err.value.errors:
        assert FIELD_PATH.match(m), m


def test_there_are_at_least_forty_invalid_resources() -> None:
    assert len(INVALID) >= 40
    assert len({i for i, _, _ in INVALID}) == len(INVALID)


@pytest.mark.parametrize(("case", "expected"), [(c, e) for _, c, e in INVALID
                                                if not callable(c)],
                         ids=[i for i, c, _ in INVALID if not callable(c)])
def test_the_operator_refuses_what_the_api_server_would_admit(
        make_cluster: Callable[..., Obj], case: Obj, expected: str) -> None:
    """The API server runs only the CRD (schema and CEL). What passes it must still not
    reach the cluster: `render` raises the same message, which the operator reports as
    InvalidSpec."""
    try:
        stored = validate(schema.cluster_schema(), make_cluster(case))
    except InvalidResource as e:
        assert any(m.startswith(expected) for m in e.errors), e.errors  # the CRD's own work
        return
    with pytest.raises(SpecError) as err:
        render(stored)
    assert expected in str(err.value)


# ---- what must still be admitted

VALID_QUANTITIES = {"cpu": "500m", "memory": "1.5Gi", "ephemeral-storage": "1e9"}


def test_edge_quantities_and_pod_fields_are_admitted_and_rendered_valid(
        make_cluster: Callable[..., Obj]) -> None:
    spec = {
        "serviceAccountName": "mooncake.sa-1",
        "roles": {
            "conductor": {"resources": {"requests": VALID_QUANTITIES,
                                        "limits": {"cpu": "1", "memory": "2Gi",
                                                   "ephemeral-storage": "1E"}}},
            "master": {"resources": {"requests": {"cpu": 1, "memory": "1e3"},
                                     "limits": {"cpu": "1000m", "memory": "1k"}}},
            "prefill": {
                "resources": {"requests": {"nvidia.com/gpu": 1, "cpu": ".5"}},
                "nodeSelector": {"kubernetes.io/os": "linux", "tier": "",
                                 "example.com/" + "g" * 63: "v" * 63},
                "priorityClassName": "high.priority",
                "tolerations": [
                    {"operator": "Exists"},
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "spot", "value": "true", "effect": "NoExecute",
                     "tolerationSeconds": 60},
                    {"key": "dedicated", "operator": "Equal", "value": ""}],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [
                                    {"key": "cores", "operator": "Gt", "values": ["8"]},
                                    {"key": "zone", "operator": "In", "values": ["a", "b"]},
                                    {"key": "spot", "operator": "DoesNotExist"}]},
                                {"matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                                  "values": ["node-1"]}]}]},
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 100, "preference": {"matchExpressions": [
                                {"key": "disk", "operator": "Exists"}]}}]},
                    "podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [{
                            "weight": 1, "podAffinityTerm": {
                                "topologyKey": "topology.kubernetes.io/zone",
                                "namespaces": ["ml"],
                                "labelSelector": {
                                    "matchLabels": {"app.kubernetes.io/name": "mooncake"},
                                    "matchExpressions": [
                                        {"key": "tier", "operator": "NotIn",
                                         "values": ["batch"]}]}}}]}}},
            "store": {"replicas": 2},
        },
        "store": {"replicationFactor": 2, "dramPerNode": "1Mi"},
    }
    c = validate_cluster(make_cluster(spec))
    r = render(c)
    for obj in r.objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    prefill = r.get("StatefulSet", "demo-prefill")["spec"]["template"]["spec"]
    assert prefill["tolerations"] == spec["roles"]["prefill"]["tolerations"]  # type: ignore[index]
    # A GPU written only under requests is no error: the renderer puts it under limits too.
    assert prefill["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_parked_cluster_is_admitted(make_cluster: Callable[..., Obj]) -> None:
    validate_cluster(make_cluster({"roles": {"prefill": {"replicas": 0},
                                             "decode": {"replicas": 0}}}))


def test_examples_stay_valid(examples: dict[str, Obj]) -> None:
    for doc in examples.values():
        render(validate_cluster(doc))


# ---- the Kubernetes rules themselves

@pytest.mark.parametrize(("text", "value"), [
    ("500m", Decimal("0.5")), ("1.5Gi", Decimal(3 << 29)), ("1e3", Decimal(1000)),
    ("1E3", Decimal(1000)), ("1E", Decimal(10) ** 18), (".5", Decimal("0.5")),
    ("5.", Decimal(5)), ("+1k", Decimal(1000)), ("-2", Decimal(-2)), ("100u", Decimal("1e-4")),
    ("3n", Decimal("3e-9")), ("2Ki", Decimal(2048)), ("1.5e-3", Decimal("0.0015")),
    (4, Decimal(4)), (0.25, Decimal("0.25")),
])
def test_quantity_grammar(text: str | int | float, value: Decimal) -> None:
    assert corev1.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1 Gi", "1GB", "1gi", "Gi", "1e", "1.5.0",
                                  "--1", "1Kib", "0x10", "1e3Gi", True, None, [1], "inf",
                                  float("nan")])
def test_quantity_grammar_rejects(text: Any) -> None:
    with pytest.raises(corev1.QuantityError, match="is not a quantity"):
        corev1.parse_quantity(text)


def test_qualified_name_limits() -> None:
    assert corev1.qualified_name("example.com/" + "n" * 63, "k") == []
    assert corev1.qualified_name("n" * 64, "k") != []
    prefix = ".".join(["a" * 63] * 4)[:253]  # 253 characters: the most a prefix may have
    assert corev1.qualified_name(prefix.rstrip(".") + "/x", "k") == []
    assert corev1.qualified_name("a" + prefix + "/x", "k") != []
    assert corev1.qualified_name("/x", "k") != [] and corev1.qualified_name("x/", "k") != []
    assert corev1.label_value("", "v") == [] and corev1.label_value("-a", "v") != []


@pytest.mark.parametrize(("fields", "schema_file"), [
    (corev1.POD_SPEC_FIELDS, "podspec-v1.json"),
    (corev1.OBJECT_META_FIELDS, "objectmeta-meta-v1.json"),
])
def test_field_lists_match_the_kubernetes_openapi(fields: tuple[str, ...],
                                                  schema_file: str) -> None:
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    published = json.loads((folder / f"v{K8S_VERSION}.0-local-strict" / schema_file)
                           .read_text())["properties"]
    assert sorted(fields) == sorted(published)


NAMES = ["a", "a-b", "a.b", "a..b", "-a", "a-", "A", "a_b", "a/b", "example.com/a_B.c",
         "Example.com/a", "a/b/c", "x" * 63, "x" * 64, "", "1", "a.b-c.d", "a.-b", "a b"]


@pytest.mark.parametrize(("pattern", "check"), [
    (schema_dsl.DNS_LABEL, corev1.dns1123_label),
    (schema_dsl.DNS_SUBDOMAIN, corev1.dns1123_subdomain),
    (corev1.QUALIFIED_NAME, corev1.qualified_name),
    (corev1.LABEL_VALUE, corev1.label_value),
])
def test_crd_patterns_agree_with_the_python_rules(
        pattern: str, check: Callable[[Any, str], list[str]]) -> None:
    """The CRD's pattern (what the API server checks) and the Python rule accept the same
    names; length limits aside, which the CRD states as maxLength."""
    for name in NAMES:
        if len(name) <= 63:
            assert (re.search(pattern, name) is not None) == (check(name, "f") == []), name


@pytest.mark.parametrize("text", ["500m", "1", "1.5Gi", "1e3", ".5", "lots", "-1", "1 Gi",
                                  "1e", "5.", "2Ki", "1gi"])
def test_crd_quantity_pattern_agrees_with_the_parser(text: str) -> None:
    """The CRD's quantity pattern is the grammar without a sign (no resource may be
    negative)."""
    assert (re.search(corev1.QUANTITY, text) is not None) == (
        corev1.quantity_errors(text, "q") == [])


TOLERATIONS = [
    {"key": "k", "operator": "Exists", "value": "v"},
    {"operator": "Equal", "value": "x"},
    {"value": "x"},
    {"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5},
    {"key": "k", "tolerationSeconds": 5},
    {"operator": "Exists", "tolerationSeconds": 5, "effect": "NoExecute"},
    {"operator": "Exists"},
    {"key": "k", "operator": "Equal", "value": "v", "effect": "PreferNoSchedule"},
]


@pytest.mark.parametrize("tol", TOLERATIONS)
def test_toleration_cel_rules_agree_with_the_python_rules(tol: Obj) -> None:
    """A toleration is refused by the CRD's CEL rules exactly when the Python rules refuse
    it, in the same words (so `mooncake render` lists it once)."""
    s = schema.cluster_spec_schema()["properties"]["roles"]["properties"]["prefill"][
        "properties"]["tolerations"]["items"]
    try:
        validate(s, tol)
        crd: list[str] = []
    except InvalidResource as e:
        crd = e.errors
    assert sorted(crd) == sorted(corev1.toleration(tol, ""))


# ---- odd values anywhere: a message or a valid pod, never an exception or a refused pod

ODD: list[Any] = [None, "", "x", "-1", "1e3", 0, -1, 1.5, True, [], [None], ["x"], {},
                  {"a": None}, {"a": [1]}, {"": ""}, {"key": {}}]
ODD_PATHS = [
    ("roles", "prefill", "resources"), ("roles", "prefill", "resources", "requests"),
    ("roles", "prefill", "resources", "limits", "cpu"),
    ("roles", "prefill", "resources", "requests", "nvidia.com/gpu"),
    ("roles", "decode", "nodeSelector"), ("roles", "decode", "tolerations"),
    ("roles", "decode", "affinity"), ("roles", "decode", "affinity", "nodeAffinity"),
    ("roles", "decode", "affinity", "podAntiAffinity"), ("roles", "store", "podTemplate"),
    ("roles", "store", "podTemplate", "spec"), ("roles", "store", "podTemplate", "metadata"),
    ("roles", "store", "podTemplate", "spec", "containers"),
    ("roles", "store", "podTemplate", "spec", "tolerations"),
    ("roles", "store", "priorityClassName"), ("serviceAccountName",), ("store", "dramPerNode"),
    ("store", "ssd"), ("model", "servedName"), ("rdma", "resourceName"), ("roles", "master"),
    ("roles", "conductor", "service", "annotations"), ("clusterDomain",),
]


@pytest.mark.parametrize("path", ODD_PATHS, ids=[".".join(p) for p in ODD_PATHS])
def test_odd_values_get_a_message_or_render_pods_kubernetes_accepts(
        make_cluster: Callable[..., Obj], path: tuple[str, ...]) -> None:
    for value in ODD:
        spec: Obj = {}
        node = spec
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        try:
            rendered = render(validate_cluster(make_cluster(spec)))
        except InvalidResource as e:
            assert all(FIELD_PATH.match(m) for m in e.errors), e.errors
            continue
        except SpecError:
            continue
        for obj in rendered.objects:
            if obj["kind"] in ("StatefulSet", "Deployment"):
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
