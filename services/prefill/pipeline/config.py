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

DEFAULT_CHUNK_TOKENS = 1024
"""The largest pipeline chunk (and the size of the next stage's inbox slots). Measured
(bench/pipeline_bench.py, 7K-token prompts on the test bed): TTFT falls from 41 s at 256-token
chunks to 36.6 s at 1024, as each chunk's handoff and the stages' contention cost more than
the shorter pipeline fill saves."""
DEFAULT_CHUNKS = 8
"""Pipeline chunks a prompt is cut into (each no larger than DEFAULT_CHUNK_TOKENS): a 7K-token
prompt gets ~900-token chunks, a 2K one 256, a 512-token one 64, so short prompts pipeline
too while long ones keep the chunk count (and its per-chunk cost) bounded."""
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


def chunk_tokens_for(tokens: int, compute_chunk: int, largest: int, chunks: int) -> int:
    """The pipeline chunk for a prompt with `tokens` to compute: about `tokens / chunks`,
    rounded up to the engine's compute chunk (bit-identical boundaries), at most `largest`;
    `chunks` 0 = always `largest`."""
    if chunks <= 0 or tokens <= 0:
        return largest
    want = -(-tokens // chunks)
    return min(largest, max(compute_chunk, -(-want // compute_chunk) * compute_chunk))


def check_pipeline(*, group: str, group_size: int, stage: int, next_addr: str,
                   chunk_tokens: int, compute_chunk: int, timeout_s: float,
                   engine_kind: str, chunks: int = DEFAULT_CHUNKS) -> None:
    """Raise InvalidArgument naming the flag that is wrong (nothing to check for a single
    instance, group size 1)."""
    if group_size < 1:
        raise InvalidArgument(f"--pipeline-group-size must be >= 1, got {group_size}")
    if chunk_tokens < 1 or chunk_tokens % compute_chunk:
        raise InvalidArgument(
            f"--pipeline-chunk-tokens must be a positive multiple of the engine's prefill "
            f"chunk ({compute_chunk} tokens), got {chunk_tokens}")
    if chunks < 0:
        raise InvalidArgument(f"--pipeline-chunks must be >= 0 (0 = every chunk "
                              f"--pipeline-chunk-tokens long), got {chunks}")
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
