"""`PrefillStage`: what a stage serves to the stage before it.

`Hello` checks the caller's view of the group against this stage (model, revision, group,
index, layer split), passes the check on down the chain and answers with this stage's inbox.
`Run` takes one prompt: the reused prefix (read whole, own layers imported; the group keeps the
shortest verified prefix), the leader's put plan, then chunk after chunk of hidden states from
the inbox, each computed through this stage's layers and passed on at once (or, on the last
stage, kept for its final position), and answers with the last hidden state and each stage's
stats. A hung-up caller (the stream cancelled) or one silent for the stage timeout aborts the
prompt here and down the chain.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import serving_pb2_grpc as pb_grpc
from mooncake_k8s.prefill.pipeline.group import StageClock, StageRuntime
from mooncake_k8s.prefill.pipeline.inbox import StageFailed, tensor_bytes
from mooncake_k8s.prefill.pipeline.link import Downstream

log = logging.getLogger(__name__)
_HUNG_UP = object()


class StageServicer(pb_grpc.PrefillStageServicer):
    """The generated `PrefillStage` service, answered by a worker's `StageRuntime`."""

    def __init__(self, rt: StageRuntime) -> None:
        self.rt = rt

    def Hello(self, request: pb.StageHello,
              context: grpc.ServicerContext) -> pb.StageHelloReply:
        rt = self.rt
        reply = pb.StageHelloReply(stage=rt.index, instance_id=rt.worker.config.instance_id)
        problem = self._mismatch(request)
        if problem:
            reply.problem = f"stage {rt.index} ({rt.worker.config.instance_id}): {problem}"
            return reply
        reply.layer_lo, reply.layer_hi = rt.layers(rt.index)
        if rt.inbox is not None:
            rt.inbox.describe(reply)
        reply.ok = True
        if not rt.last:
            nxt = rt.hello_next()
            reply.downstream.append(nxt)
            reply.downstream.extend(nxt.downstream)
            if not nxt.ok:
                reply.ok, reply.problem = False, nxt.problem
        rt.whole = reply.ok
        return reply

    def _mismatch(self, req: pb.StageHello) -> str:
        rt = self.rt
        if rt.adapter is None or rt.stage is None:
            return "the model is still loading"
        if rt.worker.draining.is_set():
            return "draining"
        info = rt.adapter.info
        for what, theirs, ours in (
                ("group", req.group, rt.group), ("group size", req.group_size, rt.size),
                ("stage index", req.stage, rt.index),
                ("model fingerprint", req.model_fingerprint, info.fingerprint),
                ("revision", req.revision, rt.worker.config.revision),
                ("layer count", req.num_layers, rt.num_layers)):
            if theirs != ours:
                return f"{what} {ours!r} here, the caller expects {theirs!r}"
        return ""

    def Run(self, request_iterator: Iterator[pb.StageMessage],
            context: grpc.ServicerContext) -> Iterator[pb.StageEvent]:
        rt = self.rt
        if rt.index == 0 or rt.stage is None or rt.inbox is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stage {rt.index} of group {rt.group!r} takes no Run stream "
                          "(the leader, or still loading)")
        rt.worker.admit(context)  # counted in flight: a draining stage finishes the prompt
        try:
            if not rt.lock.acquire(timeout=rt.timeout_s):
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"stage {rt.index} is busy with another prompt")
            yield from self._serve(_StageRun(rt, request_iterator), context)
        finally:
            rt.worker.release()

    def _serve(self, run: _StageRun,
               context: grpc.ServicerContext) -> Iterator[pb.StageEvent]:
        """Stream the prompt's events back while its thread computes it."""
        rt = self.rt
        context.add_callback(run.hang_up)
        threading.Thread(target=run.main, name="stage-run", daemon=True).start()
        try:
            while True:
                ev = run.out.get()
                if ev is None:
                    return
                if isinstance(ev, BaseException):
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"stage {rt.index}: {type(ev).__name__}: {ev}")
                yield ev
        finally:
            run.hang_up()


