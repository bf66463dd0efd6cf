"""Keeping what a reader fetched from another host: hot-block replication, the client's half.

`StoreClient.batch_get_into(keys, bufs, keep_on=segment)` reads each object from its nearest
replica; every object it had to read from another host is then added as a replica on `keep_on`
(a segment on the reader's host), from the bytes just read, before the call returns. The next
reader on this host then reads it through shared memory instead of over the network. The
protocol (`master.replicas`): `ReplicaStart` allocates on the segment, only from free room under
its watermark (it never evicts), the reader writes the bytes, `ReplicaEnd` checks their checksum
against the object's and adds the replica.

Keeping is an optimisation, never part of the read: whatever goes wrong (no room, the object
removed meanwhile, the segment unknown, a write or master failure) is counted and logged at
debug, and the read's answer stands. Objects that have a replica on the segment's host already
are skipped (counted apart: nothing went wrong).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_k8s.common.errors import InvalidArgument, StoreError, TransferError
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.wire import Location, ObjectInfo, location
from mooncake_k8s.transfer import Peer, WriteOp

log = logging.getLogger(__name__)

Item = tuple[str, ObjectInfo, memoryview]
"""(key, the object as it was read, its bytes)."""


class Keeper:
    """Adds replicas of objects just read; thread-safe. `call(method, request)` is the client's
    master call, `write(peer, ops)` its checksummed write (a TransferError marks the peer
    failed). Its counters are what a worker exports: `kept` (replicas added), `skipped`
    (already on that host) and `failures` (could not keep), with `last_error` saying why."""

    def __init__(self, call: Callable[[str, Any], Any],
                 write: Callable[[Peer, list[WriteOp]], list[int]]) -> None:
        self._call = call
        self._write = write
        self._lock = threading.Lock()
        self.kept = 0
        self.skipped = 0
        self.failures = 0
        self.last_error = ""

    def keep(self, segment: str, items: Sequence[Item]) -> dict[str, Location]:
        """Add a replica of each object on `segment`; the new replicas' locations by key."""
        if not items:
            return {}
        try:
            resp = self._call("ReplicaStart", pb.ReplicaStartRequest(
                keys=[k for k, _, _ in items], segment=segment))
        except (StoreError, InvalidArgument) as e:
            self.count(failures=len(items), why=f"keeping {len(items)} objects on "
                                                  f"{segment!r}: {e}")
            return {}
        ends, locs = self._write_all(items, resp.results)
        if not ends:
            return {}
        try:
            done = self._call("ReplicaEnd", pb.ReplicaEndRequest(items=ends))
        except (StoreError, InvalidArgument) as e:
            self.count(failures=sum(not it.revoke for it in ends),
                        why=f"ending {len(ends)} replicas on {segment!r}: {e}")
            return {}
        kept: dict[str, Location] = {}
        for it, code, msg in zip(ends, done.codes, done.errors, strict=False):
            if it.revoke:
                continue
            if code == pb.ERROR_NONE and not msg:
                kept[it.key] = locs[it.key]
            elif code == pb.ERROR_EXISTS:
                self.count(skipped=1)
            else:
                self.count(failures=1, why=msg)
        self.count(kept=len(kept))
        return kept

    def _write_all(
        self, items: Sequence[Item], results: Sequence[pb.ReplicaStartResult]
    ) -> tuple[list[pb.ReplicaEndItem], dict[str, Location]]:
        """Write each started replica: the ReplicaEnd items (revoking those that failed) and
        where each one went."""
        by_peer: dict[str, tuple[Peer, list[tuple[str, int, WriteOp]]]] = {}
        locs: dict[str, Location] = {}
        ends: list[pb.ReplicaEndItem] = []
        for (key, info, view), res in zip(items, results, strict=False):
            if res.code == pb.ERROR_EXISTS:
                self.count(skipped=1)
                continue
            if res.code != pb.ERROR_NONE or not res.replica_id:
                self.count(failures=1, why=res.error)
                continue
            if (res.size, res.checksum) != (info.size, info.checksum):  # another object now
                ends.append(pb.ReplicaEndItem(key=key, replica_id=res.replica_id, revoke=True))
                self.count(failures=1, why=f"object {key!r} changed since it was read")
                continue
            loc = locs[key] = location(res.replica)
            entry = by_peer.setdefault(loc.peer.address, (loc.peer, []))
            entry[1].append((key, res.replica_id, WriteOp(loc.segment, loc.offset,
                                                          view[: info.size])))
        for peer, ops in by_peer.values():
            try:
                sums = self._write(peer, [op for _, _, op in ops])
            except TransferError as e:
                ends += [pb.ReplicaEndItem(key=k, replica_id=r, revoke=True) for k, r, _ in ops]
                self.count(failures=len(ops), why=f"writing to {peer.address}: {e}")
                continue
            ends += [pb.ReplicaEndItem(key=k, replica_id=r, checksum=s)
                     for (k, r, _), s in zip(ops, sums, strict=True)]
        return ends, locs

    def count(self, kept: int = 0, skipped: int = 0, failures: int = 0, why: str = "") -> None:
        with self._lock:
            self.kept += kept
            self.skipped += skipped
            self.failures += failures
            if why:
                self.last_error = why
        if why:
            log.debug("block not kept", extra={"reason": why, "objects": failures})
