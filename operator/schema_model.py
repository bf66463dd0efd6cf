"""The `model` and `engine` parts of the `MooncakeCluster` spec schema: where the weights come
from and which inference engine serves them, with the engine flags each worker owns.

Split from `schema.py` (which assembles the whole spec) because these two fields carry the
longest descriptions and the engine-specific rules; the worker modules keep their own copies of
the owned flags, and a unit test holds the two lists together. Pure data: no I/O.
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.operator.schema_cel import positive
from mooncake_k8s.operator.schema_dsl import (
    DNS_LABEL,
    array,
    boolean,
    helper_resources,
    obj,
    rule,
    secret_key_ref,
    size,
    string,
)

Schema = dict[str, Any]


def model_schema() -> Schema:
    sources = ("huggingFace", "pvc", "hostPath", "image")
    count = " + ".join(f"(has(self.{s}) ? 1 : 0)" for s in sources)
    return obj(
        "Which model prefill and decode serve and where its files come from. Set at most one "
        "source; with none, the embedded engine serves its built-in SmolLM2-135M-Instruct.",
        {
            "servedName": string(
                "Model name clients pass as `model` in OpenAI requests and see in /v1/models. "
                "Defaults to the Hugging Face id, or `smollm2-135m-instruct` for the built-in "
                "model.", min_length=1, max_length=256),
            "huggingFace": obj(
                "Download the model from the Hugging Face Hub in an init container into a "
                "per-pod volume before the engine starts.",
                {
                    "id": string("Repository id, for example `Qwen/Qwen2.5-7B-Instruct`.",
                                 pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"),
                    "revision": string("Branch, tag or commit to download; pin a commit in "
                                       "production so every pod serves identical weights.",
                                       default="main", min_length=1),
                    "tokenSecret": secret_key_ref(
                        "Secret holding a Hub token for gated models (exposed as HF_TOKEN to the "
                        "download container only).", "HF_TOKEN"),
                    "cacheSize": size(
                        "Size limit of the emptyDir the model is downloaded into; prefill and "
                        "decode containers (and the download) request as much "
                        "ephemeral-storage, so pods land on nodes with room for the model.",
                        default="64Gi",
                        rules=(positive("the model cannot be downloaded into 0 bytes"),)),
                    "cacheClaimName": string(
                        "Download into this PersistentVolumeClaim instead of a per-pod emptyDir "
                        "(a ReadWriteMany claim when pods span nodes): the first pod's init "
                        "container fills `hf/<id>/<revision>` in it under a lock file and "
                        "leaves a marker, later pods find the marker and skip the download, "
                        "and the engines mount the claim read-only.",
                        pattern=DNS_LABEL, max_length=253),
                    "resources": helper_resources(
                        "model-download", "requests cpu 250m, memory 256Mi and "
                        "ephemeral-storage cacheSize without cacheClaimName; limits cpu 1, "
                        "memory 1Gi"),
                    "p2p": boolean(
                        "Share the download between pods through the store's P2P store: the "
                        "download container first runs `mooncake p2p get` (chunks from every "
                        "store node that holds them, each verified), and only when no peer "
                        "has the model downloads it from the Hub and publishes it (unpinned: "
                        "the chunks are cache, and a pod that misses one downloads from the "
                        "Hub). Off by default; not with cacheClaimName, whose pods share one "
                        "download already."),
                },
                required=("id",),
                rules=(rule("!(has(self.p2p) && self.p2p && has(self.cacheClaimName))",
                            "model.huggingFace.p2p shares downloads between per-pod volumes; "
                            "with cacheClaimName the pods share one download already",
                            field_path=".p2p"),),
            ),
            "pvc": obj(
                "Mount the model from an existing PersistentVolumeClaim (read-only; use a "
                "ReadOnlyMany or ReadWriteMany claim when pods span nodes).",
                {
                    "claimName": string("Name of the PersistentVolumeClaim.", pattern=DNS_LABEL,
                                        max_length=253),
                    "path": string("Directory of the model inside the volume.", default="",
                                   pattern=r"^([^/.][^/]*(/[^/.][^/]*)*)?$"),
                },
                required=("claimName",),
            ),
            "hostPath": obj(
                "Mount the model from a directory on every node (it must exist on each node "
                "prefill and decode can be scheduled on).",
                {"path": string("Absolute directory on the node.", pattern=r"^/.*")},
                required=("path",),
            ),
            "image": obj(
                "Mount the model from an OCI image through an `image` volume (Kubernetes "
                "1.33+ with the ImageVolume feature).",
                {
                    "reference": string("Image reference holding the model files.",
                                        min_length=1),
                    "path": string("Directory of the model inside the image.", default="",
                                   pattern=r"^([^/.][^/]*(/[^/.][^/]*)*)?$"),
                },
                required=("reference",),
            ),
        },
        default={},
        rules=(rule(f"{count} <= 1",
                    "model: set at most one of huggingFace, pvc, hostPath, image"),),
    )


ENGINES = ("embedded", "vllm", "sglang")
DEVICES = ("cpu", "cuda")
SIDECAR_STAGING_DEFAULT = "256Mi"
# Flags the vLLM worker sets itself (`mooncake_k8s.engine.vllm.server.OWNED_FLAGS`); engine.args
# may not repeat them, or every prefill and decode pod would exit at start.
VLLM_OWNED_FLAGS = ("--model", "--host", "--port", "--served-model-name", "--block-size",
                    "--kv-transfer-config")
# The same for the SGLang worker (`mooncake_k8s.engine.sglang.server.OWNED_FLAGS`).
SGLANG_OWNED_FLAGS = ("--model-path", "--host", "--port", "--served-model-name", "--page-size",
                      "--disaggregation-mode", "--disaggregation-bootstrap-port",
                      "--disaggregation-transfer-backend", "--hicache-storage-backend",
                      "--hicache-storage-backend-extra-config", "--enable-hierarchical-cache",
                      "--api-key")


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{f}'" for f in items) + "]"


def _owned_rule(kind: str, flags: tuple[str, ...], hint: str) -> Schema:
    """engine.args may not set a flag the `kind` worker sets itself. The messageExpression
    names the first offending argument; the static message lists them all."""
    owned = _cel_list(flags)
    hit = f"{owned}.exists(f, a == f || a.startsWith(f + '='))"
    listed = ", ".join(flags[:-1]) + " and " + flags[-1]
    return rule(
        f"self.kind != '{kind}' || !has(self.args) || !self.args.exists(a, {hit})",
        f"engine.args: {listed} are set by the {kind} worker ({hint}); remove them from "
        "engine.args",
        field_path=".args",
        message_expression=(
            f"'engine.args: ' + self.args.filter(a, {hit})[0] + ' is set by the {kind} "
            f"worker ({hint}); remove it from engine.args (the worker owns {listed})'"),
    )


def engine_schema() -> Schema:
    return obj(
        "The inference engine prefill and decode run.",
        {
            "kind": string(
                "`embedded` (PyTorch, CPU or CUDA, for small models and laptops), `vllm` (each "
                "prefill and decode worker starts a vLLM server on 127.0.0.1 inside its pod, "
                "wired to this project's KV store; CUDA or vLLM's CPU build) or `sglang` (each "
                "worker starts an SGLang server in PD mode inside its pod: prefill serves "
                "SGLang's bootstrap (containerPort 8998) and both hand KV over on "
                "`pd-transfer` (7300); HiCache's L3 is this project's KV pool, reached "
                "through a transfer sidecar). vllm and sglang need a model source. vllm and "
                "sglang pods get a larger Memory-backed /dev/shm (the engine's processes "
                "share memory: 1/8 of the container's memory, 256Mi to 2Gi, 2Gi without a "
                "memory request or limit; sglang adds engine.sidecar.stagingSize). vllm pods "
                "without a GPU resource (nvidia.com/gpu, amd.com/gpu) get "
                "VLLM_CPU_KVCACHE_SPACE (GiB of KV cache: half the memory request left after "
                "/dev/shm, at least 1; 4 without a request), VLLM_CPU_OMP_THREADS_BIND=nobind "
                "and OMP_NUM_THREADS (the CPU limit or request); sglang pods on a CPU get "
                "SGLANG_USE_CPU_ENGINE=1 and OMP_NUM_THREADS. Set env in "
                "roles.<role>.podTemplate to override them.",
                default="embedded", enum=ENGINES),
            "device": string(
                "Where prefill and decode compute: `cpu` or `cuda`. Default: `cuda` for "
                "sglang (its CUDA kernels are the production path); for vllm and embedded "
                "`cuda` when the role requests a GPU resource, else `cpu`. `cuda` without a "
                "GPU resource in roles.<role>.resources requests one nvidia.com/gpu; `cpu` "
                "with one is an error. For sglang it also picks the default image variant "
                "(`-sglang` or `-sglang-cpu`).", enum=DEVICES),
            "image": string(
                "Image for prefill and decode; it must carry the `mooncake` CLI and the engine. "
                "Default: spec.image for embedded; for vllm and sglang spec.image with "
                "`-<kind>` appended to its tag (`mooncake-k8s:0.1.0` -> "
                "`mooncake-k8s:0.1.0-vllm`), the variant the Dockerfile builds with "
                "`--build-arg ENGINE=<kind>`; sglang on a CPU (engine.device cpu) appends "
                "`-sglang-cpu` (`--build-arg ENGINE=sglang --build-arg DEVICE=cpu`). "
                "Required when spec.image is pinned by digest. roles.<role>.image still wins "
                "over it."),
            "args": array(
                "Extra arguments passed through to the engine: vLLM server flags (for example "
                "`--max-model-len`, `--dtype`, `--enforce-eager`, `--tensor-parallel-size`; "
                "MOONCAKE_ENGINE_ARGS) except those the worker sets itself ("
                + ", ".join(VLLM_OWNED_FLAGS) + "), or SGLang server flags (for example "
                "`--mem-fraction-static`, `--chunked-prefill-size`, `--tp-size`; after `--` "
                "on the worker's command line) except those its worker sets ("
                + ", ".join(SGLANG_OWNED_FLAGS) + ").",
                string("One argument.", max_length=4096), max_items=64),
            "sidecar": obj(
                "The transfer sidecar of sglang prefill and decode pods: `mooncake sidecar` "
                "owns the pod's KV-pool client and a staging segment in /dev/shm, and the "
                "worker's SGLang reaches it over /run/mooncake/sidecar.sock. It runs as a "
                "native sidecar (an init container with restartPolicy Always), so it starts "
                "before the worker and stops after it; this needs Kubernetes 1.29 or later. "
                "Override its container through roles.<role>.podTemplate "
                "(spec.initContainers, name `sidecar`).",
                {"stagingSize": size("Shared-memory staging segment of the sidecar (in the "
                                     "pod's /dev/shm, which grows by as much).",
                                     default=SIDECAR_STAGING_DEFAULT, rules=(positive(
                                         "the sidecar cannot stage KV blocks in 0 bytes"),)),
                 "resources": helper_resources(
                     "sidecar", "requests cpu 100m and memory stagingSize + 128Mi; limits "
                     "cpu 1 and memory stagingSize + 256Mi")}),
        },
        default={},
        rules=(
            _owned_rule("vllm", VLLM_OWNED_FLAGS, "use spec.model, spec.store.blockTokens"),
            _owned_rule("sglang", SGLANG_OWNED_FLAGS,
                        "from spec.model, spec.store.blockTokens and the cluster token"),
        ),
    )
