"""The embedded engine's prefill behind the engine seam (`engine.api`): KV through the worker's
store client, in its process.

Prefill follows the plan: it reads the `reuse_blocks` leading blocks the plan names straight
into staging memory (no "which exist?" round trip to the master; blocks read from another host
are kept on this one when the plan says `keep_fetched`), the engine verifies them and
recomputes from the first one missing or corrupt.

Where the new KV goes (issue 20's copies by host): every new full block gets one replica in
the plan's `home_segment` (this prefill's own host: a repeat here crosses no network) and one
in its `write_segment` (the decode's host: decode loads it locally); the partial tail, which
only this request's decode needs, goes to `write_segment` alone.

Layer-wise (`EngineConfig.layerwise_kv`, MOONCAKE_KV_LAYERWISE): the blocks are streamed to
those segments while they are computed, each layer's slice as soon as the layer is done
(`layerexport` on the engine's side, `store.client.streamput` on the store's), so the
transfer overlaps the rest of the forward pass and only the headers and one commit remain
after it. Whatever the stream could not store is put the plain way after the prefill; with
streaming off, everything is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mooncake_k8s.common import tracing
from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import ObjectExists, StoreError
from mooncake_k8s.engine.api import (
    EngineCounter,
    EngineLoad,
    KVStore,
    PrefillDone,
    PrefillWork,
)
from mooncake_k8s.engine.embedded.adapter import _Embedded, sampling_from_pb, tail_key
from mooncake_k8s.engine.embedded.structs import EngineConfig, PrefillResult
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.client.streamput import StreamPut

log = logging.getLogger(__name__)


_NOT_STORED = StoreError("not stored yet")


def _redo(result: Exception | None) -> bool:
    """Whether an object must still be put (neither stored nor stored by someone else)."""
    return result is not None and not isinstance(result, ObjectExists)


def _segments(*names: str) -> list[str]:
    """The distinct non-empty segment names, in order."""
    return list(dict.fromkeys(n for n in names if n))


def open_stream(store: StoreClient, work: PrefillWork, first_block: int,
                views: Sequence[memoryview], tail: bool) -> StreamPut:
    """The streamed put of a prefill's new blocks from `first_block` (their encodings are
    `views`, the tail's last when `tail`): full blocks on the plan's home and write segments,
    the tail on the write segment only."""
    plan = work.plan
    full = len(views) - int(tail)
    keys = list(plan.keys[first_block:first_block + full])
    segs = [_segments(plan.home_segment, plan.write_segment)] * full
    if tail:
        keys.append(tail_key(work.request_id))
        segs.append(_segments(plan.write_segment))
    return StreamPut(store, keys, views, segs,
                     placement="preferred" if plan.write_segment else "local_first",
                     preferred_segment=plan.write_segment, tenant=work.tenant)


class _StreamSink:
    """The engine's `LayerSink` feeding one `StreamPut`; the put starts once the engine says
    which blocks it will compute (after verifying the imported ones)."""

    def __init__(self, store: StoreClient, work: PrefillWork) -> None:
        self.store, self.work = store, work
        self.put: StreamPut | None = None

    def open(self, first_block: int, views: Sequence[memoryview], tail: bool) -> None:
        self.put = open_stream(self.store, self.work, first_block, views, tail)

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        assert self.put is not None
        self.put.ready(index, start, end, event)


class BlockReader:
    """Reads a prompt's leading blocks into one grow-only staging buffer (a single prefill at
    a time uses it: the engine copies imported KV out before the next read)."""

    def __init__(self, store: KVStore, block_bytes: int) -> None:
        self.store = store
        self.block_bytes = block_bytes
        self._staging = np.empty(0, dtype=np.uint8)

    def _views(self, n: int) -> list[memoryview]:
        """Views over the buffer; reusing it, a prefill never pays for fresh pages."""
        size = self.block_bytes
        self.store.wait_kept()  # a keep of the last prefill may still read these bytes
        if self._staging.nbytes < n * size:
            self._staging = np.empty(n * size, dtype=np.uint8)
        mv = byte_view(self._staging, writable=True)
        return [mv[i * size:(i + 1) * size] for i in range(n)]

    def read(self, keys: Sequence[str], keep_on: str) -> list[memoryview]:
        """The leading blocks, read straight into staging memory; the first miss ends them.
        Blocks read from another host are kept on `keep_on` (hot-block replication). The
        store verified each object's bytes against its checksum as it read them."""
        if not keys:
            return []
        views = self._views(len(keys))
        try:
            # Kept in the background while the engine computes (`_views` waits).
            sizes = self.store.batch_get_into(list(keys), views, keep_on=keep_on,
                                              keep_later=True)
        except StoreError as e:
            log.warning("reading cached blocks failed; computing everything",
                        extra={"error": str(e)})
            return []
        out: list[memoryview] = []
        for v, size in zip(views, sizes, strict=True):
            if size is None:
                break
            out.append(v[:size])
        return out


