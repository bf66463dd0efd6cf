"""Rendered pods a platform team can admit: resources on every container, soft spreading of every
role, a shared model cache, an optional UID, `imagePullSecrets` as objects, and RDMA marked
experimental. No API server here: the objects are checked against the Kubernetes 1.30 schemas
(strict), and the model download script runs for real against a stand-in hub package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from mooncake_k8s.operator import corev1, naming
from mooncake_k8s.operator import schema as sch
from mooncake_k8s.operator.render import Rendered, render
from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

Obj = dict[str, Any]
K8S_VERSION = "1.30"
HF = {"id": "org/model", "revision": "abc123", "cacheSize": "20Gi"}


def _render(c: Obj) -> Rendered:
    return render(validate_cluster(c))


def _templates(r: Rendered) -> Iterator[tuple[str, Obj]]:
    for o in r.objects:
        if o["kind"] in ("StatefulSet", "Deployment"):
            yield o["metadata"]["labels"][naming.LABEL_COMPONENT], o["spec"]["template"]


def _all_containers(t: Obj) -> list[Obj]:
    spec = t["spec"]
    return list(spec.get("initContainers") or []) + list(spec["containers"])


def _named(t: Obj, name: str) -> Obj:
    c: Obj = next(c for c in _all_containers(t) if c["name"] == name)
    return c


def _template(r: Rendered, role: str) -> Obj:
    return dict(_templates(r))[role]


def test_every_example_passes_1_30_with_resources_and_spread(examples: dict[str, Obj]) -> None:
    """Every container of every example (init and sidecar ones too) has cpu and memory requests
    and limits, no request above its limit; every role spreads softly over nodes."""
    for stem, doc in examples.items():
        r = _render(doc)
        for o in r.objects:
            if o["kind"] != "MooncakeRoleScaler":
                kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        roles = dict(_templates(r))
        assert set(roles) == set(sch.ROLES), stem
        for role, t in roles.items():
            for c in _all_containers(t):
                res = c.get("resources") or {}
                for part in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(res.get(part) or {}), (stem, c["name"], part)
                for name, lim in res["limits"].items():
                    req = res["requests"].get(name, lim)
                    assert corev1.parse_quantity(req) <= corev1.parse_quantity(lim), (
                        stem, c["name"], name)
            (tsc,) = t["spec"]["topologySpreadConstraints"]
            assert tsc["whenUnsatisfiable"] == "ScheduleAnyway", (stem, role)
            assert tsc["topologyKey"] == "kubernetes.io/hostname"
            assert tsc["labelSelector"]["matchLabels"] == naming.selector(
                doc["metadata"]["name"], role)


def test_gpu_example_spreads_its_two_masters_and_conductors(examples: dict[str, Obj]) -> None:
    r = _render(examples["gpu-rdma"])
    for role in ("master", "conductor"):
        kind = "Deployment" if role == "conductor" else "StatefulSet"
        wl = r.get(kind, naming.name("qwen", role))
        assert wl["spec"]["replicas"] == 2
        assert wl["spec"]["template"]["spec"]["topologySpreadConstraints"]


def test_role_resource_defaults_fill_only_what_is_left_out(
        make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"roles": {
        "conductor": {"resources": {"requests": {"cpu": "3"}, "limits": {"memory": "100Mi"}}},
        "master": {"resources": {"limits": {"cpu": "50m"}}}}}))
    cond = _named(_template(r, "conductor"), "conductor")["resources"]
    # the user's values stay; a default limit rises to the request, a default request falls
    # to the limit, so requests never exceed limits
    assert cond["requests"]["cpu"] == "3" and cond["limits"]["cpu"] == "3"
    assert cond["limits"]["memory"] == "100Mi" and cond["requests"]["memory"] == "100Mi"
    master = _named(_template(r, "master"), "master")["resources"]
    assert master["limits"]["cpu"] == "50m" and master["requests"]["cpu"] == "50m"
    # /dev/shm is charged to the container: the store's default memory covers dramPerNode
    store = _named(_template(r, "store"), "store")["resources"]
    shm = naming.parse_bytes("4Gi")
    assert corev1.parse_quantity(store["requests"]["memory"]) > shm
    assert corev1.parse_quantity(store["limits"]["memory"]) > shm


def test_server_engines_default_to_more_memory(make_cluster: Callable[..., Obj]) -> None:
    """vLLM and SGLang servers hold weights and (on a CPU) KV in host memory: their pods'
    defaults are larger than the embedded engine's."""
    def limit(spec: Obj) -> float:
        c = _named(_template(_render(make_cluster(spec)), "decode"), "decode")
        return float(corev1.parse_quantity(c["resources"]["limits"]["memory"]))

    embedded = limit({})
    vllm = limit({"engine": {"kind": "vllm"}, "model": {"huggingFace": HF}})
    assert vllm >= embedded + 14 * (1 << 30)


