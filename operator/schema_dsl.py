"""The building blocks of the operator's OpenAPI schemas: typed fields with descriptions and
defaults, CEL rules, and the patterns (with readable messages) shared with `corev1.py`.

Pure data: no I/O. `schema.py` composes the `MooncakeCluster` and `MooncakeRoleScaler`
schemas from these.
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.operator import corev1

Schema = dict[str, Any]

SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
# Kubernetes' own name grammars (`corev1` applies the same expressions in Python).
DNS_LABEL = corev1.DNS_LABEL
DNS_SUBDOMAIN = corev1.DNS_SUBDOMAIN
# A name that may also be empty (the field then means "the default").
OPTIONAL_DNS_SUBDOMAIN = "^$|" + corev1.DNS_SUBDOMAIN
OPTIONAL_QUALIFIED_NAME = "^$|" + corev1.QUALIFIED_NAME
# Pattern -> the message `validation` shows instead of "does not match <regex>"; `corev1` words
# the same violations identically, so an error reads the same from either side.
PATTERN_MESSAGES = {
    DNS_SUBDOMAIN: corev1.DNS_SUBDOMAIN_MSG,
    OPTIONAL_DNS_SUBDOMAIN: corev1.DNS_SUBDOMAIN_MSG,
    corev1.QUALIFIED_NAME: corev1.QUALIFIED_NAME_MSG,
    OPTIONAL_QUALIFIED_NAME: corev1.QUALIFIED_NAME_MSG,
    corev1.LABEL_VALUE: corev1.LABEL_VALUE_MSG,
}


def _d(schema: Schema, desc: str, default: Any = None) -> Schema:
    schema["description"] = desc
    if default is not None:
        schema["default"] = default
    return schema


def string(desc: str, *, default: str | None = None, enum: tuple[str, ...] | None = None,
           pattern: str | None = None, min_length: int | None = None,
           max_length: int | None = None) -> Schema:
    s: Schema = {"type": "string"}
    if enum is not None:
        s["enum"] = list(enum)
    if pattern is not None:
        s["pattern"] = pattern
    if min_length is not None:
        s["minLength"] = min_length
    if max_length is not None:
        s["maxLength"] = max_length
    return _d(s, desc, default)


def integer(desc: str, *, default: int | None = None, minimum: int | None = None,
            maximum: int | None = None) -> Schema:
    s: Schema = {"type": "integer"}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return _d(s, desc, default)


def number(desc: str, *, default: float | None = None, minimum: float | None = None,
           maximum: float | None = None) -> Schema:
    s: Schema = {"type": "number"}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return _d(s, desc, default)


def boolean(desc: str, *, default: bool | None = None) -> Schema:
    return _d({"type": "boolean"}, desc, default)


def size(desc: str, *, default: str | None = None, rules: tuple[Schema, ...] = ()) -> Schema:
    """A byte quantity such as `4Gi`; a plain integer is a byte count."""
    s: Schema = {
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": SIZE_PATTERN}],
    }
    if rules:
        s["x-kubernetes-validations"] = list(rules)
    return _d(s, desc, default)


def quantity_map(desc: str) -> Schema:
    """Resource name -> quantity (`500m`, `2`, `1.5Gi`, `1e3`); never negative."""
    return _d({
        "type": "object",
        "additionalProperties": {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer", "minimum": 0},
                      {"type": "string", "pattern": corev1.QUANTITY}],
        },
    }, desc)


def string_map(desc: str, *, value_pattern: str | None = None,
               value_max_length: int | None = None) -> Schema:
    values: Schema = {"type": "string"}
    if value_pattern is not None:
        values["pattern"] = value_pattern
    if value_max_length is not None:
        values["maxLength"] = value_max_length
    return _d({"type": "object", "additionalProperties": values}, desc)


def free_object(desc: str) -> Schema:
    """An object passed through to Kubernetes as written (affinity, pod template overrides)."""
    return _d({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, desc)


def array(desc: str, items: Schema, *, max_items: int | None = None) -> Schema:
    s: Schema = {"type": "array", "items": items}
    if max_items is not None:
        s["maxItems"] = max_items
    return _d(s, desc)


def rule(expr: str, message: str, *, field_path: str | None = None,
         message_expression: str | None = None) -> Schema:
    """A CEL rule. `message_expression` (a CEL string expression) words the error from the
    object; `message` stays as the fallback the API server uses if it fails."""
    r: Schema = {"rule": expr, "message": message}
    if message_expression is not None:
        r["messageExpression"] = message_expression
    if field_path is not None:
        r["fieldPath"] = field_path
    return r


def obj(desc: str, props: dict[str, Schema], *, required: tuple[str, ...] = (),
        default: dict[str, Any] | None = None, rules: tuple[Schema, ...] = ()) -> Schema:
    s: Schema = {"type": "object", "properties": props}
    if required:
        s["required"] = list(required)
    if rules:
        s["x-kubernetes-validations"] = list(rules)
    return _d(s, desc, default)


def secret_key_ref(desc: str, default_key: str) -> Schema:
    return obj(desc, {
        "name": string("Name of a Secret in the cluster's namespace.", pattern=DNS_SUBDOMAIN,
                       max_length=253),
        "key": string("Key inside the Secret.", default=default_key, min_length=1),
    }, required=("name",))


def helper_resources(container: str, defaults: str) -> Schema:
    """Requests and limits of one of the operator's helper containers (no default, so adding
    the field changed no existing spec; the renderer fills in what is left out)."""
    return obj(f"Compute resources of the {container} container; keys left out keep the "
               f"operator's defaults ({defaults}). Every container gets requests and limits, "
               "so namespaces whose ResourceQuota requires them admit the pods.", {
                   "limits": quantity_map("Maximum resources (cpu, memory, ...)."),
                   "requests": quantity_map("Resources the scheduler reserves."),
               })
