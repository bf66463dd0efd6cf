"""The classic two-phase put, the client's half: `PutStart` (the master allocates), the client
writes the bytes itself, then `PutEnd` (publish) or `PutRevoke` (free). Two master round trips
per batch (one of each, batched); it serves puts too large for a leased extent, `most_free`
placement, and puts whose space lease was lost (`spacewriter` takes the rest).

Each object's first replica computes its checksum while it copies; the others just copy. A
replica whose write fails revokes its put (the master would reclaim the space after its put
timeout anyway) and answers the transfer error for that object only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_k8s.common.errors import ObjectExists, StoreError, TransferError
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.errors import end_errors, start_error
from mooncake_k8s.store.wire import location
from mooncake_k8s.transfer import Peer, WriteOp

Results = list[Exception | None]
ByPeer = dict[str, tuple[Peer, list[tuple[int, WriteOp]]]]
"""(peer address) -> the peer and its writes, each with the index of its object."""


class ClassicWriter:
    """Puts the two-phase way; thread-safe (it keeps no state between puts). `call(method,
    request)` is the client's master call, `write(peer, ops)` its checksummed write to one peer
    (a TransferError marks the peer failed)."""

    def __init__(
        self, call: Callable[[str, Any], Any],
        write: Callable[[Peer, list[WriteOp]], list[int]], host_id: str,
    ) -> None:
        self._call = call
        self._write_to = write
        self._host_id = host_id

    def put(
        self, keys: Sequence[str], views: Sequence[memoryview], replicas: int, placement: int,
        preferred_segment: str, segments: Sequence[str] = (), tenant: str = "",
    ) -> Results:
        """A result per key: None when it is stored, else the exception for it. (The caller
        validated the shape and sizes.)"""
        try:
            starts = self._start(keys, views, replicas, placement, preferred_segment, segments,
                                 tenant)
        except StoreError as e:
            return [e] * len(keys)
        results: Results = [None] * len(keys)
        pending, by_peer = self._plan(keys, views, starts, results)
        sums, failed = self._write(by_peer, results)
        for i in pending:
            if i in failed:
                self._revoke(keys[i], starts[i].ok.put_id)
        written = [i for i in pending if i not in failed]
        self._end(keys, [(i, starts[i].ok.put_id, sums[i]) for i in written], results)
        return results

    def _start(
        self, keys: Sequence[str], views: Sequence[memoryview], replicas: int, placement: int,
        preferred_segment: str, segments: Sequence[str], tenant: str = "",
    ) -> list[pb.PutStartResult]:
        """PutStart for every key (one call, batched when there are several)."""
        reqs = [
            pb.PutStartRequest(
                key=k, size=len(v), replicas=replicas, placement=placement,  # type: ignore[arg-type]
                preferred_segment=preferred_segment, client_host_id=self._host_id,
                segments=segments, tenant=tenant,
            )
            for k, v in zip(keys, views, strict=True)
        ]
        if len(reqs) == 1:
            return [pb.PutStartResult(ok=self._call("PutStart", reqs[0]))]
        return list(self._call("BatchPutStart", pb.BatchPutStartRequest(items=reqs)).results)

    @staticmethod
    def _plan(
        keys: Sequence[str], views: Sequence[memoryview], starts: Sequence[pb.PutStartResult],
        results: Results,
    ) -> tuple[list[int], ByPeer]:
        """The objects the master placed (their indexes) and their writes grouped by peer; a
        refused or already stored object gets its answer in `results` now."""
        by_peer: ByPeer = {}
        pending: list[int] = []
        for i, res in enumerate(starts):
            if res.error:
                results[i] = start_error(keys[i], res.code, res.error)
                continue
            if res.ok.exists:
                how = "is being written by another client" if res.ok.in_progress else (
                    "already exists")
                results[i] = ObjectExists(f"object {keys[i]!r} {how}")
                continue
            pending.append(i)
            for r in res.ok.replicas:
                loc = location(r)
                entry = by_peer.setdefault(loc.peer.address, (loc.peer, []))
                entry[1].append((i, WriteOp(loc.segment, loc.offset, views[i])))
        return pending, by_peer

    def _write(self, by_peer: ByPeer, results: Results) -> tuple[dict[int, int], set[int]]:
        """Write every peer's share: (checksum per object, objects with a failed replica)."""
        sums: dict[int, int] = {}
        failed: set[int] = set()
        for peer, items in by_peer.values():
            try:
                got = self._write_to(peer, [op for _, op in items])
            except TransferError as e:
                for i, _ in items:
                    failed.add(i)
                    results[i] = e
                continue
            for (i, _), s in zip(items, got, strict=True):
                sums.setdefault(i, s)
        return sums, failed

    def _end(self, keys: Sequence[str], written: list[tuple[int, int, int]],
             results: Results) -> None:
        """PutEnd for each written object, as (index, put id, checksum); its answer in
        `results`."""
        if not written:
            return
        ends = [pb.PutEndRequest(key=keys[i], put_id=put_id, checksum=checksum)
                for i, put_id, checksum in written]
        errors: Results
        try:
            if len(ends) == 1:
                self._call("PutEnd", ends[0])
                errors = [None]
            else:
                resp = self._call("BatchPutEnd", pb.BatchPutEndRequest(items=ends))
                errors = list(end_errors([keys[i] for i, _, _ in written], resp))
        except ObjectExists as e:  # another put of the key ended first: it is stored
            errors = [e]
        except StoreError as e:
            errors = [StoreError(f"publishing {keys[i]!r}: {e}") for i, _, _ in written]
        for (i, _, _), err in zip(written, errors, strict=False):
            results[i] = err

    def _revoke(self, key: str, put_id: int) -> None:
        # On failure the master reclaims the space after its put timeout anyway.
        with contextlib.suppress(StoreError):
            self._call("PutRevoke", pb.PutRevokeRequest(key=key, put_id=put_id))
