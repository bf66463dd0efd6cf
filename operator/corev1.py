"""The API server's rules for the core/v1 pod fields a MooncakeCluster passes through.

A MooncakeCluster carries pod-level fields (resources, nodeSelector, tolerations, affinity,
service account and priority class names) that the operator copies into pod templates. The CRD
can only describe their shape, so without these rules a bad value is admitted, rendered, and
then refused by the API server when the operator applies the StatefulSet, long after the user
left. Here the same rules run first: in `mooncake render` (through `validation.validate_cluster`)
and in the operator (through `render`, which reports them as an InvalidSpec condition).

What is checked, following `k8s.io/kubernetes/pkg/apis/core/validation` and apimachinery's
`util/validation` (rules re-stated here, not copied): DNS-1123 labels and subdomains, qualified
names (label and nodeSelector keys, with an optional DNS prefix), label values, the quantity
grammar, container resource names and values (non-negative, requests <= limits, extended
resources whole and requests == limits), tolerations, and node/pod affinity terms.

Every check returns messages `"<field path>: <what is wrong>"`, never raises on odd input
(a string where a list belongs is itself a message), and knows nothing of MooncakeCluster.
`schema.py` reuses the regular expressions and messages so the CRD and these rules agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from decimal import Decimal, localcontext
from typing import Any

# --------------------------------------------------------------------------------------------
# names

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# The name part of a qualified name, and a label value (which may also be empty).
_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
LABEL_VALUE = rf"^({_NAME_PART})?$"
# A qualified name in one expression (name part at most 63 characters); the prefix's 253
# limit is the one thing a regular expression here does not say.
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

DNS_LABEL_MSG = ("must be a lowercase RFC 1123 label: at most 63 characters, lower case "
                 "alphanumerics or '-', starting and ending with an alphanumeric (e.g. 'my-name')")
DNS_SUBDOMAIN_MSG = ("must be a lowercase RFC 1123 subdomain: at most 253 characters, "
                     "dot-separated labels of lower case alphanumerics or '-', each starting and "
                     "ending with an alphanumeric (e.g. 'example.com')")
LABEL_VALUE_MSG = ("must be a label value: empty, or at most 63 characters of alphanumerics, "
                   "'-', '_' or '.', starting and ending with an alphanumeric")
QUALIFIED_NAME_MSG = ("must be a qualified name: an optional DNS subdomain prefix and '/', then "
                      "at most 63 characters of alphanumerics, '-', '_' or '.', starting and "
                      "ending with an alphanumeric (e.g. 'example.com/my-name')")


def at(path: str, key: str | int) -> str:
    """`path.key` for plain keys, `path[key]` for list indexes and keys such as
    `nvidia.com/gpu` that a dot would make ambiguous."""
    if isinstance(key, int) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def dns1123_label(value: Any, path: str) -> list[str]:
    if not isinstance(value, str) or len(value) > 63 or not re.match(DNS_LABEL, value):
        return [f"{path}: {value!r} {DNS_LABEL_MSG}"]
    return []


def dns1123_subdomain(value: Any, path: str) -> list[str]:
    if not isinstance(value, str) or len(value) > 253 or not re.match(DNS_SUBDOMAIN, value):
        return [f"{path}: {value!r} {DNS_SUBDOMAIN_MSG}"]
    return []


def qualified_name(value: Any, path: str) -> list[str]:
    """A label key, nodeSelector key, taint key or annotation key."""
    if (not isinstance(value, str) or not re.match(QUALIFIED_NAME, value)
            or len(value.rpartition("/")[0]) > 253):
        return [f"{path}: {value!r} {QUALIFIED_NAME_MSG}"]
    return []


def label_value(value: Any, path: str) -> list[str]:
    if not isinstance(value, str) or len(value) > 63 or not re.match(LABEL_VALUE, value):
        return [f"{path}: {value!r} {LABEL_VALUE_MSG}"]
    return []


def label_map(value: Any, path: str) -> list[str]:
    """A label map (also a nodeSelector or matchLabels): qualified keys, label values."""
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping of label keys to values, got {kind_of(value)}"]
    errors: list[str] = []
    for k, v in value.items():
        errors += qualified_name(k, at(path, str(k))) or label_value(v, at(path, str(k)))
    return errors


def annotation_map(value: Any, path: str) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping of annotation keys to strings, got {kind_of(value)}"]
    errors: list[str] = []
    for k, v in value.items():
        errors += qualified_name(k, at(path, str(k)))
        if not isinstance(v, str):
            errors.append(f"{at(path, str(k))}: must be a string, got {kind_of(v)}")
    return errors


# --------------------------------------------------------------------------------------------
# quantities

# The Kubernetes quantity grammar without a sign (no field here may be negative): a decimal
# number, then a binary suffix (Ki..Ei), a decimal one (n, u, m, k, M..E) or an exponent.
QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
_SIGNED = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?"
                     r"[0-9]+)?$")
_SCALE = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
          "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
          "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
          "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
          "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}
QUANTITY_MSG = ("is not a quantity: write a number with an optional suffix (m, k, M, G, T, "
                "Ki, Mi, Gi, Ti, ...) or exponent, such as 500m, 2, 1.5Gi or 1e3")
NEGATIVE_MSG = "must be greater than or equal to 0"


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message says what one looks like."""


