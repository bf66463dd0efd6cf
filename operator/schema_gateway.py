"""Schema parts for pods that come and go: `spec.gateway` (a Gateway API HTTPRoute to the
Conductor) and the workers' drain timeout (`roles.prefill|decode.drainTimeoutSeconds`).

Kept beside `schema.py` (which is near its size limit) and read by it. The shapes follow
Gateway API v1's own rules for a ParentReference and a Hostname, so a spec this schema admits
renders an HTTPRoute the Gateway API CRD admits; the rules CEL states here are also checked in
code by `admission.gateway_errors` (same messages) for clusters whose CRD is older.

Pure data: no I/O.
"""

from __future__ import annotations

from typing import Any

from mooncake_k8s.operator.schema_dsl import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    array,
    integer,
    obj,
    rule,
    string,
)

Schema = dict[str, Any]

DRAIN_DEFAULT_S = 30
"""The worker's own default (`WorkerConfig.drain_timeout_s`)."""
DRAIN_MARGIN_S = 15
"""Pod grace beyond the drain: the worker stops its servers, engine and segment after the
drain ends (vLLM's process takes seconds to exit), and the kubelet's SIGKILL must not cut it."""
MAX_PARENT_REFS = 32  # Gateway API's own bound on HTTPRoute.spec.parentRefs
MAX_HOSTNAMES = 16  # and on HTTPRoute.spec.hostnames
# Gateway API's Hostname: a DNS subdomain, optionally with one leading `*.` label; no IPs
# (refused in code: a pattern that tells them apart is unreadable).
HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DUPLICATE_PARENT = ("gateway.parentRefs lists one Gateway more than once: give each of its "
                    "entries a different sectionName (one listener each), as Gateway API "
                    "requires")
DUPLICATE_HOSTNAME = "gateway.hostnames lists a hostname twice; list each once"

# Gateway API's own rule on HTTPRoute.spec.parentRefs: entries naming one Gateway (name and
# namespace; the port does not count) all carry a sectionName, and no two the same one.
_SAME = ("a.name == b.name && (has(a.namespace) ? a.namespace : '') == "
         "(has(b.namespace) ? b.namespace : '')")
_PARENTS_RULE = (
    f"self.all(a, self.all(b, !({_SAME}) || has(a.sectionName) == has(b.sectionName))) && "
    f"self.all(a, self.exists_one(b, {_SAME} && (has(a.sectionName) ? a.sectionName : '') == "
    "(has(b.sectionName) ? b.sectionName : '')))")


def parents_error(refs: list[dict[str, Any]]) -> bool:
    """`_PARENTS_RULE` in Python (admission words a violation the same)."""
    by_gateway: dict[tuple[str, str], list[str | None]] = {}
    for ref in refs:
        key = (str(ref.get("namespace") or ""), str(ref.get("name")))
        by_gateway.setdefault(key, []).append(ref.get("sectionName") or None)
    for sections in by_gateway.values():
        if len(sections) > 1 and (None in sections or len(set(sections)) != len(sections)):
            return True
    return False


def _parent_ref() -> Schema:
    return obj("A Gateway (and optionally one of its listeners) the route attaches to.", {
        "name": string("Name of the Gateway.", pattern=DNS_SUBDOMAIN, min_length=1,
                       max_length=253),
        "namespace": string("Namespace of the Gateway (default: the cluster's namespace). A "
                            "Gateway in another namespace must allow routes from this one "
                            "(its listeners' allowedRoutes.namespaces).",
                            pattern=DNS_LABEL, max_length=63),
        "sectionName": string("The Gateway listener to attach to (its name); all listeners "
                              "that allow the route when unset.", pattern=DNS_SUBDOMAIN,
                              max_length=253),
        "port": integer("Attach only to the Gateway's listeners on this port.", minimum=1,
                        maximum=65535),
    }, required=("name",))


def gateway_schema() -> Schema:
    parents = array(
        "Gateways the route attaches to (Gateway API ParentReferences, kind Gateway). A "
        "Gateway listed more than once needs a different sectionName on each of its entries.",
        _parent_ref(), max_items=MAX_PARENT_REFS)
    parents["minItems"] = 1
    parents["x-kubernetes-validations"] = [rule(_PARENTS_RULE, DUPLICATE_PARENT)]
    hostnames = array(
        "Host names the route answers (Gateway API Hostnames: `api.example.com`, or "
        "`*.example.com` for one label). Unset: every host name the listener accepts.",
        string("A host name, or `*.` and a domain.", pattern=HOSTNAME, max_length=253),
        max_items=MAX_HOSTNAMES)
    hostnames["x-kubernetes-validations"] = [
        rule("self.all(h, self.exists_one(x, x == h))", DUPLICATE_HOSTNAME)]
    return obj(
        "Put the Conductor's OpenAI-compatible API behind a Gateway API gateway: the operator "
        "renders an HTTPRoute (gateway.networking.k8s.io/v1) named like the Conductor Service, "
        "sending every path to it; it is owned by this cluster (deleted with it). The Gateway "
        "API CRDs and a Gateway must already exist. See docs/gateway.md.",
        {"parentRefs": parents, "hostnames": hostnames},
        required=("parentRefs",),
    )


def drain_timeout(role: str) -> Schema:
    """`roles.<role>.drainTimeoutSeconds` (prefill and decode)."""
    what = {
        "prefill": "it finishes its queued prompts within this, then ends the prompts still "
                   "running UNAVAILABLE (the Conductor retries them elsewhere)",
        "decode": "streams that will finish within this finish; the others are handed over "
                  "(KV written to the pool, resumed by another decode of the same revision, "
                  "embedded engine) at once, and any left at its end too; vLLM and SGLang "
                  "streams still running at its end take the failover path",
    }[role]
    return integer(
        f"How long a stopping {role} pod drains (its --drain-timeout): on SIGTERM it turns "
        f"unready and takes no new work; {what}. The pod's terminationGracePeriodSeconds is "
        f"this plus {DRAIN_MARGIN_S} s, and its preStop starts the drain and returns when the "
        "worker has exited. Scale-downs (the autoscaler's too) and rollouts stop pods this "
        "way. 0: stop at once.", default=DRAIN_DEFAULT_S, minimum=0, maximum=3600)


def drain_seconds(spec: dict[str, Any], role: str) -> int:
    """roles.<role>.drainTimeoutSeconds; the default where a CRD older than the field did not
    fill it in."""
    value = ((spec.get("roles") or {}).get(role) or {}).get("drainTimeoutSeconds")
    return value if isinstance(value, int) else DRAIN_DEFAULT_S


def grace_seconds(drain_s: int) -> int:
    """The pod's terminationGracePeriodSeconds for a drain of `drain_s`."""
    return drain_s + DRAIN_MARGIN_S
