"""The one source of truth for the `MooncakeCluster` and `MooncakeRoleScaler` OpenAPI schemas.

`crds.py` wraps these schemas into CustomResourceDefinitions (checked in under `crds/`, a test
fails when they drift); `validation.py` evaluates the same schemas offline (jsonschema for the
structure, a CEL interpreter for `x-kubernetes-validations`) so `mooncake render` rejects what the
API server would reject; `spec.py` reads the defaulted result. Every field carries a description
because `kubectl explain` shows exactly these strings to platform engineers.

Pure data: no I/O, no Kubernetes client.
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.common import defaults as d
from mooncake_k8s.operator import corev1
from mooncake_k8s.operator.schema_cel import (
    RDMA_PROTOCOL_REFUSED,
    SHM_WHY,
    extended_resource,
    group_engine,
    group_multiple,
    min_dram,
    positive,
    segment_size,
)
from mooncake_k8s.operator.schema_dsl import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    OPTIONAL_DNS_SUBDOMAIN,
    OPTIONAL_QUALIFIED_NAME,
    array,
    boolean,
    free_object,
    helper_resources,
    integer,
    number,
    obj,
    quantity_map,
    rule,
    secret_key_ref,
    size,
    string,
    string_map,
)
from mooncake_k8s.operator.schema_gateway import drain_timeout, gateway_schema
from mooncake_k8s.operator.schema_model import engine_schema, model_schema
from mooncake_k8s.operator.schema_status import cluster_status_schema

Schema = dict[str, Any]

GROUP = "mooncake.io"
VERSION = "v1alpha1"
ROLES = ("conductor", "prefill", "decode", "store", "master")
# Roles whose pods move KV bytes and therefore get RDMA devices, /dev/shm and IPC_LOCK.
DATA_ROLES = ("prefill", "decode", "store")
DEFAULT_IMAGE = "mooncake-k8s:0.1.0"

# Byte sizes as Kubernetes quantities (binary or decimal suffixes, no exponents or millis).
# --------------------------------------------------------------------------------------------
# spec


def _role(name: str, replicas: int, extra: dict[str, Schema] | None = None,
          rules: tuple[Schema, ...] = ()) -> Schema:
    props: dict[str, Schema] = {
        "replicas": integer(
            f"Initial number of {name} pods. Later changes here re-seed the role's "
            "MooncakeRoleScaler; HPA, KEDA or the built-in autoscaler may then change it.",
            default=replicas, minimum=1 if name == "master" else 0, maximum=1000),
        "image": string(f"Image for {name} pods when it differs from the cluster default."),
        "resources": obj(
            f"Compute resources of the {name} container. cpu and memory left out of requests "
            "or limits get the operator's defaults, so every container has both (namespaces "
            "whose ResourceQuota requires them admit the pods): a default limit never falls "
            "below the request given, a default request never exceeds the limit given, and "
            "memory defaults count the role's Memory-backed /dev/shm on top. Defaults (cpu, "
            "memory requests / limits): conductor 250m, 512Mi / 2, 2Gi; master 100m, 256Mi / "
            "1, 1Gi; store 250m, shm+256Mi / 2, shm+512Mi; prefill and decode 1, shm+1Gi / 4, "
            "shm+2Gi (vllm, sglang: 2, shm+8Gi / 8, shm+16Gi).", {
            "limits": quantity_map("Maximum resources (cpu, memory, nvidia.com/gpu, ...)."),
            "requests": quantity_map("Resources the scheduler reserves."),
        }, default={}),
        "nodeSelector": string_map(f"Node labels {name} pods must match (keys are qualified "
                                   "names, values label values).",
                                   value_pattern=corev1.LABEL_VALUE, value_max_length=63),
        "tolerations": array(f"Tolerations of {name} pods.", _toleration(), max_items=64),
        "affinity": free_object(f"A core/v1 Affinity for {name} pods; RDMA node affinity is "
                                "added to it, never replaced. Checked against Kubernetes' "
                                "rules by `mooncake render` and the operator."),
        "priorityClassName": string(f"PriorityClass of {name} pods.",
                                    pattern=OPTIONAL_DNS_SUBDOMAIN, max_length=253),
        "podTemplate": free_object(
            f"A partial PodTemplateSpec merged over the rendered {name} template: maps merge "
            "recursively, lists of named items (containers, env, volumes, volumeMounts, ports) "
            "merge by name, other lists replace. Use it for what the spec does not cover."),
        "maxUnavailable": integer(
            f"PodDisruptionBudget for {name}: pods that voluntary disruptions (drains) may take "
            "down at once.", default=1, minimum=0),
    }
    props.update(extra or {})
    return obj(f"The {name} role.", props, default={}, rules=rules)


def _toleration() -> Schema:
    """A core/v1 Toleration with the API server's cross-field rules as CEL."""
    return obj("A core/v1 Toleration.", {
        "key": string("Taint key it matches; empty with operator Exists matches every taint.",
                      pattern=OPTIONAL_QUALIFIED_NAME, max_length=317),
        "operator": string("`Equal` (default) or `Exists`.",
                           enum=("", *corev1.TOLERATION_OPERATORS)),
        "value": string("Taint value it matches (operator Equal).",
                        pattern=corev1.LABEL_VALUE, max_length=63),
        "effect": string("Taint effect it matches; empty matches every effect.",
                         enum=("", *corev1.TAINT_EFFECTS)),
        "tolerationSeconds": integer("How long a NoExecute taint is tolerated before "
                                     "eviction (forever when unset)."),
    }, rules=(
        rule("(has(self.key) && self.key != '') || "
             "(has(self.operator) && self.operator == 'Exists')",
             corev1.EMPTY_KEY_NEEDS_EXISTS, field_path=".operator"),
        rule("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || "
             "self.value == ''", corev1.EXISTS_TAKES_NO_VALUE, field_path=".value"),
        rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             corev1.SECONDS_NEED_NO_EXECUTE, field_path=".effect"),
    ))


