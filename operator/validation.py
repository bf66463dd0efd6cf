"""Offline admission for MooncakeCluster: defaulting, OpenAPI validation and CEL rules.

The API server defaults, validates and evaluates `x-kubernetes-validations` before the operator
ever sees an object. `mooncake render -f` has no API server, so it runs the same three steps here
from the same schema; that is also how the unit tests prove each CEL rule rejects what it should.
Unknown fields are reported (as kubectl's strict field validation does) instead of silently
pruned, so typos surface.

After the schema, `admission` adds the rules the CRD cannot state (pod fields under
Kubernetes' own rules, quantities compared with each other); `validate_cluster` reports them
with the schema's errors, each as `<field path>: <message>`.

Called by `cli.render` and the tests; the operator itself trusts the API server (and `render`
re-runs the `admission` rules, which the API server does not know).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import celpy
import jsonschema
from celpy import celtypes
from celpy.adapter import json_to_cel

from mooncake_k8s.operator import admission, corev1
from mooncake_k8s.operator import schema as sch
from mooncake_k8s.operator.schema_dsl import PATTERN_MESSAGES

Schema = dict[str, Any]


class InvalidResource(ValueError):
    """The resource would be rejected by the API server; `errors` lists every reason."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def apply_defaults(s: Schema, value: Any) -> Any:
    """Fill missing fields from `default`, top-down, the way the API server does."""
    if isinstance(value, dict):
        props: dict[str, Schema] = s.get("properties", {})
        out = dict(value)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            for key in out:
                if key not in props:
                    out[key] = apply_defaults(extra, out[key])
        return out
    if isinstance(value, list) and isinstance(s.get("items"), dict):
        return [apply_defaults(s["items"], v) for v in value]
    return value


def _path(parts: Iterator[Any] | list[Any]) -> str:
    """`spec.roles.prefill.tolerations[0]`, `...nodeSelector[kubernetes.io/os]`: the same
    spelling `corev1` uses, so one field reads the same in every message."""
    out = ""
    for p in parts:
        out = corev1.at(out, p if isinstance(p, int) else str(p))
    return out or "<root>"


def _structural_errors(s: Schema, value: Any) -> list[str]:
    errors = []
    for e in sorted(jsonschema.Draft202012Validator(s).iter_errors(value),
                    key=lambda e: list(map(str, e.absolute_path))):
        where = _path(list(e.absolute_path))
        if e.validator == "anyOf" and e.schema.get("x-kubernetes-int-or-string"):
            msg = _int_or_string_message(e.schema, e.instance)
        elif e.validator == "pattern" and e.validator_value in PATTERN_MESSAGES:
            msg = f"{e.instance!r} {PATTERN_MESSAGES[e.validator_value]}"
        elif e.validator == "pattern":
            msg = f"{e.instance!r} does not match {e.validator_value}"
        elif e.validator == "type" and e.instance is None:
            msg = f"null is not of type {e.validator_value!r}"
        else:
            msg = e.message
        errors.append(f"{where}: {msg}")
    return errors


def _int_or_string_message(s: Schema, value: Any) -> str:
    """Why an int-or-string value failed: a byte size, or a resource quantity."""
    patterns = [b.get("pattern") for b in s.get("anyOf", ()) if b.get("type") == "string"]
    if corev1.QUANTITY not in patterns:
        return f"{value!r} is not a size; use a byte count or a quantity such as 4Gi"
    problems = corev1.quantity_errors(value, "")
    if problems:
        return problems[0].removeprefix(": ")
    # A quantity the API server's int-or-string schema still refuses: a YAML float.
    return (f"{value!r} must be an integer or a quoted quantity such as '500m' or "
            f"'{value}'")


def _unknown_fields(s: Schema, value: Any, path: list[Any]) -> Iterator[str]:
    if s.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict) and "properties" in s:
        props = s["properties"]
        for key, v in value.items():
            if key not in props:
                yield f"{_path([*path, key])}: unknown field (known: {', '.join(props)})"
            else:
                yield from _unknown_fields(props[key], v, [*path, key])
    elif isinstance(value, list) and isinstance(s.get("items"), dict):
        for i, v in enumerate(value):
            yield from _unknown_fields(s["items"], v, [*path, i])


def to_cel(s: Schema, value: Any) -> Any:
    """Type a JSON value as CEL sees it under the schema (`number` is always a double)."""
    if value is None:
        return None
    if s.get("x-kubernetes-int-or-string"):
        return celtypes.IntType(value) if isinstance(value, int) else celtypes.StringType(value)
    t = s.get("type")
    if t == "object" and isinstance(value, dict):
        props: dict[str, Schema] = s.get("properties", {})
        extra = s.get("additionalProperties")
        out = {}
        for k, v in value.items():
            sub = props.get(k) or (extra if isinstance(extra, dict) else None)
            out[celtypes.StringType(k)] = to_cel(sub, v) if sub else json_to_cel(v)
        return celtypes.MapType(out)
    if t == "array" and isinstance(value, list):
        return celtypes.ListType([to_cel(s.get("items", {}), v) for v in value])
    if t == "number":
        return celtypes.DoubleType(float(value))
    if t == "integer":
        return celtypes.IntType(value)
    return json_to_cel(value)


