"""One request's trip: route, prefill (first token), decode (the rest), as a stream of events.

Failures before the client has seen output are retried on other instances; the first token is
kept across a retry (decode continues from the token the client already has), so a retry never
changes what was said. Once decode has streamed, a dead decode instance ends the stream with an
error event: other streams and later requests are unaffected, and the instance leaves rotation.

Every nested generator is closed explicitly (`aclosing`): when the client goes away the API
layer closes `run`, and that must reach `_decode`'s `call.cancel()` at once, not whenever the
garbage collector finalises an abandoned generator (until then decode keeps generating).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import grpc

from mooncake_k8s.common import tracing
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.instances import Instance, InstancePool
from mooncake_k8s.conductor.protocol import ApiError
from mooncake_k8s.conductor.scheduler import NoCapacity, Route, Router, RouteRequest

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.CANCELLED}


@dataclass
class Generation:
    request_id: str
    token_ids: Sequence[int]
    tenant: str
    sampling: pb.Sampling
    use_prefix_cache: bool = True
    priority: str = "interactive"


@dataclass
class Delta:
    text: str
    token_id: int
    finish_reason: str | None


@dataclass
class Outcome:
    """Filled in as the request runs; the API layer reads it for usage and metrics."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)
    prefill: str = ""
    decode: str = ""
    attempts: int = 0


class _Retry(Exception):
    """An attempt failed before the client saw output: try another pair."""


