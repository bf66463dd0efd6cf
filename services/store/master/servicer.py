"""The store master's RPC handlers, served by `grpc.aio` so that open streams cost no thread.

Every RPC of `service Master` (proto/store.proto) is a thin call into `MasterState`, with errors
mapped to gRPC status codes and a specific message; no exception escapes a handler.

Why asyncio: a storage node holds a `NodeCommands` stream for as long as it lives, and every
Conductor (or any other subscriber) holds a `Watch` stream. With a thread per stream, 64 nodes
and watchers took every thread of the pool and unary calls (lookups, heartbeats) stopped being
answered. Here a stream is a coroutine parked on an `asyncio.Event`; the state wakes it (its
"waker", called from whatever thread changed the state) only when it has something to send.

Unary handlers call the state directly on the event loop: its methods are short and take one
lock, and a thread hop would cost more than most of them. The exception is `RegisterNode`,
whose inventory may hold many thousand objects; it runs on the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import Histogram

from mooncake_k8s.common.auth import METADATA_KEY, token_matches
from mooncake_k8s.common.errors import InvalidArgument, NoSpace, ObjectTooLarge, StoreError
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.master.ha import JournalEntry
from mooncake_k8s.store.master.recovery import RecoveryGate
from mooncake_k8s.store.master.state import MasterState, PutNotFound, PutSuperseded, UnknownNode
from mooncake_k8s.store.wire import (
    EPOCH_KEY,
    ERROR_KEY,
    FAST_PORT_KEY,
    LEADER_KEY,
    RECOVERING_KEY,
    STANDBY_KEY,
    code_of,
)

if TYPE_CHECKING:
    from mooncake_k8s.store.master.config import MasterConfig
    from mooncake_k8s.store.master.ha import RedisCoordinator

log = logging.getLogger(__name__)

SERVICE = "mooncake.store.v1.Master"
# RECOVERING_KEY: trailing metadata on an UNAVAILABLE that the master sent on purpose while it
# rebuilds: the call did nothing, so even a put may be retried. STANDBY_KEY (with LEADER_KEY):
# the same from a standby master of an HA group.
COMMAND_COALESCE_S = 0.002
"""After sending commands to a node, wait this long before sending more."""
_OFF_LOOP = frozenset({"RegisterNode"})
"""Unary calls run on the executor instead of the event loop (see the module docstring)."""
_OFF_LOOP_HA = _OFF_LOOP | {"PutEnd", "BatchPutEnd", "PutCommit", "ReplicaEnd", "Remove", "Pin"}
"""With Redis HA these also write to Redis before they answer: kept off the loop too."""


class _Abort(Exception):
    """Raised by a handler to end the call with this status."""

    def __init__(
        self, code: grpc.StatusCode, message: str,
        trailers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = trailers


Trailers = tuple[tuple[str, str], ...]


def status_of(e: Exception, method: str) -> tuple[grpc.StatusCode, str, Trailers]:
    """The status, message and trailers (the `ErrorCode` among them) a failed call answers;
    logs unexpected errors."""
    code, msg, error = _status_of(e)
    if code == grpc.StatusCode.INTERNAL:
        log.error("rpc failed", exc_info=e, extra={"method": method})
    trailers = e.trailers if isinstance(e, _Abort) else ()
    return code, msg, ((ERROR_KEY, pb.ErrorCode.Name(error)), *trailers)  # type: ignore[arg-type]


def _status_of(e: Exception) -> tuple[grpc.StatusCode, str, int]:
    """(gRPC status, message, ErrorCode) of an exception: the one mapping of the master's
    errors onto the wire."""
    if isinstance(e, _Abort):
        error = (pb.ERROR_UNAVAILABLE if e.code == grpc.StatusCode.UNAVAILABLE
                 else pb.ERROR_INVALID if e.code == grpc.StatusCode.INVALID_ARGUMENT
                 else pb.ERROR_INTERNAL)
        return e.code, e.message, error
    if isinstance(e, ObjectTooLarge):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e), pb.ERROR_TOO_LARGE
    if isinstance(e, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e), pb.ERROR_INVALID
    if isinstance(e, NoSpace):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), code_of(e)
    if isinstance(e, PutSuperseded):
        return grpc.StatusCode.ALREADY_EXISTS, str(e), pb.ERROR_EXISTS
    if isinstance(e, PutNotFound | UnknownNode):
        return grpc.StatusCode.NOT_FOUND, str(e), pb.ERROR_NOT_FOUND
    if isinstance(e, StoreError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e), pb.ERROR_INTERNAL
    return grpc.StatusCode.INTERNAL, "internal error in the master (see its log)", \
        pb.ERROR_INTERNAL


def _serialize(msg: Any) -> bytes:
    if type(msg) is bytes:
        return msg
    return bytes(msg.SerializeToString())


def _waker(ev: asyncio.Event) -> Callable[[], None]:
    """A callable that sets `ev` from any thread: directly on the loop's own thread, through
    `call_soon_threadsafe` from others (the tick thread, the executor). Never raises: it is
    called under the state's lock, possibly after the loop stopped."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()

    def wake() -> None:
        if ev.is_set():
            return
        if threading.get_ident() == loop_thread:
            ev.set()
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the stream is gone anyway
            loop.call_soon_threadsafe(ev.set)

    return wake