def parse_quantity(value: Any) -> Decimal:
    """A quantity (`'500m'`, `'1.5Gi'`, `'1e3'`, `2`) as an exact Decimal; signs allowed.

    Integers and finite floats are accepted because the API server takes JSON numbers too.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise QuantityError(f"{value!r} {QUANTITY_MSG}")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        d = Decimal(repr(value))
        if not d.is_finite():
            raise QuantityError(f"{value!r} {QUANTITY_MSG}")
        return d
    m = _SIGNED.match(value)
    if not m:
        raise QuantityError(f"{value!r} {QUANTITY_MSG}")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 64, 10**9, -(10**9)
        if suffix[:1] in ("e", "E") and len(suffix) > 1:
            exp = int(suffix[1:])
            if abs(exp) > 10**6:
                raise QuantityError(f"{value!r}: exponent out of range")
            d = Decimal(number).scaleb(exp)
        else:
            d = Decimal(number) * _SCALE[suffix]
    return -d if sign == "-" else d


def quantity_errors(value: Any, path: str, *, integer: bool = False) -> list[str]:
    """The value problems the API server reports for one resource quantity."""
    try:
        q = parse_quantity(value)
    except QuantityError as e:
        return [f"{path}: {e}"]
    if q < 0:
        return [f"{path}: {value!r} {NEGATIVE_MSG}"]
    if integer and q != q.to_integral_value():
        return [f"{path}: {value!r} must be an integer"]
    return []


# --------------------------------------------------------------------------------------------
# container resources

STANDARD_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")

# Field names of a core/v1 PodSpec and a meta/v1 ObjectMeta (Kubernetes 1.33; a unit test
# compares them with the published OpenAPI schemas), for catching typos in pod templates.
POD_SPEC_FIELDS = (
    "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
    "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases",
    "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname", "imagePullSecrets",
    "initContainers", "nodeName", "nodeSelector", "os", "overhead", "preemptionPolicy",
    "priority", "priorityClassName", "readinessGates", "resourceClaims", "resources",
    "restartPolicy", "runtimeClassName", "schedulerName", "schedulingGates", "securityContext",
    "serviceAccount", "serviceAccountName", "setHostnameAsFQDN", "shareProcessNamespace",
    "subdomain", "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints",
    "volumes")
OBJECT_META_FIELDS = (
    "annotations", "creationTimestamp", "deletionGracePeriodSeconds", "deletionTimestamp",
    "finalizers", "generateName", "generation", "labels", "managedFields", "name", "namespace",
    "ownerReferences", "resourceVersion", "selfLink", "uid")


def is_extended_resource(name: str) -> bool:
    """A device-plugin style name (`nvidia.com/gpu`): prefixed, and not a kubernetes.io one."""
    prefix = name.partition("/")[0] if "/" in name else ""
    return bool(prefix) and not (prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"))


def _overcommit_allowed(name: str) -> bool:
    return not is_extended_resource(name) and not name.startswith("hugepages-")


def _resource_name_errors(name: Any, path: str) -> list[str]:
    errors = qualified_name(name, path)
    if errors:
        return errors
    if "/" not in name and name not in STANDARD_CONTAINER_RESOURCES and not name.startswith(
            "hugepages-"):
        return [f"{path}: {name!r} is not a container resource: use cpu, memory, "
                "ephemeral-storage, hugepages-<size> or a prefixed extended resource such as "
                "nvidia.com/gpu"]
    if "/" in name and not is_extended_resource(name):
        return [f"{path}: {name!r} is a kubernetes.io resource that containers cannot request"]
    return []


def resource_requirements(value: Any, path: str) -> list[str]:
    """`requests` and `limits` of one container, with the API server's cross-checks."""
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping with requests and limits, got {kind_of(value)}"]
    errors = _unknown(value, path, ("requests", "limits", "claims"))
    parsed: dict[str, dict[str, Decimal]] = {"requests": {}, "limits": {}}
    for part in ("limits", "requests"):
        block = value.get(part)
        if block is None:
            continue
        where = at(path, part)
        if not isinstance(block, Mapping):
            errors.append(f"{where}: must be a mapping of resource names to quantities, "
                          f"got {kind_of(block)}")
            continue
        for name, q in block.items():
            here = at(where, str(name))
            bad = _resource_name_errors(name, here) or quantity_errors(
                q, here, integer=is_extended_resource(str(name)))
            errors += bad
            if not bad:
                parsed[part][str(name)] = parse_quantity(q)
    limits = parsed["limits"]
    for name, req in parsed["requests"].items():
        here = at(at(path, "requests"), name)
        raw_req = value["requests"][name]
        if name in limits and req > limits[name]:
            errors.append(f"{here}: {raw_req!r} must be less than or equal to the {name} limit "
                          f"({value['limits'][name]!r})")
        elif not _overcommit_allowed(name):
            if name not in limits:
                errors.append(f"{here}: {name} cannot be overcommitted; set limits.{name} "
                              "to the same value")
            elif req != limits[name]:
                errors.append(f"{here}: {raw_req!r} must equal the {name} limit "
                              f"({value['limits'][name]!r}); {name} cannot be overcommitted")
    return errors


