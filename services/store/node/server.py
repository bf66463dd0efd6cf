"""The storage node: owns DRAM (and optional SSD) segments and serves them to the transfer engine.

It is deliberately passive. The master decides what lives where; the node keeps an inventory
of the objects in its segments (learned from the master's COMMITTED/FREED commands) so that a
restarted master can rebuild its metadata from the nodes, and it performs the local copies the
master asks for (DRAM -> SSD spills, SSD -> DRAM promotions).

Each process registers with a fresh random incarnation id: when a node restarts under the same
node id, the master sees the new incarnation and drops whatever the old process held that the
new one does not report, instead of keeping phantom objects. Clients read and write the
segments directly: through /dev/shm on the same host, or through the TCP transfer server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from mooncake_k8s.common import auth, errors
from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.metrics import serve_metrics
from mooncake_k8s.common.netutil import local_host_id
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.masterlink import MasterLink
from mooncake_k8s.store.node.ssd import Journal, Record, check_header
from mooncake_k8s.store.wire import location
from mooncake_k8s.transfer import Segment, Tier, TransferServer
from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import ReadOp
from mooncake_k8s.transfer.rdma import RdmaInfoCollector
from mooncake_k8s.transfer.segments import cluster_tag

log = logging.getLogger(__name__)

#: Longest a fan-out copy may take reading from another node (see `StorageNode._fetch`).
FETCH_TIMEOUT_S = 10.0

_TIER_PB = {Tier.DRAM: pb.DRAM, Tier.SSD: pb.SSD}
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class NodeConfig:
    """Settings of one storage node (flags / env vars of `mooncake store node`)."""

    master: str
    """Master gRPC address, host:port, or a comma-separated list of the masters (HA)."""
    node_id: str
    """Unique in the cluster; also names the node's segments."""
    token: str = ""
    """Cluster token for the master and for transfer-engine handshakes."""
    host: str = "127.0.0.1"
    """Address the transfer server binds to and advertises."""
    port: int = 0
    """Transfer server port; 0 picks a free one."""
    dram_size: int = 1 << 30
    """Bytes of host DRAM (POSIX shared memory) to serve."""
    dram_segments: int = 1
    """Split DRAM into this many segments (smaller allocator domains)."""
    prefault: bool = True
    """Allocate the DRAM segments' memory at start (as Mooncake registers its buffers), so puts
    never pay for first-touch page faults; False leaves them sparse until written."""
    ssd_dir: str | None = None
    """Directory for the SSD tier's backing file; None disables the tier."""
    ssd_size: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Prometheus port; 0 picks a free one, None disables."""
    advertise_host: str | None = None
    """Address clients should dial when it differs from `host` (e.g. a pod IP)."""
    reconnect_s: float = 0.5
    host_id: str = field(default_factory=local_host_id)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.capacity = Gauge(
            "mooncake_node_capacity_bytes", "Segment size", ["segment", "tier"], registry=registry
        )
        self.used = Gauge(
            "mooncake_node_used_bytes", "Bytes of committed objects", ["segment", "tier"],
            registry=registry,
        )
        self.objects = Gauge("mooncake_node_objects", "Objects held", registry=registry)
        self.bytes = Counter(
            "mooncake_node_transfer_bytes_total", "Bytes moved by the transfer server",
            ["direction"], registry=registry,
        )
        self.copies = Counter(
            "mooncake_node_copies_total", "Local copies (spill/promote) by result", ["result"],
            registry=registry,
        )
        self.ssd_adopted = Counter(
            "mooncake_node_ssd_adopted_objects_total",
            "SSD objects re-adopted at start (bytes verified), and dropped (torn or altered)",
            ["result"], registry=registry,
        )
        self.registrations = Counter(
            "mooncake_node_registrations_total", "Registrations with a master", registry=registry
        )
        self.handshakes = Counter(
            "mooncake_node_transfer_handshakes_total",
            "Transfer connections by front-door outcome (accepted, authenticated, evicted, "
            "timed_out, rejected, busy)", ["result"], registry=registry,
        )


@dataclass
class _Item:
    segment: str
    offset: int
    size: int
    checksum: int


class StorageNode:
    """A running node: segments, transfer server, and the master session threads."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.registry.register(RdmaInfoCollector(lambda: "auto"))  # it serves; never rdma
        self.segments: dict[str, Segment] = {}
        self.inventory: dict[tuple[str, int], tuple[str, _Item]] = {}
        self._used: dict[str, int] = {}  # bytes per segment held by the inventory
        self._journals: dict[str, Journal] = {}  # per SSD segment (see `ssd`)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._master_id = ""
        self._registered = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: TransferServer | None = None
        self.metrics_port: int | None = None
        self.incarnation = uuid.uuid4().hex
        # Reconnect quickly after the master restarts: it answers nothing authoritative until
        # its known nodes re-registered, so every node's delay is everyone's delay.
        self._md = auth.call_metadata(config.token)
        # `master` may list several masters (HA): the node follows whichever leads.
        self._link = MasterLink(config.master, self._md, options=RECONNECT_OPTIONS)
        self._session_master = ""
        self._stream: Any = None
        self._engine: TransferEngine | None = None  # fan-out copies from other nodes

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Create (or take over from a dead predecessor) the segments, re-adopt the SSD tier's
        verified objects, and start serving. InvalidArgument when the SSD directory is another
        node's or layout's, or a live process holds a segment of this node id."""
        try:
            self._open_segments()
        except BaseException:
            for seg in self.segments.values():
                seg.close()
            for journal in self._journals.values():
                journal.close()
            raise
        self._serve()

    def _open_segments(self) -> None:
        cfg = self.config
        if cfg.ssd_dir and cfg.ssd_size > 0:
            self._adopt_ssd(cfg.ssd_dir, f"{cfg.node_id}-ssd-0", cfg.ssd_size)
        per = cfg.dram_size // max(1, cfg.dram_segments)
        # Node ids are unique within a cluster, not on a host: the masters' addresses tag the
        # shared-memory files, so another cluster's node of the same id keeps its own. The
        # names are stable, so a restarted node takes over its dead predecessor's file.
        tag = cluster_tag(self._link.addresses)
        for i in range(max(1, cfg.dram_segments)):
            self._add_segment(Segment.create_shm(f"{cfg.node_id}-dram-{i}", per, replace=True,
                                                 populate=cfg.prefault, tag=tag))

    def _adopt_ssd(self, directory: str, name: str, size: int) -> None:
        """Map the SSD segment (the file a previous process left, or a new one) and put the
        objects its journal lists whose bytes verify into the inventory."""
        os.makedirs(directory, exist_ok=True)
        check_header(directory, self.config.node_id, {name: size})
        seg, adopted = Segment.adopt_file(name, directory, size)
        self._add_segment(seg)
        journal = self._journals[name] = Journal(directory, name)
        kept, dropped = journal.recover(seg)
        for r in kept:
            self.inventory[(name, r.offset)] = (r.key, _Item(name, r.offset, r.size, r.checksum))
            self._used[name] = self._used.get(name, 0) + r.size
        self.metrics.ssd_adopted.labels("verified").inc(len(kept))
        self.metrics.ssd_adopted.labels("dropped").inc(dropped)
        if adopted:
            log.info("SSD segment re-adopted", extra={
                "segment": name, "objects": len(kept), "dropped": dropped,
                "bytes": self._used.get(name, 0)})

    def _serve(self) -> None:
        cfg = self.config
        self._server = TransferServer(
            self.segments, cfg.host, cfg.port, cfg.token, on_bytes=self._on_bytes,
            on_event=lambda kind: self.metrics.handshakes.labels(kind).inc(),
        )
        self._server.start()
        if cfg.metrics_port is not None:
            self.metrics_port = serve_metrics(self.registry, cfg.metrics_host, cfg.metrics_port)
        for target, name in ((self._session_loop, "session"), (self._heartbeat_loop, "heartbeat")):
            t = threading.Thread(target=target, name=f"node-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info(
            "storage node started",
            extra={
                "node_id": cfg.node_id,
                "transfer_address": self.address,
                "segments": ",".join(self.segments),
                "metrics_port": self.metrics_port,
            },
        )

    @property
    def address(self) -> str:
        assert self._server is not None
        host, _, port = self._server.address.rpartition(":")
        return f"{self.config.advertise_host or host}:{port}"

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._link.close()
        for t in self._threads:
            t.join(timeout=2)
        if self._engine is not None:
            self._engine.close()
        if self._server is not None:
            self._server.stop()
        for seg in self.segments.values():
            seg.close()
        for journal in self._journals.values():
            journal.close()
        log.info("storage node stopped", extra={"node_id": self.config.node_id})

    def _add_segment(self, seg: Segment) -> None:
        self.segments[seg.desc.name] = seg
        self.metrics.capacity.labels(seg.desc.name, seg.desc.tier.value).set(seg.desc.size)
        self.metrics.used.labels(seg.desc.name, seg.desc.tier.value).set(0)

    def _on_bytes(self, direction: str, n: int) -> None:
        self.metrics.bytes.labels(direction).inc(n)

    # -- master session --------------------------------------------------------------------

    def _register(self) -> None:
        with self._lock:
            inventory = [
                pb.InventoryItem(
                    key=key, segment=it.segment, offset=it.offset, size=it.size,
                    checksum=it.checksum,
                )
                for key, it in self.inventory.values()
            ]
        segments = [
            pb.SegmentInfo(
                name=s.desc.name, tier=_TIER_PB[s.desc.tier], size=s.desc.size, path=s.desc.path
            )
            for s in self.segments.values()
        ]
        resp = self._link.call(
            "RegisterNode",
            pb.RegisterNodeRequest(
                node_id=self.config.node_id, address=self.address, host_id=self.config.host_id,
                segments=segments, inventory=inventory, incarnation=self.incarnation,
            ),
            timeout=10, retryable=_always,  # registering twice is harmless
        )
        self._master_id = resp.master_id
        self._session_master = self._link.current
        self.metrics.registrations.inc()
        self._registered.set()
        log.info(
            "registered with master",
            extra={"master_id": resp.master_id, "inventory": len(inventory),
                   "restored": resp.restored_objects, "dropped": resp.dropped_replicas,
                   "incarnation": self.incarnation},
        )

    def _session_loop(self) -> None:
        """Register, then consume the master's command stream; on any break, start over."""
        while not self._stop.is_set():
            try:
                self._register()
                _, stub = self._link.stub(self._session_master)
                stream = self._stream = stub.NodeCommands(
                    pb.NodeCommandsRequest(node_id=self.config.node_id, master_id=self._master_id),
                    metadata=self._md,
                )
                for batch in stream:
                    for cmd in batch.commands:
                        self._apply(cmd)
                    self._refresh_usage_metrics()
                    if self._stop.is_set():
                        stream.cancel()
                        break
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                log.warning("master session lost", extra={"code": str(e.code())})
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._link.failed(self._session_master)
            except Exception:
                log.exception("master session failed")
            self._registered.clear()
            self._stop.wait(self.config.reconnect_s)

    def _heartbeat_loop(self) -> None:
        interval = 1.0
        while not self._stop.wait(interval):
            if not self._registered.is_set():
                continue
            usage = [pb.SegmentUsage(name=n, used=u) for n, u in self._usage().items()]
            try:
                resp = self._link.call(
                    "Heartbeat", pb.HeartbeatRequest(node_id=self.config.node_id, usage=usage),
                    timeout=5, retryable=_always,
                )
            except grpc.RpcError:
                continue
            moved = self._link.current != self._session_master
            if moved or resp.reregister or (
                    resp.master_id and resp.master_id != self._master_id):
                # The master restarted, or another one leads now: register again (with the
                # inventory) right away, and restart the command stream from the new leader.
                stream = self._stream
                if moved and stream is not None:
                    stream.cancel()
                with contextlib.suppress(grpc.RpcError):
                    self._register()

    def _usage(self) -> dict[str, int]:
        with self._lock:
            return {name: self._used.get(name, 0) for name in self.segments}

    def _apply(self, cmd: pb.NodeCommand) -> None:
        kind = cmd.kind
        if kind == pb.NodeCommand.COMMITTED:
            item = _Item(cmd.segment, cmd.offset, cmd.size, cmd.checksum)
            with self._lock:
                old = self.inventory.get((cmd.segment, cmd.offset))
                self.inventory[(cmd.segment, cmd.offset)] = (cmd.key, item)
                self._used[cmd.segment] = (self._used.get(cmd.segment, 0) + cmd.size
                                           - (old[1].size if old else 0))
                journal = self._journals.get(cmd.segment)
                if journal is not None:
                    journal.committed(Record(cmd.key, cmd.offset, cmd.size, cmd.checksum))
        elif kind == pb.NodeCommand.FREED:
            with self._lock:
                gone = self.inventory.pop((cmd.segment, cmd.offset), None)
                if gone is not None:
                    self._used[cmd.segment] = self._used.get(cmd.segment, 0) - gone[1].size
                journal = self._journals.get(cmd.segment)
                if journal is not None:
                    journal.freed(cmd.offset)
                    if journal.should_compact(len(self.inventory)):  # (an upper bound: cheap)
                        journal.rewrite([Record(k, it.offset, it.size, it.checksum)
                                         for k, it in self.inventory.values()
                                         if it.segment == cmd.segment])
        elif kind == pb.NodeCommand.COPY:
            ok, err = self._copy(cmd)
            self.metrics.copies.labels("ok" if ok else "failed").inc()
            with contextlib.suppress(grpc.RpcError):
                self._link.call(
                    "CommandDone",
                    pb.CommandDoneRequest(node_id=self.config.node_id, id=cmd.id, ok=ok, error=err),
                    timeout=10, retryable=_always,
                )
        else:
            log.warning("unknown node command", extra={"kind": int(kind)})

    def _copy(self, cmd: pb.NodeCommand) -> tuple[bool, str]:
        """Local segment-to-segment copy, verified against the object's checksum."""
        if cmd.HasField("src_replica"):
            return self._fetch(cmd)
        src = self.segments.get(cmd.src_segment)
        dst = self.segments.get(cmd.segment)
        if src is None or dst is None:
            return False, "unknown segment"
        n = cmd.size
        if cmd.src_offset + n > src.desc.size or cmd.offset + n > dst.desc.size:
            return False, "copy out of bounds"
        dst.buf[cmd.offset : cmd.offset + n] = src.buf[cmd.src_offset : cmd.src_offset + n]
        if cmd.checksum and checksum(dst.buf[cmd.offset : cmd.offset + n]) != cmd.checksum:
            return False, "checksum mismatch after copy"
        return True, ""

    def _fetch(self, cmd: pb.NodeCommand) -> tuple[bool, str]:
        """Fan-out: read the object from its replica on another node (transfer engine, shared
        memory on the same host, TCP otherwise) into our segment, verified by its checksum."""
        dst = self.segments.get(cmd.segment)
        n = cmd.size
        if dst is None:
            return False, f"unknown segment {cmd.segment!r}"
        if cmd.offset + n > dst.desc.size:
            return False, "copy out of bounds"
        if self._engine is None:
            # Bounded well within the master's copy deadline (its put timeout, 30 s by
            # default), after which it may hand this space to another object.
            self._engine = TransferEngine(self.config.token, host_id=self.config.host_id,
                                          connections_per_peer=1, timeout_s=FETCH_TIMEOUT_S)
        loc = location(cmd.src_replica)
        view = dst.buf[cmd.offset : cmd.offset + n]
        try:
            sums = self._engine.read(loc.peer, [ReadOp(loc.segment, loc.offset, view)],
                                     with_checksum=True)
        except (errors.TransferError, ValueError) as e:
            self._engine.forget(loc.peer)
            return False, f"reading from {loc.peer.node_id}: {e}"
        got = sums[0] if sums else checksum(view)
        if cmd.checksum and got != cmd.checksum:
            return False, "checksum mismatch after copy"
        return True, ""

    def _refresh_usage_metrics(self) -> None:
        for name, used in self._usage().items():
            seg = self.segments[name]
            self.metrics.used.labels(name, seg.desc.tier.value).set(used)
        self.metrics.objects.set(len(self.inventory))


def _always(_e: grpc.RpcError, _method: str) -> bool:
    return True


def run_node(config: NodeConfig) -> None:
    """Start a node and block until SIGTERM/SIGINT, then stop cleanly (segments unlinked)."""
    node = StorageNode(config)
    done = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        node.start()
    except InvalidArgument as e:  # a refused directory or segment: say why, no traceback
        log.error("storage node cannot start: %s", e)
        raise SystemExit(f"error: {e}") from None
    try:
        while not done.wait(0.5):
            pass
    finally:
        node.stop()
