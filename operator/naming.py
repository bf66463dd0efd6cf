"""The operator's contracts with the rest of the system: names, labels, ports and revisions.

Label contract (documented in the README, relied on by the Conductor and by users' selectors):

- every object: `app.kubernetes.io/name=mooncake`, `app.kubernetes.io/instance=<cluster>`,
  `app.kubernetes.io/component=<role>`, `app.kubernetes.io/part-of=mooncake`,
  `app.kubernetes.io/managed-by=mooncake-operator`;
- pods: `mooncake.io/revision=<hash of the role's pod template>` (changes exactly when the
  role's pods must be replaced) and, on prefill and decode,
  `mooncake.io/serving-revision=<hash>` which is also passed as MOONCAKE_REVISION. It covers
  what prefill and decode must agree on (model, engine, images, block size, transfer protocol),
  so the Conductor pairs a prefill with a decode only when the two values are equal; any change
  to it changes both roles' pod templates, so both roll and new pairs form.

Pure functions; `render` and `status` use them.
"""

from __future__ import annotations

import hashlib
import json
import re
from decimal import Decimal
from typing import Any

from mooncake_k8s.common import defaults as d

MANAGER = "mooncake-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_VERSION = "app.kubernetes.io/version"
LABEL_REVISION = "mooncake.io/revision"
LABEL_SERVING_REVISION = "mooncake.io/serving-revision"
ANNOTATION_SEED = "mooncake.io/seeded-replicas"

# Container ports. The CLI defaults, fixed so Services and NetworkPolicies can name them.
PORTS: dict[str, dict[str, int]] = {
    "conductor": {"http": d.CONDUCTOR_PORT, "metrics": d.CONDUCTOR_METRICS_PORT},
    "prefill": {"grpc": d.PREFILL_PORT, "metrics": d.WORKER_METRICS_PORT},
    "decode": {"grpc": d.DECODE_PORT, "metrics": d.WORKER_METRICS_PORT},
    "store": {"transfer": d.NODE_TRANSFER_PORT, "metrics": d.NODE_METRICS_PORT},
    "master": {"grpc": d.MASTER_PORT, "fast": d.MASTER_FAST_PORT,
               "metrics": d.MASTER_METRICS_PORT},
}
# Extra container ports of SGLang workers (the worker's --sglang-bootstrap-port and
# --pd-transfer-port): decode pods dial a prefill pod's bootstrap server, and KV moves from
# prefill to decode over pd-transfer. Pod IPs, not Services, so no Service lists them.
SGLANG_PORTS: dict[str, dict[str, int]] = {
    "prefill": {"bootstrap": 8998, "pd-transfer": 7300},
    "decode": {"pd-transfer": 7300},
}
# Ports only pods of the same cluster may reach (the rest is the API or metrics).
INTERNAL_PORTS = {"prefill": ("grpc",), "decode": ("grpc",), "store": ("transfer",),
                  "master": ("grpc", "fast"), "conductor": ()}
METRICS_PORT = {"conductor": "metrics", "prefill": "metrics", "decode": "metrics",
                "store": "metrics", "master": "metrics"}

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
            "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
            "Ei": 2**60}


def parse_bytes(q: int | str) -> int:
    """A Kubernetes byte quantity ('4Gi', '500M', 1024) as an integer byte count."""
    if isinstance(q, int):
        return q
    m = _QUANTITY.match(q.strip())
    if not m:
        raise ValueError(f"not a byte quantity: {q!r}")
    return int(Decimal(m.group(1)) * _FACTORS[m.group(2)])


def format_bytes(n: int) -> str:
    """The shortest exact binary quantity: 4294967296 -> '4Gi', 1000 -> '1000'."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        f = _FACTORS[suffix]
        if n >= f and n % f == 0:
            return f"{n // f}{suffix}"
    return str(n)


def name(cluster: str, role: str) -> str:
    return f"{cluster}-{role}"


def selector(cluster: str, role: str) -> dict[str, str]:
    """Immutable pod selector of a role's workload; never includes a revision."""
    return {LABEL_NAME: "mooncake", LABEL_INSTANCE: cluster, LABEL_COMPONENT: role}


def cluster_selector(cluster: str) -> dict[str, str]:
    return {LABEL_NAME: "mooncake", LABEL_INSTANCE: cluster}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def labels(cluster: str, role: str, version: str | None = None) -> dict[str, str]:
    out = {**selector(cluster, role), LABEL_PART_OF: "mooncake", LABEL_MANAGED_BY: MANAGER}
    if version:
        out[LABEL_VERSION] = version
    return out


def image_version(image: str) -> str | None:
    """The tag of an image reference, if it has one that is a valid label value."""
    ref = image.split("@", 1)[0]
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else None
    if tag and re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", tag):
        return tag
    return None


def image_variant(image: str, suffix: str) -> str:
    """The image built from the same source with `suffix` added to its tag (the Dockerfile's
    `--build-arg ENGINE=vllm` build is tagged `<tag>-vllm`): `repo:0.1.0` -> `repo:0.1.0-vllm`,
    an untagged `repo` -> `repo:latest-vllm`. A digest names one exact image, so it has no
    variant: a ValueError (the schema requires spec.engine.image then)."""
    if "@" in image:
        raise ValueError(f"{image!r} is pinned by digest; its {suffix} variant cannot be "
                         "derived")
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:  # no tag: the last ':' was a registry port, or there is none
        return f"{image}:latest-{suffix}"
    return f"{repo}:{tag}-{suffix}"


def digest(obj: Any, length: int = 10) -> str:
    """A short stable hash of JSON-able data (key order and whitespace never matter)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def serving_inputs(spec: dict[str, Any], prefill_image: str, decode_image: str) -> dict[str, Any]:
    """What prefill and decode must agree on to exchange KV blocks and serve one model."""
    return {
        "model": spec["model"],
        "engine": spec["engine"],
        "blockTokens": spec["store"]["blockTokens"],
        "transferProtocol": spec["transferProtocol"],
        "images": [prefill_image, decode_image],
    }


def service_fqdn(service: str, namespace: str, domain: str) -> str:
    return f"{service}.{namespace}.svc.{domain}"
