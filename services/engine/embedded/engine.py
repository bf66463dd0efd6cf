"""The embedded engine: prefill from imported KV blocks, block export, batched decode.

Prefill (one request at a time) and decode (many sequences, continuous batching) are one class
because a process may do both, but they share no state: prefill works in a scratch KV buffer
and hands its KV out as encoded blocks; decode sequences own KV tensors sized at admission
(prompt + max_tokens - 1 tokens), so a running sequence never runs out of memory and never needs
preempting, and `EngineFull` tells the caller at admission when there is no room.

Greedy identity (import vs compute): prefill computes in chunks whose boundaries are absolute
multiples of `prefill_chunk_tokens` (= `block_tokens` by default), so a full block's KV is
computed by the same kernel calls, on the same inputs, whichever prompt computed it. The first
token's logits of a prompt that is a block multiple always come from a one-token pass over the
last position (what a full hit must do anyway), and otherwise from the last chunk, which a hit
and a cold run compute alike. Decode continues from the same KV bits either way.

Used from one thread per process (the services serialise calls); not thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from mooncake_k8s.common import blocks as kvfmt
from mooncake_k8s.common.errors import IntegrityError, InvalidArgument, MooncakeError
from mooncake_k8s.engine.embedded import hfmodel
from mooncake_k8s.engine.embedded.detokenizing import TextStream
from mooncake_k8s.engine.embedded.kvblocks import BlockCodec
from mooncake_k8s.engine.embedded.kvpool import SpareKV
from mooncake_k8s.engine.embedded.layerexport import LayerExport, LayerSink
from mooncake_k8s.engine.embedded.sampling import random_seed, sample_batch, sample_one
from mooncake_k8s.engine.embedded.structs import (
    BatchLoad,
    EngineConfig,
    EngineFull,
    PrefillResult,
    SamplingParams,
    StepOutput,
)
from mooncake_k8s.engine.embedded.transformer import Transformer

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 2 << 30
GPU_KV_FRACTION = 0.4
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass
class _Sequence:
    """A running decode sequence."""

    seq_id: str
    kv: torch.Tensor
    """Its first `reserved` tokens of `base` (a reused tensor may be longer)."""
    base: torch.Tensor
    reserved: int
    length: int
    """Tokens whose KV is in `kv`; the next input sits at this position."""
    next_token: int
    generated: int
    max_new: int
    params: SamplingParams
    seed: int
    stream: TextStream


class Halted(MooncakeError):
    """The engine was halted (`Engine.halted`) during a prefill: the worker is stopping."""


@dataclass
class SequenceExport:
    """A running sequence's KV as blocks, taken when it is handed over (`Engine.export`)."""

    length: int
    """Context tokens whose KV was exported (prompt + generated tokens but the last)."""
    next_token: int
    """The last generated token: its KV is not computed yet."""
    blocks: list[tuple[int, bytes]]
    """(index, encoded block) of the full blocks from the `first_block` asked for."""
    tail: bytes | None
    """The partial last block (None when `length` is a block multiple)."""


def _after_layer(layers: LayerExport, end: int, layer: int) -> None:
    layers.after_layer(layer, end)


def after_layer_hook(layers: LayerExport | None, end: int) -> Any:
    """The forward pass's `on_layer` for a chunk ending at `end` (None: nothing exported)."""
    return None if layers is None else partial(_after_layer, layers, end)


