"""MooncakeCluster rules the CRD cannot state: pod fields under Kubernetes' own rules, and
cross-field rules on quantities.

The OpenAPI schema and its CEL rules (`schema.py`) catch shapes, enums and simple comparisons.
What is left needs code: label and nodeSelector keys (a CEL rule over map keys would cost more
than the API server's CEL budget allows), affinity (kept free-form in the CRD because its
schema is huge) and container resources compared with each other. The size and RDMA rules
below are also CEL rules in the CRD (`schema_cel.py`, same messages), so the API server
refuses those specs at apply time; they stay here for clusters whose CRD is older.

Two callers, one list of messages `"spec.<field path>: <what is wrong>"`:
`validation.validate_cluster` (so `mooncake render` rejects the resource before printing
anything) and `render.render` (so the operator, which only has the API server's checks in front
of it, reports an InvalidSpec condition instead of applying pods the API server or the
programs would refuse).
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any

from mooncake_k8s.operator import corev1, naming, pods_sizing, schema_gateway
from mooncake_k8s.operator.schema import ROLES
from mooncake_k8s.operator.schema_cel import (
    GROUP_ENGINE_WHY,
    GROUP_MULTIPLE_WHY,
    GROUP_SIZE,
    SEGMENT_WHY,
)

Obj = dict[str, Any]

# `mooncake store node --dram-size` refuses less than this, and a worker's
# --local-segment-size anything between 0 (none) and this.
MIN_DRAM_PER_NODE = 1 << 20


def metadata_errors(meta: Any) -> list[str]:
    """What the API server checks in a MooncakeCluster's ObjectMeta before the CRD's schema."""
    if not isinstance(meta, dict):
        return [f"metadata: must be a mapping with at least a name, got {corev1.kind_of(meta)}"]
    errors: list[str] = []
    if "name" not in meta or meta["name"] in (None, ""):
        errors.append("metadata.name: required")
    else:
        errors += corev1.dns1123_label(meta["name"], "metadata.name")
    if meta.get("namespace") not in (None, ""):
        errors += corev1.dns1123_label(meta["namespace"], "metadata.namespace")
    if meta.get("labels") is not None:
        errors += corev1.label_map(meta["labels"], "metadata.labels")
    if meta.get("annotations") is not None:
        errors += corev1.annotation_map(meta["annotations"], "metadata.annotations")
    return errors


def spec_errors(spec: Obj) -> list[str]:
    """Every rule below violated by a defaulted spec that passed the CRD's schema."""
    errors: list[str] = []
    if spec.get("serviceAccountName"):
        errors += corev1.dns1123_subdomain(spec["serviceAccountName"], "spec.serviceAccountName")
    if spec.get("clusterDomain") is not None:
        errors += corev1.dns1123_subdomain(spec["clusterDomain"], "spec.clusterDomain")
    roles = spec.get("roles") or {}
    for role in ROLES:
        if isinstance(roles.get(role), dict):
            errors += _role_errors(roles[role], f"spec.roles.{role}")
    service = (roles.get("conductor") or {}).get("service") or {}
    if service.get("annotations") is not None:
        errors += corev1.annotation_map(service["annotations"],
                                     "spec.roles.conductor.service.annotations")
    errors += _rdma_errors(spec.get("rdma") or {})
    if spec.get("transferProtocol") == "rdma":
        # Still refused although an RDMA transport now exists: it is untested on hardware, and
        # a cluster manifest is where production traffic is decided, so the operator does not
        # deploy it. Pods on nodes without a device would also refuse it at start and
        # crash-loop. Trying it stays possible by hand (`--transfer-protocol rdma`).
        errors.append("spec.transferProtocol: rdma is not deployed by the operator in this "
                      "release: the RDMA transport is untested on hardware (try it by hand "
                      "with a worker's --transfer-protocol rdma); use auto, which moves KV "
                      "over shared memory and TCP")
    errors += _size_errors(spec)
    errors += _group_errors(spec)
    errors += gateway_errors(spec.get("gateway"))
    return errors