# --------------------------------------------------------------------------------------------
# tolerations

TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
EMPTY_KEY_NEEDS_EXISTS = ("operator must be Exists when key is empty (an empty key with Exists "
                          "tolerates every taint)")
EXISTS_TAKES_NO_VALUE = "value must be empty when operator is Exists"
SECONDS_NEED_NO_EXECUTE = "effect must be NoExecute when tolerationSeconds is set"


def tolerations(value: Any, path: str) -> list[str]:
    if not isinstance(value, list):
        return [f"{path}: must be a list of tolerations, got {kind_of(value)}"]
    errors: list[str] = []
    for i, t in enumerate(value):
        errors += toleration(t, at(path, i))
    return errors


def toleration(t: Any, path: str) -> list[str]:
    if not isinstance(t, Mapping):
        return [f"{path}: must be a mapping (a core/v1 Toleration), got {kind_of(t)}"]
    errors = _unknown(t, path, ("key", "operator", "value", "effect", "tolerationSeconds"))
    errors += _strings(t, path, ("key", "operator", "value", "effect"))
    if errors:
        return errors
    key, op, val = t.get("key", ""), t.get("operator", "") or "Equal", t.get("value", "")
    if key:
        errors += qualified_name(key, at(path, "key"))
    elif op != "Exists":
        errors.append(f"{at(path, 'operator')}: {EMPTY_KEY_NEEDS_EXISTS}")
    if op == "Equal":
        errors += label_value(val, at(path, "value"))
    elif op == "Exists":
        if val:
            errors.append(f"{at(path, 'value')}: {EXISTS_TAKES_NO_VALUE}")
    else:
        errors.append(f"{at(path, 'operator')}: {op!r} is not one of {_list(TOLERATION_OPERATORS)}")
    effect = t.get("effect", "")
    if effect and effect not in TAINT_EFFECTS:
        errors.append(f"{at(path, 'effect')}: {effect!r} is not one of {_list(TAINT_EFFECTS)}")
    if "tolerationSeconds" in t and t["tolerationSeconds"] is not None:
        secs = t["tolerationSeconds"]
        if isinstance(secs, bool) or not isinstance(secs, int):
            errors.append(f"{at(path, 'tolerationSeconds')}: must be an integer, got "
                          f"{kind_of(secs)}")
        elif effect != "NoExecute":
            errors.append(f"{at(path, 'effect')}: {SECONDS_NEED_NO_EXECUTE}")
    return errors


