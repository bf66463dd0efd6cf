"""The engine interface the prefill and decode services serve through.

A service owns the wire (gRPC), admission, queueing, metrics and drain; an engine owns the
model and moves its own KV: the embedded engine through the store client in this process, a
vLLM engine through its KV connector in vLLM's processes. Both follow the same typed plan, so
the Conductor's decision reaches whichever engine runs and the services never branch on kind.

Kinds: `embedded` (our PyTorch engine), `vllm` (a vLLM server this worker starts), `sglang`
(an SGLang server this worker starts; its prefill hands KV to decode directly, paired by the
plan's bootstrap room). `open_engine` builds one by kind; nothing here imports an engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mooncake_k8s.common.blocks import KeyNamespace, block_keys
from mooncake_k8s.common.errors import MooncakeError
from mooncake_k8s.common.rpc import serving_pb2 as pb

if TYPE_CHECKING:
    from mooncake_k8s.store.client import StoreClient
    from mooncake_k8s.worker.base import WorkerConfig

ENGINE_KINDS = ("embedded", "vllm", "sglang")


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, as the Conductor must know it to name its KV and route to it."""

    kind: str
    served_name: str
    fingerprint: str
    """Hex model fingerprint (the weights' identity)."""
    dtype: str
    block_tokens: int
    max_context: int
    kv_layout: str = ""
    """The KV producer tag of the key namespace ("" for the embedded engine)."""
    bootstrap_addr: str = ""
    """Prefill engines with paired handoff (SGLang): host:port where decode meets them."""

    def namespace(self, tenant: str = "") -> KeyNamespace:
        return KeyNamespace(self.fingerprint, self.dtype, self.block_tokens, tenant_salt=tenant,
                            kv_layout=self.kv_layout)

    def block_keys(self, token_ids: Sequence[int], tenant: str = "") -> list[str]:
        return block_keys(self.namespace(tenant), token_ids)


@dataclass(frozen=True)
class EngineLoad:
    """An engine's load, as the services report it (`LoadReport`)."""

    running: int = 0
    waiting: int = 0
    kv_free_tokens: int = 0
    kv_capacity_tokens: int = 0
    waiting_tokens: int = 0
    """Context tokens of the `waiting` sequences: the decode load still to come, in the unit of
    the KV numbers (0 where the engine does not say, e.g. vLLM and SGLang)."""


@dataclass(frozen=True)
class KVPlan:
    """The Conductor's KV decision for one prompt, as the worker follows it.

    `keys` are every full block's key; the first `local_blocks + fetch_blocks` are expected in
    the store (read them without asking the master whether they exist); new blocks go to
    `write_segment`. A block the plan promised but the store no longer has is recomputed.
    """

    keys: tuple[str, ...]
    local_blocks: int = 0
    fetch_blocks: int = 0
    write_segment: str = ""
    planned: bool = True
    """False when the Conductor made no decision: the worker looks the prefix up itself."""
    bootstrap_addr: str = ""
    bootstrap_room: int = 0
    """Paired handoff (SGLang): where and under which room decode meets this prefill."""

    @property
    def reuse_blocks(self) -> int:
        return min(len(self.keys), self.local_blocks + self.fetch_blocks)