def prefill_done(res: PrefillResult, tail: str, stored: int, imported: int,
                 times: tuple[float, float, float]) -> PrefillDone:
    """The seam's answer for a prefill's result (`times`: load, compute, store seconds)."""
    return PrefillDone(
        first_token=res.first_token, text=res.text, finished=res.finished,
        finish_reason=res.finish_reason or "", cached_tokens=res.cached_tokens,
        computed_tokens=res.computed_tokens, tail_key=tail, stored_blocks=stored,
        imported_blocks=imported, rejected_blocks=res.rejected_blocks, load_s=times[0],
        compute_s=times[1], store_s=times[2],
    )


class EmbeddedPrefill(_Embedded):
    """One prefill at a time (the service serialises calls)."""

    def __init__(self, config: EngineConfig, store: KVStore) -> None:
        super().__init__(config, store)
        self._reader = BlockReader(store, self.block_bytes)
        self.layerwise = config.layerwise_kv and isinstance(store, StoreClient)
        self.streamed_objects = 0
        self.stream_fallbacks = 0

    def load(self) -> EngineLoad:
        return EngineLoad()

    def counters(self) -> list[EngineCounter]:
        return [
            EngineCounter("mooncake_prefill_kv_streamed_total",
                          "KV blocks (tails included) stored layer by layer during prefill",
                          self.streamed_objects),
            EngineCounter("mooncake_prefill_kv_stream_fallbacks_total",
                          "KV blocks a layer-wise stream could not store, put after prefill",
                          self.stream_fallbacks),
        ]

    def prefill(self, work: PrefillWork) -> PrefillDone:
        t0 = time.monotonic()
        plan = work.plan
        with tracing.span("prefill.load_kv", planned=plan.planned):
            n = plan.reuse_blocks if plan.planned else self._lookup(list(plan.keys))
            imported = self._read(list(plan.keys[:n]), plan.home_segment
                                  if plan.keep_fetched else "") if n else []
        t1 = time.monotonic()
        sink = _StreamSink(self.store, work) if self.layerwise else None  # type: ignore[arg-type]
        try:
            with tracing.span("prefill.compute", imported_blocks=len(imported)):
                # payload_checked: the store verified the blocks' bytes as it read them
                res = self.engine.prefill(work.token_ids, imported,
                                          sampling_from_pb(work.sampling),
                                          seq_id=work.request_id, sink=sink,
                                          payload_checked=True)
        except BaseException:
            if sink is not None and sink.put is not None:
                sink.put.abort()
            raise
        t2 = time.monotonic()
        with tracing.span("prefill.store_kv", new_blocks=len(res.new_blocks),
                          layerwise=sink is not None):
            stored, tkey = self._store(work, res, sink)
        return prefill_done(res, tkey, stored, len(imported) - res.rejected_blocks,
                            (t1 - t0, t2 - t1, time.monotonic() - t2))

    def _lookup(self, keys: list[str]) -> int:
        """No plan: ask the master how long the stored prefix is."""
        if not keys:
            return 0
        try:
            return self.store.prefix_len(keys)
        except StoreError as e:
            log.warning("prefix lookup failed; computing everything", extra={"error": str(e)})
            return 0

    def _read(self, keys: list[str], keep_on: str) -> list[memoryview]:
        """The leading blocks (`BlockReader.read`)."""
        return self._reader.read(keys, keep_on)

    def _store(self, work: PrefillWork, res: PrefillResult,
               sink: _StreamSink | None) -> tuple[int, str]:
        """Publish the new blocks (home and write segments) and the tail (write segment only).

        A block another prefill stored meanwhile (ObjectExists) is as good as ours: blocks with
        one key hold identical KV. Anything else means decode could not find the KV, so it fails
        the request rather than let decode stall. What the stream committed is done; the rest
        (all of it without a stream) is put here. A finished request's tail is not stored.
        """
        plan = work.plan
        blocks = [(plan.keys[i], data) for i, data in res.new_blocks]
        tail = None
        if res.tail_block is not None and not res.finished:
            tail = (tail_key(work.request_id), res.tail_block)
        results: list[Exception | None] = [_NOT_STORED] * (len(blocks) + 1)
        if sink is not None and sink.put is not None:
            skip = [len(blocks)] if res.tail_block is not None and tail is None else []
            results = [*sink.put.finish(skip=skip), _NOT_STORED][: len(blocks) + 1]
            wanted = len(blocks) + (tail is not None)
            failed = sum(_redo(r) for r in results[:wanted])
            self.streamed_objects += sum(r is None for r in results[:wanted])
            self.stream_fallbacks += failed
            if failed:
                log.warning("layer-wise KV stream could not store every block; putting them",
                            extra={"request_id": work.request_id, "blocks": failed,
                                   "error": str(sink.put.error or "")})
        redo = [i for i in range(len(blocks)) if _redo(results[i])]
        errors = self._put([blocks[i] for i in redo],
                           _segments(plan.home_segment, plan.write_segment), plan.write_segment,
                           work.tenant)
        for i, err in zip(redo, errors, strict=True):
            results[i] = err
        self._put_once_more(blocks, results, plan.write_segment, work.tenant)
        if tail is not None and _redo(results[len(blocks)]):
            results[len(blocks)] = self._put([tail], _segments(plan.write_segment),
                                             plan.write_segment, work.tenant)[0]
        for key, err in zip([k for k, _ in blocks] + [tail[0] if tail else ""], results,
                            strict=True):
            if key and err is not None and not isinstance(err, ObjectExists):
                raise StoreError(f"storing block {key}: {err}") from err
        return sum(r is None for r in results[: len(blocks)]), tail[0] if tail else ""

    def _put_once_more(self, blocks: list[tuple[str, Any]], results: list[Exception | None],
                       write_segment: str, tenant: str) -> None:
        """Blocks whose put failed get one more, a single replica on the write segment (decode
        reads it there). Why: the master places extra copies on any node it still lists, and
        one killed a moment ago (a crashed pipeline stage's worker segment) is listed until its
        heartbeats lapse; a copy there fails the whole object, which the copy decode needs
        must not. The lost extra copy only costs redundancy for these blocks."""
        again = [i for i in range(len(blocks)) if _redo(results[i])]
        if not again:
            return
        log.warning("retrying failed KV puts with one replica on the write segment",
                    extra={"blocks": len(again), "error": str(results[again[0]])})
        errors = self._put([blocks[i] for i in again], _segments(write_segment), write_segment,
                           tenant, replicas=1)
        for i, err in zip(again, errors, strict=True):
            results[i] = err

    def _put(self, items: list[tuple[str, Any]], segments: list[str],
             write_segment: str, tenant: str = "", replicas: int | None = None
             ) -> list[Exception | None]:
        """Plain puts of `items`, a replica on each of `segments`, counted against `tenant`'s
        quota: a result per item."""
        if not items:
            return []
        return self.store.batch_put(
            [k for k, _ in items], [d for _, d in items],
            placement="preferred" if write_segment else "local_first",
            preferred_segment=write_segment or None, segments=segments, tenant=tenant,
            replicas=replicas,
        )
