"""What a role's container gets from its node: the device the engine computes on, GPUs, whole
CPUs, memory, the size of its Memory-backed /dev/shm, and the resources block itself.

Pure functions of the defaulted spec (no render context): `render.py` sizes workloads and
checks GPU/device combinations with them, `admission.py` recognises GPU resources, and the
pod builders (`pods_env.py`, `pods_volumes.py`, `pods.py`) turn the numbers into env, volumes
and the container's `resources`.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from mooncake_k8s.operator import corev1, naming
from mooncake_k8s.operator.schema import DATA_ROLES
from mooncake_k8s.operator.schema_model import SIDECAR_STAGING_DEFAULT

Obj = dict[str, Any]
SHM_MARGIN = 256 << 20
GIB = 1 << 30
MIB = 1 << 20
# vLLM's share of /dev/shm (its processes exchange tensors and messages there; NCCL too with
# tensor parallelism): an eighth of the container's memory within these bounds, or the upper one
# without a memory request or limit (what vLLM's own Kubernetes guide mounts).
VLLM_SHM_MIN = 256 * MIB
VLLM_SHM_MAX = 2 * GIB
VLLM_CPU_KVCACHE_DEFAULT_GIB = 4
# Engines that run as a server child of the worker (slow to load, share memory in /dev/shm).
SERVER_ENGINES = ("vllm", "sglang")
# Extended resources that put a GPU in the container: nvidia.com/gpu, amd.com/gpu, and MIG
# slices (nvidia.com/mig-1g.10gb, ...).
_GPU_SUFFIX = "/gpu"
_GPU_PREFIXES = ("nvidia.com/mig-",)


def rdma_on(spec: Obj, role: str) -> bool:
    """The role's pods get RDMA devices (and with them IPC_LOCK and the RDMA probe)."""
    return bool(spec["rdma"]["enabled"]) and role in DATA_ROLES


def is_gpu_resource(name: str) -> bool:
    return name.endswith(_GPU_SUFFIX) or name.startswith(_GPU_PREFIXES)


def gpu_count(spec: Obj, role: str) -> int:
    """GPUs the role's container asks for (limits, else requests; 0 = a CPU pod)."""
    res = spec["roles"][role].get("resources") or {}
    for part in ("limits", "requests"):
        n = sum(int(corev1.parse_quantity(v)) for k, v in (res.get(part) or {}).items()
                if is_gpu_resource(k))
        if n:
            return n
    return 0


def device(spec: Obj, role: str) -> str | None:
    """Where the role's engine computes: engine.device when set; `cuda` for sglang (its
    production path); else `cuda` with a GPU resource, `cpu` for vllm without one, and None
    (the embedded engine's own choice) for embedded without one."""
    engine = spec["engine"]
    if engine.get("device"):
        return str(engine["device"])
    if engine["kind"] == "sglang" or gpu_count(spec, role):
        return "cuda"
    return "cpu" if engine["kind"] == "vllm" else None


def image_suffix(spec: Obj) -> str:
    """The tag suffix of the engine's image variant: `vllm`, `sglang`, or `sglang-cpu` (SGLang
    builds for CPUs and GPUs differ, so the device picks the image)."""
    kind = str(spec["engine"]["kind"])
    if kind == "sglang" and spec["engine"].get("device") == "cpu":
        return "sglang-cpu"
    return kind


def memory(spec: Obj, role: str, *order: str) -> int | None:
    """The container's memory from the first of `order` ('requests', 'limits') that sets it."""
    res = spec["roles"][role].get("resources") or {}
    for part in order:
        q = (res.get(part) or {}).get("memory")
        if q is not None:
            try:
                return math.ceil(corev1.parse_quantity(q))
            except ValueError:
                return None  # not a quantity: admission rejects it before rendering
    return None


def cpus(spec: Obj, role: str) -> int | None:
    """Whole CPUs of the container's CPU limit, else its request (rounded up; None if unset)."""
    res = spec["roles"][role].get("resources") or {}
    for part in ("limits", "requests"):
        q = (res.get(part) or {}).get("cpu")
        if q is not None:
            try:
                return max(1, math.ceil(corev1.parse_quantity(q)))
            except ValueError:
                return None  # not a quantity: admission rejects it before rendering
    return None


# Main containers' defaults for what roles.<role>.resources leaves out: (requests cpu, memory
# beyond the role's /dev/shm; limits cpu, memory beyond /dev/shm). A Memory-backed /dev/shm is
# charged to the container, so memory is sized on top of it.
_ROLE_DEFAULTS: dict[str, tuple[str, int, str, int]] = {
    "conductor": ("250m", 512 * MIB, "2", 2 * GIB),
    "master": ("100m", 256 * MIB, "1", 1 * GIB),
    "store": ("250m", 256 * MIB, "2", 512 * MIB),
    "prefill": ("1", 1 * GIB, "4", 2 * GIB),
    "decode": ("1", 1 * GIB, "4", 2 * GIB),
}
# vLLM and SGLang servers hold more host memory (their processes, weights on the way to the GPU,
# on a CPU the weights and the KV cache themselves): prefill and decode with them default higher.
_SERVER_DEFAULTS = ("2", 8 * GIB, "8", 16 * GIB)


def _quantity(q: Any) -> float:
    return float(corev1.parse_quantity(q))