def _roles() -> Schema:
    return obj("Per-role pod settings.", {
        "conductor": _role("conductor", 1, {
            "service": obj("How the Conductor's OpenAI-compatible API is exposed.", {
                "type": string("Service type.", default="ClusterIP",
                               enum=("ClusterIP", "NodePort", "LoadBalancer")),
                "port": integer("Service port of the HTTP API.", default=d.CONDUCTOR_PORT,
                                minimum=1, maximum=65535),
                "annotations": string_map("Annotations for the Service (load balancer "
                                          "settings)."),
            }, default={}),
            "apiKeysSecret": string(
                "Secret whose key `api-keys` lists accepted API keys, one per line. Without it "
                "the API accepts any client that can reach it.", pattern=DNS_LABEL,
                max_length=253),
            "terminationGracePeriodSeconds": integer(
                "How long a stopping Conductor pod may take: a preStop pause of "
                f"{d.CONDUCTOR_PRESTOP_S} s (endpoints drop the pod), then SIGTERM turns "
                "readiness off and closes the listener while requests and streams in flight "
                f"finish for up to this less {d.CONDUCTOR_PRESTOP_S + 5} s; what is still "
                "running then is cut. Longest generations you want to survive a rollout "
                "decide it.", default=d.CONDUCTOR_GRACE_S, minimum=15, maximum=3600),
        }),
        "prefill": _role("prefill", 1, {
            "localSegmentSize": size(
                "DRAM each prefill pod serves to the KV store on its node: prefill keeps the "
                "prefixes it computed there, so a repeat on that node crosses no network. "
                "Added to the pod's Memory-backed /dev/shm (0: none).", default="1Gi",
                rules=(segment_size(),)),
            "shmSize": size("Memory-backed /dev/shm of each prefill pod for transfer buffers; "
                            "the pod's /dev/shm is this plus localSegmentSize. With engine.kind "
                            "vllm the pod's /dev/shm also gets vLLM's share (see engine.kind).",
                            default="1Gi", rules=(positive(SHM_WHY),)),
            "pipelineGroupSize": integer(
                "Prefill pods per pipeline group (chunked pipeline-parallel prefill): pods "
                "0..G-1 form group g0, G..2G-1 group g1, and so on; each pod of a group is one "
                "stage computing its share of the model's layers for every prompt the group's "
                "leader (stage 0) takes, so one long prompt uses the whole group. The "
                "Conductor routes only to leaders of whole groups. replicas (and the "
                "autoscaler's prefill bounds) must be multiples of it; a group's pods start "
                "together, spread over nodes, and restart together (status.prefillGroups). "
                "Embedded engine only; 1 (the default) is one instance per pod.",
                default=1, minimum=1, maximum=64),
            "drainTimeoutSeconds": drain_timeout("prefill"),
        }),
        "decode": _role("decode", 1, {
            "localSegmentSize": size(
                "DRAM each decode pod serves to the KV store so prefill writes KV next to it "
                "(0: none).", default="2Gi", rules=(segment_size(),)),
            "shmSize": size("Memory-backed /dev/shm of each decode pod; must hold "
                            "localSegmentSize plus transfer buffers (default: localSegmentSize "
                            "+ 1Gi). With engine.kind vllm the pod's /dev/shm also gets "
                            "vLLM's share (see engine.kind).", rules=(positive(SHM_WHY),)),
            "drainTimeoutSeconds": drain_timeout("decode"),
        }),
        "store": _role("store", 1),
        "master": _role("master", 1),
    }, default={})


