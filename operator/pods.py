"""Pod templates for each role, configured through `mooncake` CLI environment variables (SGLang
workers and their transfer sidecar also get their own options as flags, see `sglang_args`).

Pure: a defaulted spec in, plain dicts out. `render.py` wraps these templates into workloads and
hashes them into per-role revisions, so anything that must not restart a role (replica counts,
the ConfigMap's content, status) never reaches a template.

Servers bind the pod IP from the downward API (the CLI refuses 0.0.0.0 unless told), except the
Conductor, whose HTTP API is the front door and must also answer `kubectl port-forward`.
The cluster token only ever comes from a Secret reference.
"""

from __future__ import annotations

import copy
import math
import shlex
from typing import Any

from mooncake_k8s.operator import corev1, naming
from mooncake_k8s.operator.schema import DATA_ROLES, SIDECAR_STAGING_DEFAULT

Obj = dict[str, Any]
UID = 10001
MODEL_DIR = "/models"
RUN_DIR = "/var/run/mooncake"
RDMA_RECORD = f"{RUN_DIR}/rdma.json"
# The transfer sidecar's socket folder (sglang pods). On Debian images /var/run is a link to
# /run, so this is RUN_DIR's folder too: pods with a sidecar mount the one `run` volume here.
SIDECAR_DIR = "/run/mooncake"
SIDECAR_SOCKET = f"{SIDECAR_DIR}/sidecar.sock"
SSD_DIR = "/var/lib/mooncake/ssd"
CACHE_DIR = "/var/cache/mooncake"
SHM_MARGIN = 256 << 20
BUILTIN_MODEL_NAME = "smollm2-135m-instruct"
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

_DOWNLOAD = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3])"
)