class Quantity:
    """A value of the API server's CEL quantity type (`quantity('1Gi')`, Kubernetes 1.29+),
    the part of that library the CRD's rules use: comparisons, exactly (Decimal)."""

    def __init__(self, text: str) -> None:
        self.text, self.value = text, corev1.parse_quantity(text)


def _quantity(text: Any) -> Quantity:
    if not isinstance(text, str):
        raise TypeError(f"quantity() takes a string, got {corev1.kind_of(text)}")
    return Quantity(str(text))


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        _quantity(text)
    except (TypeError, ValueError):
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _compare(a: Quantity, b: Quantity) -> int:
    return (a.value > b.value) - (a.value < b.value)


# Kubernetes' quantity library (k8s.io/apiserver/pkg/cel/library), which cel-python lacks. A
# member call `q.isLessThan(r)` reaches these as `isLessThan(q, r)`.
CEL_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b) < 0),
    "compareTo": lambda a, b: celtypes.IntType(_compare(a, b)),
    "sign": lambda a: celtypes.IntType((a.value > 0) - (a.value < 0)),
}


@functools.lru_cache(maxsize=256)
def _program(expr: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expr), functions=CEL_FUNCTIONS)


def _message(r: Schema, act: dict[str, Any]) -> str:
    """The rule's messageExpression when it evaluates to a non-empty string, else its message
    (the API server's fallback order)."""
    if "messageExpression" in r:
        text = _program(r["messageExpression"]).evaluate(act)
        if isinstance(text, str) and text.strip():
            return str(text)
    return str(r["message"])


def _cel_errors(s: Schema, value: Any, old: Any, path: list[Any]) -> Iterator[str]:
    for r in s.get("x-kubernetes-validations", ()):
        transition = re.search(r"\boldSelf\b", r["rule"]) is not None
        if transition and old is None:
            continue  # transition rules only run on updates where the old value exists
        act = {"self": to_cel(s, value)}
        if transition:
            act["oldSelf"] = to_cel(s, old)
        result = _program(r["rule"]).evaluate(act)
        if isinstance(result, Exception) or not bool(result):
            where = _path([*path, *[p for p in r.get("fieldPath", "").split(".") if p]])
            detail = f" (rule error: {result})" if isinstance(result, Exception) else ""
            yield f"{where}: {_message(r, act)}{detail}"
    if isinstance(value, dict):
        props: dict[str, Schema] = s.get("properties", {})
        for key, sub in props.items():
            if key in value:
                o = old.get(key) if isinstance(old, dict) else None
                yield from _cel_errors(sub, value[key], o, [*path, key])
    elif isinstance(value, list) and isinstance(s.get("items"), dict):
        # Items of a plain list have no old counterpart: their transition rules do not run.
        for i, v in enumerate(value):
            yield from _cel_errors(s["items"], v, None, [*path, i])


def validate(s: Schema, obj: dict[str, Any], old: dict[str, Any] | None = None,
             extra: Callable[[dict[str, Any]], list[str]] | None = None) -> dict[str, Any]:
    """Default `obj` and return it, or raise `InvalidResource` listing every violation.

    `extra` adds rules outside the schema; like CEL rules they run only on an object whose
    structure is valid. A violation both sides word identically is listed once.
    """
    defaulted: dict[str, Any] = apply_defaults(s, obj)
    errors = list(_unknown_fields(s, defaulted, []))
    errors += _structural_errors(s, defaulted)
    if not errors:
        old_d = apply_defaults(s, old) if old is not None else None
        errors += list(_cel_errors(s, defaulted, old_d, []))
        if extra is not None:
            errors += extra(defaulted)
    if errors:
        raise InvalidResource(list(dict.fromkeys(errors)))
    return defaulted


def validate_cluster(obj: Any, old: dict[str, Any] | None = None) -> dict[str, Any]:
    """Admit a MooncakeCluster as the API server would (defaults applied to the result), plus
    the `admission` rules. Any input, even one that is not a mapping, ends in a result or an
    `InvalidResource`."""
    if not isinstance(obj, dict):
        raise InvalidResource([f"<root>: a MooncakeCluster is a mapping with apiVersion, kind, "
                               f"metadata and spec, got {corev1.kind_of(obj)}"])
    api = f"{sch.GROUP}/{sch.VERSION}"
    errors = []
    if obj.get("apiVersion") != api:
        errors.append(f"apiVersion: {obj.get('apiVersion')!r} is not served here; expected "
                      f"apiVersion {api}")
    if obj.get("kind") != "MooncakeCluster":
        errors.append(f"kind: {obj.get('kind')!r} is not served here; expected kind "
                      "MooncakeCluster")
    if errors:
        raise InvalidResource(errors)  # another kind: its spec means nothing here
    errors = admission.metadata_errors(obj.get("metadata"))
    if not isinstance((obj.get("metadata") or {}).get("name"), str):
        raise InvalidResource(errors)  # the schema's rules read metadata.name
    try:
        defaulted = validate(sch.cluster_schema(), obj, old,
                             lambda c: admission.spec_errors(c["spec"]))
    except InvalidResource as e:
        raise InvalidResource(errors + e.errors) from None
    if errors:
        raise InvalidResource(errors)
    return defaulted
