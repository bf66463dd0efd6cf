"""`render`: golden output for every example, Kubernetes-schema validity, and its contracts.

Golden files live in `golden/`; after an intended change regenerate them with
`MOONCAKE_UPDATE_GOLDEN=1 pytest tests/unit/operator/test_operator_render.py` and review the diff.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.operator import naming
from mooncake_k8s.operator import schema as validation_schema
from mooncake_k8s.operator.render import Rendered, SpecError, render
from mooncake_k8s.operator.schema import DATA_ROLES, ROLES
from mooncake_k8s.operator.validation import validate, validate_cluster

Obj = dict[str, Any]
GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.33"


def _render(c: Obj, replicas: dict[str, int] | None = None) -> Rendered:
    return render(validate_cluster(c), replicas)


def _container(pod_template: Obj, name: str) -> Obj:
    c: Obj = next(c for c in pod_template["spec"]["containers"] if c["name"] == name)
    return c


def _env(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def _template(r: Rendered, role: str) -> Obj:
    kind = "Deployment" if role == "conductor" else "StatefulSet"
    t: Obj = r.get(kind, naming.name("demo", role))["spec"]["template"]
    return t


@pytest.mark.parametrize("stem", ["laptop-cpu", "gpu-rdma"])
def test_render_cli_matches_golden(repo: Path, stem: str) -> None:
    result = CliRunner().invoke(main, ["render", "-f", str(repo / "deploy/examples" /
                                                           f"{stem}.yaml")])
    assert result.exit_code == 0, result.output
    golden = GOLDEN / f"{stem}.yaml"
    if os.environ.get("MOONCAKE_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(result.output)
    assert result.output == golden.read_text()


def test_every_example_renders_objects_valid_for_kubernetes(examples: dict[str, Obj]) -> None:
    scaler = validation_schema.scaler_schema()
    for stem, doc in examples.items():
        kinds = set()
        for obj in render(validate_cluster(doc)).objects:
            if obj["kind"] == "MooncakeRoleScaler":
                validate(scaler, obj)  # our own CRD
            else:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            kinds.add(obj["kind"])
        assert kinds == {"ConfigMap", "Service", "StatefulSet", "Deployment",
                         "PodDisruptionBudget", "NetworkPolicy", "MooncakeRoleScaler"}, stem


def test_render_is_deterministic_and_pure(examples: dict[str, Obj]) -> None:
    c = validate_cluster(examples["gpu-rdma"])
    before = copy.deepcopy(c)
    a, b = render(c), render(copy.deepcopy(c))
    assert yaml.safe_dump(a.objects) == yaml.safe_dump(b.objects)
    assert c == before


def test_objects_per_role(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster())
    names = {(o["kind"], o["metadata"]["name"]) for o in r.objects}
    for role in ("prefill", "decode", "store", "master"):
        assert ("StatefulSet", f"demo-{role}") in names
        assert ("Service", f"demo-{role}") in names  # headless, governs the StatefulSet
    assert ("Deployment", "demo-conductor") in names
    assert ("Service", "demo-conductor") in names
    assert ("ConfigMap", "demo-config") in names
    for role in ROLES:
        for kind in ("PodDisruptionBudget", "NetworkPolicy", "MooncakeRoleScaler"):
            assert (kind, f"demo-{role}") in names
    for role in ("prefill", "decode", "store", "master"):
        svc = r.get("Service", f"demo-{role}")
        assert svc["spec"]["clusterIP"] == "None"
        assert r.get("StatefulSet", f"demo-{role}")["spec"]["serviceName"] == f"demo-{role}"


def test_owner_references_only_when_the_uid_is_known(make_cluster: Callable[..., Obj]) -> None:
    owned = _render(make_cluster())
    for o in owned.objects:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref["uid"] == "00000000-0000-4000-8000-000000000001"
        assert ref["controller"] is True and ref["blockOwnerDeletion"] is True
        assert o["metadata"]["namespace"] == "ml"
    assert all("ownerReferences" not in o["metadata"]
               for o in _render(make_cluster(uid=None)).objects)


def test_label_contract(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster())
    for o in r.objects:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "mooncake"
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/managed-by"] == "mooncake-operator"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
    for role in ROLES:
        t = _template(r, role)
        assert t["metadata"]["labels"][naming.LABEL_REVISION] == r.revisions[role]
        kind = "Deployment" if role == "conductor" else "StatefulSet"
        sel = r.get(kind, f"demo-{role}")["spec"]["selector"]["matchLabels"]
        assert naming.LABEL_REVISION not in sel and naming.LABEL_SERVING_REVISION not in sel
        assert sel.items() <= t["metadata"]["labels"].items()
    for role in ("prefill", "decode"):
        t = _template(r, role)
        assert t["metadata"]["labels"][naming.LABEL_SERVING_REVISION] == r.serving_revision
        assert _env(_container(t, role))["MOONCAKE_REVISION"]["value"] == r.serving_revision


def test_cluster_token_only_from_a_secret(examples: dict[str, Obj],
                                          make_cluster: Callable[..., Obj]) -> None:
    default = _render(make_cluster())
    named = _render(make_cluster({"clusterTokenSecret": {"name": "tok", "key": "k"}}))
    for r, ref in ((default, {"name": "demo-cluster-token", "key": "token"}),
                   (named, {"name": "tok", "key": "k"})):
        for role in ROLES:
            env = _env(_container(_template(r, role), role))["MOONCAKE_CLUSTER_TOKEN"]
            assert "value" not in env
            assert env["valueFrom"] == {"secretKeyRef": ref}
    text = yaml.safe_dump(default.objects)
    assert "MOONCAKE_CLUSTER_TOKEN\n    value" not in text


def test_conductor_wiring(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"slo": {"ttftMs": 900, "tbtMs": 40},
                              "roles": {"conductor": {"apiKeysSecret": "keys"}}}))
    t = _template(r, "conductor")
    c = _container(t, "conductor")
    env = _env(c)
    assert env["MOONCAKE_PREFILL"]["value"] == "dns:demo-prefill.ml.svc.cluster.local:50061"
    assert env["MOONCAKE_DECODE"]["value"] == "dns:demo-decode.ml.svc.cluster.local:50071"
    assert env["MOONCAKE_MASTER"]["value"] == "demo-master.ml.svc.cluster.local:50051"
    assert env["MOONCAKE_TTFT_SLO_MS"]["value"] == "900"
    assert env["MOONCAKE_API_KEYS_FILE"]["value"] == "/etc/mooncake/api-keys/api-keys"
    assert c["args"] == ["conductor", "--host", "0.0.0.0", "--allow-any-address"]
    vols = {v["name"]: v for v in t["spec"]["volumes"]}
    assert vols["api-keys"]["secret"]["secretName"] == "keys"
    assert vols["config"]["configMap"]["name"] == "demo-config"


def test_internal_servers_bind_the_pod_ip(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster())
    binds = {"master": "MOONCAKE_MASTER_HOST", "store": "MOONCAKE_NODE_HOST",
             "prefill": "MOONCAKE_HOST", "decode": "MOONCAKE_HOST"}
    for role, var in binds.items():
        c = _container(_template(r, role), role)
        env = c["env"]
        names = [e["name"] for e in env]
        assert _env(c)[var]["value"] == "$(MOONCAKE_POD_IP)"
        # $(VAR) expansion only sees variables defined earlier in the list.
        assert names.index("MOONCAKE_POD_IP") < names.index(var)
        assert "--allow-any-address" not in c["args"]


def test_data_roles_get_rdma_and_shm(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"rdma": {"enabled": True, "required": True, "count": 2}}))
    for role in ROLES:
        t = _template(r, role)
        c = _container(t, role)
        caps = c["securityContext"]["capabilities"]
        inits = {i["name"]: i for i in t["spec"].get("initContainers", [])}
        if role in DATA_ROLES:
            assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 2
            assert caps["add"] == ["IPC_LOCK"]
            assert inits["rdma-probe"]["args"] == [
                "rdma-probe", "--output", "/var/run/mooncake/rdma.json", "--required"]
            assert inits["rdma-probe"]["resources"]["limits"]["rdma/rdma_shared_device_a"] == 2
            terms = t["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert terms == [{"matchExpressions": [{
                "key": "feature.node.kubernetes.io/rdma.available", "operator": "In",
                "values": ["true"]}]}]
            shm = next(v for v in t["spec"]["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory"
        else:
            assert "add" not in caps and "rdma-probe" not in inits
            assert "affinity" not in t["spec"]


def test_rdma_preferred_affinity_keeps_user_affinity(make_cluster: Callable[..., Obj]) -> None:
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}}
    r = _render(make_cluster({"rdma": {"enabled": True},
                              "roles": {"decode": {"affinity": user}}}))
    aff = _template(r, "decode")["spec"]["affinity"]["nodeAffinity"]
    assert aff["requiredDuringSchedulingIgnoredDuringExecution"] == user["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    (pref,) = aff["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["preference"]["matchExpressions"][0]["key"].endswith("rdma.available")


def test_store_sizes_and_ssd(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"store": {"dramPerNode": "8Gi",
                                        "ssd": {"size": "100Gi", "storageClassName": "nvme"}}}))
    sts = r.get("StatefulSet", "demo-store")
    env = _env(_container(sts["spec"]["template"], "store"))
    assert env["MOONCAKE_DRAM_SIZE"]["value"] == str(8 << 30)
    assert env["MOONCAKE_SSD_SIZE"]["value"] == str(100 * (1 << 30) * 95 // 100)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    shm = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == "8448Mi"  # DRAM + 256Mi


def test_model_sources(make_cluster: Callable[..., Obj]) -> None:
    cases = {
        "pvc": ({"pvc": {"claimName": "weights", "path": "qwen"}}, "/models/qwen"),
        "hostPath": ({"hostPath": {"path": "/mnt/qwen"}}, "/models"),
        "image": ({"image": {"reference": "ghcr.io/x/qwen:1"}}, "/models"),
        "huggingFace": ({"huggingFace": {"id": "Qwen/Qwen2.5-0.5B"}}, "/models/hf"),
        "builtin": ({}, ""),
    }
    for kind, (model, path) in cases.items():
        r = _render(make_cluster({"model": model}))
        kubernetes_validate.validate(r.get("StatefulSet", "demo-prefill"), K8S_VERSION, True)
        t = _template(r, "prefill")
        assert _env(_container(t, "prefill"))["MOONCAKE_MODEL"]["value"] == path, kind
        vols = {v["name"]: v for v in t["spec"]["volumes"]}
        assert ("model" in vols) == (kind != "builtin"), kind
    t = _template(_render(make_cluster({"model": cases["huggingFace"][0]})), "decode")
    (dl,) = [i for i in t["spec"]["initContainers"] if i["name"] == "model-download"]
    assert dl["command"][-3:] == ["Qwen/Qwen2.5-0.5B", "main", "/models/hf"]


def test_pod_template_override_merges_by_name(make_cluster: Callable[..., Obj]) -> None:
    override = {"metadata": {"annotations": {"team": "ml"}},
                "spec": {"runtimeClassName": "nvidia",
                         "containers": [{"name": "decode",
                                         "env": [{"name": "EXTRA", "value": "1"},
                                                 {"name": "MOONCAKE_LOG_LEVEL",
                                                  "value": "debug"}]},
                                        {"name": "sidecar", "image": "busybox"}]}}
    r = _render(make_cluster({"roles": {"decode": {"podTemplate": override}}}))
    t = _template(r, "decode")
    assert t["metadata"]["annotations"] == {"team": "ml"}
    assert t["spec"]["runtimeClassName"] == "nvidia"
    assert [c["name"] for c in t["spec"]["containers"]] == ["decode", "sidecar"]
    env = _env(_container(t, "decode"))
    assert env["EXTRA"]["value"] == "1" and env["MOONCAKE_LOG_LEVEL"]["value"] == "debug"
    assert "MOONCAKE_MASTER" in env  # untouched entries survive
    base = _render(make_cluster())
    assert base.revisions["decode"] != r.revisions["decode"]
    assert base.revisions["prefill"] == r.revisions["prefill"]


def test_memory_limit_below_shm_is_a_spec_error(make_cluster: Callable[..., Obj]) -> None:
    with pytest.raises(SpecError, match=r"roles.store.resources.limits.memory \(1Gi\)"):
        _render(make_cluster({"store": {"dramPerNode": "4Gi"},
                              "roles": {"store": {"resources": {"limits": {"memory": "1Gi"}}}}}))


def test_scalers_carry_no_replicas_but_the_seed(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"roles": {"prefill": {"replicas": 3}}}), {"prefill": 5})
    sc = r.get("MooncakeRoleScaler", "demo-prefill")
    assert sc["spec"] == {"clusterName": "demo", "role": "prefill"}
    assert sc["metadata"]["annotations"][naming.ANNOTATION_SEED] == "3"
    assert r.get("StatefulSet", "demo-prefill")["spec"]["replicas"] == 5


def test_network_policies(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster())
    cond = r.get("NetworkPolicy", "demo-conductor")["spec"]["ingress"]
    assert cond == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    store = r.get("NetworkPolicy", "demo-store")["spec"]
    assert store["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "store"
    assert {"ports": [{"protocol": "TCP", "port": 9092}]} in store["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "mooncake",
        "app.kubernetes.io/instance": "demo"}}}]} in store["ingress"]


def test_render_cli_reports_every_error(tmp_path: Path,
                                        make_cluster: Callable[..., Obj]) -> None:
    bad = make_cluster({"rdma": {"required": True}, "store": {"blockTokens": 0}})
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    result = CliRunner().invoke(main, ["render", "-f", str(f)])
    assert result.exit_code == 1
    assert "MooncakeCluster/demo is invalid" in result.output
    assert "spec.store.blockTokens: 0 is less than the minimum of 1" in result.output


def test_render_cli_reads_stdin_and_sets_namespace(make_cluster: Callable[..., Obj]) -> None:
    c = make_cluster(uid=None)
    del c["metadata"]["namespace"]
    result = CliRunner().invoke(main, ["render", "-f", "-", "-n", "team-a"],
                                input=yaml.safe_dump(c))
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    assert len(docs) == 26 and {d["metadata"]["namespace"] for d in docs} == {"team-a"}