def test_helper_container_resources_are_configurable(make_cluster: Callable[..., Obj]) -> None:
    mine = {"requests": {"cpu": "2"}, "limits": {"cpu": "2", "memory": "3Gi"}}
    r = _render(make_cluster({
        "engine": {"kind": "sglang", "device": "cpu", "sidecar": {"resources": mine}},
        "model": {"huggingFace": {**HF, "resources": mine}},
        "rdma": {"enabled": True, "probeResources": {"limits": {"memory": "32Mi"}}}}))
    t = _template(r, "decode")
    for name in ("model-download", "sidecar"):
        res = _named(t, name)["resources"]
        assert res["requests"]["cpu"] == "2" and res["limits"]["memory"] == "3Gi", name
        assert "memory" in res["requests"], name  # the rest keeps its default
    probe = _named(t, "rdma-probe")["resources"]
    assert probe["limits"]["memory"] == "32Mi" and probe["requests"]["memory"] == "32Mi"
    assert probe["limits"]["rdma/rdma_shared_device_a"] == 1  # the device stays
    assert _named(t, "sidecar")["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1


def test_emptydir_download_requests_ephemeral_storage(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"engine": {"kind": "vllm"}, "model": {"huggingFace": HF}}))
    for role in ("prefill", "decode"):
        t = _template(r, role)
        (vol,) = [v for v in t["spec"]["volumes"] if v["name"] == "model"]
        assert vol["emptyDir"]["sizeLimit"] == "20Gi"
        for name in (role, "model-download"):
            assert _named(t, name)["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    # a mounted model takes no node disk
    r = _render(make_cluster({"engine": {"kind": "vllm"},
                              "model": {"pvc": {"claimName": "weights"}}}))
    c = _named(_template(r, "decode"), "decode")
    assert "ephemeral-storage" not in c["resources"]["requests"]


def test_shared_cache_claim(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"engine": {"kind": "vllm"},
                              "model": {"huggingFace": {**HF, "cacheClaimName": "models"}}}))
    for o in r.objects:
        if o["kind"] in ("StatefulSet", "Deployment"):
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    path = "/models/hf/org/model/abc123"
    for role in ("prefill", "decode"):
        t = _template(r, role)
        (vol,) = [v for v in t["spec"]["volumes"] if v["name"] == "model"]
        assert vol == {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
        main, init = _named(t, role), _named(t, "model-download")
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        assert {e["name"]: e.get("value") for e in main["env"]}["MOONCAKE_MODEL"] == path
        assert init["command"][-1] == path and not init["volumeMounts"][0].get("readOnly")
        assert "ephemeral-storage" not in main["resources"]["requests"]
        assert "ephemeral-storage" not in init["resources"]["requests"]


@pytest.fixture
def fake_hub(tmp_path: Path) -> Path:
    """A stand-in `huggingface_hub` (a third-party package; no network here): its download
    takes a moment, counts itself in a log and writes one file."""
    pkg = tmp_path / "site" / "huggingface_hub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import os, time\n"
        "from pathlib import Path\n"
        "def snapshot_download(repo_id, revision, local_dir):\n"
        "    with open(os.environ['HUB_LOG'], 'a') as f:\n"
        "        f.write(f'{os.getpid()} {repo_id} {revision}\\n')\n"
        "    time.sleep(0.5)\n"
        "    Path(local_dir, 'config.json').write_text('{}')\n")
    return pkg.parent


