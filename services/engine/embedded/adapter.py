"""The embedded engine behind the engine seam (`engine.api`): KV through the worker's store
client, in its process.

Prefill is in `prefill.py` (`EmbeddedPrefill`): it follows the plan, and places and streams
the KV it computes.

Decode: one engine thread owns the engine and runs the continuous-batching loop; between steps
it takes in newly loaded sequences and drops cancelled ones, then advances every running
sequence by one token in one forward pass. Callers' threads do the slow part of admission
(reading the KV blocks) outside that loop, so a long prompt arriving never stalls everyone's
next token.

Handoff (drain): `handoff(request_id, ...)` asks the engine thread to export a stream's
context KV at the next step boundary and drop the sequence; the stream's own thread writes the
blocks to the pool (`handoff.write_handoff`) and ends the stream with a `TokenOut.handoff` item.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from mooncake_k8s.common import tracing
from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import MooncakeError, StoreError
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.tokenizer_id import tokenizer_fingerprint
from mooncake_k8s.engine.api import (
    DecodeWork,
    EngineCounter,
    EngineFailed,
    EngineInfo,
    EngineLoad,
    KVMissing,
    KVStore,
    StreamState,
    TokenOut,
)
from mooncake_k8s.engine.embedded.engine import Engine, load_engine
from mooncake_k8s.engine.embedded.handoff import (
    HandoffCounts,
    handoff_tail_key,
    surviving_prefix,
    write_handoff,
)
from mooncake_k8s.engine.embedded.kvpool import Staging
from mooncake_k8s.engine.embedded.structs import (
    EngineConfig,
    EngineFull,
    SamplingParams,
)

log = logging.getLogger(__name__)

LOADS_KEPT = 1024
"""Admissions' load times kept for `load_seconds` (a bound: the service may never ask)."""


def tail_key(request_id: str) -> str:
    """Store key of a request's partial last block: request-scoped, never a prefix block."""
    return f"tail/{request_id}"


def sampling_from_pb(s: pb.Sampling) -> SamplingParams:
    """The engine's SamplingParams from the wire form (validation happens there)."""
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0,
        max_tokens=s.max_tokens, stop=tuple(s.stop),
        seed=s.seed if s.has_seed else None, ignore_eos=s.ignore_eos,
    )


def _info(engine: Engine) -> EngineInfo:
    tok = tokenizer_fingerprint(engine.tokenizer) if engine.tokenizer is not None else ""
    return EngineInfo("embedded", engine.served_name, engine.fingerprint.hex(),
                      engine.layout.dtype, engine.block_tokens, engine.max_context,
                      tokenizer_fingerprint=tok)


class _Embedded:
    def __init__(self, config: EngineConfig, store: KVStore) -> None:
        self.engine = load_engine(config, progress=False)
        self.store = store
        self.info = _info(self.engine)
        self.block_bytes = self.engine.layout.block_bytes(self.engine.block_tokens)

    def close(self) -> None:
        """The engine is process memory; nothing to stop."""

    def halt(self) -> None:
        """Stop a prefill in progress at its next chunk (it fails with `Halted`)."""
        self.engine.halted.set()

    def failure(self) -> str | None:
        """In-process: it cannot die without the worker."""
        return None

    def counters(self) -> list[EngineCounter]:
        return []


@dataclass
class _Seq:
    work: DecodeWork
    blocks: list[memoryview]
    sampling: SamplingParams
    staging: np.ndarray | None = None
    """The buffer `blocks` view: back to the pool once the engine copied the KV out."""
    arrived: float = 0.0
    out: queue.SimpleQueue[TokenOut | _Exported | BaseException] = field(
        default_factory=queue.SimpleQueue)
    tokens: list[int] = field(default_factory=list)
    """Prompt, first token, then every token yielded: the context of a handoff."""


@dataclass
class _Exported:
    """A stream handed over by the engine thread: what its own thread writes to the pool."""

    context: list[int]
    blocks: list[tuple[int, bytes]]
    tail: bytes | None