class Ctx:
    """Everything a role's template depends on, resolved once per render."""

    def __init__(self, cluster: str, namespace: str, spec: Obj, serving_revision: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.spec = spec
        self.serving_revision = serving_revision
        domain = spec["clusterDomain"]
        svc = naming.service_fqdn(naming.name(cluster, 'master'), namespace, domain)
        port = naming.PORTS['master']['grpc']
        masters = int(spec["roles"]["master"]["replicas"])
        self.master_svc = svc
        if masters > 1:
            # HA (metadataBackend redis): every master by its stable StatefulSet pod name;
            # clients and nodes follow whichever leads (store.masterlink).
            self.master_addr = ",".join(
                f"{naming.name(cluster, 'master')}-{i}.{svc}:{port}" for i in range(masters))
        else:
            self.master_addr = f"{svc}:{port}"
        self.domain = domain

    def image(self, role: str) -> str:
        override: str | None = self.spec["roles"][role].get("image")
        if override:
            return override
        engine = self.spec["engine"]
        if role in ("prefill", "decode"):
            if engine.get("image"):
                return str(engine["image"])
            if engine["kind"] != "embedded":
                return naming.image_variant(str(self.spec["image"]), image_suffix(self.spec))
        return str(self.spec["image"])

    def sidecar_on(self, role: str) -> bool:
        """The role's pods get a transfer sidecar (sglang prefill and decode)."""
        return self.spec["engine"]["kind"] == "sglang" and role in ("prefill", "decode")

    def token_env(self) -> Obj:
        ref = self.spec.get("clusterTokenSecret") or {
            "name": f"{self.cluster}-cluster-token", "key": "token"}
        return {"name": "MOONCAKE_CLUSTER_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}

    def rdma_on(self, role: str) -> bool:
        return bool(self.spec["rdma"]["enabled"]) and role in DATA_ROLES


def _env(name: str, value: Any) -> Obj:
    return {"name": name, "value": str(value)}


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _base_env(ctx: Ctx) -> list[Obj]:
    # Downward-API values first: later entries refer to them as $(MOONCAKE_POD_IP).
    return [
        _field_env("MOONCAKE_POD_IP", "status.podIP"),
        _field_env("MOONCAKE_POD_NAME", "metadata.name"),
        ctx.token_env(),
        _env("MOONCAKE_LOG_LEVEL", ctx.spec["logLevel"]),
        _env("MOONCAKE_LOG_FORMAT", ctx.spec["logFormat"]),
        _env("HOME", "/tmp"),
        _env("XDG_CACHE_HOME", CACHE_DIR),
        _env("HF_HOME", f"{CACHE_DIR}/huggingface"),
    ]


def _http_probe(path: str, port: str, period: int, failures: int, timeout: int = 5) -> Obj:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures}


def _tcp_probe(port: str, period: int, failures: int) -> Obj:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _security(ipc_lock: bool = False) -> Obj:
    caps: Obj = {"drop": ["ALL"]}
    if ipc_lock:
        caps["add"] = ["IPC_LOCK"]  # RDMA memory registration pins pages
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": caps}


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
    """The tag suffix of the engine's image variant: `vllm`, `sglang`, or `sglang-cpu`."""
    kind = str(spec["engine"]["kind"])
    if kind == "sglang" and spec["engine"].get("device") == "cpu":
        return "sglang-cpu"
    return kind


def _memory(spec: Obj, role: str, *order: str) -> int | None:
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


def _cpus(spec: Obj, role: str) -> int | None:
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


def _resources(ctx: Ctx, role: str) -> Obj:
    res = copy.deepcopy(ctx.spec["roles"][role].get("resources") or {})
    # A GPU is an extended resource: Kubernetes requires it in limits (requests may only repeat
    # it). Someone who wrote it under requests alone meant to ask for it.
    for name, count in (res.get("requests") or {}).items():
        if is_gpu_resource(name):
            res.setdefault("limits", {}).setdefault(name, count)
    if (role in ("prefill", "decode") and device(ctx.spec, role) == "cuda"
            and not gpu_count(ctx.spec, role)):
        res.setdefault("limits", {})["nvidia.com/gpu"] = 1  # engine.device cuda: one GPU
    if ctx.rdma_on(role):
        rname, count = ctx.spec["rdma"]["resourceName"], ctx.spec["rdma"]["count"]
        # Extended resources need requests == limits; setting limits implies the request.
        res.setdefault("limits", {})[rname] = count
        if "requests" in res:
            res["requests"][rname] = count
    return {k: v for k, v in res.items() if v}


def _ports(role: str, engine: str = "embedded") -> list[Obj]:
    ports = dict(naming.PORTS[role])
    if engine == "sglang":
        ports.update(naming.SGLANG_PORTS.get(role, {}))
    return [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()]


def _shm(size_bytes: int) -> tuple[Obj, Obj]:
    vol = {"name": "dshm", "emptyDir": {"medium": "Memory",
                                        "sizeLimit": naming.format_bytes(size_bytes)}}
    return vol, {"name": "dshm", "mountPath": "/dev/shm"}


def _scratch() -> tuple[list[Obj], list[Obj]]:
    vols = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    return vols, mounts


def _model(ctx: Ctx) -> tuple[str, list[Obj], list[Obj], list[Obj]]:
    """MOONCAKE_MODEL, volumes, mounts, init containers for the model source."""
    m = ctx.spec["model"]
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    if "pvc" in m:
        vol = {"name": "model", "persistentVolumeClaim": {"claimName": m["pvc"]["claimName"],
                                                          "readOnly": True}}
        return _join(MODEL_DIR, m["pvc"]["path"]), [vol], [mount], []
    if "hostPath" in m:
        vol = {"name": "model", "hostPath": {"path": m["hostPath"]["path"],
                                             "type": "Directory"}}
        return MODEL_DIR, [vol], [mount], []
    if "image" in m:
        vol = {"name": "model", "image": {"reference": m["image"]["reference"],
                                          "pullPolicy": ctx.spec["imagePullPolicy"]}}
        return _join(MODEL_DIR, m["image"]["path"]), [vol], [mount], []
    if "huggingFace" in m:
        hf = m["huggingFace"]
        vol = {"name": "model", "emptyDir": {"sizeLimit": _q(hf["cacheSize"])}}
        env = [_env("HOME", "/tmp"), _env("HF_HOME", f"{MODEL_DIR}/.hf")]
        if "tokenSecret" in hf:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": hf["tokenSecret"]["name"], "key": hf["tokenSecret"]["key"]}}})
        init = {
            "name": "model-download",
            "image": ctx.image("prefill"),
            "imagePullPolicy": ctx.spec["imagePullPolicy"],
            "command": ["python", "-c", _DOWNLOAD, hf["id"], hf["revision"], f"{MODEL_DIR}/hf"],
            "env": env,
            "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR},
                             {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": _security(),
        }
        return f"{MODEL_DIR}/hf", [vol], [mount], [init]
    return "", [], [], []


def _join(root: str, sub: str) -> str:
    return f"{root}/{sub}" if sub else root


def _q(value: int | str) -> str:
    return naming.format_bytes(naming.parse_bytes(value))


def served_model_name(spec: Obj) -> str:
    m = spec["model"]
    if m.get("servedName"):
        return str(m["servedName"])
    if "huggingFace" in m:
        return str(m["huggingFace"]["id"])
    if any(k in m for k in ("pvc", "hostPath", "image")):
        return "model"
    return BUILTIN_MODEL_NAME


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
        "resources": {"limits": {rname: count, "cpu": "100m", "memory": "64Mi"}},
        "volumeMounts": [{"name": "run", "mountPath": RUN_DIR}],
        "securityContext": _security(ctx.rdma_on(role)),
    }


def _rdma_affinity(ctx: Ctx, role: str, affinity: Obj) -> Obj:
    if not ctx.rdma_on(role):
        return affinity
    out = copy.deepcopy(affinity)
    expr = {"key": ctx.spec["rdma"]["nodeLabel"], "operator": "In", "values": ["true"]}
    node = out.setdefault("nodeAffinity", {})
    if ctx.spec["rdma"]["required"]:
        req = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution",
                              {"nodeSelectorTerms": []})
        terms = req.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({"matchExpressions": []})
        for t in terms:  # terms are ORed: every alternative must also be RDMA-capable
            t.setdefault("matchExpressions", []).append(expr)
    else:
        node.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "preference": {"matchExpressions": [expr]}})
    return out