# --------------------------------------------------------------------------------------------
# affinity

NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
LABEL_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def affinity(value: Any, path: str) -> list[str]:
    """A core/v1 Affinity: node affinity, pod affinity and pod anti-affinity."""
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping (a core/v1 Affinity), got {kind_of(value)}"]
    errors = _unknown(value, path, ("nodeAffinity", "podAffinity", "podAntiAffinity"))
    if "nodeAffinity" in value:
        errors += _node_affinity(value["nodeAffinity"], at(path, "nodeAffinity"))
    for kind in ("podAffinity", "podAntiAffinity"):
        if kind in value:
            errors += _pod_affinity(value[kind], at(path, kind))
    return errors


_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _node_affinity(value: Any, path: str) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping, got {kind_of(value)}"]
    errors = _unknown(value, path, (_REQUIRED, _PREFERRED))
    if _REQUIRED in value:
        req, where = value[_REQUIRED], at(path, _REQUIRED)
        if not isinstance(req, Mapping):
            errors.append(f"{where}: must be a mapping with nodeSelectorTerms, got {kind_of(req)}")
        else:
            errors += _unknown(req, where, ("nodeSelectorTerms",))
            terms, tpath = req.get("nodeSelectorTerms"), at(where, "nodeSelectorTerms")
            if not isinstance(terms, list) or not terms:
                errors.append(f"{tpath}: must list at least one node selector term")
            else:
                for i, term in enumerate(terms):
                    errors += _node_selector_term(term, at(tpath, i), required=True)
    for _, item, where in _items(value, _PREFERRED, path, errors):
        errors += _unknown(item, where, ("weight", "preference"))
        errors += _weight(item, where)
        if "preference" not in item:
            errors.append(f"{at(where, 'preference')}: required")
        else:
            errors += _node_selector_term(item["preference"], at(where, "preference"),
                                          required=False)
    return errors


def _node_selector_term(term: Any, path: str, *, required: bool) -> list[str]:
    if not isinstance(term, Mapping):
        return [f"{path}: must be a mapping with matchExpressions or matchFields, "
                f"got {kind_of(term)}"]
    errors = _unknown(term, path, ("matchExpressions", "matchFields"))
    if required and not term.get("matchExpressions") and not term.get("matchFields"):
        errors.append(f"{path}: an empty term matches no node; give it matchExpressions or "
                      "matchFields")
    for _, expr, where in _items(term, "matchExpressions", path, errors):
        errors += _requirement(expr, where, NODE_OPERATORS)
    for _, expr, where in _items(term, "matchFields", path, errors):
        errors += _requirement(expr, where, ("In", "NotIn"), fields=True)
    return errors


def _requirement(expr: Mapping[str, Any], path: str, operators: tuple[str, ...], *,
                 fields: bool = False, label_values: bool = False) -> list[str]:
    """One matchExpressions (or matchFields) entry: key, operator, and as many values as the
    operator takes."""
    errors = _unknown(expr, path, ("key", "operator", "values"))
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values")
    if fields:
        if key != "metadata.name":
            errors.append(f"{at(path, 'key')}: {key!r} is not supported; matchFields takes "
                          "only metadata.name")
    elif key is None:
        errors.append(f"{at(path, 'key')}: required")
    else:
        errors += qualified_name(key, at(path, "key"))
    vpath = at(path, "values")
    if values is not None and (not isinstance(values, list)
                               or not all(isinstance(v, str) for v in values)):
        return [*errors, f"{vpath}: must be a list of strings, got {kind_of(values)}"]
    n = len(values or [])
    if op not in operators:
        errors.append(f"{at(path, 'operator')}: {op!r} is not one of {_list(operators)}")
    elif fields and n != 1:
        errors.append(f"{vpath}: matchFields takes exactly one value, got {n}")
    elif op in ("In", "NotIn") and n == 0:
        errors.append(f"{vpath}: operator {op} needs at least one value")
    elif op in ("Exists", "DoesNotExist") and n:
        errors.append(f"{vpath}: operator {op} takes no values, got {n}")
    elif op in ("Gt", "Lt"):
        if n != 1:
            errors.append(f"{vpath}: operator {op} takes exactly one value, got {n}")
        elif not re.fullmatch(r"[+-]?[0-9]+", (values or [""])[0]):
            errors.append(f"{at(vpath, 0)}: operator {op} compares integers; "
                          f"{(values or [''])[0]!r} is not one")
    if label_values and op in ("In", "NotIn"):
        for i, v in enumerate(values or []):
            errors += label_value(v, at(vpath, i))
    return errors