class MasterServicer:
    """One method per RPC, taking (request, context); unary ones are plain functions, the
    streaming ones async generators."""

    def __init__(
        self, state: MasterState, config: MasterConfig, stopping: threading.Event,
        gate: RecoveryGate, ha: RedisCoordinator | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self._stopping = stopping
        self.gate = gate
        self.ha = ha
        self.pins: set[str] = set()
        """Keys pinned in Redis (HA): pinned again whenever their node registers."""

    def _durable(self, keys: list[str], what: str) -> None:
        """HA: journal the committed replicas of `keys` before the put is acknowledged; if
        that fails the commit is undone (the writer puts again), so nothing acknowledged
        depends on this leader's memory alone."""
        if self.ha is None or not keys:
            return
        try:
            self.ha.journal_commits(
                JournalEntry(n, inc, item) for n, inc, item in self.state.replica_records(keys))
        except Exception as e:
            self.state.remove(keys, force=True)
            log.warning("commit not journaled; undone", extra={"keys": len(keys),
                                                                "error": type(e).__name__})
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"{what}: the master could not record the commit durably ({e}); "
                         "put again", ((STANDBY_KEY, "1"),)) from e

    def _authoritative(self) -> None:
        """Refuse (UNAVAILABLE, retryable) while a restarted master is still rebuilding."""
        if not self.gate.is_open:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, self.gate.describe(),
                         ((RECOVERING_KEY, "1"),))

    # -- nodes -----------------------------------------------------------------------------

    def RegisterNode(self, req: pb.RegisterNodeRequest, ctx: Any) -> pb.RegisterNodeResponse:
        journal = self.ha.journal_for(req.node_id, req.incarnation) if self.ha else []
        reg = self.state.register_node(
            req.node_id, req.address, req.host_id, list(req.segments), list(req.inventory),
            req.incarnation, journal,
        )
        if self.pins:
            self.state.pin(list(self.pins))
        self.gate.registered(req.node_id)
        return pb.RegisterNodeResponse(
            master_id=self.state.master_id,
            heartbeat_interval_ms=self.config.heartbeat_interval_ms,
            restored_objects=reg.restored, dropped_replicas=reg.dropped,
        )

    def Heartbeat(self, req: pb.HeartbeatRequest, ctx: Any) -> pb.HeartbeatResponse:
        known = self.state.heartbeat(req.node_id)
        return pb.HeartbeatResponse(reregister=not known, master_id=self.state.master_id)

    async def NodeCommands(
        self, req: pb.NodeCommandsRequest, ctx: Any
    ) -> AsyncIterator[pb.NodeCommandBatch]:
        ev = asyncio.Event()
        stream = self.state.open_command_stream(req.node_id, req.master_id, _waker(ev))
        if stream is None:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {req.node_id!r} is not registered with this master; register again",
            )
        while not self._stopping.is_set():
            ev.clear()  # before looking: a wake-up from here on is not lost
            cmds = self.state.next_commands(req.node_id, stream, 0)
            if cmds is None:
                return  # a newer stream, the node dropped, or shutdown
            if cmds:
                yield pb.NodeCommandBatch(commands=cmds)
                # Let a burst of puts collect into the next message (the node needs no
                # command at once: commits are already visible to lookups).
                await asyncio.sleep(COMMAND_COALESCE_S)
            else:
                await ev.wait()

    def CommandDone(self, req: pb.CommandDoneRequest, ctx: Any) -> pb.CommandDoneResponse:
        self.state.command_done(req.node_id, req.id, req.ok, req.error)
        return pb.CommandDoneResponse()

    # -- puts ------------------------------------------------------------------------------

    def PutStart(self, req: pb.PutStartRequest, ctx: Any) -> pb.PutStartResponse:
        self._authoritative()
        return self.state.put_start(
            req.key, req.size, req.replicas, req.placement, req.preferred_segment,
            req.client_host_id, req.segments, tenant=req.tenant,
        )

    def PutEnd(self, req: pb.PutEndRequest, ctx: Any) -> pb.PutEndResponse:
        self.state.put_end(req.key, req.put_id, req.checksum)
        self._durable([req.key], f"put {req.key!r}")
        return pb.PutEndResponse()

    def PutRevoke(self, req: pb.PutRevokeRequest, ctx: Any) -> pb.PutRevokeResponse:
        self.state.put_revoke(req.key, req.put_id)
        return pb.PutRevokeResponse()

    def BatchPutStart(self, req: pb.BatchPutStartRequest, ctx: Any) -> pb.BatchPutStartResponse:
        self._authoritative()
        return pb.BatchPutStartResponse(results=self.state.batch_put_start(req.items))

    def BatchPutEnd(self, req: pb.BatchPutEndRequest, ctx: Any) -> pb.BatchPutEndResponse:
        resp = self.state.batch_put_end(req.items)
        self._durable([it.key for it, err in zip(req.items, resp.errors, strict=False)
                       if not err], f"batch of {len(req.items)} puts")
        return resp

    def SpaceLease(self, req: pb.SpaceLeaseRequest, ctx: Any) -> pb.SpaceLeaseResponse:
        self._authoritative()
        return self.state.lease_space(
            req.size, req.min_size, req.replicas, req.placement, req.preferred_segment,
            req.client_host_id, req.segments, tenant=req.tenant,
        )

    def PutCommit(self, req: pb.PutCommitRequest, ctx: Any) -> pb.PutCommitResponse:
        resp = self.state.put_commit(req.lease_id, req.items, req.release)
        self._durable([it.key for it, err in zip(req.items, resp.errors, strict=False)
                       if not err], f"commit of {len(req.items)} puts")
        return resp

    def SpaceRelease(self, req: pb.SpaceReleaseRequest, ctx: Any) -> pb.SpaceReleaseResponse:
        return pb.SpaceReleaseResponse(found=self.state.space_release(req.lease_id))

    def ReplicaStart(self, req: pb.ReplicaStartRequest, ctx: Any) -> pb.ReplicaStartResponse:
        self._authoritative()
        return pb.ReplicaStartResponse(results=self.state.replica_start(req.keys, req.segment))

    def ReplicaEnd(self, req: pb.ReplicaEndRequest, ctx: Any) -> pb.ReplicaEndResponse:
        resp, added = self.state.replica_end(req.items)
        if self.ha is None or not added:
            return resp
        new = set(added)
        try:  # HA: journal the new replicas before answering, like a put's (`_durable`)
            self.ha.journal_commits(
                JournalEntry(n, inc, item)
                for n, inc, item in self.state.replica_records([k for k, _ in added])
                if (item.key, item.segment) in new)
        except Exception as e:
            self.state.adds.retract(added)
            log.warning("added replicas not journaled; taken back",
                        extra={"replicas": len(added), "error": type(e).__name__})
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"the master could not record the added replicas durably ({e})",
                         ((STANDBY_KEY, "1"),)) from e
        return resp

    # -- reads -----------------------------------------------------------------------------

    def GetReplicas(self, req: pb.GetReplicasRequest, ctx: Any) -> bytes:
        self._authoritative()
        return self.state.get_replicas(req.keys, req.lease_ms, req.client_host_id).encode()

    def ReleaseLease(self, req: pb.ReleaseLeaseRequest, ctx: Any) -> pb.ReleaseLeaseResponse:
        self.state.release_lease(req.lease_id)
        return pb.ReleaseLeaseResponse()

    def Exists(self, req: pb.ExistsRequest, ctx: Any) -> pb.ExistsResponse:
        self._authoritative()
        present, prefix = self.state.exists(req.keys)
        return pb.ExistsResponse(exists=present, prefix_len=prefix)

    def Remove(self, req: pb.RemoveRequest, ctx: Any) -> pb.RemoveResponse:
        self._authoritative()
        records = self.state.replica_records(req.keys) if self.ha else []
        removed = self.state.remove(req.keys, req.force)
        if self.ha is not None and records:
            self.ha.journal_forget(JournalEntry(n, inc, item) for n, inc, item in records)
        return pb.RemoveResponse(removed=removed)

    def Pin(self, req: pb.PinRequest, ctx: Any) -> pb.PinResponse:
        self._authoritative()
        if self.ha is not None:
            self.ha.save_pins(req.keys, req.pin)  # first: a failover must not lose a pin
            (self.pins.update if req.pin else self.pins.difference_update)(req.keys)
        return pb.PinResponse(ok=self.state.pin(req.keys, req.pin))

    async def Watch(self, req: pb.WatchRequest, ctx: Any) -> AsyncIterator[pb.BlockEvent]:
        """Block events as they happen; with `snapshot`, first what is stored now (one STORED
        per replica, then SNAPSHOT_END), taken under the same lock as the subscription. A
        snapshot is refused (UNAVAILABLE) while a restarted master is still rebuilding: it
        would be partial, and the subscriber replaces what it knows with it."""
        held: list[tuple[str, str, str, int, int]] = []
        if req.snapshot:
            self._authoritative()
            held, seq, sub = self.state.subscribe_snapshot(req.node_id, self.config.event_queue)
        else:
            sub = self.state.subscribe(req.node_id, self.config.event_queue)
        ev = asyncio.Event()
        sub.waker = _waker(ev)
        try:
            if req.snapshot:
                stored = pb.BlockEvent.STORED
                for i, (key, node, seg, tier, size) in enumerate(held):
                    yield pb.BlockEvent(kind=stored, key=key, node_id=node, segment=seg,
                                        tier=tier, size=size)  # type: ignore[arg-type]
                    if i % 4096 == 4095 and self._stopping.is_set():
                        return
                yield pb.BlockEvent(seq=seq, kind=pb.BlockEvent.SNAPSHOT_END)
                del held
            while not self._stopping.is_set():
                ev.clear()
                events = sub.get(0)
                if events is None:
                    if sub.overflowed:
                        raise _Abort(
                            grpc.StatusCode.ABORTED,
                            "watch queue overflowed (subscriber too slow); resubscribe",
                        )
                    return
                for event in events:
                    yield event
                if not events:
                    await ev.wait()
        finally:
            sub.waker = None
            sub.close()

    def Stats(self, req: pb.StatsRequest, ctx: Any) -> pb.StatsResponse:
        stats = self.state.stats()
        stats.recovering = not self.gate.is_open
        return stats