def gateway_errors(gateway: Any) -> list[str]:
    """spec.gateway: the CRD's CEL rules again (an older CRD may lack them), and what no
    pattern states readably: Gateway API refuses IP addresses as hostnames."""
    if not isinstance(gateway, dict):
        return []
    errors: list[str] = []
    refs = [r for r in gateway.get("parentRefs") or [] if isinstance(r, dict)]
    if schema_gateway.parents_error(refs):
        errors.append(f"spec.gateway.parentRefs: {schema_gateway.DUPLICATE_PARENT}")
    hosts = [h for h in gateway.get("hostnames") or [] if isinstance(h, str)]
    if len(set(hosts)) != len(hosts):
        errors.append(f"spec.gateway.hostnames: {schema_gateway.DUPLICATE_HOSTNAME}")
    for i, host in enumerate(hosts):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            continue
        errors.append(f"spec.gateway.hostnames[{i}]: {host!r} is an IP address; Gateway API "
                      "hostnames are DNS names (leave hostnames unset to match any)")
    return errors


def group_size(spec: Obj) -> int:
    """roles.prefill.pipelineGroupSize (1 where an older CRD did not default it)."""
    value = ((spec.get("roles") or {}).get("prefill") or {}).get("pipelineGroupSize")
    return value if isinstance(value, int) and value >= 1 else 1


def _group_errors(spec: Obj) -> list[str]:
    """Prefill pipeline groups: whole groups only, on the embedded engine (the CRD's CEL rules
    say the same; they stay here for clusters whose CRD is older)."""
    size = group_size(spec)
    if size == 1:
        return []
    errors: list[str] = []
    roles, scaling = spec.get("roles") or {}, spec.get("autoscaling") or {}
    counts = [("roles.prefill.replicas", (roles.get("prefill") or {}).get("replicas"))]
    if scaling.get("enabled"):
        bounds = scaling.get("prefill") or {}
        counts += [(f"autoscaling.prefill.{k}", bounds.get(k))
                   for k in ("minReplicas", "maxReplicas")]
    for field, value in counts:
        if isinstance(value, int) and value % size:
            errors.append(f"spec.{field}: {field} {value} must be a multiple of {GROUP_SIZE} "
                          f"{size}: {GROUP_MULTIPLE_WHY}")
    kind = (spec.get("engine") or {}).get("kind", "embedded")
    if kind != "embedded":
        errors.append(f"spec.{GROUP_SIZE}: {GROUP_SIZE} {size} with engine.kind {kind} "
                      f"{GROUP_ENGINE_WHY}")
    return errors


def _role_errors(role: Obj, path: str) -> list[str]:
    errors: list[str] = []
    if role.get("resources") is not None:
        errors += corev1.resource_requirements(effective_resources(role["resources"]),
                                               f"{path}.resources")
    if role.get("nodeSelector") is not None:
        errors += corev1.label_map(role["nodeSelector"], f"{path}.nodeSelector")
    if role.get("tolerations") is not None:
        errors += corev1.tolerations(role["tolerations"], f"{path}.tolerations")
    if role.get("affinity") is not None:
        errors += corev1.affinity(role["affinity"], f"{path}.affinity")
    if role.get("priorityClassName"):
        errors += corev1.dns1123_subdomain(role["priorityClassName"],
                                           f"{path}.priorityClassName")
    if role.get("podTemplate") is not None:
        errors += _pod_template_errors(role["podTemplate"], f"{path}.podTemplate")
    return errors


def effective_resources(resources: Any) -> Any:
    """The role's resources as the container will get them: a GPU written only under
    requests is also put under limits (see `pods_sizing.container_resources`), so it is no
    error here."""
    if not isinstance(resources, dict) or not isinstance(resources.get("requests"), dict):
        return resources
    out = copy.deepcopy(resources)
    gpus = {k: v for k, v in out["requests"].items() if pods_sizing.is_gpu_resource(str(k))}
    if gpus:
        limits = out.setdefault("limits", {})
        if isinstance(limits, dict):
            for k, v in gpus.items():
                limits.setdefault(k, v)
    return out


