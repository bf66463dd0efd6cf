"""The volumes and mounts of each role's pod, and the init containers that work on them: the
model download fills the model volume, the RDMA probe leaves its record in the `run` volume,
and the transfer sidecar (sglang) serves its socket there and stages KV in /dev/shm.

Pure: `pods.py` calls `pod_volumes` once per role and puts the result into the pod; `pods_env`
asks `model_source` where the model is mounted; `render.py` formats storage sizes with
`quantity`. The sizes themselves come from `pods_sizing`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mooncake_k8s.operator import naming, pods_sizing
from mooncake_k8s.operator.pods_context import (
    CACHE_DIR,
    MODEL_DIR,
    RDMA_RECORD,
    RUN_DIR,
    SIDECAR_DIR,
    SIDECAR_SOCKET,
    SSD_DIR,
    Ctx,
    env_var,
    security,
)

Obj = dict[str, Any]

# Fills argv[3] with the model once: a marker file says the download finished, and a lock file
# in the same folder makes pods that share a cache claim wait for the one downloading instead of
# writing the same files at once (flock works on local disks and NFSv4).
_DOWNLOAD = """\
import fcntl, sys
from pathlib import Path
from huggingface_hub import snapshot_download
repo, revision, dest = sys.argv[1:4]
out = Path(dest)
out.mkdir(parents=True, exist_ok=True)
done = out / ".mooncake-complete"
with open(out / ".mooncake-lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
        snapshot_download(repo_id=repo, revision=revision, local_dir=dest)
        done.write_text(revision + "\\n")
"""
# With model.huggingFace.p2p (a per-pod emptyDir, so no lock): fetch argv[4] from the P2P
# store's peers; when no peer has it (or one chunk is gone), drop what was fetched, download from
# the Hub and publish it (unpinned: cache) so the next pods fetch it from their peers. The marker
# is written last, so a restarted container redoes an unfinished fetch.
_DOWNLOAD_P2P = """\
import subprocess, sys
from pathlib import Path
repo, revision, dest, name = sys.argv[1:5]
out = Path(dest)
out.mkdir(parents=True, exist_ok=True)
done = out / ".mooncake-complete"
p2p = [sys.executable, "-m", "mooncake_k8s.cli", "p2p"]
if not done.exists():
    if subprocess.run([*p2p, "get", name, dest]).returncode != 0:
        for part in out.rglob("*.p2p-part"):
            part.unlink()
        from huggingface_hub import snapshot_download
        snapshot_download(repo_id=repo, revision=revision, local_dir=dest)
        subprocess.run([*p2p, "publish", dest, name, "--no-pin"])
    done.write_text(revision + "\\n")
"""
# Helper containers' resources where the spec leaves them out (requests, limits).
DOWNLOAD_RESOURCES = ({"cpu": "250m", "memory": "256Mi"}, {"cpu": "1", "memory": "1Gi"})
PROBE_RESOURCES = ({"cpu": "100m", "memory": "64Mi"}, {"cpu": "100m", "memory": "64Mi"})


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the model comes from: the path the worker loads (MOONCAKE_MODEL; "" for the
    built-in model) and what the pod needs for it to be there."""

    path: str
    volumes: list[Obj]
    mounts: list[Obj]
    init_containers: list[Obj]


@dataclass(frozen=True, slots=True)
class PodVolumes:
    """A role's volumes, its main container's mounts, and its init containers, in pod order."""

    volumes: list[Obj]
    mounts: list[Obj]
    init_containers: list[Obj]


def quantity(value: int | str) -> str:
    """A size (bytes or a quantity) in the one canonical form the renderer writes."""
    return naming.format_bytes(naming.parse_bytes(value))


def _join(root: str, sub: str) -> str:
    return f"{root}/{sub}" if sub else root


def _shm(size_bytes: int) -> tuple[Obj, Obj]:
    vol = {"name": "dshm", "emptyDir": {"medium": "Memory",
                                        "sizeLimit": naming.format_bytes(size_bytes)}}
    return vol, {"name": "dshm", "mountPath": "/dev/shm"}


def _scratch() -> tuple[list[Obj], list[Obj]]:
    vols = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    return vols, mounts


def model_source(ctx: Ctx) -> ModelSource:
    """The spec's model source (pvc, hostPath, image volume, Hugging Face download, or none)."""
    m = ctx.spec["model"]
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    if "pvc" in m:
        vol = {"name": "model", "persistentVolumeClaim": {"claimName": m["pvc"]["claimName"],
                                                          "readOnly": True}}
        return ModelSource(_join(MODEL_DIR, m["pvc"]["path"]), [vol], [mount], [])
    if "hostPath" in m:
        vol = {"name": "model", "hostPath": {"path": m["hostPath"]["path"],
                                             "type": "Directory"}}
        return ModelSource(MODEL_DIR, [vol], [mount], [])
    if "image" in m:
        vol = {"name": "model", "image": {"reference": m["image"]["reference"],
                                          "pullPolicy": ctx.spec["imagePullPolicy"]}}
        return ModelSource(_join(MODEL_DIR, m["image"]["path"]), [vol], [mount], [])
    if "huggingFace" in m:
        return _hugging_face(ctx, m["huggingFace"], mount)
    return ModelSource("", [], [], [])


def p2p_model_name(repo: str, revision: str) -> str:
    """The P2P store name a Hugging Face model is published under: `hf/<id>/<revision>`, the
    revision's characters outside the names' alphabet replaced by `_`."""
    return f"hf/{repo}/{re.sub(r'[^A-Za-z0-9._-]', '_', revision)}"


def _hugging_face(ctx: Ctx, hf: Obj, mount: Obj) -> ModelSource:
    """A download init container into the pod's emptyDir, or into a shared claim once."""
    claim = hf.get("cacheClaimName")
    res: Obj = {}
    if claim:
        # One folder per model and revision: clusters (or revisions) sharing the claim never
        # read each other's half-written files.
        path = f"{MODEL_DIR}/hf/{hf['id']}/{hf['revision']}"
        vol: Obj = {"name": "model", "persistentVolumeClaim": {"claimName": claim}}
    else:
        path = f"{MODEL_DIR}/hf"
        vol = {"name": "model", "emptyDir": {"sizeLimit": quantity(hf["cacheSize"])}}
        res = {"requests": {"ephemeral-storage": quantity(hf["cacheSize"])}}
    env = [env_var("HOME", "/tmp"), env_var("HF_HOME", "/tmp/hf" if claim else
                                            f"{MODEL_DIR}/.hf")]
    if "tokenSecret" in hf:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hf["tokenSecret"]["name"], "key": hf["tokenSecret"]["key"]}}})
    command = ["python", "-c", _DOWNLOAD, hf["id"], hf["revision"], path]
    if hf.get("p2p"):
        command = ["python", "-c", _DOWNLOAD_P2P, hf["id"], hf["revision"], path,
                   p2p_model_name(hf["id"], hf["revision"])]
        env += [env_var("MOONCAKE_MASTER", ctx.master_addr), ctx.token_env()]
    init = {
        "name": "model-download",
        "image": ctx.image("prefill"),
        "imagePullPolicy": ctx.spec["imagePullPolicy"],
        "command": command,
        "env": env,
        "resources": helper_resources(hf.get("resources"), res, *DOWNLOAD_RESOURCES),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": security(),
    }
    return ModelSource(path, [vol], [mount], [init])