_UNARY: tuple[tuple[str, Any], ...] = (
    ("RegisterNode", pb.RegisterNodeRequest),
    ("Heartbeat", pb.HeartbeatRequest),
    ("CommandDone", pb.CommandDoneRequest),
    ("PutStart", pb.PutStartRequest),
    ("PutEnd", pb.PutEndRequest),
    ("PutRevoke", pb.PutRevokeRequest),
    ("BatchPutStart", pb.BatchPutStartRequest),
    ("BatchPutEnd", pb.BatchPutEndRequest),
    ("SpaceLease", pb.SpaceLeaseRequest),
    ("PutCommit", pb.PutCommitRequest),
    ("SpaceRelease", pb.SpaceReleaseRequest),
    ("ReplicaStart", pb.ReplicaStartRequest),
    ("ReplicaEnd", pb.ReplicaEndRequest),
    ("GetReplicas", pb.GetReplicasRequest),
    ("ReleaseLease", pb.ReleaseLeaseRequest),
    ("Exists", pb.ExistsRequest),
    ("Remove", pb.RemoveRequest),
    ("Pin", pb.PinRequest),
    ("Stats", pb.StatsRequest),
)
_STREAM: tuple[tuple[str, Any], ...] = (
    ("NodeCommands", pb.NodeCommandsRequest),
    ("Watch", pb.WatchRequest),
)
_DENIED = "missing or wrong cluster token"