def resolve_plan(msg: pb.KVPlan, info: EngineInfo, token_ids: Sequence[int], tenant: str,
                 use_cache: bool) -> tuple[KVPlan, bool]:
    """The plan to follow and whether the Conductor's was usable.

    A plan computed in another namespace (a stale report, another model) is not trusted: the
    keys are computed here and the prefix is looked up as if no plan had come.
    """
    ns = info.namespace(tenant)
    ok = bool(msg.planned) and msg.namespace == ns.digest().hex() and (
        len(msg.block_keys) == len(token_ids) // info.block_tokens)
    addr, room = msg.bootstrap_addr, msg.bootstrap_room
    if ok:
        plan = KVPlan(tuple(msg.block_keys), msg.local_blocks, msg.fetch_blocks,
                      msg.write_segment, True, addr, room)
    else:
        plan = KVPlan(tuple(block_keys(ns, token_ids)), write_segment=msg.write_segment,
                      planned=False, bootstrap_addr=addr, bootstrap_room=room)
    if not use_cache:
        plan = KVPlan(plan.keys, 0, 0, plan.write_segment, True, addr, room)
    return plan, ok


@dataclass
class PrefillWork:
    request_id: str
    token_ids: list[int]
    tenant: str
    sampling: pb.Sampling
    plan: KVPlan
    use_prefix_cache: bool = True
    trace: dict[str, str] = field(default_factory=dict)


@dataclass
class PrefillDone:
    first_token: int
    text: str
    finished: bool
    finish_reason: str
    cached_tokens: int
    computed_tokens: int
    tail_key: str = ""
    stored_blocks: int = 0
    imported_blocks: int = 0
    rejected_blocks: int = 0
    load_s: float = 0.0
    compute_s: float = 0.0
    store_s: float = 0.0


@dataclass
class DecodeWork:
    request_id: str
    token_ids: list[int]
    tenant: str
    first_token: int
    sampling: pb.Sampling
    keys: list[str]
    """The prompt's full-block keys (from the plan, else computed here)."""
    tail_key: str = ""
    trace: dict[str, str] = field(default_factory=dict)
    bootstrap_addr: str = ""
    bootstrap_room: int = 0
    """Paired handoff (SGLang): the KV arrives from this prefill, and `first_token` is 0
    (unknown yet); the engine yields the tokens after the first, as in the pool handoff."""


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineCounter:
    """A monotonically growing count the engine keeps (exported as a Prometheus counter)."""

    name: str
    help: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


class EngineFailed(MooncakeError):
    """The engine process died or stopped answering: the worker is no longer usable."""


class KVMissing(MooncakeError):
    """Decode cannot find a prompt block in the store (decode cannot recompute: the Conductor
    retries the request from prefill)."""


class PrefillEngine(Protocol):
    info: EngineInfo

    def prefill(self, work: PrefillWork) -> PrefillDone:
        """Compute the prompt's KV (reusing what the plan names), store new blocks, and return
        the first token. Called from one thread at a time."""
        ...

    def load(self) -> EngineLoad: ...

    def failure(self) -> str | None:
        """Why the engine can no longer serve (its process died), or None."""
        ...

    def counters(self) -> list[EngineCounter]: ...

    def close(self) -> None: ...


class DecodeEngine(Protocol):
    info: EngineInfo

    def decode(self, work: DecodeWork, cancelled: threading.Event) -> Iterator[TokenOut]:
        """Load the prompt's KV and stream the tokens after `first_token`. Called from many
        threads at once; stops early (and frees the sequence) once `cancelled` is set."""
        ...

    def load(self) -> EngineLoad: ...

    def failure(self) -> str | None:
        """Why the engine can no longer serve (its process died), or None."""
        ...

    def counters(self) -> list[EngineCounter]: ...

    def close(self) -> None: ...


def open_engine(role: str, config: WorkerConfig, store: StoreClient) -> Any:
    """Build the engine for `role` of the configured kind (slow: loads a model or starts a
    server). Imports only the kind asked for, so the embedded default needs no vLLM."""
    kind = config.engine_kind
    if kind == "embedded":
        from mooncake_k8s.worker import embedded

        cls = embedded.EmbeddedPrefill if role == "prefill" else embedded.EmbeddedDecode
        return cls(config, store)
    if kind == "vllm":
        from mooncake_k8s.engine.vllm import adapter

        vcls = adapter.VllmPrefill if role == "prefill" else adapter.VllmDecode
        return vcls(config)
    if kind == "sglang":
        from mooncake_k8s.engine.sglang import adapter as sgl

        scls = sgl.SglangPrefill if role == "prefill" else sgl.SglangDecode
        return scls(config)
    raise ValueError(f"unknown engine kind {kind!r}; known: {', '.join(ENGINE_KINDS)}")
