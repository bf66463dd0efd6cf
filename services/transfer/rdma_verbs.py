"""The RDMA data path on pyverbs: one-sided READ and WRITE over RC queue pairs.

UNTESTED ON HARDWARE. No machine this was written on has an RDMA device, and none could create
a soft-RoCE one, so this module has never moved a byte. What is tested: the pure rules it
relies on (`rdma_plan`), the connect exchange on a real transfer server, that every pyverbs
name and constructor used here exists with the arguments given (`PYVERBS_NAMES`,
`build_send_wr`, `build_qp_attr`, `build_qp_init_attr`), and that nothing selects it unless
asked for. The engine says so in its log and in `mooncake_transfer_rdma_info`.

Server side (`RdmaResponder`, driven by `TransferServer`): on an authenticated connection's
RDMA connect, every served segment is registered (once, cached) as a memory region with remote
read and write access, a queue pair is created for that peer and moved INIT -> RTR -> RTS
towards the peer's, and the reply lists each segment's (address, rkey, length). The server
never posts work: READ and WRITE are one-sided, its NIC answers them. The queue pair lives as
long as the TCP connection that asked for it, so a peer that goes away takes its QP with it.

Client side (`RdmaTransport`, one per peer, used by `TransferEngine(transport="rdma")`): one
queue pair and one registered staging buffer. Caller buffers are not registered: they are any
numpy array, tensor or bytearray, registering one costs far more than copying a KV block, pins
it, and would have to be undone before the caller frees it (a registration outliving its
buffer lets the NIC write into freed memory). So a READ lands in the staging buffer and is
copied out (the xxh3 checksum, when asked, is computed over the caller's bytes in that copy),
and a WRITE is copied in (and hashed) first. `rdma_plan.plan_rounds` cuts a batch into rounds
that fit the staging buffer and the send queue; each round's completions are all reaped before
the staging buffer is reused. Calls to one peer are serialised.

Failures: a completion with an error status, a failed post, or a round that makes no progress
for `io_timeout_s` (`TransferTimeout`) drops the queue pair (destroying it stops any DMA into
the staging buffer) and the next call reconnects. A range outside what the server registered
is refused before posting (`TransferRejected`) and the queue pair stays.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyverbs.addr as pv_addr
import pyverbs.cq as pv_cq
import pyverbs.device as pv_device
import pyverbs.enums as pv_enums
import pyverbs.mr as pv_mr
import pyverbs.pd as pv_pd
import pyverbs.qp as pv_qp
import pyverbs.wr as pv_wr
from pyverbs.pyverbs_error import PyverbsError

from mooncake_k8s.common.checksum import StreamingChecksum, copy_with_checksum
from mooncake_k8s.common.errors import TransferError, TransferTimeout
from mooncake_k8s.transfer.frames import (
    ST_UNSUPPORTED,
    RdmaEndpoint,
    RdmaRegion,
    decode_rdma_endpoint,
    encode_rdma_endpoint,
)
from mooncake_k8s.transfer.ops import ReadOp, TransferRejected, WriteOp, as_view, check_range
from mooncake_k8s.transfer.rdma_plan import (
    PathParams,
    Piece,
    RegionMap,
    buffer_address,
    gid_from_str,
    gid_to_str,
    negotiate,
    plan_rounds,
)
from mooncake_k8s.transfer.segments import SegmentDesc

log = logging.getLogger(__name__)

PYVERBS_NAMES: tuple[tuple[Any, str], ...] = (
    (pv_device, "get_device_list"), (pv_device, "Context"), (pv_pd, "PD"), (pv_mr, "MR"),
    (pv_cq, "CQ"), (pv_cq, "cqe_status_to_str"), (pv_qp, "QP"), (pv_qp, "QPAttr"),
    (pv_qp, "QPCap"), (pv_qp, "QPInitAttr"), (pv_wr, "SendWR"), (pv_wr, "SGE"),
    (pv_addr, "AHAttr"), (pv_addr, "GlobalRoute"), (pv_addr, "GID"),
    (pv_enums, "IBV_ACCESS_LOCAL_WRITE"), (pv_enums, "IBV_ACCESS_REMOTE_READ"),
    (pv_enums, "IBV_ACCESS_REMOTE_WRITE"), (pv_enums, "IBV_QPT_RC"),
    (pv_enums, "IBV_QPS_INIT"), (pv_enums, "IBV_QPS_RTR"), (pv_enums, "IBV_QPS_RTS"),
    (pv_enums, "IBV_WR_RDMA_READ"), (pv_enums, "IBV_WR_RDMA_WRITE"),
    (pv_enums, "IBV_SEND_SIGNALED"), (pv_enums, "IBV_WC_SUCCESS"),
    (pv_enums, "IBV_PORT_ACTIVE"), (pv_enums, "IBV_LINK_LAYER_ETHERNET"),
    (pv_enums, "IBV_GID_TYPE_SYSFS_ROCE_V2"),
)
"""Every pyverbs module attribute this module uses (a unit test resolves each one)."""

STAGE_BYTES = 16 << 20
"""Registered staging buffer per peer: a round of work requests moves at most this much."""
SEND_DEPTH = 64
"""Work requests outstanding per queue pair (capped by the device's max_qp_wr)."""
MAX_RD_ATOMIC = 16
"""Outstanding RDMA READs we ask for per queue pair (capped by both devices)."""
QP_TIMEOUT = 14
"""Local ACK timeout exponent: 4.096 us * 2**14 = 67 ms before the NIC retransmits."""
QP_RETRY = 7
MIN_RNR_TIMER = 12
HOP_LIMIT = 64
REMOTE_ACCESS = (pv_enums.IBV_ACCESS_LOCAL_WRITE | pv_enums.IBV_ACCESS_REMOTE_READ
                 | pv_enums.IBV_ACCESS_REMOTE_WRITE)


class RdmaUnsupported(TransferError):
    """The peer cannot serve RDMA (no device, no pyverbs, or it failed to set up); the engine
    then uses TCP for that peer."""


class _Served(Protocol):
    """What `TransferServer` serves: a `Segment` or a registered memory region."""

    desc: SegmentDesc
    buf: memoryview


# -- pyverbs objects built without a device (a unit test builds them too) -----------------------


def build_send_wr(opcode: int, wr_id: int, local_addr: int, length: int, lkey: int,
                  remote_addr: int, rkey: int) -> Any:
    """A signalled one-sided work request moving `length` bytes between the registered
    `local_addr` and the peer's `remote_addr`."""
    sge = pv_wr.SGE(local_addr, length, lkey)
    wr = pv_wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                      send_flags=pv_enums.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


def build_qp_attr(local_psn: int, remote: RdmaEndpoint, params: PathParams, *, port: int,
                  gid_index: int, is_global: bool) -> Any:
    """One QPAttr carrying what INIT, RTR and RTS each need (pyverbs picks the fields per
    transition with its own attribute masks)."""
    attr = pv_qp.QPAttr(port_num=port, path_mtu=params.mtu)
    attr.pkey_index = 0
    attr.qp_access_flags = REMOTE_ACCESS
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = params.rd_atomic
    attr.min_rnr_timer = MIN_RNR_TIMER
    gr = None
    if is_global:
        gr = pv_addr.GlobalRoute(dgid=pv_addr.GID(gid_to_str(remote.gid)),
                                 sgid_index=gid_index, hop_limit=HOP_LIMIT)
    attr.ah_attr = pv_addr.AHAttr(dlid=remote.lid, sl=0, port_num=port,
                                  is_global=1 if is_global else 0, gr=gr)
    attr.sq_psn = local_psn
    attr.timeout = QP_TIMEOUT
    attr.retry_cnt = QP_RETRY
    attr.rnr_retry = QP_RETRY
    attr.max_rd_atomic = params.rd_atomic
    return attr


def build_qp_init_attr(cq: Any, depth: int) -> Any:
    """An RC queue pair's creation attributes: `depth` send requests, one SGE each, completions
    only for signalled requests (all of ours are), a minimal receive queue (never used)."""
    cap = pv_qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    return pv_qp.QPInitAttr(qp_type=pv_enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def _name(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


# -- the device ------------------------------------------------------------------------------


class VerbsDevice:
    """An opened device: context, protection domain, one active port and the GID we use."""

    def __init__(self, name: str | None = None, port: int = 1,
                 gid_index: int | None = None) -> None:
        try:
            names = [_name(d.name) for d in pv_device.get_device_list()]
        except PyverbsError as e:
            raise TransferError(f"no RDMA devices: {e}") from e
        if not names:
            raise TransferError("no RDMA devices")
        if name is not None and name not in names:
            raise TransferError(f"RDMA device {name!r} not found (have {', '.join(names)})")
        problems: list[str] = []
        for candidate in [name] if name is not None else names:
            try:
                self._open(candidate, port, gid_index)
                return
            except (PyverbsError, TransferError) as e:
                problems.append(f"{candidate}: {e}")
        raise TransferError(f"no usable RDMA device port {port}: {'; '.join(problems)}")

    def _open(self, name: str, port: int, gid_index: int | None) -> None:
        ctx = pv_device.Context(name=name)
        try:
            pattr = ctx.query_port(port)
            if pattr.state != pv_enums.IBV_PORT_ACTIVE:
                raise TransferError(f"port {port} is not active")
            dattr = ctx.query_device()
            self.is_global = (pattr.link_layer == pv_enums.IBV_LINK_LAYER_ETHERNET
                              or gid_index is not None)
            self.gid_index = gid_index if gid_index is not None else self._pick_gid(
                ctx, port, int(pattr.gid_tbl_len), self.is_global)
            self.gid = gid_from_str(ctx.query_gid(port, self.gid_index).gid)
            self.pd = pv_pd.PD(ctx)
        except BaseException:
            ctx.close()
            raise
        self.ctx = ctx
        self.name = name
        self.port = port
        self.lid = int(pattr.lid)
        self.mtu = int(pattr.active_mtu)
        self.max_message = int(pattr.max_msg_sz)
        self.rd_atomic = max(1, min(MAX_RD_ATOMIC, int(dattr.max_qp_rd_atom),
                                    int(dattr.max_qp_init_rd_atom)))
        self.max_qp_wr = int(dattr.max_qp_wr)
        log.warning("RDMA device %s port %d opened (the RDMA transport is untested on hardware)",
                    name, port, extra={"gid_index": self.gid_index, "mtu_code": self.mtu})

    @staticmethod
    def _pick_gid(ctx: Any, port: int, count: int, is_global: bool) -> int:
        """RoCE: the first RoCE v2 GID, else the first non-zero one. InfiniBand: index 0."""
        if not is_global:
            return 0
        first: int | None = None
        for i in range(max(count, 1)):
            try:
                gid = gid_from_str(ctx.query_gid(port, i).gid)
            except (PyverbsError, ValueError):
                continue
            if not any(gid):
                continue
            with contextlib.suppress(PyverbsError):
                if ctx.query_gid_type(port, i) == pv_enums.IBV_GID_TYPE_SYSFS_ROCE_V2:
                    return i
            if first is None:
                first = i
        if first is None:
            raise TransferError(f"port {port} has no usable GID")
        return first

    def register(self, addr: int, length: int) -> Any:
        """A memory region over existing memory, remotely readable and writable."""
        return pv_mr.MR(self.pd, length, REMOTE_ACCESS, address=addr)

    def allocate(self, length: int) -> Any:
        """A memory region over fresh memory pyverbs allocates (freed by its close())."""
        return pv_mr.MR(self.pd, length, pv_enums.IBV_ACCESS_LOCAL_WRITE)

    def create_qp(self, depth: int) -> tuple[Any, Any]:
        """(queue pair, completion queue) for one peer, in RESET."""
        cq = pv_cq.CQ(self.ctx, depth + 1)
        try:
            return pv_qp.QP(self.pd, build_qp_init_attr(cq, depth)), cq
        except BaseException:
            cq.close()
            raise

    def endpoint(self, qp: Any, psn: int, regions: tuple[RdmaRegion, ...] = ()) -> RdmaEndpoint:
        return RdmaEndpoint(qp_num=int(qp.qp_num), psn=psn, lid=self.lid, gid=self.gid,
                            mtu=self.mtu, rd_atomic=self.rd_atomic,
                            max_message=self.max_message, regions=regions)

    def connect(self, qp: Any, local_psn: int, remote: RdmaEndpoint, params: PathParams) -> None:
        """RESET -> INIT -> RTR -> RTS towards `remote`."""
        attr = build_qp_attr(local_psn, remote, params, port=self.port,
                             gid_index=self.gid_index, is_global=self.is_global)
        qp.to_init(attr)
        qp.to_rtr(attr)
        qp.to_rts(attr)


_device_lock = threading.Lock()
_device: VerbsDevice | None = None


def open_device() -> VerbsDevice:
    """The process's device, opened once (first device with an active port 1)."""
    global _device
    with _device_lock:
        if _device is None:
            _device = VerbsDevice()
        return _device


# -- server side -------------------------------------------------------------------------------


@dataclass
class ServedQP:
    """A peer's queue pair at the server; closed when its TCP connection ends."""

    qp: Any
    cq: Any

    def close(self) -> None:
        for obj in (self.qp, self.cq):
            with contextlib.suppress(Exception):
                obj.close()


class RdmaResponder:
    """Answers RDMA connects for a `TransferServer`: registrations and per-peer QPs."""

    def __init__(self, device: VerbsDevice) -> None:
        self._dev = device
        self._lock = threading.Lock()
        self._mrs: dict[str, tuple[int, int, Any]] = {}  # name -> (addr, length, MR)

    def _sync(self, segments: Mapping[bytes, _Served]) -> tuple[RdmaRegion, ...]:
        """Register what is served and not yet registered; drop what is no longer served."""
        served = {seg.desc.name: seg for seg in segments.values() if seg.desc.size > 0}
        for name in [n for n in self._mrs if n not in served]:
            self._drop(name)
        regions: list[RdmaRegion] = []
        for name, seg in served.items():
            view = seg.buf[: seg.desc.size]
            addr = buffer_address(view)
            known = self._mrs.get(name)
            if known is None or known[:2] != (addr, len(view)):
                if known is not None:
                    self._drop(name)
                known = (addr, len(view), self._dev.register(addr, len(view)))
                self._mrs[name] = known
            regions.append(RdmaRegion(name, addr, int(known[2].rkey), len(view)))
        return tuple(regions)

    def _drop(self, name: str) -> None:
        entry = self._mrs.pop(name, None)
        if entry is not None:
            with contextlib.suppress(Exception):
                entry[2].close()

    def accept(self, client: RdmaEndpoint,
               segments: Mapping[bytes, _Served]) -> tuple[RdmaEndpoint, ServedQP]:
        """Our endpoint (with the registered segments) and the QP connected to `client`."""
        with self._lock:
            regions = self._sync(segments)
            qp, cq = self._dev.create_qp(1)  # a responder only: it never posts
            served = ServedQP(qp, cq)
            try:
                psn = secrets.randbelow(1 << 24)
                local = self._dev.endpoint(qp, psn, regions)
                self._dev.connect(qp, psn, client, negotiate(local, client))
            except BaseException:
                served.close()
                raise
            return local, served

    def forget(self, name: str) -> None:
        """Deregister a segment the server stopped serving. A peer's READ or WRITE into it then
        fails with a remote access error instead of touching memory that may be reused."""
        with self._lock:
            self._drop(name)

    def close(self) -> None:
        with self._lock:
            for name in list(self._mrs):
                self._drop(name)


# -- client side -------------------------------------------------------------------------------


class _Control(Protocol):
    """The TCP side of a peer (`TcpTransport`): authenticates and carries the connect."""

    address: str

    def exchange_rdma(self, endpoint: bytes) -> tuple[socket.socket, bytes]: ...


@dataclass
class _Link:
    sock: socket.socket
    qp: Any
    cq: Any
    regions: RegionMap
    params: PathParams

    def close(self) -> None:
        for obj in (self.qp, self.cq):
            with contextlib.suppress(Exception):
                obj.close()
        with contextlib.suppress(OSError):
            self.sock.close()


class RdmaTransport:
    """Client of one peer's segments over RDMA (see the module docstring)."""

    def __init__(self, control: _Control, device: VerbsDevice, *, io_timeout_s: float,
                 stage_bytes: int = STAGE_BYTES, depth: int = SEND_DEPTH) -> None:
        if io_timeout_s <= 0 or stage_bytes <= 0 or depth <= 0:
            raise ValueError("io_timeout_s, stage_bytes and depth must be > 0")
        self.address = control.address
        self._control = control
        self._dev = device
        self._timeout = io_timeout_s
        self._stage_bytes = stage_bytes
        self._depth = max(1, min(depth, device.max_qp_wr))
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._stage: Any = None
        self._stage_view: memoryview | None = None
        self._closed = False

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> _Link:
        qp, cq = self._dev.create_qp(self._depth)
        try:
            psn = secrets.randbelow(1 << 24)
            local = self._dev.endpoint(qp, psn)
            try:
                sock, reply = self._control.exchange_rdma(encode_rdma_endpoint(local))
            except TransferRejected as e:
                if e.code == ST_UNSUPPORTED:
                    raise RdmaUnsupported(str(e)) from e
                raise
            try:
                remote = decode_rdma_endpoint(reply)
                params = negotiate(local, remote)
                self._dev.connect(qp, psn, remote, params)
                regions = RegionMap(remote.regions)
            except BaseException:
                sock.close()
                raise
        except BaseException:
            ServedQP(qp, cq).close()
            raise
        if self._stage is None:
            self._stage = self._dev.allocate(self._stage_bytes)
            raw = (ctypes.c_char * self._stage_bytes).from_address(int(self._stage.buf))
            self._stage_view = memoryview(raw).cast("B")
        log.info("RDMA queue pair connected (untested on hardware)",
                 extra={"peer": self.address, "regions": len(regions), "mtu_code": params.mtu})
        return _Link(sock, qp, cq, regions, params)

    def _drop(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()
            stage, self._stage = self._stage, None
            if self._stage_view is not None:
                with contextlib.suppress(BufferError):
                    self._stage_view.release()
                self._stage_view = None
            if stage is not None:
                with contextlib.suppress(Exception):
                    stage.close()

    # -- operations ------------------------------------------------------------------------------

    def read(self, ops: Sequence[ReadOp], with_checksum: bool = False) -> list[int] | None:
        return self._run([(op.segment, op.offset, as_view(op.dst, True)) for op in ops],
                         True, with_checksum)

    def write(self, ops: Sequence[WriteOp], with_checksum: bool = False) -> list[int] | None:
        return self._run([(op.segment, op.offset, as_view(op.src, False)) for op in ops],
                         False, with_checksum)

    def _run(self, items: list[tuple[SegmentDesc, int, memoryview]], is_read: bool,
             with_checksum: bool) -> list[int] | None:
        for desc, off, v in items:
            check_range(desc, off, len(v))
        with self._lock:
            if self._closed:
                raise TransferError(f"RDMA transport to {self.address} is closed")
            if self._link is None:
                try:
                    self._link = self._connect()
                except PyverbsError as e:
                    raise TransferError(f"RDMA connect to {self.address} failed: {e}") from e
            link = self._link
            targets = []
            for desc, off, v in items:
                n = len(v)
                addr, rkey = link.regions.locate(desc.name, off, n) if n else (0, 0)
                targets.append((n, addr, rkey))
            rounds = plan_rounds(targets, max_message=link.params.max_message,
                                 max_outstanding=self._depth, stage_bytes=self._stage_bytes)
            sums = _Sums(items, with_checksum)
            try:
                self._move(link, rounds, items, is_read, sums)
            except PyverbsError as e:
                self._drop()
                raise TransferError(f"RDMA transfer to {self.address} failed: {e}") from e
            except TransferError:
                self._drop()
                raise
            return sums.result()

    def _move(self, link: _Link, rounds: list[list[Piece]],
              items: list[tuple[SegmentDesc, int, memoryview]], is_read: bool,
              sums: _Sums) -> None:
        """Each round through the registered staging buffer: a WRITE's bytes are copied in
        before the round is posted, a READ's copied out once it completed."""
        stage = self._stage_view
        assert stage is not None
        for rnd in rounds:
            if not is_read:
                for p in rnd:
                    sums.copy(p, stage[p.stage_offset : p.stage_offset + p.length],
                              items[p.op_index][2][p.op_offset : p.op_offset + p.length])
            self._post_and_reap(link, rnd, is_read)
            if is_read:
                for p in rnd:
                    sums.copy(p, items[p.op_index][2][p.op_offset : p.op_offset + p.length],
                              stage[p.stage_offset : p.stage_offset + p.length])

    def _post_and_reap(self, link: _Link, rnd: list[Piece], is_read: bool) -> None:
        opcode = pv_enums.IBV_WR_RDMA_READ if is_read else pv_enums.IBV_WR_RDMA_WRITE
        assert self._stage is not None
        base = int(self._stage.buf)
        lkey = int(self._stage.lkey)
        for k, p in enumerate(rnd):
            link.qp.post_send(build_send_wr(opcode, k, base + p.stage_offset, p.length, lkey,
                                            p.remote_addr, p.rkey))
        pending = len(rnd)
        deadline = time.monotonic() + self._timeout
        idle = 0
        while pending:
            n, wcs = link.cq.poll(min(pending, 16))
            if n:
                for wc in wcs[:n]:
                    if wc.status != pv_enums.IBV_WC_SUCCESS:
                        what = "READ" if is_read else "WRITE"
                        raise TransferError(
                            f"RDMA {what} to {self.address} failed: "
                            f"{pv_cq.cqe_status_to_str(wc.status)} (vendor error "
                            f"{wc.vendor_err})")
                pending -= n
                deadline = time.monotonic() + self._timeout
                idle = 0
                continue
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"RDMA transfer to {self.address}: {pending} of {len(rnd)} work requests "
                    f"without completion for {self._timeout} s")
            idle += 1
            if idle > 256:  # spin briefly for latency, then stop burning a core
                time.sleep(50e-6)


class _Sums:
    """Per-op checksums over pieces copied in op order (one pass for a single-piece op)."""

    __slots__ = ("_hashers", "_lengths", "_sums")

    def __init__(self, items: list[tuple[SegmentDesc, int, memoryview]], on: bool) -> None:
        self._lengths = [len(v) for _, _, v in items]
        self._sums: list[int] | None = None
        self._hashers: dict[int, StreamingChecksum] = {}
        if on:
            empty = StreamingChecksum().digest()
            self._sums = [empty] * len(items)

    def copy(self, p: Piece, dst: memoryview, src: memoryview) -> None:
        if self._sums is None:
            dst[:] = src
        elif p.op_offset == 0 and p.length == self._lengths[p.op_index]:
            self._sums[p.op_index] = copy_with_checksum(dst, src)
        else:
            dst[:] = src
            self._hashers.setdefault(p.op_index, StreamingChecksum()).update(dst)

    def result(self) -> list[int] | None:
        if self._sums is not None:
            for i, h in self._hashers.items():
                self._sums[i] = h.digest()
        return self._sums