class Handlers:
    """Wraps each servicer method for `grpc.aio`: token check, latency metric, and errors
    mapped to a status (with trailers where the error carries them)."""

    def __init__(
        self, servicer: MasterServicer, token: str, rpc_seconds: Histogram,
        stopping: threading.Event,
    ) -> None:
        self._servicer = servicer
        self._token = token
        self._rpc_seconds = rpc_seconds
        self._stopping = stopping
        self._ha = servicer.ha
        self._off_loop = _OFF_LOOP_HA if self._ha is not None else _OFF_LOOP
        self._methods = {name: getattr(servicer, name) for name, _ in _UNARY}
        self._timers = {name: rpc_seconds.labels(name) for name, _ in _UNARY}
        self._grpc_trailers: Trailers = ()
        """Added to every gRPC answer (the fast path's port, once it listens); the fast path's
        own answers need not repeat it."""

    def advertise_fast_port(self, port: int) -> None:
        self._grpc_trailers = ((FAST_PORT_KEY, str(port)),)

    def _not_leader(self) -> _Abort | None:
        """With Redis HA, the refusal a standby (or deposed leader) answers; else None."""
        ha = self._ha
        if ha is None or ha.is_leader:
            return None
        if ha.deposed.is_set():
            why = f"this master lost its leadership ({ha.deposed_reason}) and is exiting"
        else:
            why = "this master is a standby"
        hint = ha.leader_hint()
        trailers: tuple[tuple[str, str], ...] = ((STANDBY_KEY, "1"),)
        if hint:
            trailers += ((LEADER_KEY, hint),)
            why += f"; the leader is at {hint}"
        return _Abort(grpc.StatusCode.UNAVAILABLE, why + "; retry there", trailers)

    def _authorized(self, ctx: Any) -> bool:
        if not self._token:
            return True
        for key, value in ctx.invocation_metadata() or ():
            if (key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer ")
                    and token_matches(self._token, value[len("Bearer "):])):
                return True
        return False

    def on_loop(self, name: str) -> bool:
        """True if `name` may run right on the event loop (`invoke_now`)."""
        return name not in self._off_loop

    def invoke_now(self, name: str, req: Any) -> tuple[Any, Trailers]:
        """`invoke` for a method that runs on the loop, without a coroutine."""
        start = time.perf_counter()
        try:
            refusal = self._not_leader()
            if refusal is not None:
                raise refusal
            return self._finish(self._methods[name](req, None))
        finally:
            self._timers[name].observe(time.perf_counter() - start)

    async def invoke(self, name: str, req: Any) -> tuple[Any, Trailers]:
        """Run unary method `name`: (response, trailers), or raise (to be mapped by
        `status_of`). Shared by the gRPC handlers and the fast path (`fastpath`)."""
        if self.on_loop(name):
            return self.invoke_now(name, req)
        start = time.perf_counter()
        try:
            refusal = self._not_leader()
            if refusal is not None:
                raise refusal
            resp = await asyncio.get_running_loop().run_in_executor(
                None, self._methods[name], req, None)
            return self._finish(resp)
        finally:
            self._timers[name].observe(time.perf_counter() - start)

    def _finish(self, resp: Any) -> tuple[Any, Trailers]:
        if self._ha is None:
            return resp, ()
        # The fencing token, checked again after the work: a leader deposed meanwhile must not
        # answer (clients drop answers from older epochs).
        refusal = self._not_leader()
        if refusal is not None:
            raise refusal
        return resp, ((EPOCH_KEY, str(self._ha.epoch)),)

    def _unary(self, name: str) -> Callable[[Any, Any], Any]:
        async def handler(req: Any, ctx: Any) -> Any:
            if not self._authorized(ctx):
                await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
            try:
                resp, trailers = await self.invoke(name, req)
                trailers = (*self._grpc_trailers, *trailers)
                if trailers:
                    ctx.set_trailing_metadata(trailers)
                return resp
            except Exception as e:  # mapped to a status; nothing kills the server
                code, msg, trailers = status_of(e, name)
                if trailers:
                    ctx.set_trailing_metadata(trailers)
            await ctx.abort(code, msg)

        return handler

    def _stream(self, name: str) -> Callable[[Any, Any], AsyncIterator[Any]]:
        method = getattr(self._servicer, name)

        async def handler(req: Any, ctx: Any) -> AsyncIterator[Any]:
            if not self._authorized(ctx):
                await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
            try:
                refusal = self._not_leader()
                if refusal is not None:
                    raise refusal
                async for item in method(req, ctx):
                    yield item
                return
            except Exception as e:  # CancelledError (client gone) is not an Exception
                code, msg, _ = _status_of(e)
                if isinstance(e, _Abort) and e.trailers:
                    ctx.set_trailing_metadata(e.trailers)
                if code == grpc.StatusCode.INTERNAL:
                    if self._stopping.is_set():
                        return
                    log.exception("stream failed", extra={"method": name})
            await ctx.abort(code, msg)

        return handler

    def generic_handler(self) -> Any:
        handlers: dict[str, Any] = {}
        for name, req_type in _UNARY:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._unary(name), request_deserializer=req_type.FromString,
                response_serializer=_serialize,
            )
        for name, req_type in _STREAM:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                self._stream(name), request_deserializer=req_type.FromString,
                response_serializer=_serialize,
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)