def _rdma() -> Schema:
    return obj(
        "EXPERIMENTAL: RDMA devices for prefill, decode and store pods. In this release KV "
        "still moves over TCP whatever this says (the RDMA transport is untested on hardware "
        "and admission refuses transferProtocol rdma); enabling it only requests the devices, "
        "adds IPC_LOCK (which needs a privileged Pod Security level) and runs the rdma-probe, "
        "whose findings the RDMAReady condition reports. status.kvTransport and the "
        "KVTransport condition say which transport KV really uses.",
        {
            "enabled": boolean("EXPERIMENTAL: request RDMA devices (and IPC_LOCK) for prefill, "
                               "decode and store pods; KV still moves over TCP.",
                               default=False),
            "required": boolean(
                "Fail a pod whose init probe finds no usable RDMA device. When false such pods "
                "start anyway and RDMAReady says which pods found none.", default=False),
            "resourceName": string("Extended resource the RDMA device plugin advertises.",
                                   default="rdma/rdma_shared_device_a",
                                   pattern=corev1.QUALIFIED_NAME, max_length=317),
            "count": integer("Devices of resourceName each data pod requests.", default=1,
                             minimum=1, maximum=64),
            "nodeLabel": string(
                "Node label (value `true`) marking RDMA-capable nodes; pods require it when "
                "rdma.required, and prefer it otherwise.",
                default="feature.node.kubernetes.io/rdma.available",
                pattern=corev1.QUALIFIED_NAME, max_length=317),
            "probeResources": helper_resources(
                "rdma-probe", "requests and limits cpu 100m and memory 64Mi, plus the RDMA "
                "device"),
        },
        default={},
        rules=(rule("!self.required || self.enabled", "rdma.required needs rdma.enabled",
                    field_path=".required"), extended_resource()),
    )


