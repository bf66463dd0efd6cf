"""CEL rules for what `admission.py` also checks in code: the cross-field and quantity rules
that CEL can state, moved into the CRD so `kubectl apply` and a GitOps sync (Argo CD, Flux)
refuse such a spec at once instead of the operator reporting InvalidSpec afterwards.

Each message is the one admission words for the same violation (a test keeps them equal), so
`mooncake render`, which runs both, lists a violation once. The admission rules stay: the
operator re-checks what an older CRD may have let through. The quantity rules use the API
server's quantity library (Kubernetes 1.29+; `validation.py` provides it offline).

Left in code only: label and annotation keys (a CEL rule over map keys costs more than the
API server's CEL budget allows), affinity and pod-template overrides (free-form in the CRD),
and container resources (requests against limits per resource name, over unbounded maps).

Pure data: no I/O.
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.operator.schema_dsl import rule

Schema = dict[str, Any]

_INT_OR_QUANTITY = "(type(self) == int ? {int} : quantity(self).{method}(quantity('{q}')))"
SEGMENT_WHY = "is neither 0 (no segment) nor at least 1Mi, the least a worker serves"
SHM_WHY = "a Memory-backed /dev/shm of 0 bytes leaves no room for transfer buffers"
RDMA_PROTOCOL_REFUSED = (
    "rdma is not deployed by the operator in this release: the RDMA transport is untested on "
    "hardware (try it by hand with a worker's --transfer-protocol rdma); use auto, which moves "
    "KV over shared memory and TCP")


def positive(why: str) -> Schema:
    """A size that must be above 0, for `why`."""
    return rule(_INT_OR_QUANTITY.format(int="self > 0", method="isGreaterThan", q="0"),
                f"must be greater than 0 ({why})")


def min_dram() -> Schema:
    """store.dramPerNode of at least 1Mi; the messageExpression quotes the value as written."""
    why = "is below 1Mi, the least a store node serves (it exits at start with less)"
    return rule("!" + _INT_OR_QUANTITY.format(int=f"self < {1 << 20}", method="isLessThan",
                                              q="1Mi"),
                f"store.dramPerNode {why}",
                message_expression=f"(type(self) == int ? string(self) : \"'\" + self + \"'\")"
                                   f" + ' {why}'")


def extended_resource() -> Schema:
    """rdma.resourceName is a device-plugin name: prefixed, and not a kubernetes.io one."""
    hint = ("is not an extended resource name; device plugins advertise prefixed names such "
            "as rdma/rdma_shared_device_a")
    return rule("self.resourceName.contains('/') && "
                "!self.resourceName.matches('^([^/]*[.])?kubernetes[.]io/')",
                f"rdma.resourceName {hint}", field_path=".resourceName",
                message_expression=f"\"'\" + self.resourceName + \"' {hint}\"")


def segment_size() -> Schema:
    """A worker's localSegmentSize: 0 (none) or at least 1Mi (the worker refuses between);
    the messageExpression quotes the value as written."""
    small = _INT_OR_QUANTITY.format(int=f"self < {1 << 20}", method="isLessThan", q="1Mi")
    zero = "(type(self) == int ? self == 0 : quantity(self).sign() == 0)"
    return rule(f"{zero} || !{small}", f"localSegmentSize {SEGMENT_WHY}",
                message_expression=f"(type(self) == int ? string(self) : \"'\" + self + \"'\")"
                                   f" + ' {SEGMENT_WHY}'")


# Prefill pipeline groups (`roles.prefill.pipelineGroupSize`): CEL rules with admission's words.
GROUP_SIZE = "roles.prefill.pipelineGroupSize"
GROUP_MULTIPLE_WHY = ("every group of pipelineGroupSize consecutive pods is one pipeline, so "
                      "a remainder would be a group with a missing stage")
GROUP_ENGINE_WHY = (
    "needs engine.kind embedded: the vllm and sglang workers do not run a pipeline stage yet "
    "(pipeline parallelism of those engines needs a headless worker mode, see "
    "docs/engines.md); use 1 (the default) with them")


def group_multiple(field: str, guard: str = "") -> Schema:
    """`field` (an integer under spec) is a whole number of prefill groups (only where the CEL
    `guard` holds, when one is given)."""
    size = f"self.{GROUP_SIZE}"
    check = f"self.{field} % {size} == 0"
    return rule(f"!({guard}) || {check}" if guard else check,
                f"{field} must be a multiple of {GROUP_SIZE}: {GROUP_MULTIPLE_WHY}",
                field_path=f".{field}",
                message_expression=(f"'{field} ' + string(self.{field}) + ' must be a multiple "
                                    f"of {GROUP_SIZE} ' + string({size}) + ': "
                                    f"{GROUP_MULTIPLE_WHY}'"))


def group_engine() -> Schema:
    """Pipeline groups only on the embedded engine."""
    return rule(f"self.{GROUP_SIZE} == 1 || self.engine.kind == 'embedded'",
                f"{GROUP_SIZE} above 1 {GROUP_ENGINE_WHY}", field_path=f".{GROUP_SIZE}",
                message_expression=(f"'{GROUP_SIZE} ' + string(self.{GROUP_SIZE}) + ' with "
                                    f"engine.kind ' + self.engine.kind + ' {GROUP_ENGINE_WHY}'"))
