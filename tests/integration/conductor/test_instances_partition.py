"""The Conductor's instance pool against a partitioned worker: a real `mooncake prefill` process
(built-in model, no store needed) reached through a relay that can stop moving bytes in both
directions while keeping every connection open, as a link that is down does (no RST, no FIN:
the process is alive, nothing reaches it).

A prefill call waiting on the worker is abandoned (`Unreachable`) once the pool has missed
`lost_after` polls and another instance is usable, the instance reads `unreachable` (not routed
to) meanwhile, and it is back in rotation once the relay moves bytes again. A call waiting on a
worker that still answers its polls (its engine hung on purpose) is never abandoned, nor one
with no other instance to go to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest

from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.serving.instances import (
    Instance,
    InstancePool,
    Unreachable,
    until_answered,
)
from mooncake_k8s.store.testing import metric_value

TOKEN = "partition-test-token"
pytestmark = pytest.mark.timeout(240)


class Relay:
    """A TCP relay to `target` that can be *partitioned*: it stops reading from either side,
    so bytes wait (in the sockets, then TCP's windows) as they would on a link that is down,
    and flow again when it heals. Nothing is dropped and no connection is closed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.up = asyncio.Event()
        self.up.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await self.up.wait()  # a connection made during the partition waits for the link
        tr, tw = await asyncio.open_connection("127.0.0.1", self.target_port)
        for src, dst in ((r, tw), (tr, w)):
            t = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await src.read(65536):
                await self.up.wait()
                dst.write(data)
                await dst.drain()
        dst.close()

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            self._server.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real prefill worker whose engine hangs every request (MOONCAKE_TEST_HANG_ENGINE): its
    Prefill calls never answer, its Load polls always do. No master: nothing here reaches the
    store."""
    port, metrics = free_port(), free_port()
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": TOKEN, "MOONCAKE_TEST_HANG_ENGINE": "prefill"}
    log = tmp_path_factory.mktemp("prefill") / "prefill.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_k8s.cli", "prefill", "--master", "127.0.0.1:1",
             "--port", str(port), "--metrics-port", str(metrics), "--threads", "1",
             "--log-format", "text", "--local-segment-size", "0"],  # no master: no segment
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait(30)
        print(log.read_text(errors="replace")[-3000:])


async def _until(cond: Callable[[], bool], what: str, timeout: float = 150.0) -> None:
    """Wait for a state (the deadline only bounds a broken run)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.05)


def _prefill_call(pool: InstancePool,
                  inst: Instance) -> Coroutine[Any, Any, pb.PrefillResponse]:
    req = pb.PrefillRequest(request_id="r1", token_ids=[1, 2, 3, 4],
                            sampling=pb.Sampling(max_tokens=4))
    return until_answered(inst, inst.stub.Prefill(req, metadata=pool.metadata, timeout=600))


def _states(pool: InstancePool) -> str:
    m = ConductorMetrics()
    m.observe_pools(pool.instances.values(), [])
    return generate_latest(m.registry).decode()


def test_a_call_on_a_partitioned_instance_is_abandoned_and_the_instance_comes_back(
        worker: int) -> None:
    """Two instances (two relays to the one worker): `a` is partitioned while a call waits on
    it; `b` stays reachable, so `a`'s call is abandoned. Then `b` is partitioned too, with
    nowhere left to go: its call waits on (its own deadline bounds it)."""
    async def main() -> None:
        ra, rb = Relay(worker), Relay(worker)
        await ra.start()
        await rb.start()
        pool = InstancePool("prefill", f"127.0.0.1:{ra.port},127.0.0.1:{rb.port}", TOKEN,
                            poll_interval_s=0.2, rpc_timeout_s=1.0, lost_after=2)
        await pool.start()
        calls: list[asyncio.Future[pb.PrefillResponse]] = []
        try:
            await _until(lambda: len(pool.usable()) == 2, "the worker's model loaded")
            a, b = (pool.instances[f"127.0.0.1:{r.port}"] for r in (ra, rb))
            calls = [asyncio.ensure_future(_prefill_call(pool, i)) for i in (a, b)]
            # Reachable but slow (the engine hangs): polls answer, the calls are left alone.
            await asyncio.sleep(2.5)
            assert not any(c.done() for c in calls) and a.usable and not a.unreachable

            ra.up.clear()  # a's link goes down; the process lives on
            await _until(lambda: a.unreachable, "marked unreachable", 30)
            assert pool.usable() == [b]  # not routed to from the first missed poll
            with pytest.raises(Unreachable, match="stopped answering"):
                await asyncio.wait_for(calls[0], 30)  # abandoned after lost_after missed polls
            assert a.lost.is_set()
            text = _states(pool)
            for state, n in (("unreachable", 1), ("ready", 1)):
                assert metric_value(text, "mooncake_conductor_instances",
                                    f'role="prefill",state="{state}"') == n, state
            # A call started while the instance is lost gives up at once.
            with pytest.raises(Unreachable):
                await _prefill_call(pool, a)

            rb.up.clear()  # b too: no instance is left to retry on
            await _until(lambda: b.missed_polls >= 4, "b missed its polls", 30)
            assert b.unreachable and not b.lost.is_set() and not calls[1].done()

            ra.up.set()  # the links are back
            rb.up.set()
            await _until(lambda: len(pool.usable()) == 2, "back in rotation", 60)
            assert not a.lost.is_set() and not a.unreachable
            assert not calls[1].done()  # b's call survived the partition
            assert metric_value(_states(pool), "mooncake_conductor_instances",
                                'role="prefill",state="ready"') == 2
        finally:
            for c in calls:
                c.cancel()
            await pool.close()
            await ra.close()
            await rb.close()

    asyncio.run(main())
