"""One pipeline stage of a prefill group (issue 21, chunked pipeline-parallel prefill): the
engine's side, for one prompt at a time, whichever stage this is.

Every stage holds the whole model but computes only layers [lo, hi) = `stage_layers(...)`
(each stage on its own host). The runtime (`prefill.pipeline`) cuts the prompt into pipeline
chunks, feeds stage 0 the positions (`forward(start, end, None)`: it embeds the ids), hands
each stage's output hidden states to the next stage (`forward(start, end, hidden)`), and gives
the last stage's last hidden state back to the leader (stage 0), which samples the first token
(`complete`). Within a pipeline chunk a stage computes in the engine's compute chunks at the
same absolute positions as a single instance, through the same kernels (`Transformer.run_layers`
is the single instance's pass over a layer range): KV, hidden states and the first token are
the single instance's bits.

Reuse: every stage reads the plan's leading blocks whole (store-verified) and imports its own
layers' slices (`begin` returns how many verified); the group computes from the smallest count
(`recompute_from`).

KV: the leader leases every new block's space (`open_put`, a `StreamPut` as a single
instance's, whose `plan()` says where each byte goes) and each other stage writes its layers'
byte ranges of every new block straight into every replica as the layers are computed
(`open_writer`, a `PlanWriter`), then reports what it failed to write (`end_writes`). The
leader reads the other stages' ranges back into its encodings (`StreamPut.fill_remote`),
writes the headers and commits: a stored block is byte-identical to a single instance's. An
object a stage could not write is never committed; the prompt fails retriable (EngineFailed).

Hidden states cross hosts as the raw bytes of a contiguous `[tokens, hidden]` tensor of the
model's dtype (`hidden_bytes`, `hidden_view`, `hidden_from_bytes`).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mooncake_k8s.common.blocks import HEADER_SIZE
from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import InvalidArgument, ObjectExists, StoreError
from mooncake_k8s.engine.api import EngineFailed, KVStore, PrefillDone, PrefillWork
from mooncake_k8s.engine.embedded.adapter import sampling_from_pb, tail_key
from mooncake_k8s.engine.embedded.engine import Engine, after_layer_hook, scratch_tokens
from mooncake_k8s.engine.embedded.layerexport import LayerExport
from mooncake_k8s.engine.embedded.prefill import BlockReader, open_stream, prefill_done
from mooncake_k8s.engine.embedded.structs import PrefillResult

log = logging.getLogger(__name__)


def stage_layers(num_layers: int, group_size: int, stage: int) -> tuple[int, int]:
    """Layers [lo, hi) of `stage` in a group of `group_size`: contiguous, balanced to within
    one layer, together exactly [0, num_layers)."""
    if group_size < 1 or group_size > num_layers:
        raise InvalidArgument(f"a pipeline group of {group_size} stages cannot split a model "
                              f"of {num_layers} layers (1 to {num_layers} stages)")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < group_size:
        raise InvalidArgument(f"pipeline stage {stage!r} is not in [0, {group_size})")
    return stage * num_layers // group_size, (stage + 1) * num_layers // group_size


class StagePut(Protocol):
    """The leader's streamed put of the new blocks (`store.client.streamput.StreamPut`)."""

    def plan(self) -> bytes: ...
    def ready(self, index: int, start: int, end: int, event: Any = None) -> None: ...
    def fill_remote(self, ranges: Sequence[tuple[int, int, int]]) -> None: ...
    def finish(self, skip: Sequence[int] = ()) -> list[Exception | None]: ...
    def abort(self) -> None: ...


class StageWriter(Protocol):
    """A later stage's writer of its byte ranges (`store.client.planwrite.PlanWriter`)."""

    bytes_written: int

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None: ...
    def finish(self) -> list[Exception | None]: ...
    def abort(self) -> None: ...


PutFactory = Callable[[PrefillWork, int, Sequence[memoryview], bool], StagePut]
"""(work, first block, encodings, has tail) -> the leader's put."""
WriterFactory = Callable[[bytes, Sequence[memoryview]], StageWriter]
"""(the leader's plan, encodings) -> a later stage's writer."""