def test_download_script_fills_a_shared_cache_once(make_cluster: Callable[..., Obj],
                                                   tmp_path: Path, fake_hub: Path) -> None:
    """Three pods' init containers start together on one claim: one downloads, the others
    wait on the lock and find the marker; a later pod skips the download too."""
    r = _render(make_cluster({"engine": {"kind": "vllm"},
                              "model": {"huggingFace": {**HF, "cacheClaimName": "models"}}}))
    command = _named(_template(r, "prefill"), "model-download")["command"]
    assert command[:2] == ["python", "-c"]
    dest = tmp_path / "claim" / "hf" / "org" / "model" / "abc123"
    log = tmp_path / "hub.log"
    env = {**os.environ, "PYTHONPATH": str(fake_hub), "HUB_LOG": str(log)}
    argv = [sys.executable, "-c", command[2], *command[3:-1], str(dest)]
    procs = [subprocess.Popen(argv, env=env) for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert subprocess.run(argv, env=env, timeout=60).returncode == 0
    assert len(log.read_text().splitlines()) == 1
    assert (dest / "config.json").exists()
    assert (dest / ".mooncake-complete").read_text().strip() == "abc123"


def test_uid_is_optional(make_cluster: Callable[..., Obj]) -> None:
    for _, t in _templates(_render(make_cluster())):
        assert t["spec"]["securityContext"] == {"runAsNonRoot": True,
                                                "seccompProfile": {"type": "RuntimeDefault"}}
    ids = {"runAsUser": 10001, "runAsGroup": 0, "fsGroup": 10001}
    for _, t in _templates(_render(make_cluster({"podSecurityContext": ids}))):
        assert t["spec"]["securityContext"] == {"runAsNonRoot": True, **ids,
                                                "seccompProfile": {"type": "RuntimeDefault"}}
    with pytest.raises(InvalidResource, match=r"spec\.podSecurityContext\.runAsUser"):
        validate_cluster(make_cluster({"podSecurityContext": {"runAsUser": 0}}))


def test_image_pull_secrets_are_objects(make_cluster: Callable[..., Obj]) -> None:
    r = _render(make_cluster({"imagePullSecrets": [{"name": "regcred"}, {"name": "b.c"}]}))
    for _, t in _templates(r):
        assert t["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "b.c"}]
    # the old form is refused with the field named
    with pytest.raises(InvalidResource) as e:
        validate_cluster(make_cluster({"imagePullSecrets": ["regcred"]}))
    assert any(m.startswith("spec.imagePullSecrets[0]:") and "object" in m
               for m in e.value.errors), e.value.errors


def test_stored_string_pull_secrets_still_render(make_cluster: Callable[..., Obj]) -> None:
    """An object stored before the schema change (the API server does not revalidate it) keeps
    rendering until it is edited."""
    c = validate_cluster(make_cluster())
    c["spec"]["imagePullSecrets"] = ["regcred"]
    for _, t in _templates(render(c)):
        assert t["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


def _descriptions(s: Any) -> Iterator[str]:
    if isinstance(s, dict):
        if isinstance(s.get("description"), str):
            yield s["description"]
        for v in s.values():
            yield from _descriptions(v)


def test_rdma_is_marked_experimental(repo: Path) -> None:
    spec = sch.cluster_spec_schema()
    rdma = spec["properties"]["rdma"]
    assert rdma["description"].startswith("EXPERIMENTAL")
    assert rdma["properties"]["enabled"]["description"].startswith("EXPERIMENTAL")
    assert "EXPERIMENTAL" in spec["properties"]["transferProtocol"]["description"]
    gpu = (repo / "deploy" / "examples" / "gpu-rdma.yaml").read_text()
    rdma_lines = [ln for ln in gpu.splitlines() if "rdma" in ln.lower() and ln.startswith("#")]
    assert rdma_lines and any("EXPERIMENTAL" in ln for ln in rdma_lines)
