"""What each role's main container runs: the `mooncake` CLI's arguments and its environment
(MOONCAKE_* variables, plus vLLM's and SGLang's own settings), and SGLang workers' flags.

This is the operator's side of the CLI's contract (`docs/environment.md` lists the variables).
Pure: `pods.py` calls `base_env` and `role_env` once per role.
"""

from __future__ import annotations

import shlex
from typing import Any

from mooncake_k8s.common import defaults as d
from mooncake_k8s.operator import admission, naming, pods_sizing, pods_volumes, schema_gateway
from mooncake_k8s.operator.groups import POD_INDEX_LABEL
from mooncake_k8s.operator.pods_context import (
    CACHE_DIR,
    SIDECAR_SOCKET,
    SSD_DIR,
    Ctx,
    env_var,
    field_env_var,
)

Obj = dict[str, Any]
BUILTIN_MODEL_NAME = "smollm2-135m-instruct"


def base_env(ctx: Ctx) -> list[Obj]:
    """The environment every role's main container starts with."""
    # Downward-API values first: later entries refer to them as $(MOONCAKE_POD_IP).
    return [
        field_env_var("MOONCAKE_POD_IP", "status.podIP"),
        field_env_var("MOONCAKE_POD_NAME", "metadata.name"),
        ctx.token_env(),
        env_var("MOONCAKE_LOG_LEVEL", ctx.spec["logLevel"]),
        env_var("MOONCAKE_LOG_FORMAT", ctx.spec["logFormat"]),
        env_var("HOME", "/tmp"),
        env_var("XDG_CACHE_HOME", CACHE_DIR),
        env_var("HF_HOME", f"{CACHE_DIR}/huggingface"),
    ]


def served_model_name(spec: Obj) -> str:
    """The name the model is served under: model.servedName; else the Hugging Face id; else
    `model` for a mounted one; else the built-in model's name."""
    m = spec["model"]
    if m.get("servedName"):
        return str(m["servedName"])
    if "huggingFace" in m:
        return str(m["huggingFace"]["id"])
    if any(k in m for k in ("pvc", "hostPath", "image")):
        return "model"
    return BUILTIN_MODEL_NAME


def conductor_drain_seconds(grace: int) -> int:
    """How long the Conductor lets streams finish after SIGTERM: the pod's grace period less
    the preStop pause and a margin for stopping, so the kubelet's SIGKILL never cuts it."""
    return max(1, grace - d.CONDUCTOR_PRESTOP_S - 5)


def tenant_quotas(quotas: list[dict[str, Any]]) -> str:
    """store.tenantQuotas as the master's MOONCAKE_TENANT_QUOTAS: `NAME=DRAM,SSD` entries in
    bytes, space-separated ('-' = unlimited in that tier)."""
    def one(q: dict[str, Any], tier: str) -> str:
        return str(naming.parse_bytes(q[tier])) if tier in q else "-"

    return " ".join(f"{q['tenant']}={one(q, 'dram')},{one(q, 'ssd')}" for q in quotas)