def _store() -> Schema:
    return obj(
        "The KV cache pool (storage nodes and master).",
        {
            "dramPerNode": size("Host DRAM each storage node serves (backed by a Memory "
                                "emptyDir at /dev/shm, so count it in the node's memory).",
                                default="4Gi", rules=(min_dram(),)),
            "ssd": obj("Optional SSD tier: each storage node gets a PersistentVolumeClaim that "
                       "DRAM victims spill to. Immutable once set (StatefulSet volume claim "
                       "templates cannot change).", {
                "storageClassName": string("StorageClass of the claims (cluster default when "
                                           "empty)."),
                "size": size("Size of each node's claim; the node uses 95% of it.",
                             rules=(positive("a PersistentVolumeClaim of 0 bytes is refused"),)),
            }, required=("size",),
                rules=(rule("self == oldSelf", "store.ssd is immutable; create a new cluster "
                            "to change the SSD tier"),)),
            "replicationFactor": integer("Copies of each KV block the pool keeps on distinct "
                                         "nodes (1 = no redundancy).", default=1, minimum=1,
                                         maximum=8),
            "highWatermark": number("Start evicting a segment above this used fraction.",
                                    default=d.HIGH_WATERMARK, minimum=0.05, maximum=1.0),
            "lowWatermark": number("Evict down to this used fraction.", default=d.LOW_WATERMARK,
                                   minimum=0.0, maximum=1.0),
            "blockTokens": integer("Tokens per KV block (part of every block key; changing it "
                                   "invalidates the cache).", default=d.BLOCK_TOKENS, minimum=1,
                                   maximum=4096),
            "tenantQuotas": _tenant_quotas(),
            "fanout": _fanout(),
        },
        default={},
        rules=(
            rule("self.lowWatermark < self.highWatermark",
                 "store.lowWatermark must be below store.highWatermark",
                 field_path=".lowWatermark"),
            rule("!has(oldSelf.ssd) || has(self.ssd)",
                 "store.ssd cannot be removed once set; create a new cluster"),
        ),
    )


def _tenant_quotas() -> Schema:
    quota = obj(
        "One tenant's share of the pool. A tenant over it evicts its own coldest objects (never "
        "another tenant's); a put it cannot make room for is refused (QuotaExceeded).",
        {
            "tenant": string("The tenant, as the API-keys file names it (\"\" = requests "
                             "without a tenant).", pattern=r"^[^\s=,]*$", max_length=128),
            "dram": size("DRAM bytes the tenant's KV may take (every replica counted); unset "
                         "= unlimited."),
            "ssd": size("SSD bytes likewise; unset = unlimited."),
        },
        required=("tenant",),
        rules=(rule("has(self.dram) || has(self.ssd)",
                    "store.tenantQuotas: a tenant's quota needs dram or ssd"),),
    )
    quotas = array("Per-tenant quotas of the KV pool (the master's --tenant-quota); tenants "
                   "not listed are unlimited.", quota, max_items=256)
    quotas["x-kubernetes-validations"] = [rule(
        "self.all(q, self.exists_one(r, r.tenant == q.tenant))",
        "store.tenantQuotas names a tenant more than once")]
    return quotas


def _fanout() -> Schema:
    return obj(
        "Hot-object fan-out (the master's --fanout): an object read often from other hosts "
        "gains replicas near its readers, and loses them first when it cools. Off by default, "
        "as Mooncake ships it.",
        {
            "enabled": boolean("Turn fan-out on.", default=False),
            "threshold": integer("Reads from other hosts within the window that make an object "
                                 "hot.", default=4, minimum=1, maximum=1_000_000),
            "windowSeconds": number("The read-counting window.", default=10.0, minimum=0.1,
                                    maximum=3600.0),
            "maxReplicas": integer("Most replicas fan-out gives one object (its first copies "
                                   "included).", default=4, minimum=2, maximum=16),
        },
    )


def _bounds(name: str, lo: int, hi: int) -> Schema:
    return obj(f"Replica bounds of {name} under the SLO autoscaler.", {
        "minReplicas": integer(f"Fewest {name} pods.", default=lo, minimum=1),
        "maxReplicas": integer(f"Most {name} pods.", default=hi, minimum=1, maximum=1000),
    }, default={}, rules=(rule("self.minReplicas <= self.maxReplicas",
                               f"autoscaling.{name}.minReplicas must not exceed maxReplicas",
                               field_path=".minReplicas"),))