def _pod_affinity(value: Any, path: str) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping, got {kind_of(value)}"]
    errors = _unknown(value, path, (_REQUIRED, _PREFERRED))
    for _, term, where in _items(value, _REQUIRED, path, errors):
        errors += _pod_affinity_term(term, where)
    for _, item, where in _items(value, _PREFERRED, path, errors):
        errors += _unknown(item, where, ("weight", "podAffinityTerm"))
        errors += _weight(item, where)
        if not isinstance(item.get("podAffinityTerm"), Mapping):
            errors.append(f"{at(where, 'podAffinityTerm')}: required (a PodAffinityTerm)")
        else:
            errors += _pod_affinity_term(item["podAffinityTerm"], at(where, "podAffinityTerm"))
    return errors


def _pod_affinity_term(term: Mapping[str, Any], path: str) -> list[str]:
    errors = _unknown(term, path, ("labelSelector", "namespaceSelector", "namespaces",
                                   "topologyKey", "matchLabelKeys", "mismatchLabelKeys"))
    if not term.get("topologyKey"):
        errors.append(f"{at(path, 'topologyKey')}: required (a node label such as "
                      "kubernetes.io/hostname)")
    else:
        errors += qualified_name(term["topologyKey"], at(path, "topologyKey"))
    for sel in ("labelSelector", "namespaceSelector"):
        if term.get(sel) is not None:
            errors += label_selector(term[sel], at(path, sel))
    for _, ns, where in _items(term, "namespaces", path, errors, mappings=False):
        errors += dns1123_label(ns, where)
    for keys in ("matchLabelKeys", "mismatchLabelKeys"):
        for _, k, where in _items(term, keys, path, errors, mappings=False):
            errors += qualified_name(k, where)
    return errors


def label_selector(value: Any, path: str) -> list[str]:
    """A metav1 LabelSelector: matchLabels and matchExpressions."""
    if not isinstance(value, Mapping):
        return [f"{path}: must be a mapping (a LabelSelector), got {kind_of(value)}"]
    errors = _unknown(value, path, ("matchLabels", "matchExpressions"))
    if value.get("matchLabels") is not None:
        errors += label_map(value["matchLabels"], at(path, "matchLabels"))
    for _, expr, where in _items(value, "matchExpressions", path, errors):
        errors += _requirement(expr, where, LABEL_OPERATORS, label_values=True)
    return errors


# --------------------------------------------------------------------------------------------
# helpers


def kind_of(value: Any) -> str:
    """How messages name a value's JSON type ("got a string", "got null")."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _list(items: Iterable[str]) -> str:
    return ", ".join(items)


def _unknown(value: Mapping[str, Any], path: str, known: tuple[str, ...]) -> list[str]:
    return [f"{at(path, str(k))}: unknown field (known: {', '.join(known)})"
            for k in value if k not in known]


def _strings(value: Mapping[str, Any], path: str, keys: tuple[str, ...]) -> list[str]:
    return [f"{at(path, k)}: must be a string, got {kind_of(value[k])}"
            for k in keys if value.get(k) is not None and not isinstance(value[k], str)]


def _weight(item: Mapping[str, Any], path: str) -> list[str]:
    w = item.get("weight")
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 100:
        return [f"{at(path, 'weight')}: must be an integer from 1 to 100, got {w!r}"]
    return []


def _items(parent: Mapping[str, Any], key: str, path: str, errors: list[str], *,
           mappings: bool = True) -> Iterable[tuple[int, Any, str]]:
    """The entries of list field `key` (absent or null: none). A non-list, or (with
    `mappings`) an entry that is not a mapping, becomes an error in `errors` and is skipped."""
    value, where = parent.get(key), at(path, key)
    if value is None:
        return []
    if not isinstance(value, list):
        errors.append(f"{where}: must be a list, got {kind_of(value)}")
        return []
    out = []
    for i, v in enumerate(value):
        if mappings and not isinstance(v, Mapping):
            errors.append(f"{at(where, i)}: must be a mapping, got {kind_of(v)}")
        else:
            out.append((i, v, at(where, i)))
    return out
