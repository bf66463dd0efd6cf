"""One request's trip: route, prefill (first token), decode (the rest), as a stream of events.

Failures before the client has seen output are retried on other instances. Once it has, a
failed decode instance (killed, unreachable) leaves rotation and the stream is *resumed* on
another decode instance of the same revision (`resume` says how; the pair comes from the same
`Scheduler.decide` as any request's, never shed): prefill reads the prompt's
KV from the pool (workers keep a copy outside the decode's process, `--store-replicas 2`),
recomputes the tokens already streamed and returns the next one, and decode goes on from
there with the same seed. The client sees one stream, each token once. With no instance left,
the stream ends with an error event (`decode_failed`).

A draining decode hands its streams over instead (`resume.HandedOff`, the stream's last message):
the stream *continues* on another decode of the same revision with no prefill call, loading the
KV the draining one stored (`_continue`); should that fail before a token, it takes the
failover path above. A decode stream that sends nothing for `stall_timeout_s` after its first
chunk (a frozen or partitioned instance) is abandoned (`instances.Stalled`): its instance
leaves rotation until it answers a poll, and the stream is resumed by failover.

A prefill group (its leader: one target) whose call fails retriably (a stage died or is
partitioned: UNAVAILABLE within the group's stage timeout) is never picked again for that
request: the retry goes to another group or a single instance (`_serve`'s `excluded`), counted
in `mooncake_conductor_reroutes_total{role="prefill"}` with the cause prefixed `group_`.

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
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc

from mooncake_k8s.common import tracing
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched.fairshare import FairShare, TenantOverShare
from mooncake_k8s.conductor.serving.errors import (
    DecodeFailed,
    NoCapacity,
    NothingToResume,
    UpstreamFailed,
    WorkerFailed,
    WorkerRefused,
)
from mooncake_k8s.conductor.serving.instances import (
    Instance,
    InstancePool,
    Stalled,
    Unreachable,
    next_within,
    until_answered,
)
from mooncake_k8s.conductor.serving.resume import (
    DecodeLost,
    HandedOff,
    continued_prompt,
    continued_sampling,
    handoff_mismatch,
    resume_candidates,
    resume_request_id,
    resumed_prompt,
    resumed_sampling,
    with_seed,
)
from mooncake_k8s.conductor.serving.router import Route, Router, RouteRequest, with_pairing

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
    prefill_group_size: int = 0
    """Route only to prefill targets of this many stages (1: single instances, G: prefill
    groups of G); 0: any. `mooncake calibrate` measures each kind of target this way."""


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
    prefill_stages: int = 0
    """Stages of the prefill target of the last attempt (1: a single instance)."""
    attempts: int = 0
    resumes: int = 0
    """Times the stream moved to another decode instance: its own failed, stalled or handed it
    over (draining)."""


class _Retry(Exception):
    """An attempt failed before the client saw output: try another pair."""


class Pipeline:
    def __init__(self, prefills: InstancePool, decodes: InstancePool, router: Router,
                 attempts: int = 4, prefill_timeout_s: float = 600.0,
                 metrics: ConductorMetrics | None = None, max_resumes: int = 3,
                 retry_wait_s: float = 3.0, fair: FairShare | None = None,
                 stall_timeout_s: float | None = None) -> None:
        self.metrics = metrics
        self.stall_timeout_s = stall_timeout_s
        """The per-token deadline of a decode stream once its first chunk came (None: off),
        enforced while another decode answers its polls (with none, the stream waits on);
        the first chunk waits for its KV and a batch slot, and has the pool's `lost` only."""
        self.fair = fair
        """Fair admission between tenants (`sched.fairshare`); None: off."""
        self.retry_wait_s = retry_wait_s
        """How long a retry waits for an instance to be usable again: a failed call takes its
        instance out of rotation until its next good poll (`InstancePool.mark_failed`), and
        when that was the last one (its peer partitioned), a 503 at once would turn a
        transient failure into an error. About one poll interval plus one poll timeout."""
        self.max_resumes = max_resumes
        """Resumes one stream may take (each needs a decode instance to fail under it)."""
        self.prefills = prefills
        self.decodes = decodes
        self.router = router
        self.attempts = attempts
        """Tries before the request fails; 4, since a partitioned host can cost two: the call
        abandoned on its instance, and one whose KV went to its segment (listed by the store
        master until it drops the silent node)."""
        self.prefill_timeout_s = prefill_timeout_s

    async def run(self, gen: Generation, out: Outcome) -> AsyncGenerator[Delta, None]:
        """The request's deltas; a decode instance lost mid-stream is replaced (decode
        failover, `resume`): the client sees one stream, each token once. With `fair`, a
        tenant over its fair share of a busy Conductor is refused first (TenantOverShare)."""
        fair = self.fair
        if fair is not None:
            try:
                fair.enter(gen.tenant, gen.priority)
            except TenantOverShare:
                if self.metrics is not None:
                    self.metrics.rejections.labels("tenant_share").inc()
                raise
        try:
            async with contextlib.aclosing(self._run(gen, out)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if fair is not None:
                fair.leave(gen.tenant)

    async def _run(self, gen: Generation, out: Outcome) -> AsyncGenerator[Delta, None]:
        out.prompt_tokens = len(gen.token_ids)
        gen = replace(gen, sampling=with_seed(gen.sampling))
        streamed: list[int] = []
        lost: DecodeLost | None = None
        last_at = time.monotonic()
        for resume in range(self.max_resumes + 1):
            if isinstance(lost, HandedOff):
                attempt = self._continue(gen, streamed, lost, resume, out, last_at)
            else:
                work = gen if lost is None else self._resumed(gen, streamed, lost, resume)
                attempt = self._serve(work, out, lost)
            try:
                async with contextlib.aclosing(attempt) as deltas:
                    async for delta in deltas:
                        streamed.append(delta.token_id)
                        yield delta
                        last_at = time.monotonic()
                return
            except DecodeLost as e:
                lost = e
                log.warning("decode lost mid-stream; resuming", extra={
                    "request_id": gen.request_id, "error": str(e), "streamed": len(streamed),
                    "handoff": isinstance(e, HandedOff)})
        assert lost is not None
        raise self._resume_failed(lost, f"gave up after {self.max_resumes} resumes")

    def _resumed(self, gen: Generation, streamed: list[int], lost: DecodeLost,
                 resume: int) -> Generation:
        """The request as a resume sends it: prompt plus what the client has, same seed,
        fewer tokens left (`resume.resumed_sampling`)."""
        try:
            sampling = resumed_sampling(gen.sampling, len(streamed))
        except ValueError as e:  # the stream had produced everything: nothing to resume
            raise NothingToResume(f"{lost}: {e}") from e
        return replace(gen, request_id=resume_request_id(gen.request_id, resume),
                       token_ids=resumed_prompt(gen.token_ids, streamed), sampling=sampling)

    async def _continue(self, gen: Generation, streamed: list[int], handed: HandedOff,
                        resume: int, out: Outcome, since: float
                        ) -> AsyncGenerator[Delta, None]:
        """A handed-over stream on another decode of the same revision, no prefill call: the
        context's KV is loaded from the pool (`resume.continued_prompt`). A failure before its
        first token raises a plain DecodeLost: the caller resumes by failover (re-prefill).
        `since`: when the client got its last token (the stall at the handoff starts there)."""
        why = handoff_mismatch(handed.handoff, len(gen.token_ids), len(streamed))
        if why:
            self._handoff_outcome("fallback")
            raise DecodeLost(handed.instance, f"{handed}: {why}")
        context, first = continued_prompt(gen.token_ids, streamed)
        work = replace(gen, request_id=resume_request_id(gen.request_id, resume),
                       token_ids=context, sampling=continued_sampling(gen.sampling,
                                                                      len(streamed)))
        # As a retry (attempt 1): the draining instance just left rotation, and a moment's
        # wait for another (`retry_wait_s`) beats breaking the stream.
        route = await self._route(work, handed, 1, str(handed))
        out.decode = route.decode.instance_id
        got = False
        try:
            async with contextlib.aclosing(self._decode(
                    work, route, first, handed.handoff.tail_key, route.plan)) as chunks:
                async for chunk in chunks:
                    if not got:
                        got = True
                        self._handed_over(handed, since, out)
                    yield self._next(chunk, out)
        except (grpc.aio.AioRpcError, Unreachable) as e:
            lost = self._lost(route.decode, e)
            if not got:
                self._handoff_outcome("fallback")
                log.warning("handed-over stream did not continue; failover instead",
                            extra={"request_id": gen.request_id, "error": str(lost)})
            raise lost from e

    def _handed_over(self, handed: HandedOff, since: float, out: Outcome) -> None:
        now = time.monotonic()
        out.resumes += 1
        self._handoff_outcome("ok")
        if self.metrics is not None:
            self.metrics.handoff_stall.observe(now - since)
        log.info("handed-over stream continued", extra={
            "error": str(handed), "stall_s": round(now - since, 4),
            "detected_s": round(now - handed.at, 4)})

    def _handoff_outcome(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.handoffs.labels(outcome).inc()

    async def _serve(self, gen: Generation, out: Outcome,
                     lost: DecodeLost | None) -> AsyncGenerator[Delta, None]:
        """Prefill then decode, retried on other instances until the client sees output;
        after that a failed decode raises DecodeLost (the caller resumes). With `lost` this
        is a resume: its first token is the end of the resume latency."""
        last_error = "no attempt made"
        excluded: set[str] = set()  # prefill groups (leaders' addresses) that failed it
        for attempt in range(self.attempts):
            out.attempts += 1
            route = await self._route(gen, lost, attempt, last_error, excluded)
            out.prefill, out.decode = route.prefill.instance_id, route.decode.instance_id
            out.prefill_stages = route.prefill.group_size
            pair = route.prefill.report.bootstrap_addr if route.prefill.report else ""
            if pair:
                try:
                    async with contextlib.aclosing(
                            self._paired(gen, route, attempt, pair, out, lost)) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except _Retry as e:  # the prefill call failed
                    last_error = str(e)
                    _exclude(excluded, route.prefill)
                    continue
            try:
                resp = await self._prefill(gen, route, attempt)
            except (grpc.aio.AioRpcError, Unreachable) as e:
                last_error = self._fail(self.prefills, route.prefill, e)
                _exclude(excluded, route.prefill)
                continue
            yield self._first(resp, out, lost)
            if resp.finished:
                return
            try:
                async with contextlib.aclosing(self._decode(gen, route, resp.first_token,
                                                            resp.tail_key,
                                                            route.plan)) as chunks:
                    async for chunk in chunks:
                        yield self._next(chunk, out)
                return
            except (grpc.aio.AioRpcError, Unreachable) as e:
                raise self._lost(route.decode, e) from e
        if lost is not None:
            raise self._resume_failed(lost, f"resuming failed after {self.attempts} attempts: "
                                            f"{last_error}")
        raise UpstreamFailed(f"request failed after {self.attempts} attempts: {last_error}")

    async def _route(self, gen: Generation, lost: DecodeLost | None, attempt: int,
                     last_error: str, excluded: set[str] | None = None) -> Route:
        """The router's one decision for this attempt. A resume asks the same question of
        the instances of the lost one's revision, never to be shed (`RouteRequest.shed`).
        Prefill targets are those of the size the request asks for (`prefill_group_size`),
        less the groups that failed it (`excluded`)."""
        size, gone = gen.prefill_group_size, excluded or set()

        def wanted(p: Instance) -> bool:
            return p.address not in gone and (not size or p.group_size == size)

        # A resume waits like a retry: the instance that failed it has just left rotation,
        # and another may be benched for a moment (a stall on a busy host, a failed call).
        prefills, decodes = await self._candidates(attempt or int(lost is not None),
                                                   wanted if size or gone else None)
        if not prefills and (size or gone):
            what = f"with {size} stage(s) " if size else ""
            but = f" (other than the {len(gone)} group(s) that failed it)" if gone else ""
            cause = f"; last failure: {last_error}" if attempt else ""
            raise NoCapacity(f"no prefill target {what}is ready{but}{cause}")
        if lost is not None:
            prefills = resume_candidates(prefills, lost.revision)
            decodes = resume_candidates(decodes, lost.revision)
            if isinstance(lost, HandedOff):  # draining, whatever a late poll said
                decodes = [d for d in decodes if d is not lost.instance]
            for role, left in (("decode", decodes), ("prefill", prefills)):
                if not left:
                    raise self._resume_failed(lost, f"no {role} instance of revision "
                                                    f"{lost.revision!r} is left to resume "
                                                    f"the stream on")
        # A resume is never shed: the client is already reading the stream.
        req = RouteRequest(gen.request_id, gen.token_ids, gen.tenant, gen.sampling.max_tokens,
                           gen.use_prefix_cache, gen.priority, shed=lost is None)
        try:
            return await self.router.route(req, prefills, decodes)
        except NoCapacity as e:
            if lost is not None:
                raise self._resume_failed(lost, str(e)) from e
            why = f"{e} (last failure: {last_error})" if attempt else str(e)
            raise NoCapacity(why) from e

    async def _candidates(self, attempt: int, wanted: Callable[[Instance], bool] | None = None
                          ) -> tuple[list[Instance], list[Instance]]:
        """The usable instances of both roles (prefill ones that are `wanted`); a retry
        (`attempt` > 0) finding a role empty waits up to `retry_wait_s` for one to come back
        before the router says NoCapacity."""
        deadline = time.monotonic() + (self.retry_wait_s if attempt else 0.0)
        while True:
            prefills, decodes = self.prefills.usable(), self.decodes.usable()
            if wanted is not None:
                prefills = [p for p in prefills if wanted(p)]
            if (prefills and decodes) or time.monotonic() >= deadline:
                return prefills, decodes
            await asyncio.sleep(0.1)

    def _first(self, resp: pb.PrefillResponse, out: Outcome,
               lost: DecodeLost | None) -> Delta:
        """The prefill's token as a delta; for a resume, the resume is done here."""
        now = time.monotonic()
        if out.first_token_at is None:
            out.first_token_at = now
            out.cached_tokens = resp.cached_tokens
        if lost is not None:
            out.resumes += 1
            if self.metrics is not None:
                self.metrics.resumes.labels("ok").inc()
                self.metrics.resume_seconds.observe(now - lost.at)
            log.info("stream resumed", extra={"error": str(lost),
                                              "resume_s": round(now - lost.at, 4)})
        out.completion_tokens += 1
        reason = resp.finish_reason or None if resp.finished else None
        out.finish_reason = reason
        return Delta(resp.text, resp.first_token, reason)

    @staticmethod
    def _next(chunk: pb.DecodeChunk, out: Outcome) -> Delta:
        out.completion_tokens += 1
        reason = chunk.finish_reason or None if chunk.finished else None
        out.finish_reason = reason
        return Delta(chunk.text, chunk.token_id, reason)

    def _lost(self, inst: Instance, e: grpc.aio.AioRpcError | Unreachable) -> DecodeLost:
        """A decode failure after the client saw output (an error no other instance would
        answer differently, such as INVALID_ARGUMENT, raises WorkerRefused instead)."""
        msg = self._fail(self.decodes, inst, e)
        return DecodeLost(inst, f"decode instance {inst.instance_id} failed mid-stream: {msg}")

    def _resume_failed(self, lost: DecodeLost, why: str) -> DecodeFailed:
        if isinstance(lost, HandedOff):
            self._handoff_outcome("failed")
        elif self.metrics is not None:
            self.metrics.resumes.labels("failed").inc()
        return DecodeFailed(f"{lost}; {why}")

    async def _paired(self, gen: Generation, route: Route, attempt: int, addr: str,
                      out: Outcome, lost: DecodeLost | None) -> AsyncGenerator[Delta, None]:
        """One attempt with paired handoff (SGLang PD): decode must be waiting for the KV
        while prefill computes it, so both calls start together, meeting in a fresh room.
        Raises _Retry when the attempt failed before the client saw anything."""
        plan = with_pairing(route.plan, addr, random.getrandbits(63) or 1)
        chunks: asyncio.Queue[pb.DecodeChunk | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self._decode(gen, route, 0, "",
                                                            plan)) as stream:
                    async for chunk in stream:
                        await chunks.put(chunk)
                await chunks.put(None)
            except BaseException as e:  # handed to the reader, which decides
                await chunks.put(e)

        task = asyncio.create_task(pump())
        try:
            try:
                resp = await self._prefill(gen, route, attempt, plan)
            except (grpc.aio.AioRpcError, Unreachable) as e:
                raise _Retry(self._fail(self.prefills, route.prefill, e)) from e
            yield self._first(resp, out, lost)
            if resp.finished:
                return
            while True:
                item = await chunks.get()
                if item is None:
                    return
                if isinstance(item, (grpc.aio.AioRpcError, Unreachable)):
                    raise self._lost(route.decode, item) from item
                if isinstance(item, BaseException):
                    raise item
                yield self._next(item, out)
        finally:
            task.cancel()

    def _fail(self, pool: InstancePool, inst: Instance,
              e: grpc.aio.AioRpcError | Unreachable) -> str:
        """Why the attempt failed, after taking the instance out of rotation where the failure
        says it is gone; raises when no other instance would answer differently."""
        if isinstance(e, Unreachable):
            return self._abandoned(pool, inst, e)
        msg = f"{pool.role} {inst.instance_id}: {e.code().name}: {e.details()}"
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise WorkerRefused(e.details() or "invalid request") from e
        if e.code() not in _RETRYABLE:
            raise WorkerFailed(msg) from e
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            pool.mark_failed(inst, msg)
        log.warning("attempt failed", extra={"error": msg})
        self._rerouted(pool.role, _cause(inst, e.code().name.lower()))
        return msg

    def _abandoned(self, pool: InstancePool, inst: Instance, e: Unreachable) -> str:
        """A call given up on because its instance stopped answering (a partition): the
        instance is already out of rotation; the attempt goes to another one."""
        cause = "stalled" if isinstance(e, Stalled) else "unreachable"
        msg = f"{pool.role} {inst.instance_id}: {cause}: {e}"
        pool.mark_failed(inst, msg)
        log.warning(f"attempt abandoned: instance {cause}", extra={"error": msg})
        if isinstance(e, Stalled) and self.metrics is not None:
            self.metrics.stream_stalls.inc()
        self._rerouted(pool.role, _cause(inst, cause))
        return msg

    def _rerouted(self, role: str, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.reroutes.labels(role, cause).inc()

    async def _prefill(self, gen: Generation, route: Route, attempt: int,
                       plan: pb.KVPlan | None = None) -> pb.PrefillResponse:
        """One prefill call with `plan` (the route's own unless paired handoff made a copy)."""
        inst = route.prefill
        n = len(gen.token_ids)
        inst.inflight += 1
        inst.inflight_tokens += n
        try:
            with tracing.span("conductor.prefill", instance=inst.instance_id, attempt=attempt):
                req = pb.PrefillRequest(
                    request_id=f"{gen.request_id}-{attempt}", token_ids=gen.token_ids,
                    tenant=gen.tenant, sampling=gen.sampling,
                    plan=route.plan if plan is None else plan,
                    use_prefix_cache=gen.use_prefix_cache, trace_context=tracing.inject(),
                )
                resp: pb.PrefillResponse = await until_answered(inst, inst.stub.Prefill(
                    req, metadata=self.prefills.metadata, timeout=self.prefill_timeout_s))
                return resp
        finally:
            inst.inflight -= 1
            inst.inflight_tokens -= n
            inst.note_done(n)

    async def _decode(self, gen: Generation, route: Route, first_token: int, tail_key: str,
                      plan: pb.KVPlan) -> AsyncGenerator[pb.DecodeChunk, None]:
        """The decode stream, with the same plan the prefill call carried."""
        inst = route.decode
        inst.inflight += 1
        try:
            with tracing.span("conductor.decode", instance=inst.instance_id):
                req = pb.DecodeRequest(
                    request_id=gen.request_id, token_ids=gen.token_ids, tenant=gen.tenant,
                    first_token=first_token, sampling=gen.sampling, tail_key=tail_key,
                    trace_context=tracing.inject(), plan=plan,
                )
                call = inst.stub.Decode(req, metadata=self.decodes.metadata)
                try:
                    chunks, deadline = call.__aiter__(), None
                    while True:
                        try:
                            chunk = await next_within(
                                inst, chunks, deadline,
                                lambda: self.decodes.answering_besides(inst))
                        except StopAsyncIteration:
                            return
                        if chunk.HasField("handoff"):
                            # Draining: route nothing more there before the poll says so.
                            self.decodes.mark_failed(inst, "draining (handed a stream over)")
                            raise HandedOff(inst, chunk.handoff)
                        yield chunk
                        deadline = self.stall_timeout_s
                finally:
                    call.cancel()
        finally:
            inst.inflight -= 1
            inst.note_done(len(gen.token_ids) + gen.sampling.max_tokens)


def _exclude(excluded: set[str], inst: Instance) -> None:
    """A prefill group that failed a request is not tried again for it: its stages may be
    what failed, and the leader answers polls ready until its own check notices."""
    if inst.group_size > 1:
        excluded.add(inst.address)


def _cause(inst: Instance, cause: str) -> str:
    """The reroute cause: a prefill group's failures are told apart (`group_` + cause)."""
    return f"group_{cause}" if inst.group_size > 1 else cause
