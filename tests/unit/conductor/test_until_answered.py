"""`until_answered`: a call waiting on an instance gives up once the pool declares the instance
lost (a partition), and only then; the abandoned call is cancelled, never left running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mooncake_k8s.conductor.serving.instances import (
    Instance,
    Stalled,
    Unreachable,
    next_within,
    until_answered,
)


def _inst() -> Instance:
    return Instance("10.0.0.1:1", "prefill", None, healthy=True)  # type: ignore[arg-type]


def test_the_answer_when_it_comes_first() -> None:
    async def main() -> None:
        inst = _inst()
        assert await until_answered(inst, asyncio.sleep(0.01, result="ok")) == "ok"
        await asyncio.sleep(0)  # the watcher's cancellation lands
        assert len(asyncio.all_tasks()) == 1  # nothing left behind but this one

    asyncio.run(main())


def test_a_lost_instance_abandons_the_waiting_call() -> None:
    async def main() -> None:
        inst = _inst()
        call: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(until_answered(inst, call))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        inst.last_error = "DEADLINE_EXCEEDED: Deadline Exceeded"
        inst.lost.set()
        with pytest.raises(Unreachable, match=r"prefill 10\.0\.0\.1:1 stopped answering"):
            await waiter
        assert call.cancelled()
        # While it stays lost, a new call gives up at once, without starting.
        started = asyncio.get_running_loop().create_future()
        with pytest.raises(Unreachable, match="is unreachable"):
            await until_answered(inst, started)
        assert started.cancelled()

    asyncio.run(main())


def test_cancelling_the_waiter_cancels_the_call() -> None:
    async def main() -> None:
        inst = _inst()
        call: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(until_answered(inst, call))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert call.cancelled()

    asyncio.run(main())


class _Stream:
    """An async iterator fed by hand, as a gRPC stream's chunks arrive; notes a cancelled
    wait (the call being abandoned)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[int] = asyncio.Queue()
        self.cancelled = 0

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        try:
            return await self.items.get()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_a_stream_silent_past_its_deadline_is_stalled_and_its_wait_cancelled() -> None:
    async def main() -> None:
        inst, stream = _inst(), _Stream()
        stream.items.put_nowait(7)
        assert await next_within(inst, stream, 0.05) == 7
        with pytest.raises(Stalled, match=r"prefill 10\.0\.0\.1:1 sent nothing for 0\.05s"):
            await next_within(inst, stream, 0.05)
        assert stream.cancelled == 1
        # A stall is an abandoned call: the pipeline treats it as one (`Unreachable`).
        assert issubclass(Stalled, Unreachable)

    asyncio.run(main())


def test_with_nowhere_else_to_go_a_stalled_stream_waits_on() -> None:
    async def main() -> None:
        inst, stream = _inst(), _Stream()
        asked: list[bool] = []
        others = [False, False]  # no other instance answers for two deadlines, then one does

        def elsewhere() -> bool:
            asked.append(True)
            return others.pop(0) if others else True

        waiter = asyncio.ensure_future(next_within(inst, stream, 0.02, elsewhere))
        while len(asked) < 2:
            await asyncio.sleep(0.01)
        assert not waiter.done() and stream.cancelled == 0  # the same wait, still on
        stream.items.put_nowait(5)
        assert await waiter == 5
        with pytest.raises(Stalled):  # now another instance answers: given up on
            await next_within(inst, stream, 0.02, elsewhere)
        assert stream.cancelled == 1

    asyncio.run(main())


def test_no_deadline_waits_and_a_lost_instance_still_abandons() -> None:
    async def main() -> None:
        inst, stream = _inst(), _Stream()
        waiter = asyncio.ensure_future(next_within(inst, stream, None))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        stream.items.put_nowait(3)
        assert await waiter == 3
        waiter = asyncio.ensure_future(next_within(inst, stream, None))
        await asyncio.sleep(0.01)
        inst.lost.set()
        with pytest.raises(Unreachable, match="stopped answering"):
            await waiter
        assert stream.cancelled == 1

    asyncio.run(main())
