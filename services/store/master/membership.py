"""Storage nodes as the master sees them: registration, restarts, loss, command streams.

A mixin of `metadata.MasterState`, kept apart because node membership is a concern of its own:
a node (re-)registers with its segments and inventory (`register_node`), may come back as a new
process under the same id (`_reconcile_restart`), may go silent (`_drop_node`), and receives
the master's commands over a stream (`open_command_stream` / `next_commands`) whose copies it
reports back (`command_done`). It runs under the state's lock like everything else there.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.records import (
    DRAM,
    SSD,
    Copy,
    Node,
    Obj,
    Pending,
    Rep,
    Segment,
    check_key,
)

log = logging.getLogger(__name__)

_EV = pb.BlockEvent
_CMD = pb.NodeCommand


class Registration(NamedTuple):
    """What `register_node` did with the node's report."""

    restored: int
    """Inventory objects now known to the master on this node."""
    dropped: int
    """Replicas the node's previous incarnation held that the new one no longer reports."""


class NodeMembership:
    """Node registration, restarts, loss and command streams; see the module docstring."""

    # Provided by MasterState.
    master_id: str
    spills: int
    promotions: int
    evictions: int
    _nodes: dict[str, Node]
    _segments: dict[str, Segment]
    _objects: dict[str, Obj]
    _pending: OrderedDict[int, Pending]
    _pending_keys: dict[str, int]
    _copies: dict[int, Copy]
    _ids: itertools.count[int]
    _lock: threading.Lock
    _cond: threading.Condition
    _closed: bool
    _now: Callable[[], float]
    _cancel_spaces: Callable[[Node], None]  # SpaceLeases (after this class in the MRO)

    def _op(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _emit(self, kind: int, key: str, size: int, seg: Segment) -> None:
        raise NotImplementedError

    def _command(self, node: Node, kind: int, key: str, seg: Segment, offset: int, size: int,
                 checksum: int = 0, src: Rep | None = None) -> int:
        raise NotImplementedError

    def _free_rep(self, obj: Obj, rep: Rep, committed: bool = True) -> None:
        raise NotImplementedError

    def _drop_rep(self, obj: Obj, rep: Rep, kind: int) -> None:
        raise NotImplementedError

    def _end_pending(self, put: Pending, free: bool = True) -> None:
        raise NotImplementedError

    # -- nodes -----------------------------------------------------------------------------

    def register_node(
        self,
        node_id: str,
        address: str,
        host_id: str,
        segments: Sequence[pb.SegmentInfo],
        inventory: Sequence[pb.InventoryItem] = (),
        incarnation: str = "",
        journal: Sequence[pb.InventoryItem] = (),
    ) -> Registration:
        """(Re-)register a node.

        A known node re-registering with the same segments and incarnation (its session to
        this master broke) keeps its objects and its queued commands. With a new incarnation
        the process restarted: it is reconciled with `inventory` (`_reconcile_restart`). With
        different segments it is replaced. Inventory items that cannot be restored (overlap,
        conflict with a stored object, unknown segment) are rejected and the node is sent FREED
        for them.

        `journal` holds commits an HA leader recorded for this node process that its inventory
        may not list yet (the leader failed before the node heard of them, see `ha`): they are
        restored like inventory, unless the node reports something at their location, and sent
        to the node as COMMITTED.
        """
        if not node_id:
            raise InvalidArgument("node_id is empty")
        if not address:
            raise InvalidArgument("address is empty")
        if not segments:
            raise InvalidArgument("a node must register at least one segment")
        names = set()
        for s in segments:
            if not s.name:
                raise InvalidArgument("segment name is empty")
            if s.name in names:
                raise InvalidArgument(f"segment {s.name!r} listed twice")
            names.add(s.name)
            if s.size < 1:
                raise InvalidArgument(f"segment {s.name!r} has size 0")
            if s.tier not in (DRAM, SSD):
                raise InvalidArgument(f"segment {s.name!r} has no tier (DRAM or SSD)")
        with self._op():
            for s in segments:
                owner = self._segments.get(s.name)
                if owner is not None and owner.node.node_id != node_id:
                    raise InvalidArgument(
                        f"segment {s.name!r} is already registered by node {owner.node.node_id!r}"
                    )
            now = self._now()
            old = self._nodes.get(node_id)
            sig = [(s.name, s.tier, s.size, s.path) for s in segments]
            dropped = 0
            if old is not None and [(s.name, s.tier, s.size, s.path) for s in old.segments] == sig:
                node = old
                node.last_seen = now
                if incarnation and node.incarnation and incarnation != node.incarnation:
                    dropped = self._reconcile_restart(node, inventory)
                node.incarnation = incarnation or node.incarnation
                if (node.address, node.host_id) != (address, host_id):
                    node.address, node.host_id = address, host_id
                    for seg in node.segments:
                        seg.refresh()
                        for obj in seg.live():
                            if not isinstance(obj.at, Segment):  # its answer names the node
                                obj.set_reps(obj.reps)
            else:
                if old is not None:
                    self._drop_node(old, "re-registered with different segments")
                node = Node(node_id, address, host_id, now, incarnation)
                for s in segments:
                    seg = Segment(node, s)
                    node.segments.append(seg)
                    self._segments[seg.name] = seg
                self._nodes[node_id] = node
            restored = sum(self._restore(node, item) for item in inventory)
            held = {(it.segment, it.offset) for it in inventory}
            for item in journal:
                if (item.segment, item.offset) in held or not self._restore(node, item):
                    continue
                restored += 1
                self._command(node, _CMD.COMMITTED, item.key, self._segments[item.segment],
                              item.offset, item.size, item.checksum)
            log.info(
                "node registered",
                extra={"node_id": node_id, "address": address, "segments": len(segments),
                       "inventory": len(inventory), "restored": restored, "dropped": dropped},
            )
            return Registration(restored, dropped)

    def _reconcile_restart(self, node: Node, inventory: Sequence[pb.InventoryItem]) -> int:
        """The node's process restarted (same id and segments, new incarnation).

        Its new process holds exactly what it reports, so every replica recorded on it that
        the inventory does not list (same key, segment, offset, size and checksum) is dropped
        now, instead of living on as a phantom that `exists` reports and every read misses.
        Puts that were writing to the old process and copies it was asked to make are
        cancelled (their bytes went to memory that no longer exists); commands queued for the
        old process are discarded and its command stream is ended.
        """
        held = {(it.key, it.segment, it.offset, it.size, it.checksum) for it in inventory}
        for cp in [c for c in self._copies.values() if c.node is node]:
            del self._copies[cp.cmd_id]
            self._cancel_copy(cp)
        self._cancel_spaces(node)
        for put in [p for p in self._pending.values() if any(r.seg.node is node for r in p.reps)]:
            log.info("put cancelled: its node restarted",
                     extra={"key": put.key, "put_id": put.put_id, "node_id": node.node_id})
            self._end_pending(put)
        dropped = 0
        for seg in node.segments:
            for obj in seg.live():
                rep = obj.rep_on(seg)
                if (obj.key, seg.name, rep.offset, obj.size, obj.checksum) not in held:
                    self._drop_rep(obj, rep, _EV.EVICTED)
                    dropped += 1
        node.commands.clear()
        node.stream += 1
        self._wake(node)
        log.warning(
            "node restarted: replicas it no longer holds dropped",
            extra={"node_id": node.node_id, "replicas": dropped, "inventory": len(inventory)},
        )
        return dropped

    def _cancel_copy(self, cp: Copy) -> None:
        """Forget a copy without touching its source replica; the destination is freed."""
        cp.obj.copying = False
        if cp.kind == "spill":
            cp.src.seg.spilling -= cp.src.seg.alloc.rounded(cp.obj.size)
        self._free_rep(cp.obj, cp.dst, committed=False)

    def _restore(self, node: Node, item: pb.InventoryItem) -> int:
        seg = self._segments.get(item.segment)
        reason = ""
        if seg is None or seg.node is not node:
            reason = "unknown segment"
        else:
            existing = self._objects.get(item.key)
            if existing is not None and any(
                r.seg is seg and r.offset == item.offset for r in existing.reps
            ):
                return 1  # already known here
            try:
                check_key(item.key)
            except InvalidArgument as e:
                reason = str(e)
            if not reason and item.size < 1:
                reason = "empty object"
            elif not reason and item.key in self._pending_keys:
                reason = "a put of this key is in progress"
            elif not reason and existing is not None and (
                existing.size != item.size or existing.checksum != item.checksum
            ):
                reason = "conflicts with the stored object of this key"
            elif not reason and existing is not None and any(
                r.seg.node is node for r in existing.reps
            ):
                reason = "the node already holds a replica of this key"
            if not reason:
                try:
                    seg.alloc.reserve(item.offset, item.size)
                except ValueError as e:
                    reason = str(e)
            if not reason:
                rep = Rep(seg, item.offset)
                if existing is None:
                    existing = Obj(item.key, item.size, item.checksum, [rep])
                    self._objects[item.key] = existing
                else:
                    existing.set_reps([*existing.reps, rep])
                seg.enqueue(existing)
                self._emit(_EV.STORED, item.key, item.size, seg)
                return 1
        log.warning(
            "inventory item rejected",
            extra={"node_id": node.node_id, "key": item.key, "segment": item.segment,
                   "offset": item.offset, "reason": reason},
        )
        node.commands.append(
            _CMD(id=next(self._ids), kind=_CMD.FREED, key=item.key, segment=item.segment,
                 offset=item.offset, size=item.size)
        )
        self._wake(node)
        return 0

    def heartbeat(self, node_id: str) -> bool:
        """Record a heartbeat; False when the node is unknown (it must register again)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return False
            node.last_seen = self._now()
            return True

    def _drop_node(self, node: Node, reason: str) -> None:
        node.alive = False
        if self._nodes.get(node.node_id) is node:
            del self._nodes[node.node_id]
        dropped = 0
        for seg in node.segments:
            seg.alive = False
            if self._segments.get(seg.name) is seg:
                del self._segments[seg.name]
            for obj in seg.live():
                self._drop_rep(obj, obj.rep_on(seg), _EV.EVICTED)
                dropped += 1
        for put in list(self._pending.values()):
            if any(r.seg.node is node for r in put.reps):
                self._end_pending(put)
        self._cancel_spaces(node)
        for cp in list(self._copies.values()):
            if cp.node is node:
                del self._copies[cp.cmd_id]
                cp.obj.copying = False
        node.commands.clear()
        self._wake(node)
        log.warning(
            "node dropped", extra={"node_id": node.node_id, "reason": reason, "replicas": dropped}
        )

    # -- command stream --------------------------------------------------------------------

    def open_command_stream(
        self, node_id: str, master_id: str = "", waker: Callable[[], None] | None = None
    ) -> int | None:
        """Start a node's command stream; None if the node is unknown or was registered with
        another master incarnation. A newer stream for the same node ends older ones.

        `waker` (for streams served without a blocked thread) is called, under the state lock,
        whenever the stream has something to do: commands queued, or the stream must end.
        """
        with self._lock:
            if self._closed or (master_id and master_id != self.master_id):
                return None
            node = self._nodes.get(node_id)
            if node is None:
                return None
            node.stream += 1
            self._wake(node)  # the older stream, if any, ends
            node.waker = waker
            return node.stream

    def _wake(self, node: Node) -> None:
        self._cond.notify_all()
        if node.waker is not None:
            node.waker()

    def next_commands(
        self, node_id: str, stream: int, timeout: float
    ) -> list[pb.NodeCommand] | None:
        """Commands for the node (empty after `timeout`), or None when the stream must end."""
        with self._cond:
            for attempt in (0, 1):
                node = self._nodes.get(node_id)
                if self._closed or node is None or node.stream != stream:
                    return None
                if node.commands:
                    out = list(node.commands)
                    node.commands.clear()
                    return out
                if attempt == 0:
                    if timeout <= 0:
                        break
                    self._cond.wait(timeout)
            return []

    def command_done(self, node_id: str, cmd_id: int, ok: bool, error: str = "") -> bool:
        """A node finished a COPY; False when the command is unknown (expired, node replaced)."""
        with self._op():
            cp = self._copies.get(cmd_id)
            if cp is None or cp.node.node_id != node_id:
                return False
            del self._copies[cmd_id]
            self._finish_copy(cp, ok, error)
            return True

    def _finish_copy(self, cp: Copy, ok: bool, error: str) -> None:
        obj = cp.obj
        obj.copying = False
        if cp.kind == "spill":
            cp.src.seg.spilling -= cp.src.seg.alloc.rounded(obj.size)
        live = (
            not obj.hidden
            and self._objects.get(obj.key) is obj
            and cp.src in obj.reps
            and cp.dst.seg.alive
        )
        if not ok or not live:
            self._free_rep(obj, cp.dst, committed=False)
            if not ok:
                log.warning(
                    "copy failed",
                    extra={"kind": cp.kind, "key": obj.key, "node_id": cp.node.node_id,
                           "error": error},
                )
                if cp.kind == "spill" and live and obj.leases == 0:
                    self._drop_rep(obj, cp.src, _EV.EVICTED)
                    self.evictions += 1
            return
        dst = cp.dst
        obj.set_reps([*obj.reps, dst])
        dst.seg.enqueue(obj)
        self._command(dst.seg.node, _CMD.COMMITTED, obj.key, dst.seg, dst.offset, obj.size,
                      obj.checksum)
        if cp.kind == "spill":
            self.spills += 1
            self._emit(_EV.SPILLED, obj.key, obj.size, dst.seg)
            if obj.leases == 0:
                self._drop_rep(obj, cp.src, 0)
        else:
            self.promotions += 1
            self._emit(_EV.PROMOTED, obj.key, obj.size, dst.seg)