def _role_env(ctx: Ctx, role: str) -> tuple[list[Obj], list[str]]:
    """Role-specific environment and container args."""
    spec, p = ctx.spec, naming.PORTS[role]
    if role == "master":
        env = [_env("MOONCAKE_MASTER_HOST", "$(MOONCAKE_POD_IP)"),
               _env("MOONCAKE_MASTER_PORT", p["grpc"]),
               _env("MOONCAKE_MASTER_FAST_PORT", p["fast"]),
               _env("MOONCAKE_MASTER_METRICS_PORT", p["metrics"]),
               _env("MOONCAKE_HIGH_WATERMARK", spec["store"]["highWatermark"]),
               _env("MOONCAKE_LOW_WATERMARK", spec["store"]["lowWatermark"])]
        backend = spec["metadataBackend"]
        if backend["type"] == "redis":
            ref = backend["redisUrlSecret"]
            env += [_env("MOONCAKE_METADATA_BACKEND", "redis"),
                    {"name": "MOONCAKE_REDIS_URL", "valueFrom": {"secretKeyRef": {
                        "name": ref["name"], "key": ref["key"]}}},
                    # The leader address standbys hand out: this pod's stable name.
                    _env("MOONCAKE_MASTER_ADVERTISE",
                         f"$(MOONCAKE_POD_NAME).{ctx.master_svc}:{p['grpc']}"),
                    # One Redis may serve several clusters: keys are per cluster.
                    _env("MOONCAKE_HA_PREFIX", f"mooncake:{ctx.namespace}:{ctx.cluster}")]
        return env, ["store", "master"]
    if role == "store":
        env = [_env("MOONCAKE_MASTER", ctx.master_addr),
               _env("MOONCAKE_NODE_ID", "$(MOONCAKE_POD_NAME)"),
               _env("MOONCAKE_NODE_HOST", "$(MOONCAKE_POD_IP)"),
               _env("MOONCAKE_NODE_PORT", p["transfer"]),
               _env("MOONCAKE_NODE_ADVERTISE_HOST", "$(MOONCAKE_POD_IP)"),
               _env("MOONCAKE_DRAM_SIZE", naming.parse_bytes(spec["store"]["dramPerNode"])),
               _env("MOONCAKE_NODE_METRICS_PORT", p["metrics"])]
        if "ssd" in spec["store"]:
            ssd = naming.parse_bytes(spec["store"]["ssd"]["size"]) * 95 // 100
            env += [_env("MOONCAKE_SSD_DIR", SSD_DIR), _env("MOONCAKE_SSD_SIZE", ssd)]
        return env, ["store", "node"]
    if role == "conductor":
        def dns(r: str) -> str:
            host = naming.service_fqdn(naming.name(ctx.cluster, r), ctx.namespace, ctx.domain)
            return f"dns:{host}:{naming.PORTS[r]['grpc']}"

        env = [_env("MOONCAKE_CONDUCTOR_PORT", p["http"]),
               _env("MOONCAKE_MASTER", ctx.master_addr),
               _env("MOONCAKE_PREFILL", dns("prefill")),
               _env("MOONCAKE_DECODE", dns("decode")),
               _env("MOONCAKE_TTFT_SLO_MS", spec["slo"]["ttftMs"]),
               _env("MOONCAKE_TBT_SLO_MS", spec["slo"]["tbtMs"])]
        if spec["roles"]["conductor"].get("apiKeysSecret"):
            env.append(_env("MOONCAKE_API_KEYS_FILE", "/etc/mooncake/api-keys/api-keys"))
        return env, ["conductor", "--host", "0.0.0.0", "--allow-any-address"]
    # prefill / decode
    model_path, _, _, _ = _model(ctx)
    env = [_env("MOONCAKE_HOST", "$(MOONCAKE_POD_IP)"),
           _env("MOONCAKE_PORT", p["grpc"]),
           _env("MOONCAKE_ADVERTISE_HOST", "$(MOONCAKE_POD_IP)"),
           _env("MOONCAKE_METRICS_PORT", p["metrics"]),
           _env("MOONCAKE_INSTANCE_ID", "$(MOONCAKE_POD_NAME)"),
           _env("MOONCAKE_REVISION", ctx.serving_revision),
           _env("MOONCAKE_MASTER", ctx.master_addr),
           _env("MOONCAKE_ENGINE", spec["engine"]["kind"]),
           _env("MOONCAKE_MODEL", model_path),
           _env("MOONCAKE_SERVED_MODEL_NAME", served_model_name(spec)),
           _env("MOONCAKE_BLOCK_TOKENS", spec["store"]["blockTokens"]),
           _env("MOONCAKE_TRANSFER_PROTOCOL", spec["transferProtocol"]),
           _env("MOONCAKE_STORE_REPLICAS", spec["store"]["replicationFactor"])]
    kind = spec["engine"]["kind"]
    if spec["engine"].get("args") and kind != "sglang":
        env.append(_env("MOONCAKE_ENGINE_ARGS", shlex.join(spec["engine"]["args"])))
    if spec["engine"].get("device") and kind != "sglang":
        env.append(_env("MOONCAKE_DEVICE", spec["engine"]["device"]))
    if role == "decode":
        env.append(_env("MOONCAKE_LOCAL_SEGMENT_SIZE",
                        naming.parse_bytes(spec["roles"]["decode"]["localSegmentSize"])))
    if kind == "vllm":
        env += _vllm_env(spec, role)
    if kind == "sglang":
        env += _sglang_env(spec, role)
        return env, sglang_args(spec, role)
    return env, [role]


