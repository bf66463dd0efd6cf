"""Replicas added to stored objects: the paper's hot-block replication, the master's half.

A reader that fetched objects from another host keeps them on its own (`StoreClient.
batch_get_into(keep_on=...)`), so the next reader there reads them through shared memory:

    replica_start(keys, segment) ──> space on `segment` per object (invisible), or a refusal
    the reader writes the bytes it just read there, then
    replica_end([(key, id, checksum), ...]) ──> the replica joins its object (STORED event)
                └──revoke / timeout / the object or the segment's node gone──> space freed

What makes this safe to do on every read:
- the space comes only from free room under the segment's high watermark (`TierPolicy.
  alloc_free`): keeping a block never evicts, spills or drops anything;
- an object that already has a replica on the segment's host, or one being added there, is
  refused (ERROR_EXISTS): one copy per host is enough for locality;
- `replica_end` publishes only bytes whose checksum is the object's, and only while the object
  it started for is still the stored one (a key removed and put again meanwhile is another
  object): nothing but the object's own bytes becomes readable.

Once added, a replica is like any other: it is evicted or removed on its own (an EVICTED or
REMOVED event for its segment only), the node hears of it (COMMITTED) and lists it in its
inventory, so a restarted master rebuilds it, and with HA the leader journals it before it
answers (`servicer`), so it survives a failover like a put's replicas.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.records import Node, Obj, Rep, Segment, check_key, rep_pb
from mooncake_k8s.store.master.tiering import TierPolicy

log = logging.getLogger(__name__)

_EV = pb.BlockEvent
_CMD = pb.NodeCommand


class Adding:
    """A replica being added: its object, where it goes, until when."""

    __slots__ = ("deadline", "host", "incarnation", "obj", "rep", "replica_id")

    def __init__(self, replica_id: int, obj: Obj, rep: Rep, deadline: float) -> None:
        self.replica_id = replica_id
        self.obj = obj
        self.rep = rep
        self.incarnation = rep.seg.node.incarnation
        self.host = rep.seg.node.host_id  # as it was when the replica started
        self.deadline = deadline


class ReplicaAdds:
    """`replica_start` / `replica_end` and the replicas being added; a part of
    `state.MasterState` (its lock is held around every public method, through `Catalog.op`)."""

    def __init__(self, catalog: Catalog, tiers: TierPolicy, *, timeout_s: float) -> None:
        self._cat = catalog
        self._tiers = tiers
        self.timeout_s = timeout_s
        self._adding: OrderedDict[int, Adding] = OrderedDict()  # deadline order
        self._hosts: set[tuple[str, str]] = set()  # (key, host) of every replica being added

    def replica_start(self, keys: Sequence[str], segment: str) -> list[pb.ReplicaStartResult]:
        """Space on `segment` for a new replica of each object; a refusal per item (see the
        module docstring). An unknown or empty segment name refuses the whole call."""
        if not segment:
            raise InvalidArgument("segment is empty: name the segment the replicas go to")
        with self._cat.op():
            seg = self._cat.segments.get(segment)
            if seg is None:
                raise InvalidArgument(f"segment {segment!r} is not registered with the master")
            return [self._start_one(key, seg) for key in keys]

    def _start_one(self, key: str, seg: Segment) -> pb.ReplicaStartResult:
        try:
            check_key(key)
        except InvalidArgument as e:
            return pb.ReplicaStartResult(code=pb.ERROR_INVALID, error=str(e))
        obj = self._cat.objects.get(key)
        if obj is None or obj.hidden:
            return pb.ReplicaStartResult(code=pb.ERROR_NOT_FOUND,
                                         error=f"object {key!r} not found")
        host = seg.node.host_id
        if self._on_host(obj, host):
            return pb.ReplicaStartResult(
                code=pb.ERROR_EXISTS,
                error=f"object {key!r} has a replica on host {host!r} already (or one is "
                      "being added there)")
        size = obj.size
        off = self._tiers.alloc_free(seg, size) if seg.alloc.capacity >= size else None
        if off is None:
            return pb.ReplicaStartResult(
                code=pb.ERROR_NO_SPACE,
                error=f"segment {seg.name!r} has no free room for {size} bytes under its high "
                      "watermark (an added replica never evicts)")
        rep = Rep(seg, off)
        add = Adding(self._cat.new_id(), obj, rep, self._cat.now() + self.timeout_s)
        self._adding[add.replica_id] = add
        self._hosts.add((key, host))
        return pb.ReplicaStartResult(replica_id=add.replica_id, replica=rep_pb(rep), size=size,
                                     checksum=obj.checksum)

    def _on_host(self, obj: Obj, host: str) -> bool:
        """Whether `obj` has a replica on `host`, or one is being added there."""
        return ((obj.key, host) in self._hosts
                or any(r.seg.node.host_id == host for r in obj.reps))

    def replica_end(
        self, items: Sequence[pb.ReplicaEndItem]
    ) -> tuple[pb.ReplicaEndResponse, list[tuple[str, str]]]:
        """Add (or with `revoke`, abandon) each started replica: an error and a code per item
        ("" and ERROR_NONE when it was added or revoked), and (key, segment) of each replica
        added (what an HA leader journals before it answers)."""
        errors: list[str] = []
        codes: list[int] = []
        added: list[tuple[str, str]] = []
        with self._cat.op():
            for it in items:
                err, code, seg = self._end_one(it)
                errors.append(err)
                codes.append(code)
                if seg is not None:
                    added.append((it.key, seg.name))
        resp = pb.ReplicaEndResponse(errors=errors, codes=codes)  # type: ignore[arg-type]
        return resp, added

    def retract(self, added: Sequence[tuple[str, str]]) -> None:
        """Take back replicas just added, (key, segment) each (an HA leader could not journal
        them): an EVICTED event each, the object keeps its other replicas."""
        with self._cat.op():
            for key, segment in added:
                obj = self._cat.objects.get(key)
                seg = self._cat.segments.get(segment)
                if obj is not None and seg is not None and obj.on(seg) and len(obj.reps) > 1:
                    self._cat.drop_rep(obj, obj.rep_on(seg), _EV.EVICTED)

    def _end_one(self, it: pb.ReplicaEndItem) -> tuple[str, int, Segment | None]:
        add = self._adding.get(it.replica_id)
        if add is None:
            return (f"replica {it.replica_id} is unknown: already ended, timed out, or its "
                    "object or node left"), pb.ERROR_NOT_FOUND, None
        if add.obj.key != it.key:
            return f"replica {it.replica_id} is for another key", pb.ERROR_INVALID, None
        self._forget(add)
        if it.revoke:
            self._free(add)
            return "", pb.ERROR_NONE, None
        refusal = self._refusal(add, it.checksum)
        if refusal is not None:
            self._free(add)
            return *refusal, None
        obj, rep = add.obj, add.rep
        seg = rep.seg
        obj.set_reps([*obj.reps, rep])
        seg.enqueue(obj)
        self._cat.command(seg.node, _CMD.COMMITTED, obj.key, seg, rep.offset, obj.size,
                          obj.checksum)
        self._cat.emit(_EV.STORED, obj.key, obj.size, seg)
        return "", pb.ERROR_NONE, seg

    def _refusal(self, add: Adding, checksum: int) -> tuple[str, int] | None:
        """Why a written replica may not join its object, or None."""
        obj, seg = add.obj, add.rep.seg
        key = obj.key
        if (self._cat.objects.get(key) is not obj or obj.hidden or not seg.alive
                or seg.node.incarnation != add.incarnation):
            return f"object {key!r} or its new replica's node left meanwhile", pb.ERROR_NOT_FOUND
        if checksum != obj.checksum:
            return (f"object {key!r}: the bytes written have checksum {checksum:#x}, not the "
                    f"object's {obj.checksum:#x}"), pb.ERROR_INVALID
        if any(r.seg.node.host_id == seg.node.host_id for r in obj.reps):
            return f"object {key!r} got a replica on that host meanwhile", pb.ERROR_EXISTS
        return None

    def _forget(self, add: Adding) -> None:
        del self._adding[add.replica_id]
        self._hosts.discard((add.obj.key, add.host))

    def _free(self, add: Adding) -> None:
        seg = add.rep.seg
        if seg.alive and seg.node.incarnation == add.incarnation:
            seg.alloc.free(add.rep.offset, add.obj.size)

    # -- for the other parts -------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Free replicas not ended in time (they are kept in deadline order)."""
        while self._adding:
            add = next(iter(self._adding.values()))
            if add.deadline > now:
                break
            self._forget(add)
            log.info("added replica timed out", extra={"key": add.obj.key,
                                                        "segment": add.rep.seg.name})
            self._free(add)

    def cancel_on(self, node: Node) -> None:
        """Forget the replicas being added on `node` (it died or restarted: what was written
        there is gone); their space is freed where the segment is still the master's."""
        for add in [a for a in self._adding.values() if a.rep.seg.node is node]:
            self._forget(add)
            seg = add.rep.seg
            if seg.alive:
                seg.alloc.free(add.rep.offset, add.obj.size)

    @property
    def adding(self) -> int:
        return len(self._adding)
