"""The Conductor's listener on a real socket: request heads have a deadline (slowloris), idle
kept-alive connections and slow handlers do not."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from mooncake_k8s.conductor.http.listener import HeaderDeadlines

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.6


async def _serve(deadlines: HeaderDeadlines) -> tuple[web.AppRunner, asyncio.Server, int]:
    async def ok(_r: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(_r: web.Request) -> web.Response:
        await asyncio.sleep(TIMEOUT_S * 3)  # longer than the head deadline: must not matter
        return web.Response(text="slow")

    app = web.Application(middlewares=[deadlines.middleware])
    app.add_routes([web.get("/ok", ok), web.get("/slow", slow)])
    runner = web.AppRunner(app)
    await runner.setup()
    listener = await deadlines.serve(runner, "127.0.0.1", 0, access_log=None,
                                     keepalive_timeout=30)
    return runner, listener, listener.sockets[0].getsockname()[1]


def _run(body: Callable[[int, HeaderDeadlines, list[int]], Awaitable[None]]) -> None:
    async def main() -> None:
        expired: list[int] = []
        deadlines = HeaderDeadlines(TIMEOUT_S, lambda: expired.append(1))
        runner, listener, port = await _serve(deadlines)
        try:
            await body(port, deadlines, expired)
        finally:
            listener.close()
            await runner.cleanup()
            await listener.wait_closed()

    asyncio.run(main())


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> bytes:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return head.split(b"\r\n")[0] + b" " + await reader.readexactly(length)


async def _dribble_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                seconds: float) -> float | None:
    """Send one header line every 50 ms; the time until the server closed, or None."""
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        try:
            writer.write(b"X-Pad-%d: y\r\n" % i)
            await writer.drain()
            if await asyncio.wait_for(reader.read(100), 0.05) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except ConnectionError:
            return time.monotonic() - t0
        i += 1
    return None


def test_a_dribbled_request_head_is_closed_while_others_are_served() -> None:
    async def body(port: int, deadlines: HeaderDeadlines, expired: list[int]) -> None:
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n")
        slowloris = asyncio.create_task(_dribble_until_closed(r1, w1, TIMEOUT_S * 10))
        served = 0
        while not slowloris.done():
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            assert await _get(r2, w2, "/ok") == b"HTTP/1.1 200 OK ok"
            w2.close()
            served += 1
            await asyncio.sleep(0.05)
        closed_after = slowloris.result()
        assert closed_after is not None, "a connection dribbling its head was never closed"
        assert closed_after >= TIMEOUT_S * 0.9
        assert served >= 3 and expired == [1]
        w1.close()

    _run(body)


def test_idle_keepalive_and_slow_handlers_are_not_cut_but_the_next_head_is() -> None:
    async def body(port: int, deadlines: HeaderDeadlines, expired: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _get(reader, writer, "/slow") == b"HTTP/1.1 200 OK slow"
        await asyncio.sleep(TIMEOUT_S * 2)  # idle between requests: aiohttp's keep-alive
        assert await _get(reader, writer, "/ok") == b"HTTP/1.1 200 OK ok"
        assert expired == [] and deadlines.open_connections == 1
        writer.write(b"GET /ok HTTP/1.1\r\n")  # the next head starts, then stalls
        closed_after = await _dribble_until_closed(reader, writer, TIMEOUT_S * 10)
        assert closed_after is not None and expired == [1]
        writer.close()

    _run(body)


def test_a_silent_new_connection_is_closed() -> None:
    async def body(port: int, deadlines: HeaderDeadlines, expired: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(100), TIMEOUT_S * 10) == b""
        assert expired == [1]
        await asyncio.sleep(0.05)
        assert deadlines.open_connections == 0
        writer.close()

    _run(body)




def test_an_unparseable_request_gets_an_openai_error_and_an_info_line(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body(port: int, deadlines: HeaderDeadlines, expired: list[int]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n")
        reply = await reader.read()  # the server closes after the error
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 400 ") and b"application/json" in head
        err = json.loads(payload)["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"] == "malformed HTTP request: Invalid header token: b'Bad Header'"
        writer.close()

    with caplog.at_level(logging.INFO):
        _run(body)
    records = [(r.name, r.levelname, r.getMessage(), r.exc_info) for r in caplog.records]
    want = ("mooncake_k8s.conductor.http.listener", "INFO", "malformed HTTP request", None)
    assert want in records
    assert not [r for r in records if r[1] in ("ERROR", "WARNING")], records