def sglang_args(spec: Obj, role: str) -> list[str]:
    """The SGLang worker's command line (after the image's `mooncake` entrypoint). The
    options every worker shares come from the environment as for the other engines; these
    are the SGLang ones, then SGLang's own flags after `--`."""
    ports = naming.SGLANG_PORTS[role]
    args = [role, "--engine", "sglang", "--device", str(device(spec, role)),
            "--sidecar", SIDECAR_SOCKET, "--advertise-host", "$(MOONCAKE_POD_IP)"]
    if role == "prefill":
        args += ["--sglang-bootstrap-port", str(ports["bootstrap"])]
    args += ["--pd-transfer-port", str(ports["pd-transfer"])]
    extra = [str(a) for a in spec["engine"].get("args") or []]
    return [*args, "--", *extra] if extra else args


def _sglang_env(spec: Obj, role: str) -> list[Obj]:
    env = [_env("HF_HUB_OFFLINE", 1)]  # the model is a local directory: never reach the Hub
    if device(spec, role) == "cpu":
        env.append(_env("SGLANG_USE_CPU_ENGINE", 1))
        cpus = _cpus(spec, role)
        if cpus is not None:  # torch's threads follow the CPU the pod may use
            env.append(_env("OMP_NUM_THREADS", cpus))
    return env


