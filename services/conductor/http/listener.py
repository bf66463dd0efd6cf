"""The Conductor's HTTP listener: aiohttp's request handler behind a request-head deadline.

aiohttp bounds idle keep-alive connections (`keepalive_timeout`) but has no deadline for
receiving a request's head, so a client that dribbles one header byte at a time (slowloris)
holds a connection, and its buffers, for as long as it likes. Each connection's protocol is
wrapped here: a timer runs from the moment the connection opens, and on a kept-alive connection
from the first byte of its next request, until aiohttp hands the parsed request to the
application (the middleware below says so); when it fires first, the connection is closed.
This is nginx's `client_header_timeout` split, with aiohttp's own keep-alive timer covering the
idle time between requests. The body has its own deadline (`bodies.read_body`), and nothing
limits a response being streamed: generation may legitimately take minutes.

Requests aiohttp cannot parse (a bad header, Content-Length with chunked, a line too long)
never reach the application; `EdgeRequestHandler` answers them in OpenAI's error shape too and
logs one INFO line, where aiohttp would log an ERROR with a traceback for every such request.

`Conductor` calls `HeaderDeadlines.serve`; `api.make_app` installs its middleware.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_request import BaseRequest

from mooncake_k8s.conductor.http.protocol import ApiError

log = logging.getLogger(__name__)

_IDLE, _HEAD, _BUSY = "idle", "head", "busy"


class HeaderDeadlines:
    """Per-connection request-head deadlines for one aiohttp server."""

    def __init__(self, timeout_s: float, on_expired: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_expired = on_expired or (lambda: None)
        self._guards: dict[object, _Guard] = {}
        """aiohttp's protocol object (what `request.protocol` returns) -> its guard."""

    @property
    def open_connections(self) -> int:
        return len(self._guards)

    @property
    def busy_connections(self) -> int:
        """Connections whose request is being handled (a stream counts until its last byte)."""
        return sum(g.state == _BUSY for g in self._guards.values())

    async def drained(self, poll_s: float = 0.05) -> None:
        """Return once no request is being handled (the caller bounds the wait)."""
        while self.busy_connections:
            await asyncio.sleep(poll_s)

    def close_idle(self) -> int:
        """Close kept-alive connections that wait for a next request (on shutdown: their
        clients reconnect, to another replica once the listener is closed). Returns how many."""
        idle = [g for g in self._guards.values() if g.state == _IDLE and g.transport is not None]
        for g in idle:
            assert g.transport is not None
            g.transport.close()
        return len(idle)

    async def serve(self, runner: web.BaseRunner, host: str, port: int,
                    **handler_args: Any) -> asyncio.Server:
        """Listen on host:port with `runner`'s server behind the deadlines (in place of a
        `web.TCPSite`; close the returned server before `runner.cleanup()`). The connections'
        handlers are `EdgeRequestHandler`s built with `handler_args` (`keepalive_timeout`,
        `access_log`, ...: `web.RequestHandler`'s keywords), not with the runner's."""
        server = runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before serve()")
        loop = asyncio.get_running_loop()

        def connection() -> _Guard:
            return _Guard(self, EdgeRequestHandler(server, loop=loop, **handler_args))

        return await loop.create_server(connection, host, port, reuse_address=True)

    @property
    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """The head has arrived: stop the clock until the handler is done."""

        @web.middleware
        async def head_received(request: web.Request, handler: Callable[
                [web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
            guard = self._guards.get(request.protocol)
            if guard is None:  # served without `serve` (a test server): no deadlines
                return await handler(request)
            guard.head_received()
            try:
                return await handler(request)
            finally:
                guard.handler_done()

        return head_received


class _Guard(asyncio.Protocol):
    """Forwards every transport callback to aiohttp's protocol and keeps the head timer."""

    def __init__(self, owner: HeaderDeadlines, inner: asyncio.Protocol) -> None:
        self.owner = owner
        self.inner = inner
        self.state = _HEAD
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.owner._guards[self.inner] = self
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:  # first byte of the next request on a kept-alive connection
            self.state = _HEAD
            self._arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.owner._guards.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- the deadline ------------------------------------------------------------------------

    def head_received(self) -> None:
        self.state = _BUSY
        self._disarm()

    def handler_done(self) -> None:
        self.state = _IDLE  # aiohttp's keep-alive timer owns the idle time

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.owner.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if self.state != _HEAD or self.transport is None or self.transport.is_closing():
            return
        peer = self.transport.get_extra_info("peername")
        log.info("closing a connection that sent no complete request head in time",
                 extra={"peer": str(peer), "timeout_s": self.owner.timeout_s})
        self.owner.on_expired()
        self.transport.close()


class EdgeRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering unparseable requests as the API answers bad
    ones: an OpenAI error body and an INFO line, not a text page and an ERROR traceback."""

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        lines = [line.strip() for line in (message or str(exc or "")).splitlines()]
        reason = " ".join(line for line in lines if line.strip("^"))[:300]
        log.info("malformed HTTP request", extra={"peer": request.remote, "status": status,
                                                  "error": reason})
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send the error")
        resp = web.json_response(ApiError(status, f"malformed HTTP request: {reason}").body(),
                                 status=status)
        resp.force_close()
        return resp
