"""The MooncakeCluster CRD schema: structure, descriptions, defaults, and admission of bad CRs.

Invalid resources go through the same path as `mooncake render`: API-server-style defaulting,
the OpenAPI schema with jsonschema, then every `x-kubernetes-validations` rule with cel-python.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mooncake_k8s.operator import crds, schema, schema_model
from mooncake_k8s.operator.validation import (
    InvalidResource,
    _program,
    apply_defaults,
    validate,
    validate_cluster,
)

Obj = dict[str, Any]


def _nodes(s: Obj, path: str = "") -> Iterator[tuple[str, Obj]]:
    yield path, s
    for k, sub in s.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{k}")
    if isinstance(s.get("items"), dict):
        yield from _nodes(s["items"], f"{path}[]")
    if isinstance(s.get("additionalProperties"), dict):
        yield from _nodes(s["additionalProperties"], f"{path}{{}}")


ALL_SCHEMAS = [("cluster", schema.cluster_schema()), ("scaler", schema.scaler_schema())]


@pytest.mark.parametrize(("kind", "s"), ALL_SCHEMAS)
def test_every_field_has_a_description_for_kubectl_explain(kind: str, s: Obj) -> None:
    missing = [p for p, node in _nodes(s) if p and not p.endswith("{}") and
               not p.endswith(".metadata") and not node.get("description")]
    assert missing == []


@pytest.mark.parametrize(("kind", "s"), ALL_SCHEMAS)
def test_schema_is_structural(kind: str, s: Obj) -> None:
    # The API server rejects CRDs whose nodes lack a type (except int-or-string) or that mix
    # properties with additionalProperties.
    for path, node in _nodes(s):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), path


@pytest.mark.parametrize(("kind", "s"), ALL_SCHEMAS)
def test_defaults_validate_against_their_own_schema(kind: str, s: Obj) -> None:
    for _path, node in _nodes(s):
        if "default" in node:
            sub = {k: v for k, v in node.items() if k != "default"}
            jsonschema.validate(apply_defaults(sub, node["default"]), sub)


@pytest.mark.parametrize(("kind", "s"), ALL_SCHEMAS)
def test_every_cel_rule_compiles(kind: str, s: Obj) -> None:
    rules = [r for _, node in _nodes(s) for r in node.get("x-kubernetes-validations", [])]
    assert rules
    for r in rules:
        assert _program(r["rule"]) is not None
        assert r["message"].strip()


def test_crd_has_status_scale_columns_and_short_name() -> None:
    c = crds.cluster_crd()
    v = c["spec"]["versions"][0]
    assert c["spec"]["names"]["shortNames"] == ["mcc"]
    assert v["subresources"] == {"status": {}}
    assert {col["name"] for col in v["additionalPrinterColumns"]} >= {
        "Ready", "Prefill", "Decode", "Store", "Transport", "Age"}
    s = crds.scaler_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert s == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                 "labelSelectorPath": ".status.selector"}


def test_empty_spec_gets_every_default(make_cluster: Callable[..., Obj]) -> None:
    spec = validate_cluster(make_cluster({}))["spec"]
    assert spec["image"] == schema.DEFAULT_IMAGE
    assert spec["engine"] == {"kind": "embedded"}
    assert spec["roles"]["decode"]["localSegmentSize"] == "2Gi"
    assert spec["store"]["blockTokens"] == 64
    assert spec["autoscaling"]["ratio"] == {"min": 0.25, "max": 4.0}
    assert {r: spec["roles"][r]["replicas"] for r in schema.ROLES} == dict.fromkeys(
        schema.ROLES, 1)


def test_defaulting_keeps_what_the_user_set(make_cluster: Callable[..., Obj]) -> None:
    spec = validate_cluster(make_cluster({"roles": {"prefill": {"replicas": 3}},
                                          "store": {"blockTokens": 16}}))["spec"]
    assert spec["roles"]["prefill"]["replicas"] == 3
    assert spec["roles"]["prefill"]["shmSize"] == "1Gi"
    assert spec["store"]["blockTokens"] == 16 and spec["store"]["dramPerNode"] == "4Gi"


def test_examples_are_valid(examples: dict[str, Obj]) -> None:
    assert {"laptop-cpu", "gpu-rdma", "vllm-cpu", "sglang-cpu"} <= set(examples)
    for doc in examples.values():
        validate_cluster(doc)


# (id, spec, expected message fragment including the field path)
INVALID: list[tuple[str, Obj, str]] = [
    ("rdma-required-without-enabled", {"rdma": {"required": True}},
     "spec.rdma.required: rdma.required needs rdma.enabled"),
    ("rdma-protocol-without-rdma", {"transferProtocol": "rdma"},
     "spec.transferProtocol: transferProtocol rdma needs rdma.enabled"),
    ("rdma-with-tcp", {"rdma": {"enabled": True}, "transferProtocol": "tcp"},
     "spec.rdma.enabled: rdma.enabled contradicts transferProtocol tcp"),
    ("prefill-min-above-max", {"autoscaling": {"prefill": {"minReplicas": 5, "maxReplicas": 2}}},
     "spec.autoscaling.prefill.minReplicas: autoscaling.prefill.minReplicas must not exceed"),
    ("decode-min-above-max", {"autoscaling": {"decode": {"minReplicas": 9, "maxReplicas": 3}}},
     "spec.autoscaling.decode.minReplicas: autoscaling.decode.minReplicas must not exceed"),
    ("ratio-min-above-max", {"autoscaling": {"ratio": {"min": 3, "max": 1}}},
     "spec.autoscaling.ratio.min: autoscaling.ratio.min must not exceed ratio.max"),
    ("ratio-unreachable-low", {"autoscaling": {"prefill": {"maxReplicas": 1},
                                               "decode": {"minReplicas": 8},
                                               "ratio": {"min": 0.5}}},
     "prefill.maxReplicas is below ratio.min x decode.minReplicas"),
    ("ratio-unreachable-high", {"autoscaling": {"prefill": {"minReplicas": 8},
                                                "decode": {"maxReplicas": 1},
                                                "ratio": {"max": 2}}},
     "prefill.minReplicas is above ratio.max x decode.maxReplicas"),
    ("watermarks-inverted", {"store": {"highWatermark": 0.5, "lowWatermark": 0.7}},
     "spec.store.lowWatermark: store.lowWatermark must be below store.highWatermark"),
    ("watermark-above-one", {"store": {"highWatermark": 1.5}},
     "spec.store.highWatermark: 1.5 is greater than the maximum of 1.0"),
    ("two-masters-embedded", {"roles": {"master": {"replicas": 2}}},
     "spec.roles.master.replicas: more than one master needs metadataBackend.type redis"),
    ("redis-without-url", {"metadataBackend": {"type": "redis"}},
     "spec.metadataBackend.redisUrlSecret: metadataBackend.type redis needs"),
    ("sglang-without-model", {"engine": {"kind": "sglang"}},
     "spec.model: engine.kind sglang needs a model source"),
    ("vllm-without-model", {"engine": {"kind": "vllm"}},
     "spec.model: engine.kind vllm needs a model source (huggingFace, pvc, hostPath or image)"),
    ("vllm-args-set-the-model", {"engine": {"kind": "vllm", "args": ["--model=/m"]},
                                 "model": {"hostPath": {"path": "/m"}}},
     "spec.engine.args: engine.args: --model=/m is set by the vllm worker (use spec.model, "
     "spec.store.blockTokens); remove it from engine.args (the worker owns --model, --host, "
     "--port, --served-model-name, --block-size and --kv-transfer-config)"),
    ("vllm-args-set-the-block-size", {"engine": {"kind": "vllm",
                                                 "args": ["--dtype", "bfloat16",
                                                          "--block-size", "16"]},
                                      "model": {"hostPath": {"path": "/m"}}},
     "spec.engine.args: engine.args: --block-size is set by the vllm worker"),
    ("sglang-args-set-the-page-size", {"engine": {"kind": "sglang",
                                                  "args": ["--tp-size", "2", "--page-size=16"]},
                                       "model": {"hostPath": {"path": "/m"}}},
     "spec.engine.args: engine.args: --page-size=16 is set by the sglang worker (from "
     "spec.model, spec.store.blockTokens and the cluster token); remove it from engine.args"),
    ("unknown-device", {"engine": {"kind": "sglang", "device": "rocm"},
                        "model": {"hostPath": {"path": "/m"}}},
     "spec.engine.device: 'rocm' is not one of ['cpu', 'cuda']"),
    ("sidecar-staging-not-a-size", {"engine": {"kind": "sglang", "sidecar": {
        "stagingSize": "lots"}}, "model": {"hostPath": {"path": "/m"}}},
     "spec.engine.sidecar.stagingSize: 'lots' is not a size"),
    ("vllm-image-by-digest", {"image": "reg.example/mooncake-k8s@sha256:" + "0" * 64,
                              "engine": {"kind": "vllm"}, "model": {"hostPath": {"path": "/m"}}},
     "spec.engine.image: spec.image is pinned by digest, so the engine's image variant cannot"),
    ("two-model-sources", {"model": {"hostPath": {"path": "/m"}, "pvc": {"claimName": "m"}}},
     "spec.model: model: set at most one of huggingFace, pvc, hostPath, image"),
    ("size-with-space", {"store": {"dramPerNode": "4 GB"}},
     "spec.store.dramPerNode: '4 GB' is not a size"),
    ("unknown-field-typo", {"roles": {"prefil": {"replicas": 2}}},
     "spec.roles.prefil: unknown field"),
    ("unknown-engine", {"engine": {"kind": "tgi"}},
     "spec.engine.kind: 'tgi' is not one of ['embedded', 'vllm', 'sglang']"),
    ("negative-replicas", {"roles": {"decode": {"replicas": -1}}},
     "spec.roles.decode.replicas: -1 is less than the minimum of 0"),
    ("zero-masters", {"roles": {"master": {"replicas": 0}}},
     "spec.roles.master.replicas: 0 is less than the minimum of 1"),
    ("zero-block-tokens", {"store": {"blockTokens": 0}},
     "spec.store.blockTokens: 0 is less than the minimum of 1"),
    ("bad-hf-id", {"model": {"huggingFace": {"id": "just a name"}}},
     "spec.model.huggingFace.id: 'just a name' does not match"),
    ("replicas-outside-bounds", {"autoscaling": {"enabled": True, "prefill": {"minReplicas": 2}},
                                 "roles": {"prefill": {"replicas": 1}}},
     "spec.roles.prefill.replicas: roles.prefill.replicas must lie within autoscaling.prefill"),
    ("slo-wrong-type", {"slo": {"ttftMs": "fast"}},
     "spec.slo.ttftMs: 'fast' is not of type 'integer'"),
    ("pvc-path-escapes", {"model": {"pvc": {"claimName": "models", "path": "../etc"}}},
     "spec.model.pvc.path: '../etc' does not match"),
    ("bad-secret-name", {"roles": {"conductor": {"apiKeysSecret": "Bad_Name"}}},
     "spec.roles.conductor.apiKeysSecret: 'Bad_Name' does not match"),
    ("rdma-zero-devices", {"rdma": {"enabled": True, "count": 0}},
     "spec.rdma.count: 0 is less than the minimum of 1"),
    ("hostpath-relative", {"model": {"hostPath": {"path": "models"}}},
     "spec.model.hostPath.path: 'models' does not match"),
    ("service-type", {"roles": {"conductor": {"service": {"type": "Ingress"}}}},
     "spec.roles.conductor.service.type: 'Ingress' is not one of"),
]


@pytest.mark.parametrize(("spec", "expected"), [(s, e) for _, s, e in INVALID],
                         ids=[i for i, _, _ in INVALID])
def test_invalid_cluster_is_rejected_with_a_clear_message(
        make_cluster: Callable[..., Obj], spec: Obj, expected: str) -> None:
    with pytest.raises(InvalidResource) as err:
        validate_cluster(make_cluster(spec))
    assert any(expected in m for m in err.value.errors), err.value.errors


def test_there_are_at_least_twenty_invalid_cases() -> None:
    assert len(INVALID) >= 20


def test_name_too_long_for_child_names(make_cluster: Callable[..., Obj]) -> None:
    with pytest.raises(InvalidResource, match="at most 40 characters"):
        validate_cluster(make_cluster({}, name="a" * 41))
    validate_cluster(make_cluster({}, name="a" * 40))


def test_wrong_kind_is_rejected(make_cluster: Callable[..., Obj]) -> None:
    c = make_cluster({})
    c["apiVersion"] = "mooncake.io/v1"
    with pytest.raises(InvalidResource, match=r"expected apiVersion mooncake\.io/v1alpha1"):
        validate_cluster(c)


def test_ssd_tier_is_immutable_on_update(make_cluster: Callable[..., Obj]) -> None:
    old = make_cluster({"store": {"ssd": {"size": "100Gi"}}})
    validate_cluster(copy.deepcopy(old), old)  # unchanged: fine
    grown = make_cluster({"store": {"ssd": {"size": "200Gi"}}})
    with pytest.raises(InvalidResource, match=r"spec.store.ssd: store.ssd is immutable"):
        validate_cluster(grown, old)
    with pytest.raises(InvalidResource, match=r"store\.ssd cannot be removed"):
        validate_cluster(make_cluster({}), old)
    validate_cluster(grown)  # a create may set any size


def test_scaler_role_is_immutable() -> None:
    s = schema.scaler_schema()
    old: Obj = {"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeRoleScaler",
           "metadata": {"name": "x"}, "spec": {"clusterName": "x", "role": "prefill",
                                               "replicas": 2}}
    validate(s, old)
    new = copy.deepcopy(old)
    new["spec"]["role"] = "decode"
    with pytest.raises(InvalidResource, match=r"spec.role: spec.role is immutable"):
        validate(s, new, old)
    bad = copy.deepcopy(old)
    bad["spec"]["role"] = "router"
    with pytest.raises(InvalidResource, match="'router' is not one of"):
        validate(s, bad)


def test_vllm_accepts_a_model_source_and_its_own_args(make_cluster: Callable[..., Obj]) -> None:
    """What the vllm rules must not reject: flags that only share a prefix with an owned one,
    a digest-pinned spec.image with an explicit engine image, the same args for sglang."""
    model = {"pvc": {"claimName": "weights"}}
    args = ["--model-impl", "vllm", "--max-model-len=4096", "--hostname-unrelated"]
    spec = validate_cluster(make_cluster({"engine": {"kind": "vllm", "args": args},
                                          "model": model}))["spec"]
    assert spec["engine"] == {"kind": "vllm", "args": args}
    digest = "reg.example/mooncake-k8s@sha256:" + "0" * 64
    validate_cluster(make_cluster({"image": digest, "model": model, "engine": {
        "kind": "vllm", "image": "reg.example/mooncake-k8s:0.1.0-vllm"}}))
    validate_cluster(make_cluster({"image": digest, "model": model, "engine": {"kind": "vllm"},
                                   "roles": {"prefill": {"image": "p:1"},
                                             "decode": {"image": "d:1"}}}))
    validate_cluster(make_cluster({"image": digest}))  # embedded runs spec.image itself
    # vLLM's owned flags are SGLang's own options and the other way round.
    validate_cluster(make_cluster({"engine": {"kind": "sglang", "args": [
        "--model", "x", "--block-size", "16", "--kv-transfer-config", "{}"]}, "model": model}))
    validate_cluster(make_cluster({"engine": {"kind": "vllm", "args": [
        "--model-path", "x", "--page-size", "16"]}, "model": model}))


def _owned_flags(repo: Path, module: str) -> tuple[str, ...]:
    """OWNED_FLAGS of a worker's engine module, read from its source (importing the SGLang one
    imports SGLang)."""
    tree = ast.parse((repo / "services" / "engine" / module / "server.py").read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "OWNED_FLAGS" for t in n.targets)]
    flags: tuple[str, ...] = ast.literal_eval(value)
    return flags


def test_owned_flags_match_the_workers(repo: Path) -> None:
    """The CRD rejects exactly what the worker would exit on."""
    assert _owned_flags(repo, "vllm") == schema_model.VLLM_OWNED_FLAGS
    assert _owned_flags(repo, "sglang") == schema_model.SGLANG_OWNED_FLAGS


@pytest.mark.parametrize("flag", schema_model.SGLANG_OWNED_FLAGS)
def test_sglang_rejects_every_flag_its_worker_owns(make_cluster: Callable[..., Obj],
                                                   flag: str) -> None:
    model = {"pvc": {"claimName": "weights"}}
    for args, offending in ((["--dtype", "bfloat16", flag, "v"], flag),
                            ([f"{flag}=v"], f"{flag}=v")):
        with pytest.raises(InvalidResource) as err:
            validate_cluster(make_cluster({"engine": {"kind": "sglang", "args": args},
                                           "model": model}))
        (msg,) = err.value.errors
        assert msg.startswith(f"spec.engine.args: engine.args: {offending} is set by the "
                              "sglang worker"), msg
    # What only shares a prefix with it is SGLang's own.
    for arg in (f"{flag}-x", f"{flag}x=1"):
        validate_cluster(make_cluster({"engine": {"kind": "sglang", "args": [arg]},
                                       "model": model}))


def test_sglang_engine_rule_has_a_static_fallback_message() -> None:
    """API servers that cannot evaluate messageExpression show the message: it names the field
    and every owned flag."""
    rules = schema.cluster_spec_schema()["properties"]["engine"]["x-kubernetes-validations"]
    (r,) = [r for r in rules if "'sglang'" in r["rule"]]
    assert r["fieldPath"] == ".args" and r["message"].startswith("engine.args: ")
    assert all(f in r["message"] for f in schema_model.SGLANG_OWNED_FLAGS)
    assert "messageExpression" in r


def test_engine_sidecar_and_device_have_no_default(make_cluster: Callable[..., Obj]) -> None:
    """A default there would change spec.engine, and so the serving revision, of every
    existing cluster when the operator is upgraded."""
    spec = validate_cluster(make_cluster({}))["spec"]
    assert spec["engine"] == {"kind": "embedded"}
    spec = validate_cluster(make_cluster({"engine": {"kind": "sglang", "sidecar": {}},
                                          "model": {"pvc": {"claimName": "w"}}}))["spec"]
    assert spec["engine"] == {"kind": "sglang", "sidecar": {"stagingSize": "256Mi"}}
    doc = schema.cluster_spec_schema()["properties"]["engine"]["properties"]["sidecar"][
        "description"]
    assert "restartPolicy Always" in doc and "Kubernetes 1.29" in doc


def test_model_source_message_names_the_engine_kind(make_cluster: Callable[..., Obj]) -> None:
    """The rule's messageExpression words the error; the static message is the fallback an
    API server without messageExpression support shows."""
    (r,) = [r for r in schema.cluster_spec_schema()["x-kubernetes-validations"]
            if "need a model source" in r["message"]]
    assert "vllm and sglang" in r["message"] and r["fieldPath"] == ".model"
    for kind in ("vllm", "sglang"):
        with pytest.raises(InvalidResource) as err:
            validate_cluster(make_cluster({"engine": {"kind": kind}}))
        assert err.value.errors == [
            f"spec.model: engine.kind {kind} needs a model source (huggingFace, pvc, hostPath "
            "or image); the built-in model only runs on the embedded engine"]
