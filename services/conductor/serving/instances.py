"""The prefill and decode instances the Conductor can route to, and how loaded each one is.

Instances come from a static list (`host:port,host:port`) or from DNS (`dns:NAME:PORT`, a
Kubernetes headless Service, re-resolved every poll so scaling shows up by itself). Each is
polled for its load report; one that fails a poll or a request is out of rotation until it
answers again. Between polls the Conductor adds what it has itself sent (`inflight`), so a burst
of requests does not all pick the instance that looked idle a moment ago.

A partitioned host (link down, processes alive) answers nothing and resets nothing: a call to it
waits for its deadline (the prefill call's is long: a long prompt on a CPU takes minutes). So a
poll that times out or finds the instance unavailable marks it *unreachable* at once (not routed
to), and after `lost_after` such polls in a row (about 5 s with the defaults) the instance is
*lost*, provided another instance of its role answers: calls still waiting on it are abandoned
(`Instance.lost`, `until_answered`) and their requests retried on another instance. A lost
instance also gets a fresh channel on every poll: the old connection's TCP retransmissions back
off for tens of seconds after a long partition, while a new connection answers within a round
trip once the link is back.

Prefill groups (chunked pipeline-parallel prefill): G prefill workers, each a stage of one
group, are ONE prefill target, their leader (stage 0; `LoadReport.pipeline_*`). A later stage
is polled and listed (state "stage") but never routed to; a leader is routed to only while
its group is whole: it says so (`pipeline_whole`, its own checks down the chain) and no stage
of its group that this pool polls has stopped answering (`InstancePool.groups`); otherwise its
state is "incomplete".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from mooncake_k8s.common import auth, serving_rpc
from mooncake_k8s.common.rpc import serving_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_MSG = 64 << 20
_UNREACHABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
"""Poll failures that say nothing answered (a partition, a dead or paused process)."""
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MSG),
    ("grpc.max_send_message_length", _MAX_MSG),
    # Its own connection, not one shared with an older channel to the same address: a fresh
    # channel for a lost instance must not inherit the stuck connection it replaces.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class Unreachable(Exception):
    """A call was abandoned because its instance stopped answering polls (`Instance.lost`)."""


class Stalled(Unreachable):
    """A decode stream sent nothing within the per-token deadline (`next_within`): the
    instance is frozen, partitioned or hung, whatever its polls say yet."""


def new_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)


@dataclass
class Instance:
    address: str
    role: str
    channel: grpc.aio.Channel
    report: pb.LoadReport | None = None
    healthy: bool = False
    last_ok: float = 0.0
    last_error: str = ""
    inflight: int = 0
    inflight_tokens: int = 0
    tokenizer: str = ""
    """The Conductor's tokenizer fingerprint ("" until it is loaded)."""
    unreachable: bool = False
    """The latest poll timed out or found nothing listening (a partition, a dead process)."""
    missed_polls: int = 0
    """Polls in a row that failed as unreachable."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the instance is lost (`InstancePool.lost_after` polls missed in a row): calls
    waiting on it give up (`until_answered`). Cleared when it answers a poll again."""
    done_since_poll: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic end, tokens) of calls here that ended after the latest answered poll was
    sent: its report may still count them (`since_report`)."""
    _stub: Any = None

    def note_done(self, tokens: int) -> None:
        """A call here ended: until a poll sent after now answers, the report overstates."""
        self.done_since_poll.append((time.monotonic(), tokens))

    def since_report(self) -> tuple[int, int]:
        """(calls, tokens) the report may still count although they have ended. Without this
        a decode that just streamed a long prompt looks busy for up to a poll interval, and
        the next request with that prefix goes to an instance that must fetch it."""
        return len(self.done_since_poll), sum(t for _, t in self.done_since_poll)

    @property
    def stub(self) -> Any:
        """The generated client stub of this instance's role (`common.serving_rpc.stub`):
        `inst.stub.Prefill`, `.Decode`, `.Load`. Made once, on first use."""
        if self._stub is None:
            self._stub = serving_rpc.stub(self.role, self.channel)
        return self._stub

    def set_channel(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self._stub = None

    group_broken: str = ""
    """For a group's leader: why its group is incomplete as this pool sees it (a stage it
    polls stopped answering), "" when nothing is known against it (`InstancePool.groups`)."""

    @property
    def state(self) -> str:
        """For the `mooncake_conductor_instances` gauge: "ready" (routed to), "unreachable"
        (polls time out or find nothing listening), "stage" (a prefill group's later stage:
        reached only through its leader), "incomplete" (a group's leader while a stage is
        missing), or "unready" (answers but is loading, draining, failed a request, or
        serves another tokenizer)."""
        if self.usable:
            return "ready"
        if self.unreachable:
            return "unreachable"
        return self.not_target or "unready"

    @property
    def group_size(self) -> int:
        """Stages of this target: G for a prefill group's leader (or stage), else 1."""
        r = self.report
        if r is None or not r.pipeline_group or r.pipeline_group_size <= 1:
            return 1
        return int(r.pipeline_group_size)

    @property
    def group_key(self) -> tuple[str, str] | None:
        """(group name, revision) of a prefill group's member, None for a single instance
        (the name alone may repeat across the revisions of a rollout)."""
        r = self.report
        if r is None or self.group_size == 1:
            return None
        return r.pipeline_group, r.revision

    @property
    def not_target(self) -> str:
        """Why this instance is never a prefill target now whatever its health: "stage"
        (a group's later stage), "incomplete" (a leader whose group is not whole), or ""."""
        r = self.report
        if r is None or self.group_size == 1:
            return ""
        if r.pipeline_stage > 0:
            return "stage"
        if not r.pipeline_whole or self.group_broken:
            return "incomplete"
        return ""

    @property
    def answering(self) -> bool:
        """Its last poll answered ready: somewhere a call abandoned elsewhere can go, even
        while a failed request keeps it out of rotation until the next poll."""
        r = self.report
        return (not self.unreachable and r is not None and r.ready and not r.draining
                and not self.tokenizer_mismatch and not self.not_target)

    @property
    def usable(self) -> bool:
        r = self.report
        return (self.healthy and r is not None and r.ready and not r.draining
                and not self.tokenizer_mismatch and not self.not_target)

    @property
    def tokenizer_mismatch(self) -> bool:
        """The instance serves a model whose tokenizer is not the Conductor's: the ids the
        Conductor sends would mean other words there, so it is never routed to."""
        r = self.report
        return bool(self.tokenizer and r is not None and r.tokenizer_fingerprint
                    and r.tokenizer_fingerprint != self.tokenizer)

    @property
    def instance_id(self) -> str:
        return self.report.instance_id if self.report else self.address


