"""`render`: golden output for every example, Kubernetes-schema validity, and its contracts.

Golden files live in `golden/`; after an intended change regenerate them with
`MOONCAKE_UPDATE_GOLDEN=1 pytest tests/unit/operator/test_operator_render.py` and review the diff.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from click.testing import CliRunner

from mooncake_k8s.cli import main
from mooncake_k8s.operator import naming, pods_sizing
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


def _values(container: Obj) -> dict[str, str]:
    """Literal env values by name (entries from the downward API or Secrets left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _template(r: Rendered, role: str) -> Obj:
    kind = "Deployment" if role == "conductor" else "StatefulSet"
    t: Obj = r.get(kind, naming.name("demo", role))["spec"]["template"]
    return t


@pytest.mark.parametrize("stem", ["laptop-cpu", "gpu-rdma", "vllm-cpu", "sglang-cpu"])
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
    # The API and the metrics port (apart from it since issue 18).
    assert cond == [{"ports": [{"protocol": "TCP", "port": 8000},
                               {"protocol": "TCP", "port": 9093}]}]
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


# ---- vLLM workers

VLLM_MODEL = {"pvc": {"claimName": "weights"}}


def _vllm(make_cluster: Callable[..., Obj], roles: Obj | None = None, **spec: Any) -> Rendered:
    return _render(make_cluster({"engine": {"kind": "vllm"}, "model": VLLM_MODEL,
                                 "roles": roles or {}, **spec}))


def _volume(t: Obj, name: str) -> Obj:
    v: Obj = next(v for v in t["spec"]["volumes"] if v["name"] == name)
    return v


def test_vllm_cpu_pods(make_cluster: Callable[..., Obj]) -> None:
    """Same command as the embedded engine; vLLM's CPU settings derived from the resources."""
    res = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "3500m",
                                                                 "memory": "16Gi"}}
    r = _vllm(make_cluster, {"prefill": {"resources": res}, "decode": {"resources": res}},
              engine={"kind": "vllm", "args": ["--max-model-len", "4096", "--dtype", "bf16 x"]})
    for role in ("prefill", "decode"):
        t = _template(r, role)
        c = _container(t, role)
        env = _values(c)
        assert c["args"] == [role] and "command" not in c  # the image's `mooncake` entrypoint
        assert c["image"] == "mooncake-k8s:0.1.0-vllm"
        assert env["MOONCAKE_ENGINE"] == "vllm" and env["MOONCAKE_MODEL"] == "/models"
        assert env["MOONCAKE_ENGINE_ARGS"] == "--max-model-len 4096 --dtype 'bf16 x'"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert env["OMP_NUM_THREADS"] == "4"  # the 3.5-CPU limit, rounded up
        assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
        # /dev/shm: the transfer share and pool segment plus vLLM's 2Gi (1/8 of 16Gi); both
        # roles serve a segment (prefill: shmSize 1Gi + localSegmentSize 1Gi; decode: 2Gi + 1Gi)
        transfer = {"prefill": 2 << 30, "decode": 3 << 30}[role]
        shm = _volume(t, "dshm")["emptyDir"]
        assert shm == {"medium": "Memory",
                       "sizeLimit": naming.format_bytes(transfer + (2 << 30))}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        # KV cache: half of the 8Gi request left after /dev/shm, in whole GiB
        assert env["VLLM_CPU_KVCACHE_SPACE"] == str((8 * 2**30 - transfer - 2**31) // 2 // 2**30)
        assert _volume(t, "model")["persistentVolumeClaim"] == {"claimName": "weights",
                                                                 "readOnly": True}
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert "nvidia.com/gpu" not in str(c["resources"])
        kubernetes_validate.validate(r.get("StatefulSet", f"demo-{role}"), K8S_VERSION, True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # decode: (8 - 3 - 2) / 2, rounded down


def test_vllm_cpu_defaults_without_resources(make_cluster: Callable[..., Obj]) -> None:
    t = _template(_vllm(make_cluster), "prefill")
    env = _values(_container(t, "prefill"))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "OMP_NUM_THREADS" not in env  # no CPU limit or request: vLLM's own choice
    # 1Gi shmSize + the 1Gi pool segment + 2Gi for vLLM
    assert _volume(t, "dshm")["emptyDir"]["sizeLimit"] == "4Gi"


def test_vllm_shm_follows_the_memory(make_cluster: Callable[..., Obj]) -> None:
    def shm(resources: Obj) -> str:
        t = _template(_vllm(make_cluster, {"prefill": {"resources": resources,
                                                       "shmSize": "512Mi",
                                                       "localSegmentSize": 0}}), "prefill")
        size: str = _volume(t, "dshm")["emptyDir"]["sizeLimit"]
        return size

    assert shm({"limits": {"memory": "6Gi"}}) == "1280Mi"  # 512Mi + 6Gi/8
    assert shm({"requests": {"memory": "6Gi"}}) == "1280Mi"  # the request when no limit
    assert shm({"limits": {"memory": "1Gi"}}) == "768Mi"  # vLLM gets at least 256Mi
    assert shm({"limits": {"memory": "256Gi"}}) == "2560Mi"  # and at most 2Gi
    assert shm({"limits": {"memory": "6G"}}) == "1227Mi"  # decimal: whole MiB of 6G/8


def test_vllm_gpu_pods(examples: dict[str, Obj], make_cluster: Callable[..., Obj]) -> None:
    """A GPU resource makes a GPU pod: no CPU-build settings, the GPU in limits."""
    gpu = {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1},
           "limits": {"memory": "96Gi", "nvidia.com/gpu": 1}}
    requests_only = {"requests": {"memory": "64Gi", "nvidia.com/gpu": 2}}
    r = _vllm(make_cluster, {"prefill": {"resources": gpu},
                             "decode": {"resources": requests_only}},
              engine={"kind": "vllm", "image": "reg.example/mooncake-k8s:0.1.0-vllm-cu128",
                      "args": ["--tensor-parallel-size", "2"]})
    for role, count in (("prefill", 1), ("decode", 2)):
        t = _template(r, role)
        c = _container(t, role)
        env = _values(c)
        assert c["image"] == "reg.example/mooncake-k8s:0.1.0-vllm-cu128"
        assert env["MOONCAKE_ENGINE"] == "vllm"
        assert env["MOONCAKE_ENGINE_ARGS"] == "--tensor-parallel-size 2"
        assert not {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                    "OMP_NUM_THREADS"} & set(env)
        # Kubernetes wants extended resources in limits; a GPU under requests alone moves there
        assert c["resources"]["limits"]["nvidia.com/gpu"] == count
        assert _volume(t, "dshm")["emptyDir"]["medium"] == "Memory"
        kubernetes_validate.validate(r.get("StatefulSet", f"demo-{role}"), K8S_VERSION, True)
    assert _volume(_template(r, "prefill"), "dshm")["emptyDir"]["sizeLimit"] == "4Gi"
    # The shipped GPU example (SGLang): its engine's image variant, no vLLM settings.
    g = render(validate_cluster(examples["gpu-rdma"]))
    c = _container(g.get("StatefulSet", "qwen-prefill")["spec"]["template"], "prefill")
    assert c["image"] == "registry.example.com/mooncake-k8s:0.1.0-sglang"
    assert not any(e["name"].startswith("VLLM_") for e in c["env"])


def test_vllm_probes_allow_a_slow_start(make_cluster: Callable[..., Obj]) -> None:
    embedded = _container(_template(_render(make_cluster()), "prefill"), "prefill")
    for role in ("prefill", "decode"):
        c = _container(_template(_vllm(make_cluster), role), role)
        assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}

        def budget(p: Obj) -> int:
            return int(p["periodSeconds"] * p["failureThreshold"])

        assert budget(c["startupProbe"]) >= 3600 > budget(embedded["startupProbe"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["timeoutSeconds"] > embedded[probe]["timeoutSeconds"]
        assert budget(c["readinessProbe"]) > budget(embedded["readinessProbe"])


def test_vllm_image_variant(make_cluster: Callable[..., Obj]) -> None:
    def images(**spec: Any) -> dict[str, str]:
        r = _vllm(make_cluster, spec.pop("roles", None), **spec)
        return {role: _container(_template(r, role), role)["image"] for role in ROLES}

    assert images(image="reg.example:5000/mc/mooncake-k8s:1.2") == {
        "prefill": "reg.example:5000/mc/mooncake-k8s:1.2-vllm",
        "decode": "reg.example:5000/mc/mooncake-k8s:1.2-vllm",
        "conductor": "reg.example:5000/mc/mooncake-k8s:1.2",
        "store": "reg.example:5000/mc/mooncake-k8s:1.2",
        "master": "reg.example:5000/mc/mooncake-k8s:1.2"}
    assert images(engine={"kind": "vllm", "image": "mine:v"})["decode"] == "mine:v"
    assert images(roles={"decode": {"image": "d:1"}})["decode"] == "d:1"  # a role's image wins
    assert images(roles={"decode": {"image": "d:1"}})["prefill"] == "mooncake-k8s:0.1.0-vllm"
    sglang = _render(make_cluster({"engine": {"kind": "sglang"}, "model": VLLM_MODEL}))
    assert _container(_template(sglang, "decode"), "decode")["image"] == (
        "mooncake-k8s:0.1.0-sglang")  # the Dockerfile's ENGINE=sglang variant
    embedded = _render(make_cluster())
    assert _container(_template(embedded, "decode"), "decode")["image"] == "mooncake-k8s:0.1.0"
    # The model download runs in the worker image too (it has huggingface_hub).
    r = _vllm(make_cluster, model={"huggingFace": {"id": "Qwen/Qwen2.5-0.5B"}})
    t = _template(r, "prefill")
    (dl,) = t["spec"]["initContainers"]
    assert dl["image"] == "mooncake-k8s:0.1.0-vllm"
    assert _env(_container(t, "prefill"))["MOONCAKE_MODEL"]["value"] == "/models/hf"


def test_image_variant_names() -> None:
    assert naming.image_variant("mooncake-k8s:0.1.0", "vllm") == "mooncake-k8s:0.1.0-vllm"
    assert naming.image_variant("mooncake-k8s", "vllm") == "mooncake-k8s:latest-vllm"
    assert naming.image_variant("localhost:5000/mooncake-k8s", "sglang") == (
        "localhost:5000/mooncake-k8s:latest-sglang")
    assert naming.image_variant("localhost:5000/m:0.1", "vllm") == "localhost:5000/m:0.1-vllm"
    with pytest.raises(ValueError, match="pinned by digest"):
        naming.image_variant("m@sha256:" + "0" * 64, "vllm")


def test_vllm_changes_the_serving_revision(make_cluster: Callable[..., Obj]) -> None:
    base = _render(make_cluster({"model": VLLM_MODEL}))
    r = _vllm(make_cluster)
    assert r.serving_revision != base.serving_revision
    assert r.revisions["store"] == base.revisions["store"]  # other roles do not roll


def test_vllm_shm_counts_against_the_memory_limit(make_cluster: Callable[..., Obj]) -> None:
    # 1Gi transfer + 256Mi for vLLM do not fit a 1Gi limit; the embedded engine's 1Gi does
    # (no pool segment here: it would count too).
    roles = {"prefill": {"resources": {"limits": {"memory": "1Gi"}}, "localSegmentSize": 0}}
    _render(make_cluster({"model": VLLM_MODEL, "roles": roles}))
    with pytest.raises(SpecError, match=r"roles.prefill.resources.limits.memory \(1Gi\) is "
                                        r"below the role's Memory-backed /dev/shm \(1280Mi\)"):
        _vllm(make_cluster, roles)


def test_vllm_env_can_be_overridden_per_role(make_cluster: Callable[..., Obj]) -> None:
    override = {"spec": {"containers": [{"name": "decode", "env": [
        {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "12"}]}]}}
    t = _template(_vllm(make_cluster, {"decode": {"podTemplate": override}}), "decode")
    env = _env(_container(t, "decode"))
    assert env["VLLM_CPU_KVCACHE_SPACE"]["value"] == "12"
    assert [e["name"] for e in _container(t, "decode")["env"]].count(
        "VLLM_CPU_KVCACHE_SPACE") == 1


def test_vllm_cpu_example(examples: dict[str, Obj]) -> None:
    r = render(validate_cluster(examples["vllm-cpu"]))
    for role, replicas in (("prefill", 2), ("decode", 1)):
        sts = r.get("StatefulSet", f"vllm-cpu-{role}")
        assert sts["spec"]["replicas"] == replicas
        c = _container(sts["spec"]["template"], role)
        env = _values(c)
        assert c["image"] == "mooncake-k8s:0.1.0-vllm" and c["args"] == [role]
        assert env["MOONCAKE_ENGINE"] == "vllm"
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["OMP_NUM_THREADS"] == "2"
        assert "--enforce-eager" in env["MOONCAKE_ENGINE_ARGS"]
        vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert vols["model"]["persistentVolumeClaim"]["claimName"] == "smollm2-135m-instruct"


# ---- SGLang workers

SOCKET = "/run/mooncake/sidecar.sock"


def _sglang(make_cluster: Callable[..., Obj], roles: Obj | None = None,
            **engine: Any) -> Rendered:
    return _render(make_cluster({"engine": {"kind": "sglang", **engine}, "model": VLLM_MODEL,
                                 "roles": roles or {}}))


def _init(t: Obj, name: str) -> Obj:
    c: Obj = next(c for c in t["spec"].get("initContainers", []) if c["name"] == name)
    return c


def _ports_of(c: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def test_sglang_cpu_pods(make_cluster: Callable[..., Obj]) -> None:
    res = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "1500m",
                                                                 "memory": "6Gi"}}
    r = _sglang(make_cluster, {"prefill": {"resources": res}, "decode": {"resources": res}},
                device="cpu", args=["--dtype", "bfloat16", "--context-length", "2048"])
    for role in ("prefill", "decode"):
        t = _template(r, role)
        c = _container(t, role)
        env = _values(c)
        assert c["image"] == "mooncake-k8s:0.1.0-sglang-cpu" and "command" not in c
        bootstrap = ["--sglang-bootstrap-port", "8998"] if role == "prefill" else []
        assert c["args"] == [role, "--engine", "sglang", "--device", "cpu", "--sidecar", SOCKET,
                             "--advertise-host", "$(MOONCAKE_POD_IP)", *bootstrap,
                             "--pd-transfer-port", "7300",
                             "--", "--dtype", "bfloat16", "--context-length", "2048"]
        # SGLang's flags go after `--`, never twice through MOONCAKE_ENGINE_ARGS as well
        assert "MOONCAKE_ENGINE_ARGS" not in env
        assert env["MOONCAKE_ENGINE"] == "sglang" and env["MOONCAKE_MODEL"] == "/models"
        assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
        assert env["OMP_NUM_THREADS"] == "2"  # the 1.5-CPU limit, rounded up
        assert not any(k.startswith("VLLM_") for k in env)
        assert not any(is_gpu for is_gpu in map(pods_sizing.is_gpu_resource,
                                                [*c["resources"].get("limits", {}),
                                                 *c["resources"].get("requests", {})]))
        want = {"grpc": naming.PORTS[role]["grpc"], "metrics": 9090, "pd-transfer": 7300}
        if role == "prefill":
            want["bootstrap"] = 8998
        assert _ports_of(c) == want
        # /dev/shm: the transfer share and pool segment + SGLang's 1/8 of 6Gi + the sidecar's
        # 256Mi staging
        transfer = {"prefill": 2 << 30, "decode": 3 << 30}[role]
        assert _volume(t, "dshm")["emptyDir"] == {
            "medium": "Memory", "sizeLimit": naming.format_bytes(transfer + (768 << 20)
                                                                 + (256 << 20))}
        assert _volume(t, "run")["emptyDir"]["medium"] == "Memory"
        assert {"name": "run", "mountPath": "/run/mooncake"} in c["volumeMounts"]
        kubernetes_validate.validate(r.get("StatefulSet", f"demo-{role}"), K8S_VERSION, True)


def test_sglang_sidecar_is_a_native_sidecar(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({
        "engine": {"kind": "sglang", "device": "cpu", "sidecar": {"stagingSize": "512Mi"}},
        "model": {"huggingFace": {"id": "Qwen/Qwen2.5-0.5B"}}, "logLevel": "debug",
        "clusterTokenSecret": {"name": "tok", "key": "t"}}))
    for role in ("prefill", "decode"):
        t = _template(r, role)
        # last init container: after the model download, right before the worker
        assert [c["name"] for c in t["spec"]["initContainers"]] == ["model-download", "sidecar"]
        sc = _init(t, "sidecar")
        assert sc["restartPolicy"] == "Always"  # native sidecar (Kubernetes 1.29+)
        assert sc["image"] == _container(t, role)["image"] == "mooncake-k8s:0.1.0-sglang-cpu"
        assert sc["args"] == ["sidecar", "--socket", SOCKET, "--master",
                              "demo-master.ml.svc.cluster.local:50051",
                              "--staging-size", str(512 << 20)]
        assert _env(sc)["MOONCAKE_CLUSTER_TOKEN"] == {"name": "MOONCAKE_CLUSTER_TOKEN",
                                                      "valueFrom": {"secretKeyRef": {
                                                          "name": "tok", "key": "t"}}}
        assert _values(sc)["MOONCAKE_LOG_LEVEL"] == "debug"
        # The socket folder and /dev/shm (the staging segment) are the worker's too.
        worker = _container(t, role)
        for mount in ({"name": "run", "mountPath": "/run/mooncake"},
                      {"name": "dshm", "mountPath": "/dev/shm"}):
            assert mount in sc["volumeMounts"] and mount in worker["volumeMounts"]
        assert _volume(t, "dshm")["emptyDir"]["medium"] == "Memory"
        for probe in ("startupProbe", "readinessProbe"):
            assert sc[probe]["exec"] == {"command": ["test", "-S", SOCKET]}
        assert sc["securityContext"]["readOnlyRootFilesystem"] is True
        # the staging segment is charged to the sidecar's memory
        assert naming.parse_bytes(sc["resources"]["requests"]["memory"]) > 512 << 20
        kubernetes_validate.validate(r.get("StatefulSet", f"demo-{role}"), K8S_VERSION, True)
    # Other engines and roles get no sidecar.
    for engine in ({"kind": "embedded"}, {"kind": "vllm"}):
        other = _render(make_cluster({"engine": engine, "model": VLLM_MODEL}))
        for role in ROLES:
            assert "sidecar" not in str(_template(other, role)["spec"].get("initContainers"))
    for role in ("store", "master"):
        assert "initContainers" not in _template(r, role)["spec"]
    # The Conductor fetches only the tokenizer of the workers' model, and has no sidecar.
    inits = _template(r, "conductor")["spec"]["initContainers"]
    assert [c["name"] for c in inits] == ["tokenizer-download"]


def test_sglang_defaults_to_cuda_with_one_gpu(make_cluster: Callable[..., Obj]) -> None:
    r = _sglang(make_cluster, {"decode": {"resources": {"requests": {"nvidia.com/gpu": 2}}}},
                args=["--tp-size", "2"])
    for role, gpus in (("prefill", 1), ("decode", 2)):
        t = _template(r, role)
        c = _container(t, role)
        env = _values(c)
        assert c["image"] == _init(t, "sidecar")["image"] == "mooncake-k8s:0.1.0-sglang"
        assert c["args"][3:5] == ["--device", "cuda"]
        assert c["args"][-3:] == ["--", "--tp-size", "2"]
        assert "SGLANG_USE_CPU_ENGINE" not in env and "OMP_NUM_THREADS" not in env
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert "nvidia.com/gpu" not in str(_init(t, "sidecar")["resources"])
        kubernetes_validate.validate(r.get("StatefulSet", f"demo-{role}"), K8S_VERSION, True)
    # without engine args there is no `--`
    plain = _container(_template(_sglang(make_cluster), "decode"), "decode")
    assert "--" not in plain["args"] and plain["args"][-2:] == ["--pd-transfer-port", "7300"]


def test_engine_device_for_other_engines(make_cluster: Callable[..., Obj]) -> None:
    # vllm on engine.device cuda: a GPU pod even without a GPU written in the resources
    c = _container(_template(_vllm(make_cluster, engine={"kind": "vllm", "device": "cuda"}),
                             "prefill"), "prefill")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "VLLM_CPU_KVCACHE_SPACE" not in _values(c)
    assert _values(c)["MOONCAKE_DEVICE"] == "cuda"
    # embedded: the device goes to the worker; unset, the worker picks (no env, no GPU added)
    c = _container(_template(_render(make_cluster({"engine": {"kind": "embedded",
                                                              "device": "cpu"}})), "decode"),
                   "decode")
    assert _values(c)["MOONCAKE_DEVICE"] == "cpu"
    assert not any(pods_sizing.is_gpu_resource(k) for k in c["resources"]["limits"])
    c = _container(_template(_render(make_cluster()), "decode"), "decode")
    assert "MOONCAKE_DEVICE" not in _values(c)
    assert not any(pods_sizing.is_gpu_resource(k) for k in c["resources"]["limits"])


def test_cpu_device_with_a_gpu_is_a_spec_error(make_cluster: Callable[..., Obj]) -> None:
    roles = {"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}
    with pytest.raises(SpecError, match=r"engine.device is cpu but roles.decode.resources "
                                        r"requests a GPU"):
        _sglang(make_cluster, roles, device="cpu")
    _sglang(make_cluster, roles)  # cuda (the default) is fine


def test_sglang_with_rdma(make_cluster: Callable[..., Obj]) -> None:
    """The rdma-probe record, the worker and the sidecar share one `run` volume: /var/run is
    /run in the image, so two volumes there would collide."""
    r = _render(make_cluster({"engine": {"kind": "sglang"}, "model": VLLM_MODEL,
                              "rdma": {"enabled": True}}))
    for role in ("prefill", "decode"):
        t = _template(r, role)
        assert [c["name"] for c in t["spec"]["initContainers"]] == ["rdma-probe", "sidecar"]
        worker, sc = _container(t, role), _init(t, "sidecar")
        assert [v["name"] for v in t["spec"]["volumes"]].count("run") == 1
        for c in (worker, sc):
            paths = [m["mountPath"].replace("/var/run/", "/run/") for m in c["volumeMounts"]]
            assert len(paths) == len(set(paths)), paths
            assert "/run/mooncake" in paths
        # the sidecar moves the pool's KV bytes: RDMA device and IPC_LOCK as the worker
        assert sc["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert sc["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        kubernetes_validate.validate(r.get("StatefulSet", f"demo-{role}"), K8S_VERSION, True)


def test_sglang_probes_and_revision(make_cluster: Callable[..., Obj]) -> None:
    embedded = _container(_template(_render(make_cluster()), "prefill"), "prefill")
    base = _sglang(make_cluster)
    for role in ("prefill", "decode"):
        c = _container(_template(base, role), role)
        budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        assert budget >= 3600 and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["timeoutSeconds"] > embedded["livenessProbe"]["timeoutSeconds"]
    # device and staging size are part of what prefill and decode pair on
    assert _sglang(make_cluster, device="cpu").serving_revision != base.serving_revision
    staged = _sglang(make_cluster, sidecar={"stagingSize": "1Gi"})
    assert staged.serving_revision != base.serving_revision
    assert staged.revisions["store"] == base.revisions["store"]


def test_sglang_images(make_cluster: Callable[..., Obj]) -> None:
    def image(role: str = "prefill", roles: Obj | None = None, spec_image: str | None = None,
              **engine: Any) -> str:
        spec: Obj = {"engine": {"kind": "sglang", **engine}, "model": VLLM_MODEL,
                     "roles": roles or {}}
        if spec_image:
            spec["image"] = spec_image
        c: str = _container(_template(_render(make_cluster(spec)), role), role)["image"]
        return c

    assert image(spec_image="reg.example:5000/mc/mooncake-k8s:1.2") == (
        "reg.example:5000/mc/mooncake-k8s:1.2-sglang")
    assert image(device="cuda") == "mooncake-k8s:0.1.0-sglang"
    assert image("decode", device="cpu") == "mooncake-k8s:0.1.0-sglang-cpu"
    assert image(device="cpu", spec_image="m") == "m:latest-sglang-cpu"
    assert image("store", device="cpu") == "mooncake-k8s:0.1.0"
    assert image(device="cpu", spec_image="x:1", image="mine:v") == "mine:v"
    assert image("decode", {"decode": {"image": "d:1"}}, device="cpu") == "d:1"


def test_sglang_shm_counts_against_the_memory_limit(make_cluster: Callable[..., Obj]) -> None:
    # 1Gi transfer + 256Mi for SGLang + 256Mi staging = 1536Mi: above a 1400Mi limit
    roles = {"prefill": {"resources": {"limits": {"memory": "1400Mi"}}, "localSegmentSize": 0}}
    with pytest.raises(SpecError, match=r"\(1536Mi\)"):
        _sglang(make_cluster, roles, device="cpu")


def test_sidecar_can_be_overridden_per_role(make_cluster: Callable[..., Obj]) -> None:
    override = {"spec": {"initContainers": [{"name": "sidecar", "resources": {
        "limits": {"memory": "2Gi"}}}]}}
    t = _template(_sglang(make_cluster, {"decode": {"podTemplate": override}}), "decode")
    (sc,) = [c for c in t["spec"]["initContainers"] if c["name"] == "sidecar"]
    assert sc["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}  # maps merge
    assert sc["resources"]["requests"]["memory"] == "384Mi"
    assert sc["restartPolicy"] == "Always"


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def _pod_env(c: Obj) -> dict[str, str]:
    """The container's environment as the kubelet would resolve it (fake pod IP, name and
    Secret values)."""
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = _expand(e["value"], out)
        elif "fieldRef" in e["valueFrom"]:
            out[e["name"]] = {"status.podIP": "10.1.2.3",
                              "metadata.name": "pod-0"}[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = "secret-token"
    return out


@pytest.mark.parametrize("stem", ["sglang-cpu", "gpu-rdma", "vllm-cpu", "laptop-cpu"])
def test_worker_pods_run_real_cli_commands(examples: dict[str, Obj], stem: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every container of a prefill or decode pod that runs `mooncake` parses with the real
    CLI, with the environment the pod would give it (a flag that does not exist, a wrong
    type, or a missing required option fails here instead of in a crash-looping pod)."""
    import click

    r = render(validate_cluster(examples[stem]))
    name = examples[stem]["metadata"]["name"]
    for key in [k for k in os.environ if k.startswith(("MOONCAKE_", "SGLANG_"))]:
        monkeypatch.delenv(key)
    parsed = 0
    for role in ("prefill", "decode"):
        t = r.get("StatefulSet", f"{name}-{role}")["spec"]["template"]["spec"]
        for c in [*t.get("initContainers", []), *t["containers"]]:
            if "command" in c:
                continue  # not the image's `mooncake` entrypoint (the model download)
            env = _pod_env(c)
            args = [_expand(a, env) for a in c["args"]]
            with monkeypatch.context() as m:
                for k, v in env.items():
                    m.setenv(k, v)
                group = main.make_context("mooncake", list(args), resilient_parsing=False)
                cmd = main.get_command(group, args[0])
                assert cmd is not None, args[0]
                ctx = cmd.make_context(args[0], args[1:], parent=group)
            p = ctx.params
            parsed += 1
            if args[0] == "sidecar":
                assert p["socket_path"] == SOCKET and p["token"] == "secret-token"
                ns = examples[stem]["metadata"]["namespace"]
                svc = f"{name}-master.{ns}.svc.cluster.local"
                n = examples[stem]["spec"].get("roles", {}).get("master", {}).get("replicas", 1)
                # With several masters (HA) the list of every master's stable pod name.
                assert p["master"] == (f"{svc}:50051" if n == 1 else ",".join(
                    f"{name}-master-{i}.{svc}:50051" for i in range(n)))
                assert p["staging_size"] > 0
            elif args[0] in ("prefill", "decode"):
                engine = examples[stem]["spec"]["engine"]
                assert p["engine_kind"] == engine["kind"]
                assert p["advertise_host"] == p["host"] == "10.1.2.3"
                assert p["token"] == "secret-token"
                # roles.<role>.drainTimeoutSeconds reaches the worker's --drain-timeout.
                assert p["drain_timeout"] == examples[stem]["spec"].get("roles", {}).get(
                    args[0], {}).get("drainTimeoutSeconds", 30)
                if engine["kind"] == "sglang":
                    assert p["sidecar"] == SOCKET and p["pd_port"] == 7300
                    assert list(p["engine_argv"]) == engine.get("args", [])
                    if role == "prefill":
                        assert p["bootstrap_port"] == 8998
                    assert p["device"] == engine.get("device", "cuda")
            assert isinstance(ctx, click.Context)
    sidecars = 2 if examples[stem]["spec"]["engine"]["kind"] == "sglang" else 0
    rdma = 2 if examples[stem]["spec"].get("rdma", {}).get("enabled") else 0
    assert parsed == 2 + sidecars + rdma


def test_sglang_cpu_example(examples: dict[str, Obj]) -> None:
    r = render(validate_cluster(examples["sglang-cpu"]))
    for role, replicas in (("prefill", 2), ("decode", 1)):
        sts = r.get("StatefulSet", f"sglang-cpu-{role}")
        assert sts["spec"]["replicas"] == replicas
        t = sts["spec"]["template"]
        c = _container(t, role)
        assert c["image"] == "mooncake-k8s:0.1.0-sglang-cpu"
        assert c["args"][:5] == [role, "--engine", "sglang", "--device", "cpu"]
        assert _values(c)["SGLANG_USE_CPU_ENGINE"] == "1"
        assert _init(t, "sidecar")["restartPolicy"] == "Always"
        assert _volume(t, "model")["persistentVolumeClaim"]["claimName"] == (
            "smollm2-135m-instruct")
        assert "nvidia.com/gpu" not in str(c["resources"])


def test_ha_masters_parse_with_the_real_cli(examples: dict[str, Obj],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The masters of the GPU example (two, metadataBackend redis) get every HA setting from
    the environment the pod gives them, and their clients list both masters."""
    from mooncake_k8s.cli import main

    r = render(validate_cluster(examples["gpu-rdma"]))
    for key in [k for k in os.environ if k.startswith("MOONCAKE_")]:
        monkeypatch.delenv(key)
    sts = r.get("StatefulSet", "qwen-master")
    assert sts["spec"]["replicas"] == 2
    c = _container(sts["spec"]["template"], "master")
    env = _pod_env(c)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    group = main.make_context("mooncake", list(c["args"]), resilient_parsing=False)
    store = main.get_command(group, "store")
    sub = store.make_context("store", ["master"], parent=group)  # type: ignore[union-attr]
    master = store.get_command(sub, "master")  # type: ignore[union-attr]
    p = master.make_context("master", [], parent=sub).params  # type: ignore[union-attr]
    assert p["metadata_backend"] == "redis" and p["redis_url"] == "secret-token"
    assert p["advertise"] == "pod-0.qwen-master.llm.svc.cluster.local:50051"
    assert p["ha_prefix"] == "mooncake:llm:qwen"
    node = _container(r.get("StatefulSet", "qwen-store")["spec"]["template"], "store")
    assert _pod_env(node)["MOONCAKE_MASTER"].split(",") == [
        f"qwen-master-{i}.qwen-master.llm.svc.cluster.local:50051" for i in range(2)]