def role_env(ctx: Ctx, role: str) -> tuple[list[Obj], list[str]]:
    """Role-specific environment and container args."""
    spec, p = ctx.spec, naming.PORTS[role]
    if role == "master":
        env = [env_var("MOONCAKE_MASTER_HOST", "$(MOONCAKE_POD_IP)"),
               env_var("MOONCAKE_MASTER_PORT", p["grpc"]),
               env_var("MOONCAKE_MASTER_FAST_PORT", p["fast"]),
               env_var("MOONCAKE_MASTER_METRICS_PORT", p["metrics"]),
               env_var("MOONCAKE_HIGH_WATERMARK", spec["store"]["highWatermark"]),
               env_var("MOONCAKE_LOW_WATERMARK", spec["store"]["lowWatermark"])]
        if spec["store"].get("tenantQuotas"):
            env.append(env_var("MOONCAKE_TENANT_QUOTAS",
                               tenant_quotas(spec["store"]["tenantQuotas"])))
        fanout = spec["store"].get("fanout") or {}
        if fanout.get("enabled"):
            env += [env_var("MOONCAKE_FANOUT", "true"),
                    env_var("MOONCAKE_FANOUT_THRESHOLD", fanout.get("threshold", 4)),
                    env_var("MOONCAKE_FANOUT_WINDOW", fanout.get("windowSeconds", 10.0)),
                    env_var("MOONCAKE_FANOUT_MAX_REPLICAS", fanout.get("maxReplicas", 4))]
        backend = spec["metadataBackend"]
        if backend["type"] == "redis":
            ref = backend["redisUrlSecret"]
            env += [env_var("MOONCAKE_METADATA_BACKEND", "redis"),
                    {"name": "MOONCAKE_REDIS_URL", "valueFrom": {"secretKeyRef": {
                        "name": ref["name"], "key": ref["key"]}}},
                    # The leader address standbys hand out: this pod's stable name.
                    env_var("MOONCAKE_MASTER_ADVERTISE",
                            f"$(MOONCAKE_POD_NAME).{ctx.master_svc}:{p['grpc']}"),
                    # One Redis may serve several clusters: keys are per cluster.
                    env_var("MOONCAKE_HA_PREFIX", f"mooncake:{ctx.namespace}:{ctx.cluster}")]
        return env, ["store", "master"]
    if role == "store":
        env = [env_var("MOONCAKE_MASTER", ctx.master_addr),
               env_var("MOONCAKE_NODE_ID", "$(MOONCAKE_POD_NAME)"),
               env_var("MOONCAKE_NODE_HOST", "$(MOONCAKE_POD_IP)"),
               env_var("MOONCAKE_NODE_PORT", p["transfer"]),
               env_var("MOONCAKE_NODE_ADVERTISE_HOST", "$(MOONCAKE_POD_IP)"),
               env_var("MOONCAKE_DRAM_SIZE", naming.parse_bytes(spec["store"]["dramPerNode"])),
               env_var("MOONCAKE_NODE_METRICS_PORT", p["metrics"])]
        if "ssd" in spec["store"]:
            ssd = naming.parse_bytes(spec["store"]["ssd"]["size"]) * 95 // 100
            env += [env_var("MOONCAKE_SSD_DIR", SSD_DIR), env_var("MOONCAKE_SSD_SIZE", ssd)]
        return env, ["store", "node"]
    if role == "conductor":
        def dns(r: str) -> str:
            host = naming.service_fqdn(naming.name(ctx.cluster, r), ctx.namespace, ctx.domain)
            return f"dns:{host}:{naming.PORTS[r]['grpc']}"

        grace = spec["roles"]["conductor"]["terminationGracePeriodSeconds"]
        env = [env_var("MOONCAKE_CONDUCTOR_PORT", p["http"]),
               # Metrics on the pod IP only: Prometheus scrapes it, the API stays apart.
               env_var("MOONCAKE_CONDUCTOR_METRICS_PORT", p["metrics"]),
               env_var("MOONCAKE_CONDUCTOR_METRICS_HOST", "$(MOONCAKE_POD_IP)"),
               env_var("MOONCAKE_SHUTDOWN_TIMEOUT", conductor_drain_seconds(grace)),
               env_var("MOONCAKE_MASTER", ctx.master_addr),
               env_var("MOONCAKE_PREFILL", dns("prefill")),
               env_var("MOONCAKE_DECODE", dns("decode")),
               # The workers' model (its tokenizer) and name: the Conductor tokenises for them.
               env_var("MOONCAKE_MODEL", pods_volumes.conductor_model_source(ctx).path),
               env_var("MOONCAKE_SERVED_MODEL_NAME", served_model_name(spec)),
               env_var("HF_HUB_OFFLINE", 1),
               env_var("MOONCAKE_TTFT_SLO_MS", spec["slo"]["ttftMs"]),
               env_var("MOONCAKE_TBT_SLO_MS", spec["slo"]["tbtMs"])]
        if spec["roles"]["conductor"].get("apiKeysSecret"):
            env.append(env_var("MOONCAKE_API_KEYS_FILE", "/etc/mooncake/api-keys/api-keys"))
        if "tenantFairShare" in spec["slo"]:
            env.append(env_var("MOONCAKE_TENANT_FAIR_SHARE", spec["slo"]["tenantFairShare"]))
        return env, ["conductor", "--host", "0.0.0.0", "--allow-any-address"]
    # prefill / decode
    env = [env_var("MOONCAKE_HOST", "$(MOONCAKE_POD_IP)"),
           env_var("MOONCAKE_PORT", p["grpc"]),
           env_var("MOONCAKE_ADVERTISE_HOST", "$(MOONCAKE_POD_IP)"),
           env_var("MOONCAKE_METRICS_PORT", p["metrics"]),
           env_var("MOONCAKE_INSTANCE_ID", "$(MOONCAKE_POD_NAME)"),
           env_var("MOONCAKE_REVISION", ctx.serving_revision),
           env_var("MOONCAKE_MASTER", ctx.master_addr),
           env_var("MOONCAKE_ENGINE", spec["engine"]["kind"]),
           env_var("MOONCAKE_MODEL", pods_volumes.model_source(ctx).path),
           env_var("MOONCAKE_SERVED_MODEL_NAME", served_model_name(spec)),
           env_var("MOONCAKE_BLOCK_TOKENS", spec["store"]["blockTokens"]),
           env_var("MOONCAKE_TRANSFER_PROTOCOL", spec["transferProtocol"]),
           env_var("MOONCAKE_STORE_REPLICAS", spec["store"]["replicationFactor"]),
           # The worker's --drain-timeout; its pod's grace period and preStop follow the same
           # field (`pods`).
           env_var("MOONCAKE_DRAIN_TIMEOUT", schema_gateway.drain_seconds(spec, role))]
    kind = spec["engine"]["kind"]
    if spec["engine"].get("args") and kind != "sglang":
        env.append(env_var("MOONCAKE_ENGINE_ARGS", shlex.join(spec["engine"]["args"])))
    if spec["engine"].get("device") and kind != "sglang":
        env.append(env_var("MOONCAKE_DEVICE", spec["engine"]["device"]))
    env.append(env_var("MOONCAKE_LOCAL_SEGMENT_SIZE",
                       naming.parse_bytes(spec["roles"][role]["localSegmentSize"])))
    if role == "prefill":
        env += pipeline_env(ctx)
    if kind == "vllm":
        env += _vllm_env(spec, role)
    if kind == "sglang":
        env += _sglang_env(spec, role)
        return env, sglang_args(spec, role)
    return env, [role]


