"""Plain data at the engine's boundary: its configuration, sampling parameters and results.

No I/O and no torch here, so the prefill/decode services and the Conductor can build and check
these (and turn them into wire messages) without loading a model. Validation happens at
construction, so a bad request fails with a specific `InvalidArgument` before any work starts.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from mooncake_k8s.common.errors import InvalidArgument, MooncakeError
from mooncake_k8s.engine.api import ModelConfig

#: Longest stop string we accept: stop matching rescans this many characters per token.
MAX_STOP_CHARS = 256
MAX_STOP_STRINGS = 16


class EngineFull(MooncakeError):
    """No room for another sequence: `max_batch` sequences run, or the KV budget is spent.

    Retryable once running sequences finish; the decode service maps it to RESOURCE_EXHAUSTED.
    """


LAYERWISE_ENV = "MOONCAKE_KV_LAYERWISE"


def layerwise_from_env() -> bool:
    """MOONCAKE_KV_LAYERWISE: 1 (default) streams prefill KV layer by layer, 0 stores it after
    the prefill (the benchmark's baseline). Anything else is an error naming the variable."""
    raw = os.environ.get(LAYERWISE_ENV, "").strip() or "1"
    if raw not in ("0", "1"):
        raise InvalidArgument(f"{LAYERWISE_ENV} must be 0 or 1, not {raw!r}")
    return raw == "1"


@dataclass(frozen=True)
class EngineConfig(ModelConfig):
    """How to build the embedded engine: the shared model settings plus its own. Every field
    has a default that works on a laptop."""

    max_batch: int = 32
    """Decode: most sequences running at once."""
    kv_capacity_tokens: int | None = None
    """Decode: KV tokens it may hold in total; None = sized from `kv_budget_bytes`."""
    threads: int | None = None
    """torch.set_num_threads on CPU (None leaves torch's default)."""
    random_weights: bool = False
    """Build the model from config.json with random weights (GPU benchmarks of big shapes
    whose weights are not at hand). Blocks get a fingerprint no real model shares."""
    prefill_chunk_tokens: int | None = None
    """Prefill computes in chunks of this many tokens at absolute multiples of it; None =
    `block_tokens`. Only `block_tokens` makes every full block's KV bit-identical no matter
    which prompt computed it (the greedy identity guarantee across prompts); larger chunks run
    faster on GPUs and keep the guarantee only for the same prompt."""
    kv_budget_bytes: int | None = None
    """Decode KV budget when `kv_capacity_tokens` is None; None = 2 GiB on CPU, 40% of the
    free GPU memory after loading on CUDA."""
    verify_threads: int | None = None
    """Threads checksumming imported blocks; None = 1 on CPU, up to 8 on CUDA hosts (the
    checksum would otherwise cost more than the host-to-device copy)."""
    layerwise_kv: bool = field(default_factory=layerwise_from_env)
    """Prefill sends each layer's KV to the store as soon as it is computed, overlapping the
    transfer with the rest of the forward pass; False stores the blocks after the prefill.
    Default from MOONCAKE_KV_LAYERWISE (read when the config is built)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch < 1:
            raise InvalidArgument(f"max_batch must be >= 1, got {self.max_batch}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise InvalidArgument(
                f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}"
            )
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise InvalidArgument(f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgument(f"threads must be >= 1, got {self.threads}")
        if self.verify_threads is not None and self.verify_threads < 1:
            raise InvalidArgument(f"verify_threads must be >= 1, got {self.verify_threads}")
        chunk = self.prefill_chunk_tokens
        if chunk is not None and (chunk < 1 or chunk % self.block_tokens):
            raise InvalidArgument(
                f"prefill_chunk_tokens must be a positive multiple of block_tokens "
                f"({self.block_tokens}), got {chunk}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    """Tokens to generate, the first one (emitted by prefill) included."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the matched string is not part of the output."""
    seed: int | None = None
    """Same seed, same prompt, same model: same tokens, even across processes. None = random."""
    ignore_eos: bool = False
    """Keep generating past EOS until max_tokens (benchmarks want fixed output lengths)."""

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {p!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidArgument(f"max_tokens must be an integer >= 1, got {m!r}")
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple):
            raise InvalidArgument("stop must be a tuple of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidArgument(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        sd = self.seed
        if sd is not None and (isinstance(sd, bool) or not isinstance(sd, int)):
            raise InvalidArgument(f"seed must be an integer or None, got {sd!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class PrefillResult:
    """What prefill hands back: the first token and the KV blocks it computed."""

    first_token: int
    text: str
    """Text of the first token (withholds a partial stop-string match)."""
    finished: bool
    finish_reason: str | None
    """"stop" (EOS or a stop string), "length" (max_tokens == 1 or the context is full)."""
    cached_tokens: int
    """Prompt tokens whose KV was imported."""
    computed_tokens: int
    """Prompt tokens whose KV was computed here (the recomputed last token of a full hit
    counts: it is work done)."""
    new_blocks: list[tuple[int, bytes | memoryview]] = field(default_factory=list)
    """(block index, encoded block) for every full block not imported (with a chunk size
    above block_tokens, also verified blocks of a partial chunk, which are recomputed)."""
    tail_block: bytes | memoryview | None = None
    """Encoded partial block: KV of the prompt tokens after the last full block."""
    rejected_blocks: int = 0
    """Imported blocks not used because verification failed at or before them."""


@dataclass
class StepOutput:
    """One sequence's progress in one decode step."""

    seq_id: str
    token_id: int
    text: str
    """Text delta; withholds a partial stop-string match until it resolves."""
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class BatchLoad:
    """How full the engine's decode batch and KV budget are (`Engine.load`): what a scheduler
    needs to place the next sequence here.

    Not the services' `engine.api.EngineLoad`: that one is any engine kind's report, with the
    worker's own queue (`waiting`); the worker builds it from this one.
    """

    running: int
    """Sequences in the batch."""
    max_batch: int
    """Sequences the batch may hold (`EngineConfig.max_batch`)."""
    kv_used_tokens: int
    """KV tokens reserved by running sequences (each reserves its whole length at admission)."""
    kv_free_tokens: int
    kv_capacity_tokens: int