class Pipeline:
    def __init__(self, prefills: InstancePool, decodes: InstancePool, router: Router,
                 attempts: int = 3, prefill_timeout_s: float = 600.0) -> None:
        self.prefills = prefills
        self.decodes = decodes
        self.router = router
        self.attempts = attempts
        self.prefill_timeout_s = prefill_timeout_s

    async def run(self, gen: Generation, out: Outcome) -> AsyncGenerator[Delta, None]:
        out.prompt_tokens = len(gen.token_ids)
        first: pb.PrefillResponse | None = None
        last_error = "no attempt made"
        for attempt in range(self.attempts):
            out.attempts = attempt + 1
            try:
                route = await self.router.route(
                    RouteRequest(gen.request_id, gen.token_ids, gen.tenant,
                                 gen.sampling.max_tokens, gen.use_prefix_cache, gen.priority),
                    self.prefills.usable(), self.decodes.usable())
            except NoCapacity as e:
                why = f"{e} (last failure: {last_error})" if attempt else str(e)
                raise ApiError(503, why, type_="server_error", code="no_capacity") from e
            out.prefill, out.decode = route.prefill.instance_id, route.decode.instance_id
            pair = route.prefill.report.bootstrap_addr if route.prefill.report else ""
            if pair:
                try:
                    async with contextlib.aclosing(
                            self._paired(gen, route, attempt, pair, out)) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except _Retry as e:
                    last_error = str(e)
                    continue
            try:
                resp = await self._prefill(gen, route, attempt)
            except grpc.aio.AioRpcError as e:
                last_error = self._fail(self.prefills, route.prefill, e)
                continue
            if first is None:
                first = resp
                out.cached_tokens = resp.cached_tokens
                out.first_token_at = time.monotonic()
                out.completion_tokens = 1
                reason = resp.finish_reason or None if resp.finished else None
                out.finish_reason = reason
                yield Delta(resp.text, resp.first_token, reason)
                if resp.finished:
                    return
            streamed = False
            try:
                async with contextlib.aclosing(self._decode(gen, route, first.first_token,
                                                            resp.tail_key)) as chunks:
                    async for chunk in chunks:
                        streamed = True
                        out.completion_tokens += 1
                        reason = chunk.finish_reason or None if chunk.finished else None
                        out.finish_reason = reason
                        yield Delta(chunk.text, chunk.token_id, reason)
                return
            except grpc.aio.AioRpcError as e:
                last_error = self._fail(self.decodes, route.decode, e)
                if streamed:
                    raise ApiError(502, f"decode instance {route.decode.instance_id} failed "
                                        f"mid-stream: {last_error}", type_="server_error",
                                   code="decode_failed") from e
        raise ApiError(503, f"request failed after {self.attempts} attempts: {last_error}",
                       type_="server_error", code="upstream_failed")

    async def _paired(self, gen: Generation, route: Route, attempt: int, addr: str,
                      out: Outcome) -> AsyncGenerator[Delta, None]:
        """One attempt with paired handoff (SGLang PD): decode must be waiting for the KV
        while prefill computes it, so both calls start together, meeting in a fresh room.
        Raises _Retry when the attempt failed before the client saw anything."""
        room = random.getrandbits(63) or 1
        plan = route.plan()
        plan.bootstrap_addr, plan.bootstrap_room = addr, room
        chunks: asyncio.Queue[pb.DecodeChunk | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self._decode(gen, route, 0, "",
                                                            (addr, room))) as stream:
                    async for chunk in stream:
                        await chunks.put(chunk)
                await chunks.put(None)
            except BaseException as e:  # handed to the reader, which decides
                await chunks.put(e)

        task = asyncio.create_task(pump())
        try:
            try:
                resp = await self._prefill(gen, route, attempt, plan)
            except grpc.aio.AioRpcError as e:
                raise _Retry(self._fail(self.prefills, route.prefill, e)) from e
            out.cached_tokens = resp.cached_tokens
            out.first_token_at = time.monotonic()
            out.completion_tokens = 1
            reason = resp.finish_reason or None if resp.finished else None
            out.finish_reason = reason
            yield Delta(resp.text, resp.first_token, reason)
            if resp.finished:
                return
            while True:
                item = await chunks.get()
                if item is None:
                    return
                if isinstance(item, grpc.aio.AioRpcError):
                    msg = self._fail(self.decodes, route.decode, item)
                    raise ApiError(502, f"decode instance {route.decode.instance_id} failed "
                                        f"after the first token: {msg}", type_="server_error",
                                   code="decode_failed") from item
                if isinstance(item, BaseException):
                    raise item
                out.completion_tokens += 1
                reason = item.finish_reason or None if item.finished else None
                out.finish_reason = reason
                yield Delta(item.text, item.token_id, reason)
        finally:
            task.cancel()

    def _fail(self, pool: InstancePool, inst: Instance, e: grpc.aio.AioRpcError) -> str:
        msg = f"{pool.role} {inst.instance_id}: {e.code().name}: {e.details()}"
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise ApiError(400, e.details() or "invalid request") from e
        if e.code() not in _RETRYABLE:
            raise ApiError(502, msg, type_="server_error") from e
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            pool.mark_failed(inst, msg)
        log.warning("attempt failed", extra={"error": msg})
        return msg

    async def _prefill(self, gen: Generation, route: Route, attempt: int,
                       plan: pb.KVPlan | None = None) -> pb.PrefillResponse:
        inst = route.prefill
        n = len(gen.token_ids)
        inst.inflight += 1
        inst.inflight_tokens += n
        try:
            with tracing.span("conductor.prefill", instance=inst.instance_id, attempt=attempt):
                req = pb.PrefillRequest(
                    request_id=f"{gen.request_id}-{attempt}", token_ids=gen.token_ids,
                    tenant=gen.tenant, sampling=gen.sampling,
                    plan=plan if plan is not None else route.plan(),
                    use_prefix_cache=gen.use_prefix_cache, trace_context=tracing.inject(),
                )
                resp: pb.PrefillResponse = await inst.call("Prefill")(
                    req, metadata=self.prefills.metadata, timeout=self.prefill_timeout_s)
                return resp
        finally:
            inst.inflight -= 1
            inst.inflight_tokens -= n

    async def _decode(self, gen: Generation, route: Route, first_token: int, tail_key: str,
                      pair: tuple[str, int] = ("", 0)) -> AsyncGenerator[pb.DecodeChunk, None]:
        inst = route.decode
        inst.inflight += 1
        try:
            with tracing.span("conductor.decode", instance=inst.instance_id):
                req = pb.DecodeRequest(
                    request_id=gen.request_id, token_ids=gen.token_ids, tenant=gen.tenant,
                    first_token=first_token, sampling=gen.sampling, tail_key=tail_key,
                    trace_context=tracing.inject(), block_keys=route.keys,
                    namespace=route.namespace, bootstrap_addr=pair[0], bootstrap_room=pair[1],
                )
                call = inst.call("Decode", stream=True)(req, metadata=self.decodes.metadata)
                try:
                    async for chunk in call:
                        yield chunk
                finally:
                    call.cancel()
        finally:
            inst.inflight -= 1
