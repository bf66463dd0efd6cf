"""The `MooncakeCluster` status schema: what the operator writes back (conditions, per-role
replicas, store usage, RDMA probe results, the autoscaler's last decision).

Pure data, composed into the whole object by `schema.cluster_schema`.
"""

from __future__ import annotations

from mooncake_k8s.operator.schema_dsl import Schema, array, integer, number, obj, string


def _condition() -> Schema:
    return obj("A condition of the cluster.", {
        "type": string("Ready, Progressing, Degraded, KVStoreReady, KVTransport, Reconciling, "
                       "Stalled or RDMAReady (the last only with rdma.enabled)."),
        "status": string("True, False or Unknown.", enum=("True", "False", "Unknown")),
        "reason": string("CamelCase reason for the last transition."),
        "message": string("Human-readable detail."),
        "lastTransitionTime": string("When status last changed (RFC 3339)."),
        "observedGeneration": integer("metadata.generation this condition was computed for."),
    }, required=("type", "status"))


def _role_status() -> Schema:
    return obj("Observed state of one role.", {
        "replicas": integer("Pods desired now (after autoscaling)."),
        "readyReplicas": integer("Pods ready."),
        "updatedReplicas": integer("Pods running the current revision."),
        "revision": string("Hash of the role's current pod template (label "
                           "`mooncake.io/revision`)."),
    })


def _store_status() -> Schema:
    """status.store: the pool's usage and each quota'd tenant's, from the master's metrics."""
    return obj("KV cache pool usage, read from the master's metrics.", {
        "capacityBytes": integer("Total bytes of all segments (DRAM and SSD)."),
        "usedBytes": integer("Bytes allocated to KV blocks."),
        "hitRate": number("Fraction of block lookups that hit since the master started."),
        "tenants": array("Per tenant with a quota (spec.store.tenantQuotas): what it "
                         "holds against it.", obj("One tenant.", {
                             "tenant": string("The tenant."),
                             "dramUsedBytes": integer("DRAM bytes it holds (every "
                                                      "replica)."),
                             "ssdUsedBytes": integer("SSD bytes it holds."),
                             "dramQuotaBytes": integer("Its DRAM quota (absent: "
                                                       "unlimited)."),
                             "ssdQuotaBytes": integer("Its SSD quota (absent: unlimited)."),
                             "evictions": integer("Its own objects evicted to keep it "
                                                  "within its quota."),
                             "refusals": integer("Puts refused as over its quota."),
                         }), max_items=256),
    })


def _prefill_groups_status() -> Schema:
    """status.prefillGroups: the pipeline groups the prefill replicas make."""
    return obj("Prefill pipeline groups (roles.prefill.pipelineGroupSize above 1): the "
               "Conductor routes only to whole ones.", {
        "size": integer("Pods (stages) per group."),
        "total": integer("Groups the prefill replicas make."),
        "whole": integer("Groups whose every stage is ready."),
        "restarts": integer("Groups the operator restarted together since it started "
                            "(a stage restarted alone, so its peers were deleted)."),
    })


def cluster_status_schema(roles: tuple[str, ...]) -> Schema:
    """The status of a cluster whose pods play `roles`."""
    s = obj("Observed state, written by the operator.", {
        "observedGeneration": integer("metadata.generation the operator last applied."),
        "conditions": array("Ready, Progressing, Degraded, KVStoreReady, KVTransport (how KV "
                            "moves between pods: reason Tcp or Rdma) and, with rdma.enabled, "
                            "RDMAReady (EXPERIMENTAL: which devices the pods see). Reconciling "
                            "and Stalled are kstatus' pair for Flux and other GitOps tools: "
                            "Stalled=True (reason InvalidSpec) when only a spec change can help, "
                            "Reconciling=True while the cluster moves toward its spec.",
                            _condition(), max_items=16),
        "roles": obj("Per-role replicas.", {r: _role_status() for r in roles}),
        "servingRevision": string("Revision prefill and decode pair on (label "
                                  "`mooncake.io/serving-revision`, env MOONCAKE_REVISION)."),
        "store": _store_status(),
        "kvTransport": string("How KV moves between pods: `tcp`, or `rdma` (EXPERIMENTAL; "
                              "admission refuses it in this release).", enum=("tcp", "rdma")),
        "rdma": obj("EXPERIMENTAL, with rdma.enabled: what the rdma-probe init containers found "
                    "(devices the pods see; KV does not use them, see kvTransport).", {
            "podsWithDevices": integer("Data pods whose probe found an active device."),
            "podsWithoutDevices": integer("Data pods whose probe found none (TCP)."),
            "devices": array("Distinct device names seen.", string("Device name."),
                             max_items=64),
        }),
        "autoscaling": obj("The SLO autoscaler's last decision.", {
            "prefill": integer("Prefill replicas it chose."),
            "decode": integer("Decode replicas it chose."),
            "reason": string("Why."),
            "time": string("When (RFC 3339)."),
        }),
        "prefillGroups": _prefill_groups_status(),
        "endpoint": string("In-cluster URL of the OpenAI-compatible API."),
    })
    conditions = s["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return s