class _StageRun:
    """One prompt through a stage > 0 (the thread that computes it)."""

    def __init__(self, rt: StageRuntime, requests: Iterator[pb.StageMessage]) -> None:
        self.rt = rt
        self.requests = requests
        self.inq: queue.Queue[Any] = queue.Queue()
        self.out: queue.Queue[Any] = queue.Queue()
        self.down: Downstream | None = None
        self.clock = StageClock()
        self.bytes_in = 0
        self._hung_up = threading.Event()
        threading.Thread(target=self._read, name="stage-run-read", daemon=True).start()

    def hang_up(self) -> None:
        self._hung_up.set()
        self.inq.put(_HUNG_UP)

    def _read(self) -> None:
        try:
            for msg in self.requests:
                self.inq.put(msg)
        except Exception:  # cancelled: the same as a hang-up
            pass
        self.inq.put(_HUNG_UP)

    def _next(self, kind: str) -> Any:
        """The caller's next message, which must be of `kind` (a chunk's kind also admits the
        end); bounded by the stage timeout."""
        try:
            msg = self.inq.get(timeout=self.rt.timeout_s)
        except queue.Empty:
            raise StageFailed(f"the previous stage sent nothing for {self.rt.timeout_s:g} s",
                              "timeout") from None
        if msg is _HUNG_UP:
            raise StageFailed("the previous stage hung up", "hung_up")
        got = msg.WhichOneof("msg")
        if got != kind and not (kind == "chunk" and got == "end"):
            raise StageFailed(f"{got} where {kind} was due", "protocol")
        return msg

    def main(self) -> None:
        rt = self.rt
        try:
            self.out.put(self._prompt())
            self.out.put(None)
        except BaseException as e:
            if isinstance(e, StageFailed):
                rt.metrics.failures.labels(e.cause).inc()
                log.warning("pipeline prompt aborted", extra={"error": str(e)})
            else:
                log.exception("pipeline stage failed")
            rt.stage.abort()
            self.out.put(e)
        finally:
            if self.down is not None:
                self.down.close()
            rt.lock.release()

    def _prompt(self) -> pb.StageEvent:
        rt, stage = self.rt, self.rt.stage
        begin = self._next("begin").begin
        if not rt.last:
            self.down = rt.open_downstream()
            self.down.begin(begin)
        keep_on = rt.worker.local_segment if begin.keep_fetched else ""
        verified = stage.begin(begin.request_id, list(begin.token_ids), list(begin.reuse_keys),
                               keep_on)
        if self.down is not None:
            verified = min(verified, self.down.wait_begun())
        self.out.put(pb.StageEvent(begun=pb.StageBegun(verified_blocks=verified)))
        start = self._next("start").start
        stage.open_writer(start.first_block, start.put_plan)
        if self.down is not None:
            self.down.start(start)
        self.clock = StageClock()  # the span starts with the first chunk's wait
        last_hidden = self._chunks()
        failed, kv_bytes = stage.end_writes()
        return self._result(last_hidden, failed, kv_bytes)

    def _chunks(self) -> torch.Tensor | None:
        """Every chunk until the end: compute, pass on (or keep the last position)."""
        rt, stage = self.rt, self.rt.stage
        assert rt.inbox is not None
        last: torch.Tensor | None = None
        while True:
            msg = self._next("chunk")
            if msg.WhichOneof("msg") == "end":
                return last
            c = msg.chunk
            hidden = rt.inbox.take(c, rt.dtype)
            self.bytes_in += c.nbytes
            rt.metrics.bytes.labels("in").inc(c.nbytes)
            self.out.put(pb.StageEvent(credit=pb.StageCredit(slot=c.slot)))
            with self.clock.timed():
                if c.last_token_pass:
                    out = stage.last_token_pass(hidden)
                else:
                    out = stage.forward(c.start, c.end, hidden)
            if self.down is not None:
                self.down.send(out, c.start, c.end, c.last_token_pass)
            else:
                last = out[-1:].clone()

    def _result(self, last_hidden: torch.Tensor | None, failed: list[int],
                kv_bytes: int) -> pb.StageEvent:
        rt = self.rt
        lo, hi = rt.layers(rt.index)
        res = pb.StageResult(failed_objects=failed)
        if self.down is not None:
            below = self.down.finish()
            res.last_hidden, res.dtype = below.last_hidden, below.dtype
            res.failed_objects.extend(i for i in below.failed_objects if i not in failed)
            out_bytes = self.down.bytes_out
        else:
            if last_hidden is None:
                raise StageFailed("the prompt ended before any hidden state arrived",
                                  "protocol")
            res.last_hidden = bytes(tensor_bytes(last_hidden))
            res.dtype = str(last_hidden.dtype).removeprefix("torch.")
            below, out_bytes = None, 0
        mine = self.clock.stats(rt.index, lo, hi, bytes_in=self.bytes_in,
                                bytes_out=out_bytes, kv_bytes=kv_bytes)
        rt.metrics.account(mine)
        res.stages.append(mine)
        res.layer_ranges.extend((lo, hi))
        if below is not None:
            res.stages.extend(below.stages)
            res.layer_ranges.extend(below.layer_ranges)
        return pb.StageEvent(result=res)