@dataclass(frozen=True)
class _HandoffAsk:
    request_id: str
    first_block: int
    """Leading blocks with a copy off this instance already: not exported."""
    segment: str
    avoid: str


class EmbeddedDecode(_Embedded):
    """Continuous batching over the embedded engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, store: KVStore) -> None:
        super().__init__(config, store)
        self._inbox: queue.SimpleQueue[_Seq] = queue.SimpleQueue()
        self._waiting: list[_Seq] = []
        self._running: dict[str, _Seq] = {}
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.kv_bytes_loaded = 0
        self._steps: queue.SimpleQueue[float] = queue.SimpleQueue()
        """Durations of batched steps, drained by the service into its histogram."""
        self._loads: deque[tuple[float, int]] = deque(maxlen=LOADS_KEPT)
        """(seconds, bytes) per admission; the newest kept while nobody reads them."""
        self._staging = Staging()
        self._handoffs: queue.SimpleQueue[_HandoffAsk] = queue.SimpleQueue()
        self._asked: dict[str, _HandoffAsk] = {}
        self._held: dict[str, _Seq] = {}
        """Every stream admitted and not ended (running or waiting), for `handoff`."""
        self._states: list[StreamState] = []
        """Published by the engine thread after each step (one rebinding: no torn reads)."""
        self._step_ema = 0.0
        self._writing = threading.Lock()
        """One handoff writes at a time: two streams of one prefix must not both move the
        copy that lived only on this instance (one removing what the other just put)."""
        self.handoff_counts = HandoffCounts()
        self.recomputed_tokens = 0
        """Context tokens whose KV was computed here instead of loaded: always 0 (this decode
        loads every block or refuses), exported so a benchmark can sum it across instances."""
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def counters(self) -> list[EngineCounter]:
        blocks = "KV blocks of handed-over streams: written to the pool, or present off this " \
                 "instance already"
        return [EngineCounter("mooncake_decode_kv_bytes_total", "KV bytes loaded from the store",
                              self.kv_bytes_loaded),
                EngineCounter("mooncake_decode_handoff_blocks_total", blocks,
                              self.handoff_counts.written, {"outcome": "written"}),
                EngineCounter("mooncake_decode_handoff_blocks_total", blocks,
                              self.handoff_counts.present, {"outcome": "present"}),
                EngineCounter("mooncake_decode_recomputed_tokens_total",
                              "Context tokens whose KV this decode computed instead of loading "
                              "(0: every block is loaded, a handed-over stream's too)",
                              self.recomputed_tokens)]

    # -- handoff (drain) -------------------------------------------------------------------

    def streams(self) -> list[StreamState]:
        return list(self._states)

    def step_estimate(self) -> float:
        return self._step_ema

    def handoff(self, request_id: str, segment: str, avoid: str) -> bool:
        seq = self._held.get(request_id)
        if seq is None or request_id in self._asked:
            return seq is not None
        first = surviving_prefix(self.store, seq.work.keys, avoid)
        ask = _HandoffAsk(request_id, first, segment, avoid)
        self._asked[request_id] = ask
        self._handoffs.put(ask)
        self._wake.set()
        return True

    def step_seconds(self) -> list[float]:
        out: list[float] = []
        while not self._steps.empty():
            out.append(self._steps.get())
        return out

    def load_seconds(self) -> list[tuple[float, int]]:
        """(seconds, bytes) of each admission since the last call (the newest `LOADS_KEPT`):
        from the request's arrival to its KV in the engine's cache (read, verified, copied),
        and the KV bytes read."""
        out: list[tuple[float, int]] = []
        with contextlib.suppress(IndexError):
            while True:
                out.append(self._loads.popleft())
        return out

    def load(self) -> EngineLoad:
        load = self.engine.load()
        waiting = self._waiting  # the engine thread rebinds it; read one list
        return EngineLoad(running=load.running, waiting=len(waiting),
                          kv_free_tokens=load.kv_free_tokens,
                          kv_capacity_tokens=load.kv_capacity_tokens,
                          waiting_tokens=sum(len(s.work.token_ids) for s in waiting))

    def decode(self, work: DecodeWork, cancelled: threading.Event) -> Iterator[TokenOut]:
        arrived = time.monotonic()
        with tracing.span("decode.load_kv", request_id=work.request_id):
            seq = self._load_kv(work)
        seq.arrived = arrived
        seq.tokens = [*work.token_ids, work.first_token]
        self._held[work.request_id] = seq
        self._inbox.put(seq)
        self._wake.set()
        try:
            while True:
                try:
                    item = seq.out.get(timeout=0.1)
                except queue.Empty:
                    if cancelled.is_set():
                        return
                    if self._stop.is_set():
                        raise EngineFailed("decode engine stopped") from None
                    continue
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Exported):
                    yield self._hand_over(seq, item)
                    return
                yield item
                if item.finished:
                    return
        finally:
            self._held.pop(work.request_id, None)
            self._asked.pop(work.request_id, None)
            self._aborts.put(work.request_id)
            self._wake.set()

    def _hand_over(self, seq: _Seq, exp: _Exported) -> TokenOut:
        """Write an exported stream's KV to the pool: its last item (StoreError: it fails
        over instead)."""
        w = seq.work
        ask = self._asked[w.request_id]
        keys = self.info.block_keys(exp.context, w.tenant)
        tail = (handoff_tail_key(w.request_id), exp.tail) if exp.tail is not None else None
        with tracing.span("decode.handoff", request_id=w.request_id), self._writing:
            done = write_handoff(self.store, keys, exp.blocks, tail, len(exp.context),
                                 ask.segment, ask.avoid, w.tenant, self.handoff_counts)
        return TokenOut(0, "", handoff=done)

    def _load_kv(self, work: DecodeWork) -> _Seq:
        """Every prompt block plus the tail, read into a reused staging buffer; a missing one
        fails the request (the Conductor retries it from prefill), since decode cannot
        recompute. Blocks read from another host are kept on the plan's `keep_on` segment
        (hot-block replication; the store does it before returning)."""
        keys = list(work.keys)
        if work.tail_key:
            keys.append(work.tail_key)
        size = self.block_bytes
        buf = self._staging.take(len(keys) * size)
        mv = byte_view(buf, writable=True)
        views = [mv[i * size:(i + 1) * size] for i in range(len(keys))]
        got = self.store.batch_get_into(keys, views, keep_on=work.keep_on)
        missing = [k for k, n in zip(keys, got, strict=True) if n is None]
        if missing:
            self._staging.give(buf)
            raise KVMissing(f"{len(missing)} of {len(keys)} KV blocks missing from the store "
                            f"(first: {missing[0]})")
        if work.tail_key:
            with contextlib.suppress(StoreError):
                self.store.remove([work.tail_key], force=True)
        self.kv_bytes_loaded += sum(n or 0 for n in got)
        loaded = len(work.keys) * self.engine.block_tokens + (
            len(work.token_ids) % self.engine.block_tokens if work.tail_key else 0)
        self.recomputed_tokens += max(0, len(work.token_ids) - loaded)
        blocks = [v[:n] for v, n in zip(views, got, strict=True) if n is not None]
        return _Seq(work, blocks, sampling_from_pb(work.sampling), buf)

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._between_steps(engine)
            if not self._running:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                outs = engine.step()
            except Exception as e:
                log.exception("decode step failed; failing the batch")
                for rid, seq in list(self._running.items()):
                    seq.out.put(e)
                    with contextlib.suppress(Exception):
                        engine.abort(rid)
                self._running.clear()
                continue
            dt = time.monotonic() - t0
            self._steps.put(dt)
            self._step_ema = dt if not self._step_ema else 0.8 * self._step_ema + 0.2 * dt
            for o in outs:
                target = self._running.get(o.seq_id)
                if target is None:
                    continue
                target.tokens.append(o.token_id)
                target.out.put(TokenOut(o.token_id, o.text, o.finished, o.finish_reason))
                if o.finished:
                    del self._running[o.seq_id]
            self._publish(engine)

    def _between_steps(self, engine: Engine) -> None:
        """At a step boundary: take in new sequences, drop cancelled ones, export the ones
        asked to be handed over, and publish the streams for the drain policy."""
        self._admit_new(engine)
        while not self._aborts.empty():
            rid = self._aborts.get()
            if rid in self._running:
                engine.abort(rid)
                del self._running[rid]
            self._waiting = [s for s in self._waiting if s.work.request_id != rid]
        asks: list[_HandoffAsk] = []
        while not self._handoffs.empty():
            asks.append(self._handoffs.get())
        for ask in asks:
            self._export(engine, ask)
        self._publish(engine)

    def _publish(self, engine: Engine) -> None:
        """The streams as the drain policy reads them (`streams`)."""
        left = engine.remaining()
        states = [StreamState(rid, left.get(rid, 0), True) for rid in self._running]
        states += [StreamState(s.work.request_id, s.sampling.max_tokens, False)
                   for s in self._waiting]
        self._states = states

    def _export(self, engine: Engine, ask: _HandoffAsk) -> None:
        """On the engine thread, between steps: take a stream's KV out and drop it; its own
        thread writes it (`_hand_over`). A stream that ended meanwhile is left alone."""
        rid = ask.request_id
        seq = self._running.get(rid)
        try:
            if seq is not None:
                del self._running[rid]
                exp = engine.export(rid, ask.first_block)
                if exp is None or exp.length != len(seq.tokens) - 1:
                    raise EngineFailed(f"handoff of {rid!r}: the engine's sequence does not "
                                       "match the stream")
                seq.out.put(_Exported(seq.tokens[:-1], exp.blocks, exp.tail))
                return
            seq = next((s for s in self._waiting if s.work.request_id == rid), None)
            if seq is not None:
                self._waiting = [s for s in self._waiting if s is not seq]
                seq.out.put(self._export_waiting(seq, ask.first_block))
            elif rid in self._held:  # asked before it reached the inbox: next boundary
                self._handoffs.put(ask)
        except Exception as e:
            log.exception("handoff export failed", extra={"request_id": rid})
            if seq is not None:
                seq.out.put(e)

    def _export_waiting(self, seq: _Seq, first_block: int) -> _Exported:
        """A stream not in the batch yet: its context is the prompt, whose blocks are staged."""
        n, bt = len(seq.work.token_ids), self.engine.block_tokens
        full = n // bt
        blocks = [(i, bytes(seq.blocks[i])) for i in range(first_block, full)]
        tail = bytes(seq.blocks[full]) if n % bt else None
        self._unstage(seq)
        return _Exported(list(seq.work.token_ids), blocks, tail)

    def _admit_new(self, engine: Engine) -> None:
        while not self._inbox.empty():
            self._waiting.append(self._inbox.get())
        still: list[_Seq] = []
        for seq in self._waiting:
            w = seq.work
            try:
                # the store verified every byte against its checksum as it read them
                engine.add_sequence(w.request_id, w.token_ids, seq.blocks, w.first_token,
                                    seq.sampling, payload_checked=True)
            except EngineFull:
                still.append(seq)  # joins when a running sequence finishes
                continue
            except Exception as e:  # a bad sequence fails alone; the loop goes on
                if not isinstance(e, MooncakeError):
                    log.exception("adding a sequence failed", extra={"request_id": w.request_id})
                self._unstage(seq)
                seq.out.put(e)
                continue
            self._loads.append((time.monotonic() - seq.arrived, sum(len(b) for b in seq.blocks)))
            self._unstage(seq)  # the engine copied the KV out
            self._running[w.request_id] = seq
        self._waiting = still

    def _unstage(self, seq: _Seq) -> None:
        """The staging buffer back to the pool (no view of it is left in `seq`)."""
        seq.blocks = []
        if seq.staging is not None:
            self._staging.give(seq.staging)
            seq.staging = None