def _pod_template_errors(tpl: Any, path: str) -> list[str]:
    """The pod-level fields of a podTemplate override, checked like the role's own. Fields the
    override may set that no rule here covers go to the API server as written."""
    if not isinstance(tpl, dict):
        return [f"{path}: must be a mapping (a partial PodTemplateSpec), got "
                f"{corev1.kind_of(tpl)}"]
    errors = [f"{corev1.at(path, str(k))}: unknown field (known: metadata, spec)"
              for k in tpl if k not in ("metadata", "spec")]
    meta, spec = tpl.get("metadata"), tpl.get("spec")
    for key in ("metadata", "spec"):  # null would replace the rendered one, not merge into it
        if key in tpl and tpl[key] is None:
            errors.append(f"{path}.{key}: must be a mapping, got null")
    if meta is not None:
        if not isinstance(meta, dict):
            errors.append(f"{path}.metadata: must be a mapping, got {corev1.kind_of(meta)}")
        else:
            errors += [f"{corev1.at(path + '.metadata', str(k))}: unknown field of an ObjectMeta"
                       for k in meta if k not in corev1.OBJECT_META_FIELDS]
            if meta.get("labels") is not None:
                errors += corev1.label_map(meta["labels"], f"{path}.metadata.labels")
            if meta.get("annotations") is not None:
                errors += corev1.annotation_map(meta["annotations"], f"{path}.metadata.annotations")
    if spec is None:
        return errors
    if not isinstance(spec, dict):
        return [*errors, f"{path}.spec: must be a mapping (a partial PodSpec), got "
                         f"{corev1.kind_of(spec)}"]
    where = f"{path}.spec"
    errors += [f"{corev1.at(where, str(k))}: unknown field of a PodSpec (`kubectl explain "
               "pod.spec` lists them)" for k in spec if k not in corev1.POD_SPEC_FIELDS]
    for key, check in (("nodeSelector", corev1.label_map), ("tolerations", corev1.tolerations),
                       ("affinity", corev1.affinity),
                       ("priorityClassName", corev1.dns1123_subdomain),
                       ("serviceAccountName", corev1.dns1123_subdomain)):
        value = spec.get(key)
        if value is not None and (value != "" or not key.endswith("Name")):
            errors += check(value, f"{where}.{key}")
    for key in ("containers", "initContainers"):
        if key not in spec:
            continue
        items = spec[key]
        if not isinstance(items, list):
            errors.append(f"{where}.{key}: must be a list, got {corev1.kind_of(items)}")
            continue
        for i, c in enumerate(items):
            if not isinstance(c, dict):
                errors.append(f"{where}.{key}[{i}]: must be a mapping, got {corev1.kind_of(c)}")
            elif c.get("resources") is not None:
                errors += corev1.resource_requirements(c["resources"],
                                                       f"{where}.{key}[{i}].resources")
    return errors


def _rdma_errors(rdma: Obj) -> list[str]:
    errors: list[str] = []
    name = rdma.get("resourceName")
    if isinstance(name, str) and not corev1.is_extended_resource(name):
        errors.append(f"spec.rdma.resourceName: {name!r} is not an extended resource name; "
                      "device plugins advertise prefixed names such as "
                      "rdma/rdma_shared_device_a")
    elif name is not None:
        errors += corev1.qualified_name(name, "spec.rdma.resourceName")
    if rdma.get("nodeLabel") is not None:
        errors += corev1.qualified_name(rdma["nodeLabel"], "spec.rdma.nodeLabel")
    return errors


def _size_errors(spec: Obj) -> list[str]:
    """Sizes that must not be zero (or too small for the program that gets them)."""
    errors: list[str] = []
    store = spec.get("store") or {}
    dram = _bytes(store.get("dramPerNode"))
    if dram is not None and dram < MIN_DRAM_PER_NODE:
        errors.append(f"spec.store.dramPerNode: {store['dramPerNode']!r} is below 1Mi, the "
                      "least a store node serves (it exits at start with less)")
    positive = [("spec.store.ssd.size", (store.get("ssd") or {}).get("size"),
                 "a PersistentVolumeClaim of 0 bytes is refused"),
                ("spec.model.huggingFace.cacheSize",
                 ((spec.get("model") or {}).get("huggingFace") or {}).get("cacheSize"),
                 "the model cannot be downloaded into 0 bytes"),
                ("spec.engine.sidecar.stagingSize",
                 ((spec.get("engine") or {}).get("sidecar") or {}).get("stagingSize"),
                 "the sidecar cannot stage KV blocks in 0 bytes")]
    roles = spec.get("roles") or {}
    for role in ("prefill", "decode"):
        seg = (roles.get(role) or {}).get("localSegmentSize")
        if _bytes(seg) is not None and 0 < (_bytes(seg) or 0) < MIN_DRAM_PER_NODE:
            errors.append(f"spec.roles.{role}.localSegmentSize: {seg!r} {SEGMENT_WHY}")
        positive.append((f"spec.roles.{role}.shmSize", (roles.get(role) or {}).get("shmSize"),
                         "a Memory-backed /dev/shm of 0 bytes leaves no room for transfer "
                         "buffers"))
    for path, value, why in positive:
        if _bytes(value) == 0:
            errors.append(f"{path}: must be greater than 0 ({why})")
    return errors


def _bytes(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return naming.parse_bytes(value)
    except (ValueError, TypeError):
        return None  # not a size: the schema reports it
