"""A worker's place in a prefill group: the flags' values, resolved and checked.

Kept free of the engine and gRPC so the CLI can validate flags before anything loads. The
Kubernetes forms (`--pipeline-stage auto`, `{index}` in `--pipeline-next`) are resolved from the
pod's index: `MOONCAKE_POD_INDEX`, else the `-<n>` suffix of the hostname (a StatefulSet pod).
"""

from __future__ import annotations

import os
import re
import socket

from mooncake_k8s.common.errors import InvalidArgument

DEFAULT_CHUNK_TOKENS = 256
"""Tokens per pipeline chunk until the bench measures the best default."""
DEFAULT_STAGE_TIMEOUT_S = 10.0
EMBEDDED_ONLY = (
    "pipeline-parallel prefill groups (--pipeline-group-size > 1) run on the embedded engine "
    "only; for --engine {kind} use its own pipeline parallelism (e.g. --engine-arg="
    "--pipeline-parallel-size=N for vLLM, --engine-arg=--pp-size=N for SGLang) in one worker "
    "instead (see docs/engines.md)")


def pod_index(hostname: str | None = None) -> int:
    """This pod's ordinal: MOONCAKE_POD_INDEX, else the hostname's trailing `-<n>`."""
    env = os.environ.get("MOONCAKE_POD_INDEX", "").strip()
    if env:
        if not env.isdigit():
            raise InvalidArgument(f"MOONCAKE_POD_INDEX must be a non-negative integer, "
                                  f"got {env!r}")
        return int(env)
    host = hostname if hostname is not None else socket.gethostname()
    m = re.search(r"-(\d+)$", host)
    if m is None:
        raise InvalidArgument(
            f"--pipeline-stage auto needs MOONCAKE_POD_INDEX or a hostname ending in -<n> "
            f"(got {host!r})")
    return int(m.group(1))


def resolve_stage(value: str, group_size: int, hostname: str | None = None) -> int:
    """`--pipeline-stage`: an index, or `auto` = the pod index mod the group size."""
    v = value.strip().lower()
    if v == "auto":
        return pod_index(hostname) % max(group_size, 1)
    if not v.isdigit():
        raise InvalidArgument(f"--pipeline-stage must be a non-negative integer or 'auto', "
                              f"got {value!r}")
    return int(v)


def resolve_next(value: str, hostname: str | None = None) -> str:
    """`--pipeline-next`: `{index}` becomes this pod's index + 1 (the next pod's name)."""
    if "{index}" not in value:
        return value
    return value.replace("{index}", str(pod_index(hostname) + 1))


def resolve_group(value: str, group_size: int, hostname: str | None = None) -> str:
    """`--pipeline-group`: `{group}` becomes this pod's index // the group size, so one pod
    template names every group of a StatefulSet (g0 for pods 0..G-1, g1 for G..2G-1, ...)."""
    if "{group}" not in value:
        return value
    return value.replace("{group}", str(pod_index(hostname) // max(group_size, 1)))


def check_pipeline(*, group: str, group_size: int, stage: int, next_addr: str,
                   chunk_tokens: int, compute_chunk: int, timeout_s: float,
                   engine_kind: str) -> None:
    """Raise InvalidArgument naming the flag that is wrong (nothing to check for a single
    instance, group size 1)."""
    if group_size < 1:
        raise InvalidArgument(f"--pipeline-group-size must be >= 1, got {group_size}")
    if chunk_tokens < 1 or chunk_tokens % compute_chunk:
        raise InvalidArgument(
            f"--pipeline-chunk-tokens must be a positive multiple of the engine's prefill "
            f"chunk ({compute_chunk} tokens), got {chunk_tokens}")
    if timeout_s <= 0:
        raise InvalidArgument(f"--pipeline-stage-timeout must be > 0 s, got {timeout_s}")
    if group_size == 1:
        if stage != 0:
            raise InvalidArgument(f"--pipeline-stage {stage} needs --pipeline-group-size > 1")
        return
    if engine_kind != "embedded":
        raise InvalidArgument(EMBEDDED_ONLY.format(kind=engine_kind))
    _check_group(group)
    if stage >= group_size:
        raise InvalidArgument(f"--pipeline-stage {stage} must be below --pipeline-group-size "
                              f"{group_size}")
    if stage < group_size - 1 and not next_addr:
        raise InvalidArgument(f"--pipeline-next is required on stage {stage} of "
                              f"{group_size} (every stage but the last): the next stage's "
                              "gRPC address")


def _check_group(group: str) -> None:
    """The group's name: given, and usable in a segment name (its stages' inboxes)."""
    if not group:
        raise InvalidArgument("--pipeline-group-size > 1 needs --pipeline-group (the group's "
                              "name)")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,40}", group):
        raise InvalidArgument(f"--pipeline-group must be 1-40 of [A-Za-z0-9._-], got {group!r}")


def stage_layers(num_layers: int, group_size: int, stage: int) -> tuple[int, int]:
    """Stage `stage`'s layers [lo, hi): the engine's split (`EmbeddedStage`), restated here
    so the handshake can check it without importing the engine."""
    return stage * num_layers // group_size, (stage + 1) * num_layers // group_size
