"""A stage's inbox: where the previous stage writes a chunk's hidden states.

The inbox is a shared-memory segment cut into a ring of equal slots, served by a transfer
server of its own on the stage's bind host (the cluster token authenticates every peer), so the
upstream writes with the transfer engine like any KV put: shared memory on one host, TCP across
hosts. The `Run` stream only announces a written slot (positions, byte count, xxh3 checksum the
sender's transfer computed); the receiver hashes the slot itself, so a torn or misdirected write
is a failed prompt, never wrong hidden states. A slot returns to the sender (a credit on the
stream) once its bytes are copied out: the ring is the pipeline's flow control.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.transfer.engine import TransferEngine
from mooncake_k8s.transfer.ops import Peer, WriteOp
from mooncake_k8s.transfer.segments import Segment, SegmentDesc, Tier
from mooncake_k8s.transfer.tcp_server import TransferServer

DEFAULT_SLOTS = 4
"""Chunks in flight between two stages: enough for the sender to run ahead of a stage that
is a chunk behind, bounded so a slow stage holds back, not buffers, its upstream."""


class StageFailed(Exception):
    """Another stage failed, went silent, or sent something wrong: the prompt fails retriable
    (UNAVAILABLE) and the leader takes the group out of rotation until it answers again."""

    def __init__(self, message: str, cause: str = "stage") -> None:
        super().__init__(message)
        self.cause = cause


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (bfloat16 has no numpy type)."""
    return t.contiguous().view(torch.uint8).numpy().data.cast("B")


def tensor_from(data: bytes | bytearray | memoryview, dtype: torch.dtype,
                rows: int) -> torch.Tensor:
    """A `[rows, hidden]` tensor owning a copy of `data`."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    return flat.view(rows, -1)


class Inbox:
    """The receiving side: the segment, its server, and the slot reads."""

    def __init__(self, name: str, slots: int, slot_bytes: int, *, host: str,
                 advertise_host: str | None, token: str, host_id: str) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError("an inbox needs at least one slot of at least one byte")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.host_id = host_id
        self.segment = Segment.create_shm(name, slots * slot_bytes, replace=True)
        self.server = TransferServer({name: self.segment}, host=host, port=0, token=token)
        self.server.start()
        self.address = f"{advertise_host or host}:{self.server.port}"

    def describe(self, reply: pb.StageHelloReply) -> None:
        """Fill the handshake's inbox fields: what the upstream needs to write here."""
        d = self.segment.desc
        reply.inbox_segment, reply.inbox_path, reply.inbox_size = d.name, d.path, d.size
        reply.inbox_address, reply.host_id = self.address, self.host_id
        reply.slots, reply.slot_bytes = self.slots, self.slot_bytes

    def take(self, chunk: pb.StageChunk, dtype: torch.dtype) -> torch.Tensor:
        """The announced slot's hidden states, checksum verified, copied out (the slot is free
        once this returns)."""
        rows = chunk.end - chunk.start
        if chunk.slot >= self.slots or chunk.nbytes > self.slot_bytes or rows <= 0:
            raise StageFailed(f"bad chunk announcement: slot {chunk.slot} of {self.slots}, "
                              f"{chunk.nbytes} bytes of {self.slot_bytes}, positions "
                              f"[{chunk.start}, {chunk.end})", "protocol")
        off = chunk.slot * self.slot_bytes
        view = self.segment.buf[off:off + chunk.nbytes]
        data = bytes(view)  # one copy, then hash the copy: the slot may be rewritten after
        if checksum(data) != chunk.checksum:
            raise StageFailed(f"hidden states of positions [{chunk.start}, {chunk.end}) failed "
                              "their checksum in the inbox", "checksum")
        return tensor_from(data, dtype, rows)

    def close(self) -> None:
        self.server.stop()
        self.segment.close()


@dataclass
class InboxTarget:
    """The sending side's view of the next stage's inbox (from its Hello reply)."""

    peer: Peer
    desc: SegmentDesc
    slots: int
    slot_bytes: int

    @classmethod
    def from_reply(cls, reply: pb.StageHelloReply) -> InboxTarget:
        if not reply.inbox_segment or reply.slots < 1:
            raise StageFailed(f"stage {reply.stage} announced no inbox", "protocol")
        peer = Peer(f"pipeline-inbox-{reply.instance_id}", reply.inbox_address, reply.host_id)
        desc = SegmentDesc(reply.inbox_segment, Tier.DRAM, reply.inbox_size, reply.inbox_path)
        return cls(peer, desc, reply.slots, reply.slot_bytes)

    def write(self, engine: TransferEngine, slot: int, data: memoryview) -> int:
        """Write `data` into `slot`; the xxh3 checksum of what was written."""
        if len(data) > self.slot_bytes:
            raise StageFailed(f"{len(data)} bytes of hidden states do not fit the next stage's "
                              f"{self.slot_bytes}-byte inbox slots (a different chunk size?)",
                              "protocol")
        try:
            sums = engine.write(self.peer, [WriteOp(self.desc, slot * self.slot_bytes, data)],
                                with_checksum=True)
        except Exception as e:
            engine.forget(self.peer)
            raise StageFailed(f"writing hidden states to {self.peer.address}: "
                              f"{type(e).__name__}: {e}", "transfer") from e
        return int(sums[0]) if sums else checksum(data)


class SlotRing:
    """The sender's free slots: taken before a write, returned by the receiver's credits."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self._failed: BaseException | None = None

    def take(self, timeout_s: float) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._failed, timeout_s):
                raise StageFailed(f"the next stage freed no inbox slot within {timeout_s:g} s",
                                  "timeout")
            if self._failed is not None:
                raise StageFailed(str(self._failed), "stream") from self._failed
            return self._free.pop(0)

    def give(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._failed = error
            self._cond.notify_all()
