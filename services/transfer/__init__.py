"""Transfer engine: segments, and the shm / tcp transports that move KV bytes between them."""

from __future__ import annotations

from .engine import TransferEngine
from .ops import Peer, ReadOp, TransferRejected, WriteOp
from .rdma import RdmaStatus, detect_rdma
from .segments import Segment, SegmentDesc, Tier
from .shm import ShmMapError, ShmTransport
from .tcp import TcpTransport, TransferServer

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