def _autoscaling() -> Schema:
    return obj(
        "The built-in SLO autoscaler for prefill and decode. It reads the Conductor's metrics "
        "(queued tokens per role, predicted TTFT headroom, rejections) and writes the role's "
        "MooncakeRoleScaler; do not point an HPA at a role it manages.",
        {
            "enabled": boolean("Run the SLO autoscaler.", default=False),
            "prefill": _bounds("prefill", 1, 8),
            "decode": _bounds("decode", 1, 8),
            "ratio": obj("Bounds of prefill:decode replicas (prefill divided by decode).", {
                "min": number("Lowest prefill/decode ratio.", default=0.25, minimum=0.01),
                "max": number("Highest prefill/decode ratio.", default=4.0, minimum=0.01),
            }, default={}, rules=(rule("self.min <= self.max",
                                       "autoscaling.ratio.min must not exceed ratio.max",
                                       field_path=".min"),)),
            "targetQueueTokensPerPrefill": integer(
                "Queued prompt tokens per prefill pod the autoscaler aims for.", default=8192,
                minimum=1),
            "targetQueueTokensPerDecode": integer(
                "Decode load per decode pod it aims for, in tokens: the KV tokens the decode "
                "instances hold plus the context tokens of sequences waiting there for a batch "
                "slot (mooncake_conductor_decode_load_tokens).",
                default=16384, minimum=1),
            "maxRejectionRate": number(
                "Fraction of requests rejected (429) above which both roles scale up.",
                default=0.01, minimum=0.0, maximum=1.0),
            "scaleUpStabilizationSeconds": integer(
                "A scale-up must be recommended for this long (the smallest recommendation in "
                "the window wins).", default=30, minimum=0, maximum=3600),
            "scaleDownStabilizationSeconds": integer(
                "A scale-down must be recommended for this long (the largest recommendation in "
                "the window wins).", default=300, minimum=0, maximum=7200),
            "intervalSeconds": integer("How often metrics are read and a decision is made.",
                                       default=15, minimum=5, maximum=600),
        },
        default={},
        rules=(
            rule("double(self.prefill.maxReplicas) >= self.ratio.min * "
                 "double(self.decode.minReplicas)",
                 "autoscaling: prefill.maxReplicas is below ratio.min x decode.minReplicas, so "
                 "no replica count satisfies the ratio bounds"),
            rule("double(self.prefill.minReplicas) <= self.ratio.max * "
                 "double(self.decode.maxReplicas)",
                 "autoscaling: prefill.minReplicas is above ratio.max x decode.maxReplicas, so "
                 "no replica count satisfies the ratio bounds"),
        ),
    )


def _metadata_backend() -> Schema:
    return obj(
        "Where the store master keeps HA state. `embedded` keeps it in the master process (a "
        "restarted master rebuilds from the storage nodes); `redis` adds leader election so "
        "several masters can run.",
        {
            "type": string("Backend kind.", default="embedded", enum=("embedded", "redis")),
            "redisUrlSecret": secret_key_ref("Secret holding the Redis URL "
                                             "(redis://[:password@]host:port/db).", "url"),
        },
        default={},
        rules=(rule("self.type != 'redis' || has(self.redisUrlSecret)",
                    "metadataBackend.type redis needs metadataBackend.redisUrlSecret",
                    field_path=".redisUrlSecret"),),
    )


def _pair_rule(role: str, other: str) -> Schema:
    """A request needs a prefill and a decode pod: 0 of one role with some of the other serves
    nothing (both 0 parks the cluster)."""
    return rule(f"self.roles.{role}.replicas > 0 || self.roles.{other}.replicas == 0",
                f"roles.{role}.replicas is 0 but roles.{other}.replicas is not: every request "
                f"needs a prefill and a decode pod (set both to 0 to park the cluster)",
                field_path=f".roles.{role}.replicas")