def _vllm_env(spec: Obj, role: str) -> list[Obj]:
    """vLLM's own settings. The worker starts vLLM with its environment, so they go here."""
    env = [_env("VLLM_NO_USAGE_STATS", 1),  # no usage reports to vLLM's servers from a cluster
           _env("HF_HUB_OFFLINE", 1)]  # the model is a local directory: never reach the Hub
    if device(spec, role) == "cuda":
        return env
    # vLLM's CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE alone (GiB, default 4):
    # half of the memory request left after /dev/shm (which counts against the pod's memory),
    # the other half for weights, activations and the runtime.
    memory = _memory(spec, role, "requests", "limits")
    kv_gib = VLLM_CPU_KVCACHE_DEFAULT_GIB
    if memory is not None:
        kv_gib = max(1, (memory - (shm_bytes(spec, role) or 0)) // 2 // GIB)
    # nobind: vLLM would otherwise pin its OpenMP threads to cores it picks itself, which may
    # lie outside the container's cpuset. The thread count follows the CPU the pod may use,
    # not the node's core count.
    env += [_env("VLLM_CPU_KVCACHE_SPACE", kv_gib), _env("VLLM_CPU_OMP_THREADS_BIND", "nobind")]
    cpus = _cpus(spec, role)
    if cpus is not None:
        env.append(_env("OMP_NUM_THREADS", cpus))
    return env


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
        size = naming.parse_bytes(r["shmSize"])
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
    memory = _memory(spec, role, "limits", "requests")
    if memory is None:
        return VLLM_SHM_MAX
    return min(VLLM_SHM_MAX, max(VLLM_SHM_MIN, memory // 8 // MIB * MIB))


def _probes(role: str, engine: str = "embedded") -> Obj:
    if role in ("prefill", "decode") and engine in SERVER_ENGINES:
        # vLLM and SGLang start in ~40 s on a CPU and in minutes on a GPU (weights,
        # torch.compile, CUDA graphs); /readyz says 503 meanwhile. The startup probe allows an
        # hour before liveness counts, and both probes allow 10 s answers: the engine keeps
        # every core busy while it loads and serves, and the worker's health thread shares them.
        return {"startupProbe": _http_probe("/healthz", "metrics", 10, 360, timeout=10),
                "livenessProbe": _http_probe("/healthz", "metrics", 10, 6, timeout=10),
                "readinessProbe": _http_probe("/readyz", "metrics", 5, 6, timeout=10)}
    if role in ("prefill", "decode"):
        # Loading weights can take many minutes; the startup probe holds liveness off meanwhile.
        return {"startupProbe": _http_probe("/healthz", "metrics", 10, 180),
                "livenessProbe": _http_probe("/healthz", "metrics", 10, 6),
                "readinessProbe": _http_probe("/readyz", "metrics", 5, 3)}
    if role == "conductor":
        return {"livenessProbe": _http_probe("/healthz", "http", 10, 6),
                "readinessProbe": _http_probe("/readyz", "http", 5, 3)}
    port = "grpc" if role == "master" else "transfer"
    return {"startupProbe": _tcp_probe(port, 5, 60), "livenessProbe": _tcp_probe(port, 10, 6),
            "readinessProbe": _tcp_probe(port, 5, 3)}


def _sidecar(ctx: Ctx, role: str) -> Obj:
    """The transfer sidecar as a native sidecar: an init container with restartPolicy Always
    (Kubernetes 1.29+) starts, and passes its startup probe (the socket exists), before the
    worker starts, and stops after the worker has."""
    spec = ctx.spec
    staging = sidecar_staging_bytes(spec)

    def socket_probe() -> Obj:  # fresh dicts: shared ones would print as YAML aliases
        return {"exec": {"command": ["test", "-S", SIDECAR_SOCKET]}}

    c: Obj = {
        "name": "sidecar",
        "image": ctx.image(role),
        "imagePullPolicy": spec["imagePullPolicy"],
        "restartPolicy": "Always",
        "args": ["sidecar", "--socket", SIDECAR_SOCKET, "--master", ctx.master_addr,
                 "--staging-size", str(staging)],
        "env": [ctx.token_env(), _env("MOONCAKE_LOG_LEVEL", spec["logLevel"]),
                _env("MOONCAKE_LOG_FORMAT", spec["logFormat"]), _env("HOME", "/tmp"),
                _env("MOONCAKE_STORE_REPLICAS", spec["store"]["replicationFactor"])],
        "volumeMounts": [{"name": "run", "mountPath": SIDECAR_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": "/tmp"}],
        # The staging segment lives in /dev/shm and is charged to this container's memory.
        "resources": {"requests": {"cpu": "100m",
                                   "memory": naming.format_bytes(staging + 128 * MIB)}},
        "startupProbe": {**socket_probe(), "periodSeconds": 1, "timeoutSeconds": 5,
                         "failureThreshold": 120},
        "readinessProbe": {**socket_probe(), "periodSeconds": 10, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "securityContext": _security(ctx.rdma_on(role)),
    }
    if ctx.rdma_on(role):  # the sidecar moves the pool's KV bytes: it needs the device too
        rname, count = spec["rdma"]["resourceName"], spec["rdma"]["count"]
        c["resources"]["limits"] = {rname: count}
        c["resources"]["requests"][rname] = count
    return c


def pod_template(ctx: Ctx, role: str) -> Obj:
    """The role's PodTemplateSpec before the user's podTemplate override is merged in."""
    spec, rspec = ctx.spec, ctx.spec["roles"][role]
    env, args = _role_env(ctx, role)
    volumes, mounts = _scratch()
    init: list[Obj] = []
    size = shm_bytes(spec, role)
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
    if role in ("prefill", "decode"):
        _, mvols, mmounts, minit = _model(ctx)
        volumes += mvols
        mounts += mmounts
        init += minit
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
    container: Obj = {
        "name": role,
        "image": ctx.image(role),
        "imagePullPolicy": spec["imagePullPolicy"],
        "args": args,
        "env": _base_env(ctx) + env,
        "ports": _ports(role, spec["engine"]["kind"]),
        "volumeMounts": mounts,
        "securityContext": _security(ctx.rdma_on(role)),
        **_probes(role, spec["engine"]["kind"]),
    }
    res = _resources(ctx, role)
    if res:
        container["resources"] = res
    labels = naming.labels(ctx.cluster, role)
    if role in ("prefill", "decode"):
        labels[naming.LABEL_SERVING_REVISION] = ctx.serving_revision
    pod: Obj = {
        "serviceAccountName": spec.get("serviceAccountName") or None,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60 if role in ("prefill", "decode") else 30,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                            "fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": init or None,
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": rspec.get("nodeSelector") or None,
        "tolerations": rspec.get("tolerations") or None,
        "affinity": _rdma_affinity(ctx, role, rspec.get("affinity") or {}) or None,
        "priorityClassName": rspec.get("priorityClassName") or None,
        "imagePullSecrets": [{"name": s} for s in spec.get("imagePullSecrets") or []] or None,
    }
    if role in ("prefill", "decode", "store"):
        pod["topologySpreadConstraints"] = [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": naming.selector(ctx.cluster, role)}}]
    template = {"metadata": {"labels": labels},
                "spec": {k: v for k, v in pod.items() if v is not None}}
    merged: Obj = merge_override(template, rspec.get("podTemplate") or {})
    return merged


_NAMED_LISTS = {"containers", "initContainers", "env", "volumes", "volumeMounts", "ports",
                "imagePullSecrets"}


def merge_override(base: Any, override: Any, key: str = "") -> Any:
    """Merge a user's partial template: maps recurse, named lists merge by name, else replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge_override(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if (key in _NAMED_LISTS and isinstance(base, list) and isinstance(override, list)
            and all(isinstance(i, dict) and "name" in i for i in base + override)):
        merged = [copy.deepcopy(i) for i in base]
        index = {i["name"]: n for n, i in enumerate(merged)}
        for item in override:
            if item["name"] in index:
                merged[index[item["name"]]] = merge_override(merged[index[item["name"]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(override)