# The files a tokenizer (and its chat template) may live in, never weights.
TOKENIZER_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
TOKENIZER_CACHE = "256Mi"
_TOKENIZER_DOWNLOAD = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3], "
    "allow_patterns=sys.argv[4:])"
)


def conductor_model_source(ctx: Ctx) -> ModelSource:
    """What the Conductor loads its tokenizer from: the workers' own model, so the two always
    tokenise alike. A mounted source (pvc, hostPath, image) is mounted as the workers mount it
    (read-only; only the tokenizer files are read). A Hugging Face model is not downloaded in
    full: the Conductor's init container fetches only its tokenizer and config files (a few MB,
    `TOKENIZER_PATTERNS`) of the same id and revision, into a small emptyDir, even where the
    workers share a cache claim (the Conductor never waits for, or mounts, their download)."""
    m = ctx.spec["model"]
    if "huggingFace" not in m:
        return model_source(ctx)
    hf = m["huggingFace"]
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    vol = {"name": "model", "emptyDir": {"sizeLimit": TOKENIZER_CACHE}}
    env = [env_var("HOME", "/tmp"), env_var("HF_HOME", f"{MODEL_DIR}/.hf")]
    if "tokenSecret" in hf:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hf["tokenSecret"]["name"], "key": hf["tokenSecret"]["key"]}}})
    init = {
        "name": "tokenizer-download",
        "image": ctx.image("conductor"),
        "imagePullPolicy": ctx.spec["imagePullPolicy"],
        "command": ["python", "-c", _TOKENIZER_DOWNLOAD, hf["id"], hf["revision"],
                    f"{MODEL_DIR}/hf", *TOKENIZER_PATTERNS],
        "env": env,
        "resources": helper_resources(hf.get("resources"), {
            "requests": {"ephemeral-storage": TOKENIZER_CACHE}}, *DOWNLOAD_RESOURCES),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": security(),
    }
    return ModelSource(f"{MODEL_DIR}/hf", [vol], [mount], [init])


def helper_resources(user: Obj | None, base: Obj, requests: Obj, limits: Obj) -> Obj:
    """A helper container's resources: the user's keys first, then `base` (what the container
    needs, such as a device), then the defaults."""
    res = pods_sizing.fill_defaults(user or {}, base.get("requests", {}),
                                    base.get("limits", {}))
    return pods_sizing.fill_defaults(res, requests, limits)


