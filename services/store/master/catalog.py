"""The master's shared records and the few primitives every part changes them through.

`state.MasterState` is made of parts (`membership`, `tiering`, `puts`, `spaces`) that each own
their own records (pending puts, copies, space leases) and work on these shared ones: the nodes,
segments and objects, the id sequence, the event outbox and the counters. A part gets the
`Catalog` at construction and uses only what is public here, so what one part may do to another's
objects is written down once: drop or free a replica, publish an object, queue a node command,
emit a block event.

Nothing here takes the lock by itself except `op`; every caller already holds it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.events import EventHub
from mooncake_k8s.store.master.records import Node, Obj, Rep, Segment, rep_pb

_EV = pb.BlockEvent
_CMD = pb.NodeCommand


class Catalog:
    """Nodes, segments, objects and what changes them consistently; see the module docstring."""

    def __init__(self, *, now: Callable[[], float], wall: Callable[[], float], first_id: int,
                 event_queue: int) -> None:
        self.now = now
        self.wall = wall
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self.nodes: dict[str, Node] = {}
        self.segments: dict[str, Segment] = {}
        self.objects: dict[str, Obj] = {}
        # Put, lease and command ids share one sequence (see MasterState for its start).
        self._ids = itertools.count(first_id)
        self.seq = 0
        self.hub = EventHub(event_queue)
        self._outbox: list[pb.BlockEvent] = []
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.spills = 0
        self.promotions = 0
        self.hidden_objects = 0

    def new_id(self) -> int:
        return next(self._ids)

    @contextlib.contextmanager
    def op(self) -> Iterator[None]:
        """Hold the lock; the block events emitted meanwhile go out when it is released."""
        with self.lock:
            try:
                yield
            finally:
                if self._outbox:
                    self.hub.publish(self._outbox)
                    self._outbox = []

    def emit(self, kind: int, key: str, size: int, seg: Segment) -> None:
        self.seq += 1
        if self.hub.active:
            self._outbox.append(
                _EV(
                    seq=self.seq, kind=kind, key=key, node_id=seg.node.node_id,  # type: ignore[arg-type]
                    segment=seg.name, tier=seg.tier, size=size,  # type: ignore[arg-type]
                    unix_ms=int(self.wall() * 1000),
                )
            )

    def command(self, node: Node, kind: int, key: str, seg: Segment, offset: int, size: int,
                checksum: int = 0, src: Rep | None = None, remote: bool = False) -> int:
        """Queue a command for `node` (if it is alive) and wake its stream; returns its id.
        With `remote`, the COPY's source is on another node: described in full (fan-out)."""
        cmd_id = next(self._ids)
        if node.alive:
            cmd = _CMD(
                id=cmd_id, kind=kind, key=key, segment=seg.name, offset=offset, size=size,  # type: ignore[arg-type]
                checksum=checksum, src_segment=src.seg.name if src else "",
                src_offset=src.offset if src else 0,
            )
            if remote and src is not None:
                cmd.src_replica.CopyFrom(rep_pb(src))
            node.commands.append(cmd)
            self.wake(node)
        return cmd_id

    def wake(self, node: Node) -> None:
        """Wake whoever waits on the node's command stream (a thread, or its stream's waker)."""
        self.cond.notify_all()
        if node.waker is not None:
            node.waker()

    def free_rep(self, obj: Obj, rep: Rep, committed: bool = True) -> None:
        seg = rep.seg
        if seg.alive:
            size = obj.size
            seg.alloc.free(rep.offset, size)
            if committed:
                self.command(seg.node, _CMD.FREED, obj.key, seg, rep.offset, size)

    def drop_rep(self, obj: Obj, rep: Rep, kind: int) -> None:
        """Take one replica away from a visible object (evicted, node gone, spilled away)."""
        reps = obj.reps
        reps.remove(rep)
        self.free_rep(obj, rep)
        obj.set_reps(reps)
        seg = rep.seg
        seg.count -= 1  # its queue entry is stale now; scans skip it
        if kind:
            self.emit(kind, obj.key, obj.size, seg)
        if not reps and self.objects.get(obj.key) is obj:
            del self.objects[obj.key]

    def release_hidden(self, obj: Obj) -> None:
        """Free the replicas of a removed object whose last lease ended."""
        for rep in obj.reps:
            self.free_rep(obj, rep)
        obj.set_reps([])
        self.hidden_objects -= 1

    def publish(self, key: str, size: int, checksum: int, reps: list[Rep]) -> None:
        """Make a written object visible: lookups see it, its nodes and watchers hear of it."""
        obj = Obj(key, size, checksum, reps)
        self.objects[key] = obj
        for rep in reps:
            seg = rep.seg
            seg.enqueue(obj)
            self.command(seg.node, _CMD.COMMITTED, key, seg, rep.offset, size, checksum)
            self.emit(_EV.STORED, key, size, seg)