def cluster_spec_schema() -> Schema:
    return obj(
        "Desired state of one disaggregated serving cluster: a Conductor (OpenAI API and "
        "global scheduler), prefill and decode pools, and a KV cache pool (store nodes and "
        "master).",
        {
            "image": string("Image carrying the `mooncake` CLI used by every role unless "
                            "overridden.", default=DEFAULT_IMAGE, min_length=1),
            "imagePullPolicy": string("Pull policy of every container.", default="IfNotPresent",
                                      enum=("Always", "IfNotPresent", "Never")),
            "imagePullSecrets": array(
                "Secrets for pulling images, as in a pod: `[{name: regcred}]`. (Plain strings, "
                "accepted before, are refused with this field named in the error.)",
                obj("A reference to a Secret of type kubernetes.io/dockerconfigjson.", {
                    "name": string("Secret name.", pattern=DNS_SUBDOMAIN, max_length=253)},
                    required=("name",)),
                max_items=16),
            "podSecurityContext": obj(
                "Pod identity of every role. Unset (the default), pods set only runAsNonRoot "
                "and the image's USER (10001) applies, which leaves platforms that assign "
                "UIDs (OpenShift's restricted SCC) free to. Set the fields to pin them; set "
                "fsGroup when store.ssd's storage class mounts volumes the pod's user cannot "
                "write (most block-storage classes do).", {
                    "runAsUser": integer("UID every container runs as.", minimum=1,
                                         maximum=2147483647),
                    "runAsGroup": integer("Primary GID of every container.", minimum=0,
                                          maximum=2147483647),
                    "fsGroup": integer("GID that owns mounted volumes.", minimum=0,
                                       maximum=2147483647),
                }),
            "serviceAccountName": string("ServiceAccount the pods run as (the namespace "
                                         "default when empty; pods need no API access).",
                                         pattern=OPTIONAL_DNS_SUBDOMAIN, max_length=253),
            "clusterDomain": string("DNS domain of the Kubernetes cluster.",
                                    default="cluster.local", pattern=DNS_SUBDOMAIN,
                                    max_length=253),
            "model": model_schema(),
            "engine": engine_schema(),
            "roles": _roles(),
            "rdma": _rdma(),
            "transferProtocol": string(
                "How KV bytes move between pods: `auto` uses shared memory within a pod and "
                "TCP between pods (each pod has its own /dev/shm), never RDMA; `tcp` forces "
                "TCP. `rdma` (EXPERIMENTAL) is refused by admission in this release: the RDMA "
                "transport is untested on hardware. status.kvTransport reports the result.",
                default="auto",
                enum=("auto", "rdma", "tcp")),
            "store": _store(),
            "slo": obj("Latency objectives the Conductor admits requests against (it rejects "
                       "with 429 what it predicts would miss them).", {
                "ttftMs": integer("Time-to-first-token objective in milliseconds.",
                                  default=2000, minimum=1),
                "tbtMs": integer("Time-between-tokens objective in milliseconds.",
                                 default=100, minimum=1),
                "tenantFairShare": integer(
                    "Fair admission between tenants: with this many requests in flight on a "
                    "Conductor pod, a tenant holding its max-min fair share of them (this over "
                    "the tenants with requests in flight) is refused with a 429 "
                    "(tenant_share) while other tenants still get in. Unset: off.", minimum=1),
            }, default={}),
            "autoscaling": _autoscaling(),
            "gateway": gateway_schema(),
            "metadataBackend": _metadata_backend(),
            "clusterTokenSecret": secret_key_ref(
                "Secret holding the shared cluster token internal endpoints require. When "
                "unset the operator creates `<name>-cluster-token` once with a random token.",
                "token"),
            "logLevel": string("Log level of every component.", default="info",
                               enum=("debug", "info", "warning", "error")),
            "logFormat": string("Log format of every component.", default="json",
                                enum=("json", "text")),
        },
        default={},
        rules=(
            rule("self.transferProtocol != 'rdma'", RDMA_PROTOCOL_REFUSED,
                 field_path=".transferProtocol"),
            rule("self.transferProtocol != 'rdma' || self.rdma.enabled",
                 "transferProtocol rdma needs rdma.enabled", field_path=".transferProtocol"),
            rule("!self.rdma.enabled || self.transferProtocol != 'tcp'",
                 "rdma.enabled contradicts transferProtocol tcp; use auto or rdma",
                 field_path=".rdma.enabled"),
            rule("self.engine.kind == 'embedded' || has(self.model.huggingFace) || "
                 "has(self.model.pvc) || has(self.model.hostPath) || has(self.model.image)",
                 "engine.kind vllm and sglang need a model source (huggingFace, pvc, hostPath "
                 "or image); the built-in model only runs on the embedded engine",
                 field_path=".model",
                 message_expression="'engine.kind ' + self.engine.kind + ' needs a model "
                                    "source (huggingFace, pvc, hostPath or image); the "
                                    "built-in model only runs on the embedded engine'"),
            rule("self.engine.kind == 'embedded' || "
                 "(has(self.engine.image) && self.engine.image != '') || "
                 "!self.image.contains('@') || ("
                 "has(self.roles.prefill.image) && self.roles.prefill.image != '' && "
                 "has(self.roles.decode.image) && self.roles.decode.image != '')",
                 "spec.image is pinned by digest, so the engine's image variant cannot be "
                 "derived from it; set engine.image",
                 field_path=".engine.image"),
            rule("self.roles.master.replicas == 1 || self.metadataBackend.type == 'redis'",
                 "more than one master needs metadataBackend.type redis (leader election)",
                 field_path=".roles.master.replicas"),
            rule("self.store.replicationFactor <= self.roles.store.replicas",
                 "store.replicationFactor is above roles.store.replicas: every copy of a KV "
                 "block needs its own store node",
                 field_path=".store.replicationFactor",
                 message_expression="'store.replicationFactor ' + "
                                    "string(self.store.replicationFactor) + ' is above "
                                    "roles.store.replicas ' + string(self.roles.store.replicas) "
                                    "+ ': every copy of a KV block needs its own store node'"),
            _pair_rule("prefill", "decode"),
            _pair_rule("decode", "prefill"),
            group_multiple("roles.prefill.replicas"),
            group_engine(),
            group_multiple("autoscaling.prefill.minReplicas", "self.autoscaling.enabled"),
            group_multiple("autoscaling.prefill.maxReplicas", "self.autoscaling.enabled"),
            rule("!self.autoscaling.enabled || (self.roles.prefill.replicas >= "
                 "self.autoscaling.prefill.minReplicas && self.roles.prefill.replicas <= "
                 "self.autoscaling.prefill.maxReplicas)",
                 "roles.prefill.replicas must lie within autoscaling.prefill bounds",
                 field_path=".roles.prefill.replicas"),
            rule("!self.autoscaling.enabled || (self.roles.decode.replicas >= "
                 "self.autoscaling.decode.minReplicas && self.roles.decode.replicas <= "
                 "self.autoscaling.decode.maxReplicas)",
                 "roles.decode.replicas must lie within autoscaling.decode bounds",
                 field_path=".roles.decode.replicas"),
        ),
    )