def pipeline_env(ctx: Ctx) -> list[Obj]:
    """A prefill pod's pipeline stage settings (roles.prefill.pipelineGroupSize above 1).

    One pod template serves every pod of the StatefulSet, so nothing here names a pod: the
    worker derives its stage from its pod index (the StatefulSet's `apps.kubernetes.io/
    pod-index` label, through the downward API) modulo the group size, its group `g<index //
    size>` from the `{group}` template, and the next stage's address from the `{index}`
    template (this pod's index + 1) under the role's headless Service, which gives each pod a
    stable DNS name. The last stage of a group has no next stage and ignores it."""
    size = admission.group_size(ctx.spec)
    if size == 1:
        return []
    svc = naming.name(ctx.cluster, "prefill")
    host = naming.service_fqdn(svc, ctx.namespace, ctx.domain)
    return [field_env_var("MOONCAKE_POD_INDEX", f"metadata.labels['{POD_INDEX_LABEL}']"),
            env_var("MOONCAKE_PIPELINE_GROUP_SIZE", size),
            env_var("MOONCAKE_PIPELINE_STAGE", "auto"),
            env_var("MOONCAKE_PIPELINE_GROUP", "g{group}"),
            env_var("MOONCAKE_PIPELINE_NEXT",
                    f"{svc}-{{index}}.{host}:{naming.PORTS['prefill']['grpc']}")]


def sglang_args(spec: Obj, role: str) -> list[str]:
    """The SGLang worker's command line (after the image's `mooncake` entrypoint). The
    options every worker shares come from the environment as for the other engines; these
    are the SGLang ones, then SGLang's own flags after `--`."""
    ports = naming.SGLANG_PORTS[role]
    args = [role, "--engine", "sglang", "--device", str(pods_sizing.device(spec, role)),
            "--sidecar", SIDECAR_SOCKET, "--advertise-host", "$(MOONCAKE_POD_IP)"]
    if role == "prefill":
        args += ["--sglang-bootstrap-port", str(ports["bootstrap"])]
    args += ["--pd-transfer-port", str(ports["pd-transfer"])]
    extra = [str(a) for a in spec["engine"].get("args") or []]
    return [*args, "--", *extra] if extra else args


def _sglang_env(spec: Obj, role: str) -> list[Obj]:
    env = [env_var("HF_HUB_OFFLINE", 1)]  # the model is a local directory: never reach the Hub
    if pods_sizing.device(spec, role) == "cpu":
        env.append(env_var("SGLANG_USE_CPU_ENGINE", 1))
        cpus = pods_sizing.cpus(spec, role)
        if cpus is not None:  # torch's threads follow the CPU the pod may use
            env.append(env_var("OMP_NUM_THREADS", cpus))
    return env


def _vllm_env(spec: Obj, role: str) -> list[Obj]:
    """vLLM's own settings. The worker starts vLLM with its environment, so they go here."""
    env = [env_var("VLLM_NO_USAGE_STATS", 1),  # no usage reports to vLLM's servers from a cluster
           env_var("HF_HUB_OFFLINE", 1)]  # the model is a local directory: never reach the Hub
    if pods_sizing.device(spec, role) == "cuda":
        return env
    # vLLM's CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE alone (GiB, default 4):
    # half of the memory request left after /dev/shm (which counts against the pod's memory),
    # the other half for weights, activations and the runtime.
    memory = pods_sizing.memory(spec, role, "requests", "limits")
    kv_gib = pods_sizing.VLLM_CPU_KVCACHE_DEFAULT_GIB
    if memory is not None:
        shm = pods_sizing.shm_bytes(spec, role) or 0
        kv_gib = max(1, (memory - shm) // 2 // pods_sizing.GIB)
    # nobind: vLLM would otherwise pin its OpenMP threads to cores it picks itself, which may
    # lie outside the container's cpuset. The thread count follows the CPU the pod may use,
    # not the node's core count.
    env += [env_var("VLLM_CPU_KVCACHE_SPACE", kv_gib),
            env_var("VLLM_CPU_OMP_THREADS_BIND", "nobind")]
    cpus = pods_sizing.cpus(spec, role)
    if cpus is not None:
        env.append(env_var("OMP_NUM_THREADS", cpus))
    return env
