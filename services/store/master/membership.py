"""Storage nodes as the master sees them: registration, restarts, loss, command streams.

A part of `state.MasterState`, kept apart because node membership is a concern of its own:
a node (re-)registers with its segments and inventory (`register_node`), may come back as a new
process under the same id (`_reconcile_restart`), may go silent (`drop_node`), and receives
the master's commands over a stream (`open_command_stream` / `next_commands`) whose copies it
reports back (`command_done`, finished by `tiering`). A node that leaves or restarts takes its
puts, space leases, replicas being added and copies with it: the parts that own them are told
(`cancel_on`, `cancel_copies`). It runs under the state's lock like everything else there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.catalog import Catalog
from mooncake_k8s.store.master.puts import ClassicPuts
from mooncake_k8s.store.master.records import (
    DRAM,
    SSD,
    Node,
    Obj,
    Rep,
    Segment,
    check_key,
)
from mooncake_k8s.store.master.replicas import ReplicaAdds
from mooncake_k8s.store.master.spaces import SpaceLeases
from mooncake_k8s.store.master.tiering import TierPolicy

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

    def __init__(self, catalog: Catalog, tiers: TierPolicy, puts: ClassicPuts,
                 spaces: SpaceLeases, adds: ReplicaAdds, *, master_id: str,
                 node_timeout_s: float) -> None:
        self._adds = adds
        self._cat = catalog
        self._tiers = tiers
        self._puts = puts
        self._spaces = spaces
        self.master_id = master_id
        self.node_timeout_s = node_timeout_s

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
        _check_registration(node_id, address, segments)
        with self._cat.op():
            self._check_owners(node_id, segments)
            old = self._cat.nodes.get(node_id)
            sig = [(s.name, s.tier, s.size, s.path) for s in segments]
            dropped = 0
            if old is not None and [(s.name, s.tier, s.size, s.path) for s in old.segments] == sig:
                node = old
                dropped = self._rejoin(node, address, host_id, inventory, incarnation)
            else:
                if old is not None:
                    self.drop_node(old, "re-registered with different segments")
                node = self._add_node(node_id, address, host_id, segments, incarnation)
            restored = self._restore_all(node, inventory, journal)
            log.info(
                "node registered",
                extra={"node_id": node_id, "address": address, "segments": len(segments),
                       "inventory": len(inventory), "restored": restored, "dropped": dropped},
            )
            return Registration(restored, dropped)

    def _check_owners(self, node_id: str, segments: Sequence[pb.SegmentInfo]) -> None:
        """Refuse a segment name another node registered."""
        for s in segments:
            owner = self._cat.segments.get(s.name)
            if owner is not None and owner.node.node_id != node_id:
                raise InvalidArgument(
                    f"segment {s.name!r} is already registered by node {owner.node.node_id!r}"
                )

    def _rejoin(self, node: Node, address: str, host_id: str,
                inventory: Sequence[pb.InventoryItem], incarnation: str) -> int:
        """A known node with the same segments: reconciled when its process restarted (a new
        incarnation); its answers renamed when its address moved. Returns replicas dropped."""
        node.last_seen = self._cat.now()
        dropped = 0
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
        return dropped

    def _add_node(self, node_id: str, address: str, host_id: str,
                  segments: Sequence[pb.SegmentInfo], incarnation: str) -> Node:
        node = Node(node_id, address, host_id, self._cat.now(), incarnation)
        for s in segments:
            seg = Segment(node, s)
            node.segments.append(seg)
            self._cat.segments[seg.name] = seg
        self._cat.nodes[node_id] = node
        return node

    def _restore_all(self, node: Node, inventory: Sequence[pb.InventoryItem],
                     journal: Sequence[pb.InventoryItem]) -> int:
        """Restore what the node reports, then the journaled commits it does not (sent to it
        as COMMITTED); returns how many objects are known on it now."""
        restored = sum(self._restore(node, item) for item in inventory)
        held = {(it.segment, it.offset) for it in inventory}
        for item in journal:
            if (item.segment, item.offset) in held or not self._restore(node, item):
                continue
            restored += 1
            self._cat.command(node, _CMD.COMMITTED, item.key, self._cat.segments[item.segment],
                              item.offset, item.size, item.checksum)
        return restored

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
        self._tiers.cancel_copies(node)
        self._spaces.cancel_on(node)
        self._adds.cancel_on(node)
        self._puts.cancel_on(node, "put cancelled: its node restarted")
        dropped = 0
        for seg in node.segments:
            for obj in seg.live():
                rep = obj.rep_on(seg)
                if (obj.key, seg.name, rep.offset, obj.size, obj.checksum) not in held:
                    self._cat.drop_rep(obj, rep, _EV.EVICTED)
                    dropped += 1
        node.commands.clear()
        node.stream += 1
        self._cat.wake(node)
        log.warning(
            "node restarted: replicas it no longer holds dropped",
            extra={"node_id": node.node_id, "replicas": dropped, "inventory": len(inventory)},
        )
        return dropped

    def _restore(self, node: Node, item: pb.InventoryItem) -> int:
        seg = self._cat.segments.get(item.segment)
        reason = ""
        if seg is None or seg.node is not node:
            reason = "unknown segment"
        else:
            existing = self._cat.objects.get(item.key)
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
            elif not reason and self._puts.claimed(item.key):
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
                    self._cat.objects[item.key] = existing
                else:
                    existing.set_reps([*existing.reps, rep])
                seg.enqueue(existing)
                self._cat.emit(_EV.STORED, item.key, item.size, seg)
                return 1
        log.warning(
            "inventory item rejected",
            extra={"node_id": node.node_id, "key": item.key, "segment": item.segment,
                   "offset": item.offset, "reason": reason},
        )
        node.commands.append(
            _CMD(id=self._cat.new_id(), kind=_CMD.FREED, key=item.key, segment=item.segment,
                 offset=item.offset, size=item.size)
        )
        self._cat.wake(node)
        return 0

    def heartbeat(self, node_id: str) -> bool:
        """Record a heartbeat; False when the node is unknown (it must register again)."""
        with self._cat.lock:
            node = self._cat.nodes.get(node_id)
            if node is None:
                return False
            node.last_seen = self._cat.now()
            return True

    def drop_node(self, node: Node, reason: str) -> None:
        node.alive = False
        if self._cat.nodes.get(node.node_id) is node:
            del self._cat.nodes[node.node_id]
        dropped = 0
        for seg in node.segments:
            seg.alive = False
            if self._cat.segments.get(seg.name) is seg:
                del self._cat.segments[seg.name]
            for obj in seg.live():
                self._cat.drop_rep(obj, obj.rep_on(seg), _EV.EVICTED)
                dropped += 1
        self._puts.cancel_on(node)
        self._spaces.cancel_on(node)
        self._adds.cancel_on(node)
        self._tiers.forget_copies(node)
        node.commands.clear()
        self._cat.wake(node)
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
        with self._cat.lock:
            if self._cat.closed or (master_id and master_id != self.master_id):
                return None
            node = self._cat.nodes.get(node_id)
            if node is None:
                return None
            node.stream += 1
            self._cat.wake(node)  # the older stream, if any, ends
            node.waker = waker
            return node.stream

    def next_commands(
        self, node_id: str, stream: int, timeout: float
    ) -> list[pb.NodeCommand] | None:
        """Commands for the node (empty after `timeout`), or None when the stream must end."""
        with self._cat.cond:
            for attempt in (0, 1):
                node = self._cat.nodes.get(node_id)
                if self._cat.closed or node is None or node.stream != stream:
                    return None
                if node.commands:
                    out = list(node.commands)
                    node.commands.clear()
                    return out
                if attempt == 0:
                    if timeout <= 0:
                        break
                    self._cat.cond.wait(timeout)
            return []

    def command_done(self, node_id: str, cmd_id: int, ok: bool, error: str = "") -> bool:
        """A node finished a COPY; False when the command is unknown (expired, node replaced)."""
        with self._cat.op():
            return self._tiers.copy_done(node_id, cmd_id, ok, error)

    def expire(self, now: float) -> None:
        """Drop the nodes not heard from for `node_timeout_s`."""
        for node in list(self._cat.nodes.values()):
            if now - node.last_seen > self.node_timeout_s:
                self.drop_node(node, f"no heartbeat for {self.node_timeout_s}s")


def _check_registration(node_id: str, address: str, segments: Sequence[pb.SegmentInfo]) -> None:
    """Refuse a registration that names no node, no address or no usable segments."""
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