def _rdma_probe(ctx: Ctx, role: str) -> Obj:
    args = ["rdma-probe", "--output", RDMA_RECORD]
    if ctx.spec["rdma"]["required"]:
        args.append("--required")
    rname, count = ctx.spec["rdma"]["resourceName"], ctx.spec["rdma"]["count"]
    return {
        "name": "rdma-probe",
        "image": ctx.image(role),
        "imagePullPolicy": ctx.spec["imagePullPolicy"],
        "args": args,
        # The kubelet keeps the last 4 KiB written here in the pod's status: the operator reads
        # the probe's JSON record from there to report RDMAReady without exec'ing into pods.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "resources": helper_resources(ctx.spec["rdma"].get("probeResources"), {
            "requests": {rname: count}, "limits": {rname: count}}, *PROBE_RESOURCES),
        "volumeMounts": [{"name": "run", "mountPath": RUN_DIR}],
        "securityContext": security(ctx.rdma_on(role)),
    }


def _sidecar(ctx: Ctx, role: str) -> Obj:
    """The transfer sidecar as a native sidecar: an init container with restartPolicy Always
    (Kubernetes 1.29+) starts, and passes its startup probe (the socket exists), before the
    worker starts, and stops after the worker has."""
    spec = ctx.spec
    staging = pods_sizing.sidecar_staging_bytes(spec)
    device: Obj = {}
    if ctx.rdma_on(role):  # the sidecar moves the pool's KV bytes: it needs the device too
        rname, count = spec["rdma"]["resourceName"], spec["rdma"]["count"]
        device = {"requests": {rname: count}, "limits": {rname: count}}

    def socket_probe() -> Obj:  # fresh dicts: shared ones would print as YAML aliases
        return {"exec": {"command": ["test", "-S", SIDECAR_SOCKET]}}

    c: Obj = {
        "name": "sidecar",
        "image": ctx.image(role),
        "imagePullPolicy": spec["imagePullPolicy"],
        "restartPolicy": "Always",
        "args": ["sidecar", "--socket", SIDECAR_SOCKET, "--master", ctx.master_addr,
                 "--staging-size", str(staging)],
        "env": [ctx.token_env(), env_var("MOONCAKE_LOG_LEVEL", spec["logLevel"]),
                env_var("MOONCAKE_LOG_FORMAT", spec["logFormat"]), env_var("HOME", "/tmp"),
                env_var("MOONCAKE_STORE_REPLICAS", spec["store"]["replicationFactor"])],
        "volumeMounts": [{"name": "run", "mountPath": SIDECAR_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": "/tmp"}],
        # The staging segment lives in /dev/shm and is charged to this container's memory.
        "resources": helper_resources(
            (spec["engine"].get("sidecar") or {}).get("resources"), device, {
                "cpu": "100m", "memory": naming.format_bytes(staging + 128 * pods_sizing.MIB)},
            {"cpu": "1", "memory": naming.format_bytes(staging + 256 * pods_sizing.MIB)}),
        "startupProbe": {**socket_probe(), "periodSeconds": 1, "timeoutSeconds": 5,
                         "failureThreshold": 120},
        "readinessProbe": {**socket_probe(), "periodSeconds": 10, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "securityContext": security(ctx.rdma_on(role)),
    }
    return c


def pod_volumes(ctx: Ctx, role: str) -> PodVolumes:
    """Everything the role's pod mounts, and the init containers, in the order the pod lists
    them (the order is part of the rendered template, hence of the role's revision)."""
    spec, rspec = ctx.spec, ctx.spec["roles"][role]
    volumes, mounts = _scratch()
    init: list[Obj] = []
    size = pods_sizing.shm_bytes(spec, role)
    if size is not None:
        v, m = _shm(size)
        volumes.append(v)
        mounts.append(m)
    sidecar = ctx.sidecar_on(role)
    if ctx.rdma_on(role) or sidecar:
        volumes.append({"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
        if sidecar:  # the worker connects to the sidecar's socket there
            mounts.append({"name": "run", "mountPath": SIDECAR_DIR})
        else:
            mounts.append({"name": "run", "mountPath": RUN_DIR, "readOnly": True})
    if ctx.rdma_on(role):  # first: it takes a second, the model download may take an hour
        init.append(_rdma_probe(ctx, role))
    if role in ("prefill", "decode", "conductor"):
        model = model_source(ctx) if role != "conductor" else conductor_model_source(ctx)
        volumes += model.volumes
        mounts += model.mounts
        init += model.init_containers
    if sidecar:  # last: it starts right before the worker (and stops after it)
        init.append(_sidecar(ctx, role))
    if role == "store" and "ssd" in spec["store"]:
        mounts.append({"name": "ssd", "mountPath": SSD_DIR})
    if role == "conductor":
        volumes.append({"name": "config", "configMap": {
            "name": naming.name(ctx.cluster, "config")}})
        mounts.append({"name": "config", "mountPath": "/etc/mooncake/cluster",
                       "readOnly": True})
        if rspec.get("apiKeysSecret"):
            volumes.append({"name": "api-keys", "secret": {"secretName": rspec["apiKeysSecret"],
                                                           "defaultMode": 0o440}})
            mounts.append({"name": "api-keys", "mountPath": "/etc/mooncake/api-keys",
                           "readOnly": True})
    return PodVolumes(volumes, mounts, init)
