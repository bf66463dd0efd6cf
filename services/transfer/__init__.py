"""Transfer engine: segments, and the shm / tcp transports that move KV bytes between them."""

from __future__ import annotations

from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import Peer, ReadOp, TransferRejected, WriteOp
from mooncake_k8s.transfer.rdma import RdmaStatus, detect_rdma
from mooncake_k8s.transfer.segments import Segment, SegmentDesc, Tier
from mooncake_k8s.transfer.shm import ShmMapError, ShmTransport
from mooncake_k8s.transfer.tcp import TcpTransport, TransferServer

__all__ = [
    "Peer",
    "RdmaStatus",
    "ReadOp",
    "Segment",
    "SegmentDesc",
    "ShmMapError",
    "ShmTransport",
    "TcpTransport",
    "Tier",
    "TransferEngine",
    "TransferRejected",
    "TransferServer",
    "WriteOp",
    "detect_rdma",
]
