"""A writer of some byte ranges of objects another process leased (a pipeline stage's KV).

A prefill group computes each block's layers on several hosts. The leader's `StreamPut` leases
the space of every new block and hands out its `plan()`; each other stage builds a
`PlanWriter` from it and its own encodings of the blocks (`views`, the same layout as the
leader's), and says which ranges are final as it computes them (`ready`, LayerSink-compatible:
one layer of one block at a time). A background sender writes each range into every replica
through the client's transfer engine (authenticated by the cluster token; shared memory for a
replica on this host), overlapping the caller's next layer, and checks that every replica got
exactly those bytes (the receiver's xxh3-64 of each range against ours). `finish` then says, per
object, whether every byte made ready reached every replica; the stage reports that to the
leader, which reads the ranges back from its nearest replica (`StreamPut.fill_remote`), writes
the headers and commits. A PlanWriter never commits anything, so a range it failed to write
only ever costs the leader that object (never committed).

Every wait is bounded by the transfer engine's io timeout (a replica's node that stops
answering fails its writes within it); a node that failed once is not written to again by this
writer, so a vanished node costs one timeout, not one per layer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import InvalidArgument, TransferError
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.client.plan import decode_plan
from mooncake_k8s.store.client.streamput import StreamFailed
from mooncake_k8s.transfer import Peer, WriteOp

_STOP = None

_Item = tuple[int, int, int, Any]


class PlanWriter:
    """Writes ranges of the objects of a `StreamPut.plan()` into every replica. Use:
    `ready(i, start, end)` as ranges of `views[i]` become final (each byte once, any order),
    then `finish()`; or `abort()`. `bytes_written` counts bytes that reached a replica
    (each replica counted: what this process wrote), `written[i]` the bytes of object i in
    every replica."""

    def __init__(self, client: StoreClient, plan: bytes, views: Sequence[Any]) -> None:
        self._objects = decode_plan(plan)
        if len(views) != len(self._objects):
            raise InvalidArgument(
                f"{len(views)} views for a plan of {len(self._objects)} objects")
        self.views = [byte_view(v) for v in views]
        for i, (v, o) in enumerate(zip(self.views, self._objects, strict=True)):
            if len(v) != o.size:
                raise InvalidArgument(
                    f"view {i} has {len(v)} bytes, the plan's object {i} has {o.size}")
        self._client = client
        self._errors: list[Exception | None] = [None] * len(self._objects)
        self._dead: dict[str, Exception] = {}
        self.written = [0] * len(self._objects)
        self.bytes_written = 0
        self._closed = False
        self._aborted = False
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-plan-write", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------------

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        """Bytes [start, end) of object `index` are final in its view (or will be once
        `event`, a CUDA event, completes): write them to every replica. InvalidArgument for
        a range outside its object; ignored once the writer finished or was aborted."""
        if not 0 <= index < len(self.views):
            raise InvalidArgument(f"object index {index} outside 0..{len(self.views) - 1}")
        if not 0 <= start < end <= len(self.views[index]):
            raise InvalidArgument(f"range [{start}, {end}) outside object {index} "
                                  f"of {len(self.views[index])} bytes")
        if not self._closed:
            self._queue.put((index, start, end, event))

    def finish(self) -> list[Exception | None]:
        """Wait for every range made ready to be written (each write bounded by the
        transfer engine's io timeout); a result per object: None when every byte made
        ready reached every replica, else StreamFailed saying what did not."""
        self._stop()
        if self._aborted:
            return [StreamFailed("the plan writer was aborted")] * len(self.views)
        return list(self._errors)

    def abort(self) -> None:
        """Stop: ranges not written yet are dropped (a write under way ends within the io
        timeout). Idempotent."""
        self._aborted = True
        self._stop()

    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()

    # -- the sender thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while item is not _STOP and not self._queue.empty():
                item = self._queue.get()
                batch.append(item)
            if not self._aborted:
                try:
                    self._send([b for b in batch if b is not None])
                except Exception as e:  # never leave a caller waiting on a dead thread
                    for i, *_ in (b for b in batch if b is not None):
                        self._fail(i, StreamFailed(f"writing object {i} failed: {e}"))
            if batch[-1] is _STOP:
                return

    def _send(self, items: list[_Item]) -> None:
        """Write every range to every replica of its object: one transfer call per peer."""
        for *_, event in items:
            if event is not None:
                event.synchronize()
        by_peer: dict[str, tuple[Peer, list[int], list[WriteOp], list[int]]] = {}
        live: list[tuple[int, int, int]] = []
        for i, start, end, _ in items:
            if self._errors[i] is not None:
                continue  # failed already: the leader will not commit it anyway
            src = self.views[i][start:end]
            want = checksum(src)
            for r in self._objects[i].replicas:
                dead = self._dead.get(r.peer.address)
                if dead is not None:
                    self._fail(i, self._failure(i, r.peer, dead))
                    continue
                got = by_peer.setdefault(r.peer.address, (r.peer, [], [], []))
                got[1].append(i)
                got[2].append(WriteOp(r.segment, r.offset + start, src))
                got[3].append(want)
            live.append((i, start, end))
        for peer, idx, ops, want_sums in by_peer.values():
            self._write(peer, idx, ops, want_sums)
        for i, start, end in live:
            if self._errors[i] is None:
                self.written[i] += end - start
                self.bytes_written += (end - start) * len(self._objects[i].replicas)

    def _write(self, peer: Peer, idx: list[int], ops: list[WriteOp], want: list[int]) -> None:
        try:
            sums = self._client.engine.write(peer, ops, with_checksum=True)
        except TransferError as e:
            self._client._failed(peer)
            self._dead[peer.address] = e
            for i in idx:
                self._fail(i, self._failure(i, peer, e))
            return
        for n, i in enumerate(idx):
            if sums is None or sums[n] != want[n]:
                self._fail(i, StreamFailed(
                    f"object {i}: node {peer.node_id} ({peer.address}) stored other bytes "
                    "than were written"))

    @staticmethod
    def _failure(i: int, peer: Peer, e: Exception) -> StreamFailed:
        return StreamFailed(f"writing object {i} to node {peer.node_id} ({peer.address}) "
                            f"failed: {e}")

    def _fail(self, i: int, e: Exception) -> None:
        if self._errors[i] is None:
            self._errors[i] = e