def scratch_tokens(n: int, max_context: int) -> int:
    """Tokens a prefill buffer gets for an n-token prompt: rounded up to a multiple of 1024
    (few distinct sizes, so a grow-only buffer rarely grows). Every prefill buffer, a
    pipeline stage's included, is sized by this: same strides, same kernels."""
    return max(min(max_context, -(-n // 1024) * 1024), n)


class Engine:
    """See the module docstring; build one with `load_engine`."""

    def __init__(self, config: EngineConfig, loaded: hfmodel.LoadedModel) -> None:
        self.config = config
        self.tokenizer: Any | None = loaded.tokenizer
        self.served_name = loaded.served_name
        self.fingerprint = loaded.fingerprint
        self.eos_ids = loaded.eos_ids
        self.device = loaded.device
        self.model = Transformer(loaded.model)
        loaded.model = None  # the fused weights replace the HF modules; free the originals
        self.dtype_name = hfmodel.dtype_name(self.model.dtype)
        self.block_tokens = config.block_tokens
        self.chunk_tokens = config.prefill_chunk_tokens or config.block_tokens
        self.max_context = self.model.max_context
        self.vocab_size = self.model.vocab
        self.layout = kvfmt.BlockLayout(
            self.fingerprint,
            self.dtype_name,
            self.model.num_layers,
            self.model.num_kv_heads,
            self.model.head_dim,
        )
        threads = config.verify_threads or (
            min(8, os.cpu_count() or 1) if self.device.type == "cuda" else 1
        )
        self.codec = BlockCodec(self.layout, self.block_tokens, threads)
        self.kv_capacity_tokens = config.kv_capacity_tokens or self._default_capacity()
        self._running: dict[str, _Sequence] = {}
        self._kv_used = 0
        self._spare_kv = SpareKV(
            self.model.new_kv, self.kv_capacity_tokens * self.model.kv_bytes_per_token(),
            enabled=self.device.type == "cpu",
        )
        self._scratch: torch.Tensor | None = None
        self.halted = threading.Event()
        """Set when the worker gives up on its work (the end of a drain): a prefill in
        progress stops at its next chunk, so the process exits without a computation running."""

    def _default_capacity(self) -> int:
        budget = self.config.kv_budget_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * GPU_KV_FRACTION)
            else:
                budget = CPU_KV_BUDGET
        return max(1, budget // self.model.kv_bytes_per_token())

    # -- names and text -----------------------------------------------------------------

    def namespace(self, tenant: str = "") -> kvfmt.KeyNamespace:
        """The block-key namespace; `tenant` salts it so tenants never share blocks."""
        return kvfmt.KeyNamespace(
            self.fingerprint.hex(), self.dtype_name, self.block_tokens, tenant_salt=tenant
        )

    def block_keys(self, token_ids: Sequence[int], tenant: str = "") -> list[str]:
        """Keys of the full blocks of `token_ids` (DESIGN §3)."""
        return kvfmt.block_keys(self.namespace(tenant), token_ids)

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidArgument(f"model {self.served_name!r} has no tokenizer")
        return self.tokenizer

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template applied to `messages`, ending with the assistant's turn prompt."""
        tok = self._need_tokenizer()
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidArgument(f"messages[{i}] must be an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}"
                )
            if not isinstance(content, str):
                raise InvalidArgument(f"messages[{i}].content must be a string")
        if not getattr(tok, "chat_template", None):
            raise InvalidArgument(f"model {self.served_name!r} has no chat template")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return [int(t) for t in tok.encode(text, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgument("prompt must be a string")
        return [int(t) for t in self._need_tokenizer().encode(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- shared checks ------------------------------------------------------------------

    def _check_tokens(self, token_ids: Sequence[int], what: str = "prompt") -> torch.Tensor:
        try:
            ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise InvalidArgument(f"{what} token ids must be integers") from e
        n = ids.numel()
        if ids.ndim != 1 or n == 0:
            raise InvalidArgument(f"{what} is empty")
        if n > self.max_context:
            raise InvalidArgument(
                f"{what} has {n} tokens; the model's context is {self.max_context} tokens"
            )
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def _max_new(self, n: int, params: SamplingParams) -> int:
        """max_tokens, cut where the context ends (the last token needs no KV)."""
        return min(params.max_tokens, self.max_context - n + 1)

    def _finish(
        self, token: int, stream: TextStream, generated: int, max_new: int, params: SamplingParams
    ) -> tuple[str, str | None]:
        """Text for `token` and why the sequence ends after it (None: it goes on)."""
        if token in self.eos_ids and not params.ignore_eos:
            return stream.flush(), "stop"
        text = stream.add(token)
        if stream.stopped:
            return text, "stop"
        if generated >= max_new:
            return text + stream.flush(), "length"
        return text, None

    # -- prefill ------------------------------------------------------------------------

    def _scratch_kv(self, n: int) -> torch.Tensor:
        """The prefill KV buffer, reused across calls: no page faults on the hot path."""
        if self._scratch is None or self._scratch.shape[3] < n:
            self._scratch = None
            self._scratch = self.model.new_kv(scratch_tokens(n, self.max_context))
        return self._scratch

    def usable_blocks(self, verified: int, n: int) -> int:
        """Of `verified` leading imported blocks of an n-token prompt, how many to keep.
        Chunks must start at absolute multiples of the chunk size (determinism, see module
        doc): a partial chunk's worth of imported blocks is recomputed instead."""
        per_chunk = self.chunk_tokens // self.block_tokens
        return verified - (verified % per_chunk if verified * self.block_tokens < n else 0)

    def compute_chunks(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """The compute chunks [s, e) covering positions [start, end): `chunk_tokens` long,
        from `start` (an absolute multiple of it, by `usable_blocks`)."""
        for s in range(start, end, self.chunk_tokens):
            yield s, min(end, s + self.chunk_tokens)

    def last_token_hidden(
        self, x: torch.Tensor, n: int, kv: torch.Tensor, lo: int, hi: int
    ) -> torch.Tensor:
        """Layers [lo, hi) of the one-token pass over position n-1 (a block-multiple prompt's
        first-token logits, as a full hit computes them); the KV it writes at n-1 is put
        back, so the prompt's KV stays the chunked pass's bits. `kv` holds layers [lo, hi)."""
        keep = kv[:, :, :, n - 1].clone()
        out = self.model.decode_layers(x, [n - 1], [kv], lo, hi)
        kv[:, :, :, n - 1].copy_(keep)
        return out

    def first_result(
        self, ids: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
        cached: int, rejected: int,
    ) -> PrefillResult:
        """The first token sampled from `logits` [1, vocab] of prompt `ids`, with its text
        and whether the sequence ends there (no blocks attached yet)."""
        n = ids.numel()
        seed = params.seed if params.seed is not None else random_seed()
        token = sample_one(logits[0], params, seed, n)
        stream = TextStream(self.tokenizer, ids.tolist(), params.stop)
        text, reason = self._finish(token, stream, 1, self._max_new(n, params), params)
        return PrefillResult(
            first_token=token, text=text, finished=reason is not None, finish_reason=reason,
            cached_tokens=cached, computed_tokens=n - cached, rejected_blocks=rejected,
        )

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        imported: Sequence[Any],
        sampling: SamplingParams,
        seq_id: str = "",
        *,
        export: bool = True,
        sink: LayerSink | None = None,
        payload_checked: bool = False,
    ) -> PrefillResult:
        """Import the leading full blocks' KV, compute the rest, sample the first token.

        `imported`: encoded blocks for full blocks 0, 1, ... in order (bytes, memoryview,
        numpy or uint8 torch tensors; pinned tensors reach a GPU by DMA). A block that fails
        verification ends the import there: it and the blocks after it are recomputed and
        counted in `rejected_blocks`. `export=False` skips encoding new blocks (no store).
        `sink`: the new blocks (and the tail) are encoded layer by layer as the forward pass
        makes each layer final and handed to it (`layerexport`) instead of after the pass;
        the encodings are the same bytes either way. `payload_checked`: the imported blocks'
        bytes were verified by the store as they were read (`kvblocks`).
        """
        ids = self._check_tokens(token_ids)
        n, bt = ids.numel(), self.block_tokens
        full = n // bt
        if len(imported) > full:
            raise InvalidArgument(
                f"{len(imported)} imported blocks for a prompt of {n} tokens, "
                f"which has {full} full blocks of {bt}"
            )
        kv = self._scratch_kv(n)
        verified = self.import_blocks(kv, imported, seq_id, payload_checked)
        used = self.usable_blocks(verified, n)
        layers = None
        if export and sink is not None and (full > used or n % bt):
            layers = LayerExport(kv, self.layout, bt, used, n, sink)
        logits = self._forward(ids, used * bt, kv, layers)
        result = self.first_result(ids, logits, sampling, min(used * bt, n - 1),
                                   len(imported) - verified)
        if layers is not None:
            blocks, tail = layers.finish()
            result.new_blocks = list(zip(range(used, full), blocks, strict=True))
            result.tail_block = tail
        elif export:
            encoded = self.codec.export_range(kv, used, full - used)
            result.new_blocks = list(zip(range(used, full), encoded, strict=True))
            if n % bt:
                result.tail_block = self.codec.export(kv, full * bt, n)
        return result

    def _forward(
        self, ids: torch.Tensor, start: int, kv: torch.Tensor, layers: LayerExport | None
    ) -> torch.Tensor:
        """Compute positions [start, n) in chunks into kv; the first token's logits."""
        n = ids.numel()
        host_last = int(ids[-1])
        ids = ids.to(self.device)
        hidden: torch.Tensor | None = None
        for s, e in self.compute_chunks(start, n):
            if self.halted.is_set():
                raise Halted("the engine was halted (the worker is stopping)")
            hidden = self.model.prefill_chunk(ids[s:e], s, kv, after_layer_hook(layers, e))
        if n % self.block_tokens == 0:  # logits from a one-token pass, as a full hit does
            x = self.model.embed_ids(torch.tensor([host_last], device=self.device))
            return self.model.logits(
                self.last_token_hidden(x, n, kv, 0, self.model.num_layers))
        assert hidden is not None
        return self.model.logits(hidden)

    def import_blocks(
        self, kv: torch.Tensor, blocks: Sequence[Any], seq_id: str, payload_checked: bool = False,
        layers: tuple[int, int] | None = None,
    ) -> int:
        """Copy verified blocks into kv (which holds `layers` [lo, hi) of the model, default
        all: a pipeline stage imports its own layers' slices of whole blocks); returns how
        many leading blocks were usable."""
        used, error = self.codec.load(
            kv, blocks, [self.block_tokens] * len(blocks), payload_checked, layers
        )
        if error is not None:
            log.warning(
                "imported block failed verification; recomputing from it",
                extra={"seq_id": seq_id, "block": used, "reason": str(error)},
            )
        return used

    _import = import_blocks  # the benches' name for it

    # -- decode -------------------------------------------------------------------------

    @torch.inference_mode()
    def add_sequence(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        blocks: Sequence[Any],
        first_token: int,
        sampling: SamplingParams,
        *,
        payload_checked: bool = False,
    ) -> None:
        """Admit a prefilled sequence into the running batch; it joins the next `step()`.

        `blocks`: every full block of the prompt, then the partial tail block if the prompt is
        not a block multiple. `first_token` was emitted by prefill and counts toward
        max_tokens. Raises EngineFull when max_batch sequences run or the KV budget cannot
        hold prompt + max_tokens - 1 tokens, IntegrityError when a block fails verification.
        `payload_checked`: the blocks' bytes were verified by the store as they were read
        (`kvblocks`); headers, layout and sizes are checked either way.
        """
        sizes, max_new, stream = self._admission(seq_id, token_ids, blocks, first_token, sampling)
        n, params = sum(sizes), sampling
        reserve = n + max_new - 1
        if reserve > self.kv_capacity_tokens:
            raise InvalidArgument(
                f"sequence needs {reserve} KV tokens (prompt + max_tokens - 1), more than this "
                f"engine's whole capacity of {self.kv_capacity_tokens}"
            )
        if len(self._running) >= self.config.max_batch:
            raise EngineFull(f"{len(self._running)} sequences running (max_batch)")
        free = self.kv_capacity_tokens - self._kv_used
        if reserve > free:
            raise EngineFull(f"sequence needs {reserve} KV tokens, {free} free")
        base = self._spare_kv.take(reserve)
        kv = base[:, :, :, :reserve]
        copied, error = self.codec.load(kv, blocks, sizes, payload_checked)
        if error is not None:
            self._spare_kv.give(base, self._live_kv_bytes())
            raise IntegrityError(f"block {copied} of sequence {seq_id!r}: {error}")
        seed = params.seed if params.seed is not None else random_seed()
        self._running[seq_id] = _Sequence(
            seq_id, kv, base, reserve, n, first_token, 1, max_new, params, seed, stream
        )
        self._kv_used += reserve

    def _admission(
        self, seq_id: str, token_ids: Sequence[int], blocks: Sequence[Any], first_token: int,
        params: SamplingParams,
    ) -> tuple[list[int], int, TextStream]:
        """A new sequence's arguments checked: the tokens in each of its blocks, its max_new
        and its text stream (primed with the first token)."""
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidArgument("seq_id must be a non-empty string")
        if seq_id in self._running:
            raise InvalidArgument(f"sequence {seq_id!r} is already running")
        ids = self._check_tokens(token_ids)
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not (
            0 <= first_token < self.vocab_size
        ):
            raise InvalidArgument(f"first_token {first_token!r} is not a token id")
        n, bt = ids.numel(), self.block_tokens
        sizes = [bt] * (n // bt) + ([n % bt] if n % bt else [])
        if len(blocks) != len(sizes):
            raise InvalidArgument(
                f"a prompt of {n} tokens needs {len(sizes)} blocks "
                f"({n // bt} full + {1 if n % bt else 0} tail), got {len(blocks)}"
            )
        max_new = self._max_new(n, params)
        stream = TextStream(self.tokenizer, ids.tolist(), params.stop)
        _, reason = self._finish(first_token, stream, 1, max_new, params)
        if reason is not None:
            raise InvalidArgument(
                f"sequence {seq_id!r} already finished at its first token ({reason})"
            )
        return sizes, max_new, stream

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Advance every running sequence by one token in one forward pass."""
        seqs = list(self._running.values())
        if not seqs:
            return []
        ids = torch.tensor([s.next_token for s in seqs], device=self.device)
        logits = self.model.decode(ids, [s.length for s in seqs], [s.kv for s in seqs])
        for s in seqs:
            s.length += 1
        tokens = sample_batch(
            logits, [s.params for s in seqs], [s.seed for s in seqs], [s.length for s in seqs]
        )
        out: list[StepOutput] = []
        for s, tok in zip(seqs, tokens, strict=True):
            s.generated += 1
            s.next_token = tok
            text, reason = self._finish(tok, s.stream, s.generated, s.max_new, s.params)
            out.append(StepOutput(s.seq_id, tok, text, reason is not None, reason))
            if reason is not None:
                self._release(s.seq_id)
        return out

    def _release(self, seq_id: str) -> None:
        seq = self._running.pop(seq_id, None)
        if seq is not None:
            self._kv_used -= seq.reserved
            self._spare_kv.give(seq.base, self._live_kv_bytes())

    def _live_kv_bytes(self) -> int:
        return sum(s.base.nbytes for s in self._running.values())

    def abort(self, seq_id: str) -> None:
        """Drop a sequence and free its KV; unknown or finished ids are ignored (idempotent)."""
        self._release(seq_id)

    @torch.inference_mode()
    def export(self, seq_id: str, first_block: int = 0) -> SequenceExport | None:
        """Encode a running sequence's KV (full blocks from `first_block`, and the tail) and
        drop the sequence: the handoff of a live stream (None: not running). The blocks are the
        very bits the next step would have read, so an engine importing them continues as this
        one would have (greedy identity across the handoff)."""
        seq = self._running.get(seq_id)
        if seq is None:
            return None
        try:
            bt, n = self.block_tokens, seq.length
            full = n // bt
            first = max(0, min(first_block, full))
            blocks = list(zip(range(first, full),
                              self.codec.export_range(seq.kv, first, full - first), strict=True))
            tail = self.codec.export(seq.kv, full * bt, n) if n % bt else None
        finally:
            self._release(seq_id)
        return SequenceExport(n, seq.next_token, blocks, tail)

    def remaining(self) -> dict[str, int]:
        """Tokens each running sequence may still produce (at most: it may stop earlier)."""
        return {s.seq_id: s.max_new - s.generated for s in self._running.values()}

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._running

    def load(self) -> BatchLoad:
        """What the scheduler needs to place the next request here."""
        return BatchLoad(
            running=len(self._running),
            max_batch=self.config.max_batch,
            kv_used_tokens=self._kv_used,
            kv_free_tokens=self.kv_capacity_tokens - self._kv_used,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )


def load_engine(config: EngineConfig | None = None, progress: bool = True) -> Engine:
    """Load the model (converting and caching the built-in one on first use) and build an
    engine around it."""
    config = config or EngineConfig()
    return Engine(config, hfmodel.load_model(config, progress))
