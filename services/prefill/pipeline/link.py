"""One hop of a prompt down the group: the `Run` stream to the next stage, seen from upstream.

The compute thread only hands over finished chunks (`send`) and goes on with the next one: a
sender thread waits for a free inbox slot, writes the hidden states with the transfer engine
and announces them on the stream; a reader thread takes the next stage's answers (its verified
prefix, slot credits, the final result). Every wait is bounded by the stage timeout, counted
from the next stage's last sign of life: a stage that resets its stream (dead) or says nothing
for that long (partitioned, hung) fails the prompt with `StageFailed`, never a hang.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch

from mooncake_k8s.common.auth import call_metadata
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc
from mooncake_k8s.prefill.pipeline.inbox import InboxTarget, SlotRing, StageFailed, tensor_bytes
from mooncake_k8s.transfer.engine import TransferEngine

_CLOSE = object()


def rpc_failure(e: grpc.RpcError, what: str) -> StageFailed:
    """A gRPC error of the next stage as a StageFailed naming it."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    cause = "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "stream"
    return StageFailed(f"{what}: {code.name if code else 'error'}: {details}", cause)


class Downstream:
    """The stream to the next stage for one prompt (open, begin, start, send..., finish)."""

    def __init__(self, channel: grpc.Channel, token: str, target: InboxTarget,
                 engine: TransferEngine, timeout_s: float, address: str,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.address = address
        self._on_bytes = on_bytes
        self._target = target
        self._engine = engine
        self._timeout = timeout_s
        self._requests: queue.Queue[Any] = queue.Queue()
        self._ring = SlotRing(target.slots)
        self._events: queue.Queue[pb.StageEvent | BaseException] = queue.Queue()
        self._outgoing: queue.Queue[Any] = queue.Queue(maxsize=target.slots)
        self._alive = time.monotonic()
        self._error: BaseException | None = None
        self.bytes_out = 0
        stub = pb_grpc.PrefillStageStub(channel)  # type: ignore[no-untyped-call]
        self._call = stub.Run(self._request_iter(), metadata=call_metadata(token))
        threading.Thread(target=self._read, name="stage-link-read", daemon=True).start()
        self._sender = threading.Thread(target=self._send_loop, name="stage-link-send",
                                        daemon=True)
        self._sender.start()

    # -- the stream --------------------------------------------------------------------------

    def _request_iter(self) -> Iterator[pb.StageMessage]:
        while True:
            msg = self._requests.get()
            if msg is _CLOSE:
                return
            yield msg

    def _read(self) -> None:
        try:
            for ev in self._call:
                self._alive = time.monotonic()
                if ev.WhichOneof("event") == "credit":
                    self._ring.give(ev.credit.slot)
                else:
                    self._events.put(ev)
            err: BaseException = StageFailed(f"stage at {self.address} ended the stream "
                                             "without a result", "stream")
        except grpc.RpcError as e:
            err = rpc_failure(e, f"stage at {self.address}")
        self._fail(err)

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        self._ring.fail(err)
        self._events.put(err)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error if isinstance(self._error, StageFailed) else StageFailed(
                str(self._error))

    def _wait_event(self, kind: str) -> pb.StageEvent:
        """The next event of `kind`, waiting while the next stage shows signs of life (its
        credits), at most the stage timeout since the last one."""
        while True:
            left = self._alive + self._timeout - time.monotonic()
            try:
                ev = self._events.get(timeout=max(left, 0.0))
            except queue.Empty:
                if self._alive + self._timeout <= time.monotonic():
                    raise StageFailed(f"stage at {self.address} said nothing for "
                                      f"{self._timeout:g} s (waiting for its {kind})",
                                      "timeout") from None
                continue
            if isinstance(ev, BaseException):
                self._check()
                raise StageFailed(str(ev))
            if ev.WhichOneof("event") != kind:
                raise StageFailed(f"stage at {self.address} sent {ev.WhichOneof('event')} "
                                  f"where {kind} was due", "protocol")
            return ev

    # -- the prompt --------------------------------------------------------------------------

    def begin(self, msg: pb.StageBegin) -> None:
        self._alive = time.monotonic()
        self._requests.put(pb.StageMessage(begin=msg))

    def wait_begun(self) -> int:
        return int(self._wait_event("begun").begun.verified_blocks)

    def start(self, msg: pb.StageStart) -> None:
        self._check()
        self._requests.put(pb.StageMessage(start=msg))

    def send(self, hidden: torch.Tensor, start: int, end: int, last_pass: bool = False) -> None:
        """Queue a chunk's hidden states for the next stage and return at once (bounded by
        the ring: at most `slots` chunks wait here)."""
        self._check()
        try:
            self._outgoing.put((hidden, start, end, last_pass), timeout=self._timeout)
        except queue.Full:
            raise StageFailed(f"stage at {self.address} took no chunk for {self._timeout:g} s",
                              "timeout") from None

    def _send_loop(self) -> None:
        while True:
            item = self._outgoing.get()
            if item is _CLOSE:
                return
            if self._error is not None:
                continue  # drain: the prompt is failing
            hidden, start, end, last_pass = item
            try:
                slot = self._ring.take(self._timeout)
                data = tensor_bytes(hidden)
                sum_ = self._target.write(self._engine, slot, data)
                self.bytes_out += len(data)
                if self._on_bytes is not None:
                    self._on_bytes(len(data))
                self._requests.put(pb.StageMessage(chunk=pb.StageChunk(
                    slot=slot, start=start, end=end, nbytes=len(data), checksum=sum_,
                    last_token_pass=last_pass)))
            except BaseException as e:
                self._fail(e)

    def finish(self) -> pb.StageResult:
        """End the prompt's input and wait for the next stage's result."""
        self._check()
        try:
            self._outgoing.put(_CLOSE, timeout=self._timeout)  # after every queued chunk
        except queue.Full:
            raise StageFailed(f"stage at {self.address} took no chunk for {self._timeout:g} s",
                              "timeout") from None
        self._sender.join(self._timeout)
        self._check()
        self._requests.put(pb.StageMessage(end=pb.StageEnd()))
        return self._wait_event("result").result

    def close(self) -> None:
        """Hang up (idempotent): the next stage aborts the prompt if it has not finished."""
        self._requests.put(_CLOSE)
        if self._sender.is_alive():
            self._ring.fail(StageFailed("the prompt ended", "closed"))  # unblocks a take
            with contextlib.suppress(queue.Full):  # the sender drains what is queued, then ends
                self._outgoing.put(_CLOSE, timeout=self._timeout)
        self._call.cancel()