def parse_targets(spec: str) -> list[str]:
    """`a:1,b:2` -> the list; `dns:NAME:PORT` is kept as one entry and resolved per poll."""
    return [t.strip() for t in spec.split(",") if t.strip()]


async def resolve(target: str) -> list[str]:
    if not target.startswith("dns:"):
        return [target]
    _, name, port = target.split(":", 2)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        log.warning("DNS resolution failed", extra={"target": target, "error": str(e)})
        return []
    return sorted({f"{i[4][0]}:{port}" for i in infos})


async def until_answered(inst: Instance, call: Awaitable[T]) -> T:
    """`call`'s result, unless `inst` is lost first (`InstancePool.lost_after` polls missed):
    then the call is cancelled and `Unreachable` raised, so the request can be retried on
    another instance instead of waiting out a deadline on a host that answers nothing."""
    if inst.lost.is_set():
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()
        elif asyncio.iscoroutine(call):
            call.close()
        raise Unreachable(f"{inst.role} {inst.instance_id} is unreachable")
    work: asyncio.Future[T] = asyncio.ensure_future(call)
    lost = asyncio.ensure_future(inst.lost.wait())
    try:
        await asyncio.wait((work, lost), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise Unreachable(f"{inst.role} {inst.instance_id} stopped answering "
                          f"({inst.last_error or 'polls time out'})")
    finally:
        lost.cancel()
        if not work.done():
            work.cancel()


async def next_within(inst: Instance, items: AsyncIterator[T], timeout_s: float | None,
                      elsewhere: Callable[[], bool] = lambda: True) -> T:
    """The stream's next item (`until_answered`), given up on (`Stalled`) when none comes
    within `timeout_s` (None: no deadline) while `elsewhere` says another instance could take
    the stream; with none, it waits on, checking again every `timeout_s` (abandoning would
    only turn a pause into an error, as `InstancePool._missed` reasons). The poll-based `lost`
    takes about `lost_after` x (poll timeout + interval), ~5 s; a stream that was flowing and
    stops says far sooner that its instance is gone."""
    step = asyncio.ensure_future(until_answered(inst, items.__anext__()))
    try:
        while True:
            done, _ = await asyncio.wait((step,), timeout=timeout_s)
            if done:
                return step.result()
            if elsewhere():
                raise Stalled(f"{inst.role} {inst.instance_id} sent nothing for "
                              f"{timeout_s:g}s mid-stream")
    finally:  # the abandoned read is cancelled before the stream moves on
        if not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await step


class InstancePool:
    """All instances of one role, kept fresh by a background poll."""

    def __init__(self, role: str, spec: str, token: str, poll_interval_s: float = 0.5,
                 rpc_timeout_s: float = 2.0, lost_after: int = 2) -> None:
        if lost_after < 1:
            raise ValueError(f"lost_after must be >= 1, got {lost_after}")
        self.lost_after = lost_after
        """Unreachable polls in a row after which calls waiting on the instance are abandoned:
        one slow poll (a busy host) only keeps new requests away; two in a row, about
        2 x `rpc_timeout_s` + `poll_interval_s` of silence, give up on the calls too."""
        self._retired: set[asyncio.Task[None]] = set()
        self.role = role
        self.targets = parse_targets(spec)
        self.instances: dict[str, Instance] = {}
        self._md = auth.call_metadata(token)
        self._interval = poll_interval_s
        self._timeout = rpc_timeout_s
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        self.tokenizer = ""

    def expect_tokenizer(self, fingerprint: str) -> None:
        """Route only to instances whose tokenizer has this fingerprint (or reports none)."""
        self.tokenizer = fingerprint
        for inst in self.instances.values():
            inst.tokenizer = fingerprint
        self.changed.set()

    def mismatched(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.tokenizer_mismatch]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._retired):
            t.cancel()
        for inst in self.instances.values():
            await inst.channel.close(None)

    def usable(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.usable]

    def answering_besides(self, inst: Instance) -> bool:
        """Whether another instance of the role answered its last poll ready: somewhere a
        call given up on `inst` can go."""
        return any(o.answering for o in self.instances.values() if o is not inst)

    def mark_failed(self, inst: Instance, error: str) -> None:
        """Take an instance out of rotation now; the next good poll brings it back."""
        if inst.healthy:
            log.warning("instance failed", extra={"role": self.role, "address": inst.address,
                                                   "error": error})
        inst.healthy = False
        inst.last_error = error

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.poll_once()
            except Exception:
                log.exception("instance poll failed", extra={"role": self.role})

    async def poll_once(self) -> None:
        addresses: list[str] = []
        for t in self.targets:
            addresses.extend(await resolve(t))
        for gone in set(self.instances) - set(addresses):
            inst = self.instances.pop(gone)
            await inst.channel.close(None)
        for a in addresses:
            if a not in self.instances:
                self.instances[a] = Instance(a, self.role, new_channel(a),
                                             tokenizer=self.tokenizer)
        await asyncio.gather(*(self._poll(i) for i in self.instances.values()))
        self.groups()
        self.changed.set()

    def groups(self) -> dict[tuple[str, str], list[Instance]]:
        """The prefill groups among the instances, (name, revision) -> members by stage, and
        each leader's `group_broken` set from what this pool sees of its stages: a stage it
        polls that stopped answering (dead, partitioned) makes the group incomplete at once,
        before the leader's own check notices (a stage it does not poll is the leader's
        word alone). Called after every poll."""
        out: dict[tuple[str, str], list[Instance]] = {}
        for inst in self.instances.values():
            key = inst.group_key
            if key is not None:
                out.setdefault(key, []).append(inst)
        for members in out.values():
            members.sort(key=lambda i: i.report.pipeline_stage if i.report else 0)
            why = _missing_stage(members)
            for i in members:
                if i.report is not None and i.report.pipeline_stage == 0:
                    i.group_broken = why
        return out

    async def _poll(self, inst: Instance) -> None:
        sent = time.monotonic()
        try:
            rep = await inst.stub.Load(pb.LoadRequest(), metadata=self._md,
                                       timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            if inst.healthy or not inst.last_error:
                self.mark_failed(inst, f"{e.code().name}: {e.details()}")
            if e.code() in _UNREACHABLE:
                self._missed(inst)
            return
        was = inst.usable
        if inst.lost.is_set():
            log.info("instance reachable again", extra={
                "role": self.role, "address": inst.address, "instance_id": rep.instance_id,
                "unreachable_s": round(time.monotonic() - inst.last_ok, 1)})
        inst.report = rep
        inst.done_since_poll = [d for d in inst.done_since_poll if d[0] >= sent]
        inst.healthy = True
        inst.unreachable = False
        inst.missed_polls = 0
        inst.lost.clear()
        inst.last_ok = time.monotonic()
        inst.last_error = ""
        if inst.usable and not was:
            log.info("instance ready", extra={"role": self.role, "address": inst.address,
                                               "instance_id": rep.instance_id})

    def _missed(self, inst: Instance) -> None:
        """A poll found nothing answering: unreachable now, lost after `lost_after` in a row
        while another instance of the role answers its polls (with none, abandoning a call
        would only turn a wait into an error: it waits on, bounded by its own deadline). A
        lost instance's calls are abandoned (they wait on `inst.lost`) and it gets a fresh
        channel each poll (see the module's docstring); the old one is closed once the calls
        abandoned on it have had a moment to go."""
        inst.unreachable = True
        inst.missed_polls += 1
        if inst.missed_polls < self.lost_after:
            return
        if not inst.lost.is_set():
            if not self.answering_besides(inst):
                return
            log.warning("instance unreachable: abandoning its calls", extra={
                "role": self.role, "address": inst.address, "instance_id": inst.instance_id,
                "missed_polls": inst.missed_polls, "inflight": inst.inflight})
            inst.lost.set()
        old = inst.channel
        inst.set_channel(new_channel(inst.address))
        task = asyncio.create_task(old.close(grace=self._timeout))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)


def _missing_stage(members: list[Instance]) -> str:
    """Why a group (its members this pool polls, by stage) misses a stage, or "". A stage
    polled but not answering is missing; when any later stage is polled (the targets list the
    stages: a Kubernetes headless Service lists every ready pod), one not listed at all is
    missing too. With only the leader polled, its own word (`pipeline_whole`) is all there is."""
    later = [i for i in members if i.report is not None and i.report.pipeline_stage > 0]
    for i in later:
        if not i.healthy:
            assert i.report is not None
            why = i.last_error.split(":", 1)[0] or "no answer yet"  # the status, no details
            return f"stage {i.report.pipeline_stage} ({i.instance_id}) is not answering: {why}"
    if not later:
        return ""
    size = later[0].group_size
    missing = sorted(set(range(1, size)) - {i.report.pipeline_stage for i in later
                                             if i.report is not None})
    return f"stage {missing[0]} of {size} is not among the instances" if missing else ""