def fill_defaults(res: Obj, requests: Obj, limits: Obj) -> Obj:
    """`res` with every key of `requests` and `limits` it lacks: a default request never
    exceeds the limit set, a default limit never falls below the request set (Kubernetes
    refuses requests above limits)."""
    out = copy.deepcopy(res)
    req, lim = out.setdefault("requests", {}), out.setdefault("limits", {})
    for name, value in requests.items():
        if name not in req:
            req[name] = (lim[name] if name in lim and _quantity(lim[name]) < _quantity(value)
                         else value)
    for name, value in limits.items():
        if name not in lim:
            lim[name] = (req[name] if name in req and _quantity(req[name]) > _quantity(value)
                         else value)
    return out


def role_defaults(spec: Obj, role: str) -> tuple[Obj, Obj]:
    """The requests and limits a role's main container gets where its resources say nothing."""
    cpu_req, mem_req, cpu_lim, mem_lim = _ROLE_DEFAULTS[role]
    if role in ("prefill", "decode") and spec["engine"]["kind"] in SERVER_ENGINES:
        cpu_req, mem_req, cpu_lim, mem_lim = _SERVER_DEFAULTS
    shm = shm_bytes(spec, role) or 0
    return ({"cpu": cpu_req, "memory": naming.format_bytes(shm + mem_req)},
            {"cpu": cpu_lim, "memory": naming.format_bytes(shm + mem_lim)})


def container_resources(spec: Obj, role: str) -> Obj:
    """The role's main container `resources`: the user's, the role's defaults for cpu and
    memory requests and limits left out, plus what Kubernetes and the engine need (GPUs under
    limits, one GPU for engine.device cuda, the RDMA devices)."""
    try:
        res = fill_defaults(spec["roles"][role].get("resources") or {},
                            *role_defaults(spec, role))
    except ValueError:  # not a quantity: admission rejects it before rendering
        res = copy.deepcopy(spec["roles"][role].get("resources") or {})
    # A GPU is an extended resource: Kubernetes requires it in limits (requests may only repeat
    # it). Someone who wrote it under requests alone meant to ask for it.
    for name, count in (res.get("requests") or {}).items():
        if is_gpu_resource(name):
            res.setdefault("limits", {}).setdefault(name, count)
    if (role in ("prefill", "decode") and device(spec, role) == "cuda"
            and not gpu_count(spec, role)):
        res.setdefault("limits", {})["nvidia.com/gpu"] = 1  # engine.device cuda: one GPU
    scratch = model_download_bytes(spec)
    if role in ("prefill", "decode") and scratch:
        # The model lands in an emptyDir on the node's disk: ask for room for it.
        res.setdefault("requests", {}).setdefault("ephemeral-storage",
                                                 naming.format_bytes(scratch))
    if rdma_on(spec, role):
        rname, count = spec["rdma"]["resourceName"], spec["rdma"]["count"]
        # Extended resources need requests == limits; setting limits implies the request.
        res.setdefault("limits", {})[rname] = count
        if "requests" in res:
            res["requests"][rname] = count
    return {k: v for k, v in res.items() if v}


def model_download_bytes(spec: Obj) -> int | None:
    """Bytes of node disk a pod's model download takes: huggingFace.cacheSize when the model
    goes into a per-pod emptyDir, None when there is no download or it fills a shared claim."""
    hf = spec["model"].get("huggingFace")
    if not hf or hf.get("cacheClaimName"):
        return None
    return naming.parse_bytes(hf["cacheSize"])


def shm_bytes(spec: Obj, role: str) -> int | None:
    """Size of the role's Memory-backed /dev/shm (None: the role has none)."""
    r = spec["roles"][role]
    if role == "store":
        return naming.parse_bytes(spec["store"]["dramPerNode"]) + SHM_MARGIN
    if role == "decode":
        if r.get("shmSize") is not None:
            size = naming.parse_bytes(r["shmSize"])
        else:
            size = naming.parse_bytes(r["localSegmentSize"]) + GIB
    elif role == "prefill":
        # shmSize is the transfer buffers alone (its default predates the segment).
        size = naming.parse_bytes(r["shmSize"]) + naming.parse_bytes(r["localSegmentSize"])
    else:
        return None
    if spec["engine"]["kind"] in SERVER_ENGINES:
        size += vllm_shm_bytes(spec, role)
    if spec["engine"]["kind"] == "sglang":
        size += sidecar_staging_bytes(spec)
    return size


def sidecar_staging_bytes(spec: Obj) -> int:
    # No schema default on engine.sidecar itself: a default there would change spec.engine,
    # and with it the serving revision, of every existing cluster.
    sidecar = spec["engine"].get("sidecar") or {}
    return naming.parse_bytes(sidecar.get("stagingSize", SIDECAR_STAGING_DEFAULT))


def vllm_shm_bytes(spec: Obj, role: str) -> int:
    """The engine server's share of /dev/shm (vLLM's or SGLang's): 1/8 of the container's
    memory (limit, else request) in whole MiB within [VLLM_SHM_MIN, VLLM_SHM_MAX];
    VLLM_SHM_MAX when neither is set."""
    mem = memory(spec, role, "limits", "requests")
    if mem is None:
        return VLLM_SHM_MAX
    return min(VLLM_SHM_MAX, max(VLLM_SHM_MIN, mem // 8 // MIB * MIB))