class _Opening:
    """A `LayerSink` whose target is built once `LayerExport` has made the encodings."""

    def __init__(self, make: Callable[[int, Sequence[memoryview], bool], Any]) -> None:
        self.make = make
        self.target: Any = None

    def open(self, first_block: int, views: Sequence[memoryview], tail: bool) -> None:
        self.target = self.make(first_block, views, tail)

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        self.target.ready(index, start, end, event)


@dataclass
class _Prompt:
    request_id: str
    ids: torch.Tensor
    """On the CPU; `dev` on the engine's device."""
    dev: torch.Tensor
    kv: torch.Tensor
    read: int
    verified: int
    began: float
    loaded: float
    start: int | None = None
    """First position computed (fixed by open_put/open_writer or the first forward)."""
    next: int = 0
    export: LayerExport | None = None
    put: StagePut | None = None
    writer: StageWriter | None = None

    @property
    def n(self) -> int:
        return int(self.ids.numel())


class EmbeddedStage:
    """One stage's engine side for one prompt at a time (any stage index); single-threaded."""

    def __init__(self, engine: Engine, store: KVStore, stage: int, group_size: int, *,
                 put_factory: PutFactory | None = None,
                 writer_factory: WriterFactory | None = None) -> None:
        """`put_factory`/`writer_factory`: where the KV goes (default: the store's
        `StreamPut` and `PlanWriter` over `store`, a `StoreClient`)."""
        self.engine = engine
        self.store = store
        self.stage, self.group_size = stage, group_size
        self.lo, self.hi = stage_layers(engine.model.num_layers, group_size, stage)
        self.first, self.last = stage == 0, stage == group_size - 1
        self.hidden_size = engine.model.hidden
        self.dtype = engine.model.dtype
        self._put_factory = put_factory or self._store_put
        self._writer_factory = writer_factory or self._store_writer
        self._reader = BlockReader(store, engine.layout.block_bytes(engine.block_tokens))
        self._kv: torch.Tensor | None = None
        self._p: _Prompt | None = None
        self.kv_bytes = 0
        """KV bytes the last prompt's writes of this stage put into the pool, every replica
        counted (the leader: its layers and the headers; `PrefillDone.kv_bytes` too)."""

    # -- hidden states on the wire ----------------------------------------------------------

    def hidden_bytes(self, tokens: int) -> int:
        """Bytes of hidden states [tokens, hidden] in the model's dtype."""
        return tokens * self.hidden_size * self.dtype.itemsize

    @staticmethod
    def hidden_view(hidden: torch.Tensor) -> memoryview:
        """The raw bytes of a contiguous CPU tensor (what `forward` returns), no copy."""
        if hidden.device.type != "cpu" or not hidden.is_contiguous():
            raise InvalidArgument("hidden states must be a contiguous CPU tensor")
        return byte_view(hidden.reshape(-1).view(torch.uint8).numpy())

    def hidden_from_bytes(self, buf: Any, tokens: int) -> torch.Tensor:
        """Hidden states [tokens, hidden] rebuilt from received bytes (copied into a fresh
        tensor: the buffer may be reused once this returns)."""
        view = byte_view(buf)
        want = self.hidden_bytes(tokens)
        if tokens < 1 or len(view) != want:
            raise InvalidArgument(f"hidden states of {tokens} tokens are {want} bytes "
                                  f"([{tokens}, {self.hidden_size}] {self.dtype}), got {len(view)}")
        out = torch.empty((tokens, self.hidden_size), dtype=self.dtype)
        with warnings.catch_warnings():  # a read-only buffer is fine: we only read it
            warnings.simplefilter("ignore", UserWarning)
            out.view(-1).view(torch.uint8).copy_(torch.frombuffer(view, dtype=torch.uint8))
        return out

    # -- a prompt ---------------------------------------------------------------------------

    def begin(self, request_id: str, token_ids: Sequence[int], reuse_keys: Sequence[str],
              keep_on: str = "") -> int:
        """Start a prompt: check its ids, size this stage's KV, read the `reuse_keys` leading
        blocks whole (store-verified) and import this stage's layers of them. Returns how many
        leading blocks verified. A prompt still open here is dropped first."""
        self.abort()
        t0 = time.monotonic()
        eng = self.engine
        ids = eng._check_tokens(token_ids)
        n, bt = ids.numel(), eng.block_tokens
        if len(reuse_keys) > n // bt:
            raise InvalidArgument(f"{len(reuse_keys)} reused blocks for a prompt of {n} tokens, "
                                  f"which has {n // bt} full blocks of {bt}")
        kv = self._scratch(n)
        with torch.inference_mode():
            blocks = self._reader.read(list(reuse_keys), keep_on)
            verified = eng.import_blocks(kv, blocks, request_id, payload_checked=True,
                                         layers=(self.lo, self.hi))
        self._p = _Prompt(request_id, ids, ids.to(eng.device), kv, len(blocks), verified,
                          t0, time.monotonic())
        return verified

    def _scratch(self, n: int) -> torch.Tensor:
        """This stage's KV ([hi-lo] layers), grow-only; sized as the single instance's."""
        if self._kv is None or self._kv.shape[3] < n:
            self._kv = None
            self._kv = self.engine.model.new_kv(scratch_tokens(n, self.engine.max_context),
                                                self.hi - self.lo)
        return self._kv

    def _prompt(self) -> _Prompt:
        if self._p is None:
            raise InvalidArgument(f"pipeline stage {self.stage} has no prompt (begin first)")
        return self._p

    def recompute_from(self, verified: Sequence[int]) -> int:
        """The group's first block to compute, given every stage's `begin` result: the
        smallest, cut back to a compute-chunk multiple as a single instance does."""
        p = self._prompt()
        if not verified or min(verified) < 0:
            raise InvalidArgument("verified block counts must be one non-negative int a stage")
        return self.engine.usable_blocks(min(min(verified), p.verified), p.n)

    def _fix_start(self, p: _Prompt, first_block: int) -> None:
        start = first_block * self.engine.block_tokens
        if p.start is not None and p.start != start:
            raise InvalidArgument(f"computing from block {first_block}, but stage {self.stage} "
                                  f"already computes from position {p.start}")
        if first_block < 0 or first_block > p.verified:
            raise InvalidArgument(f"first block {first_block}: stage {self.stage} holds the KV "
                                  f"of {p.verified} leading blocks only")
        if start < p.n and start % self.engine.chunk_tokens:
            raise InvalidArgument(f"first block {first_block} does not start a compute chunk "
                                  f"of {self.engine.chunk_tokens} tokens")
        p.start = p.next = start

    def _has_new(self, p: _Prompt, first_block: int) -> bool:
        """Whether computing from `first_block` makes new objects (full blocks or a tail)."""
        bt = self.engine.block_tokens
        return p.n // bt > first_block or p.n % bt != 0

    def _open(self, p: _Prompt, first_block: int, make: Callable[..., Any]) -> Any:
        """Fix the start; export this stage's layers of the new objects into `make`'s
        target (None when nothing is new: a full hit)."""
        self._fix_start(p, first_block)
        if not self._has_new(p, first_block):
            return None
        eng = self.engine
        sink = _Opening(make)
        p.export = LayerExport(p.kv, eng.layout, eng.block_tokens, first_block, p.n, sink,
                               (self.lo, self.hi))
        return sink.target

    def open_put(self, work: PrefillWork, first_block: int) -> bytes:
        """Leader: lease the new full blocks from `first_block` (home and write segments) and
        the tail (write segment only); returns the lease plan for the other stages (b"" when
        nothing is new)."""
        p = self._prompt()
        if not self.first:
            raise InvalidArgument(f"open_put is the leader's; this is stage {self.stage}")
        if len(work.token_ids) != p.n:
            raise InvalidArgument(f"the work has {len(work.token_ids)} tokens, the prompt {p.n}")
        p.put = self._open(p, first_block,
                           lambda first, views, tail: self._put_factory(work, first, views, tail))
        if p.put is None:
            return b""
        try:
            return p.put.plan()
        except BaseException:  # no space: nothing was leased, nothing will be stored
            p.put.abort()
            p.put = None
            raise

    def open_writer(self, first_block: int, plan: bytes) -> None:
        """A later stage: write this stage's layers of the new objects where `plan` (the
        leader's) says, as they are computed."""
        p = self._prompt()
        if self.first:
            raise InvalidArgument("the leader stores through open_put, not open_writer")
        if not plan and self._has_new(p, first_block):
            raise InvalidArgument(f"no KV plan for the new blocks from block {first_block}")
        p.writer = self._open(p, first_block,
                              lambda first, views, tail: self._writer_factory(plan, views))

    def _store_put(self, work: PrefillWork, first: int, views: Sequence[memoryview],
                   tail: bool) -> StagePut:
        from mooncake_k8s.store.client.client import StoreClient

        assert isinstance(self.store, StoreClient), "a stage's default put needs a StoreClient"
        return open_stream(self.store, work, first, views, tail)

    def _store_writer(self, plan: bytes, views: Sequence[memoryview]) -> StageWriter:
        from mooncake_k8s.store.client.client import StoreClient
        from mooncake_k8s.store.client.planwrite import PlanWriter

        assert isinstance(self.store, StoreClient), "a stage's default writer needs a StoreClient"
        return PlanWriter(self.store, plan, views)

    # -- compute ----------------------------------------------------------------------------

    def _input(self, p: _Prompt, start: int, end: int,
               hidden: torch.Tensor | None) -> torch.Tensor:
        """The layers' input for positions [start, end): the ids' embeddings on stage 0, else
        the previous stage's hidden states, checked."""
        if self.first:
            if hidden is not None:
                raise InvalidArgument("stage 0 embeds the prompt's ids: it takes no hidden states")
            return self.engine.model.embed_ids(p.dev[start:end])
        if not isinstance(hidden, torch.Tensor):
            raise InvalidArgument(f"stage {self.stage} needs the previous stage's hidden states")
        want = (end - start, self.hidden_size)
        if tuple(hidden.shape) != want or hidden.dtype != self.dtype:
            raise InvalidArgument(f"hidden states must be {list(want)} {self.dtype}, got "
                                  f"{list(hidden.shape)} {hidden.dtype}")
        return hidden.to(self.engine.device)

    def _check_span(self, p: _Prompt, start: int, end: int) -> None:
        if p.start is None:  # no store in the loop: the first chunk fixes the start
            self._fix_start(p, start // self.engine.block_tokens)
            if p.start != start:
                raise InvalidArgument(f"position {start} does not start a block")
        if start != p.next or not start < end <= p.n:
            raise InvalidArgument(f"positions [{start}, {end}) of a prompt of {p.n} tokens: "
                                  f"stage {self.stage} computes from position {p.next} next")
        if end < p.n and end % self.engine.chunk_tokens:
            raise InvalidArgument(f"a pipeline chunk must end at a multiple of the compute "
                                  f"chunk ({self.engine.chunk_tokens} tokens) or at the "
                                  f"prompt's end, not at {end}")

    @torch.inference_mode()
    def forward(self, start: int, end: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """Positions [start, end) through this stage's layers, in the engine's compute chunks
        at their absolute positions (each layer's KV handed to the export as it is final).
        `hidden`: None on stage 0 (it embeds the ids), else the previous stage's output for
        these positions. Returns [end-start, hidden] as a contiguous CPU tensor."""
        p = self._prompt()
        self._check_span(p, start, end)
        eng = self.engine
        x = self._input(p, start, end, hidden)
        outs = [
            eng.model.run_layers(x[s - start:e - start], s, p.kv, self.lo, self.hi,
                                 after_layer_hook(p.export, e))
            for s, e in eng.compute_chunks(start, end)
        ]
        p.next = end
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.contiguous() if out.device.type == "cpu" else out.cpu()

    def needs_last_token_pass(self) -> bool:
        """Whether the first token's logits come from a one-token pass over the last position
        (the prompt is a block multiple), through every stage, after every chunk."""
        return self._prompt().n % self.engine.block_tokens == 0

    @torch.inference_mode()
    def last_token_pass(self, hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers of the one-token pass over position n-1 (`hidden`: the previous
        stage's [1, hidden], None on stage 0); its KV at n-1 is put back. Returns [1, hidden]
        as a contiguous CPU tensor."""
        p = self._prompt()
        if not self.needs_last_token_pass():
            raise InvalidArgument(f"a prompt of {p.n} tokens (not a block multiple) takes its "
                                  "first token from the last chunk, not a one-token pass")
        if p.start is None or p.next != p.n:
            raise InvalidArgument(f"stage {self.stage} has computed positions up to {p.next} "
                                  f"of {p.n}: the one-token pass comes after every chunk")
        eng = self.engine
        x = self._input(p, p.n - 1, p.n, hidden)
        out = eng.last_token_hidden(x, p.n, p.kv, self.lo, self.hi)
        return out.contiguous() if out.device.type == "cpu" else out.cpu()

    # -- the KV -----------------------------------------------------------------------------

    def end_writes(self) -> tuple[list[int], int]:
        """A later stage, after its last chunk: wait for its KV writes. Returns (indexes of
        the objects it could not write completely, KV bytes written)."""
        p = self._prompt()
        if self.first:
            raise InvalidArgument("the leader's KV is committed by complete(), not end_writes")
        w, export = p.writer, p.export
        if w is None or export is None:
            return [], 0
        p.writer = None
        if p.next != p.n:  # not every layer's bytes exist: fail everything, commit nothing
            w.abort()
            return list(range(len(export.views))), w.bytes_written
        export.finish(headers=False)
        results = w.finish()
        self.kv_bytes = w.bytes_written
        return [i for i, r in enumerate(results) if r is not None], w.bytes_written

    def complete(self, work: PrefillWork, last_hidden: torch.Tensor,
                 remote: Sequence[tuple[int, int]], remote_failed: Sequence[int]) -> PrefillDone:
        """Leader, after every stage's last chunk (and one-token pass): the first token from
        the last stage's `last_hidden` [1, hidden], the other stages' layer ranges `remote`
        read back into the encodings, the headers written and every new object committed.
        Raises EngineFailed (retriable: another instance computes it) when a stage could not
        write an object (`remote_failed`: their indexes) or an object could not be stored."""
        p = self._prompt()
        if not self.first:
            raise InvalidArgument(f"complete is the leader's; this is stage {self.stage}")
        if p.start is None or p.next != p.n:
            raise InvalidArgument(f"the leader has computed positions up to {p.next} of {p.n}")
        self._check_remote(remote)
        t_done = time.monotonic()
        try:
            res = self._first(p, work, last_hidden)
            tkey, stored = self._commit(p, work, remote, remote_failed, res.finished)
        finally:
            self.abort()
        assert p.start is not None
        done = prefill_done(res, tkey, stored, p.start // self.engine.block_tokens,
                            (p.loaded - p.began, t_done - p.loaded, time.monotonic() - t_done))
        done.kv_bytes = self.kv_bytes
        return done

    @torch.inference_mode()
    def _first(self, p: _Prompt, work: PrefillWork, last_hidden: torch.Tensor) -> PrefillResult:
        """The first token from the prompt's last hidden state, as `Engine.prefill` samples
        it (a `PrefillResult` without blocks)."""
        want = (1, self.hidden_size)
        if not isinstance(last_hidden, torch.Tensor) or tuple(last_hidden.shape) != want or \
                last_hidden.dtype != self.dtype:
            got = (f"{list(last_hidden.shape)} {last_hidden.dtype}"
                   if isinstance(last_hidden, torch.Tensor) else type(last_hidden).__name__)
            raise InvalidArgument(f"the last hidden state must be {list(want)} {self.dtype}, "
                                  f"got {got}")
        eng = self.engine
        logits = eng.model.logits(last_hidden.to(eng.device))
        assert p.start is not None
        return eng.first_result(p.ids, logits, sampling_from_pb(work.sampling),
                                min(p.start, p.n - 1), p.read - p.verified)

    def _check_remote(self, remote: Sequence[tuple[int, int]]) -> None:
        """The other stages' layer ranges and ours must tile [0, num_layers) exactly."""
        pos = 0
        for lo, hi in sorted([(self.lo, self.hi), *((int(a), int(b)) for a, b in remote)]):
            if lo != pos or hi <= lo:
                raise InvalidArgument(f"the stages' layer ranges {sorted(remote)} and "
                                      f"[{self.lo}, {self.hi}) do not tile the model's layers")
            pos = hi
        if pos != self.engine.model.num_layers:
            raise InvalidArgument(f"the stages' layer ranges end at layer {pos}, the model has "
                                  f"{self.engine.model.num_layers}")

    def _commit(self, p: _Prompt, work: PrefillWork, remote: Sequence[tuple[int, int]],
                remote_failed: Sequence[int], finished: bool) -> tuple[str, int]:
        """Fill in the other stages' layers, write the headers, commit: (tail key or "",
        full blocks stored). A finished request's tail is not stored (decode never runs)."""
        export, put = p.export, p.put
        if export is None or put is None:
            return "", 0
        p.put = None  # ours to finish or abort from here
        views = export.views
        try:
            if remote_failed:
                raise EngineFailed(f"pipeline stages could not store their layers of KV "
                                   f"objects {sorted(set(remote_failed))} of {len(views)}")
            try:
                put.fill_remote([(i, *export.layer_range(i, lo, hi))
                                 for i in range(len(views)) for lo, hi in remote])
            except StoreError as e:
                raise EngineFailed(f"reading the other stages' KV layers back: {e}") from e
            export.finish(headers=True)
        except BaseException:
            put.abort()
            raise
        tail = bool(export.tail)
        skip = [len(views) - 1] if tail and finished else []
        results = put.finish(skip=skip)
        self.kv_bytes = self._own_bytes(export, work)
        bad = [(i, r) for i, r in enumerate(results)
               if i not in skip and r is not None and not isinstance(r, ObjectExists)]
        if bad:
            raise EngineFailed(f"storing {len(bad)} of {len(views)} new KV objects failed "
                               f"(object {bad[0][0]}: {bad[0][1]})")
        full = len(views) - int(tail)
        stored = sum(r is None for r in results[:full])
        return (tail_key(work.request_id) if tail and not finished else ""), stored

    def _own_bytes(self, export: LayerExport, work: PrefillWork) -> int:
        """Bytes the leader wrote itself: its layers and the headers of every object, once a
        replica (new blocks: the home and write segments, the tail: the write segment)."""
        plan = work.plan
        copies = max(1, len({s for s in (plan.home_segment, plan.write_segment) if s}))
        total = 0
        for i in range(len(export.views)):
            start, end = export.layer_range(i, self.lo, self.hi)
            tail = bool(export.tail) and i == len(export.views) - 1
            total += (end - start + HEADER_SIZE) * (1 if tail else copies)
        return total

    def abort(self) -> None:
        """Drop the prompt: its put or writer aborted, nothing committed (idempotent)."""
        p, self._p = self._p, None
        if p is None:
            return
        for target in (p.put, p.writer):
            if target is not None:
                try:
                    target.abort()
                except Exception:  # the prompt is gone either way; leases lapse at their ttl
                    log.warning("aborting a stage's KV writes failed", exc_info=True,
                                extra={"request_id": p.request_id})