def cluster_schema() -> Schema:
    """The whole object schema (what goes under `openAPIV3Schema`)."""
    return obj("MooncakeCluster deploys KV-cache-centric disaggregated LLM serving.", {
        "apiVersion": string("API version of this object."),
        "kind": string("Kind of this object."),
        "metadata": {"type": "object"},
        "spec": cluster_spec_schema(),
        "status": cluster_status_schema(ROLES),
    }, required=("spec",), rules=(rule(
        "self.metadata.name.size() <= 40",
        "metadata.name: at most 40 characters (child names and labels append suffixes)"),))


def scaler_schema() -> Schema:
    return obj(
        "MooncakeRoleScaler exposes one role of a MooncakeCluster through the scale "
        "subresource, so HPA, KEDA, `kubectl scale` or the built-in autoscaler can resize it "
        "while the operator stays the only writer of the role's StatefulSet or Deployment.",
        {
            "apiVersion": string("API version of this object."),
            "kind": string("Kind of this object."),
            "metadata": {"type": "object"},
            "spec": obj("Desired replicas of the role.", {
                "clusterName": string("The MooncakeCluster this scaler belongs to.",
                                      pattern=DNS_LABEL, max_length=63),
                "role": string("The role it scales.", enum=ROLES),
                "replicas": integer("Desired pods of the role.", minimum=0, maximum=1000),
            }, required=("clusterName", "role"), rules=(
                rule("self.clusterName == oldSelf.clusterName",
                     "spec.clusterName is immutable", field_path=".clusterName"),
                rule("self.role == oldSelf.role", "spec.role is immutable",
                     field_path=".role"),
            )),
            "status": obj("Observed pods of the role.", {
                "replicas": integer("Pods that exist."),
                "readyReplicas": integer("Pods ready."),
                "selector": string("Label selector of the role's pods (for HPA pod metrics)."),
            }),
        },
        required=("spec",),
    )
