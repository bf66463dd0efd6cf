"""The prefill and decode instances the Conductor can route to, and how loaded each one is.

Instances come from a static list (`host:port,host:port`) or from DNS (`dns:NAME:PORT`, a
Kubernetes headless Service, re-resolved every poll so scaling shows up by itself). Each is
polled for its load report; one that fails a poll or a request is out of rotation until it
answers again. Between polls the Conductor adds what it has itself sent (`inflight`), so a burst
of requests does not all pick the instance that looked idle a moment ago.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import grpc

from mooncake_k8s.common import auth, serving_rpc
from mooncake_k8s.common.rpc import serving_pb2 as pb

log = logging.getLogger(__name__)

_MAX_MSG = 64 << 20


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
    _stub: Any = None

    @property
    def stub(self) -> Any:
        """The generated client stub of this instance's role (`common.serving_rpc.stub`):
        `inst.stub.Prefill`, `.Decode`, `.Load`. Made once, on first use."""
        if self._stub is None:
            self._stub = serving_rpc.stub(self.role, self.channel)
        return self._stub

    @property
    def usable(self) -> bool:
        r = self.report
        return (self.healthy and r is not None and r.ready and not r.draining
                and not self.tokenizer_mismatch)

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


class InstancePool:
    """All instances of one role, kept fresh by a background poll."""

    def __init__(self, role: str, spec: str, token: str, poll_interval_s: float = 0.5,
                 rpc_timeout_s: float = 2.0) -> None:
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
        for inst in self.instances.values():
            await inst.channel.close(None)

    def usable(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.usable]

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
                ch = grpc.aio.insecure_channel(a, options=[
                    ("grpc.max_receive_message_length", _MAX_MSG),
                    ("grpc.max_send_message_length", _MAX_MSG)])
                self.instances[a] = Instance(a, self.role, ch, tokenizer=self.tokenizer)
        await asyncio.gather(*(self._poll(i) for i in self.instances.values()))
        self.changed.set()

    async def _poll(self, inst: Instance) -> None:
        try:
            rep = await inst.stub.Load(pb.LoadRequest(), metadata=self._md,
                                       timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            if inst.healthy or not inst.last_error:
                self.mark_failed(inst, f"{e.code().name}: {e.details()}")
            return
        was = inst.usable
        inst.report = rep
        inst.healthy = True
        inst.last_ok = time.monotonic()
        inst.last_error = ""
        if inst.usable and not was:
            log.info("instance ready", extra={"role": self.role, "address": inst.address,
                                               "instance_id": rep.instance_id})
