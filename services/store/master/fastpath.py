"""The master's fast path: its hot unary calls over a lean framed TCP protocol.

Why: a put is two master round trips (`PutStart`, `PutEnd`) and a cold get one (`GetReplicas`).
Through gRPC in Python each costs about a millisecond of CPU between client and server (the
store logic itself is a few microseconds), which made a 64 KiB put 5x slower than Mooncake's.
The same calls over a plain socket, one request in flight per connection, cost a fraction of
that. gRPC stays for everything else (node registration and command streams, `Watch`) and is
the fallback: a client learns the fast port from the `mooncake-fast-port` trailer of any gRPC
answer and uses it from then on; without it (older master, `--fast-port -1`, a `dns:` target)
nothing changes.

The protocol (little-endian; its frames are in `wire`, the caller's half in `client.fastpath`),
on a connection from the client:

    hello    "MCFP" u8 version u16 token_len token        -> u8 ok(0)|denied(1) u16 len msg
    request  u32 body_len u8 method body(protobuf)        -> u32 body_len u8 status body
    ok body: u32 len, the response's protobuf, then the trailers (u16 count, then for each
             key and value: u16 len, bytes)
    error:   u16 len message, then the trailers

`status` is the gRPC status code's number, and errors carry the same messages and trailers
(standby, leader, recovering, epoch) as over gRPC: the client raises them as `grpc.RpcError`,
so retries and failover (`client.masterlink`) treat both paths alike. The handler is the same
(`servicer.Handlers.invoke`): token, leader check, metrics, error mapping.

Hardening, like the transfer port: the hello must arrive within `HELLO_DEADLINE_S`; at most
`MAX_UNAUTHENTICATED` connections may be waiting for theirs (a newcomer beyond that pushes
out the oldest, so idle or dripping sockets cannot lock clients out); frames are capped at
the gRPC message limit; a wrong token or a malformed frame closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections import OrderedDict
from typing import Any

from google.protobuf.message import DecodeError

from mooncake_k8s.common.auth import token_matches
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpcserver import MAX_MESSAGE
from mooncake_k8s.store.master.servicer import status_of
from mooncake_k8s.store.wire import (
    HDR,
    MAGIC,
    METHODS,
    U16,
    U32,
    VERSION,
    pack_trailers,
    short_message,
)

log = logging.getLogger(__name__)

HELLO_DEADLINE_S = 5.0
MAX_UNAUTHENTICATED = 64
MAX_CONNECTIONS = 4096


class FastPathServer:
    """Serves `METHODS` through the master's `Handlers` on its event loop.

    A protocol object per connection rather than a coroutine: a call that runs on the loop is
    parsed, run and answered within one `data_received`, which is what keeps a round trip near
    a hundred microseconds in Python."""

    def __init__(self, handlers: Any, token: str) -> None:
        self.handlers = handlers
        self.token = token
        self._servers: list[asyncio.Server] = []
        self.pending: OrderedDict[int, _Conn] = OrderedDict()
        self.connections = 0
        self.rejected = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` and return the port. A host name binds every address it
        resolves to, all on one port (the first bind picks it when `port` is 0): clients learn
        only the port, and reach it on whichever of those addresses their resolver gives."""
        loop = asyncio.get_running_loop()
        try:
            for addr in await _bind_addresses(host):
                server = await loop.create_server(lambda: _Conn(self), addr, port,
                                                  reuse_address=True)
                self._servers.append(server)
                port = int(server.sockets[0].getsockname()[1])
        except OSError:
            await self.stop()
            raise
        return port

    async def stop(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)


async def _bind_addresses(host: str) -> list[str | None]:
    """What `create_server` binds for `host`. An unspecified address (any spelling, or a name
    that resolves to one) is None: every interface of both families, as gRPC binds it, where
    asyncio would make an IPv6 one IPv6-only. A name resolves here (as gRPC resolves it) so
    each of its addresses gets the same port; one that does not resolve raises OSError."""
    if host in ("", "0"):
        return [None]
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        addrs: list[str] = list(dict.fromkeys(str(info[4][0]) for info in infos))
    else:
        addrs = [str(literal)]
    if any(ipaddress.ip_address(a.partition("%")[0]).is_unspecified for a in addrs):
        return [None]
    return list(addrs)


class _Conn(asyncio.Protocol):
    """One fast-path connection: the hello, then calls answered in order."""

    def __init__(self, server: FastPathServer) -> None:
        self.s = server
        self.t: asyncio.Transport | None = None
        self.buf = bytearray()
        self.authed = False
        self.busy = False  # an off-loop call is running: later frames wait
        self.deadline: asyncio.TimerHandle | None = None
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.t = transport
        s = self.s
        if s.connections >= MAX_CONNECTIONS:
            s.rejected += 1
            transport.close()
            return
        if len(s.pending) >= MAX_UNAUTHENTICATED:
            # Push out the oldest connection still in its hello: a real client sends its hello
            # as it connects and is through at once; the one stalling longest is the likeliest
            # to be hostile. Refusing newcomers instead would let idle sockets lock clients out.
            _, oldest = s.pending.popitem(last=False)
            oldest.close()
            s.rejected += 1
        s.connections += 1
        self.counted = True
        s.pending[id(self)] = self
        self.deadline = asyncio.get_running_loop().call_later(HELLO_DEADLINE_S, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted:
            self.s.connections -= 1
        self.s.pending.pop(id(self), None)
        if self.deadline is not None:
            self.deadline.cancel()

    def close(self) -> None:
        if self.t is not None:
            self.t.close()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            if not self.authed and not self._hello():
                return
            self._calls()
        except (ValueError, struct.error, UnicodeDecodeError):
            self.close()  # a malformed frame: the connection ends

    def _hello(self) -> bool:
        buf = self.buf
        if len(buf) < 7:
            return False
        if bytes(buf[:4]) != MAGIC or buf[4] != VERSION:
            self._send(b"\x02" + short_message(f"expected {MAGIC!r} version {VERSION}"))
            self.close()
            return False
        (n,) = U16.unpack_from(buf, 5)
        if len(buf) < 7 + n:
            return False
        token = bytes(buf[7:7 + n])
        del buf[:7 + n]
        if self.s.token and not token_matches(self.s.token, token):
            self._send(b"\x01" + short_message("missing or wrong cluster token"))
            self.close()
            return False
        self.authed = True
        self.s.pending.pop(id(self), None)
        if self.deadline is not None:
            self.deadline.cancel()
        sock = self.t.get_extra_info("socket") if self.t else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(b"\x00" + short_message(""))
        return True

    def _calls(self) -> None:
        buf = self.buf
        while not self.busy and len(buf) >= HDR.size:
            size, method = HDR.unpack_from(buf)
            if size > MAX_MESSAGE or method >= len(METHODS):
                raise ValueError("bad frame")
            if len(buf) < HDR.size + size:
                return
            body = bytes(buf[HDR.size:HDR.size + size])
            del buf[:HDR.size + size]
            name, req_type, _ = METHODS[method]
            h = self.s.handlers
            try:
                req = req_type.FromString(body)
            except DecodeError:
                self._answer(name, None, InvalidArgument(f"malformed {name} request"))
                continue
            try:
                if h.on_loop(name):
                    self._answer(name, h.invoke_now(name, req), None)
                    continue
            except Exception as e:
                self._answer(name, None, e)
                continue
            self.busy = True
            if self.t is not None:
                self.t.pause_reading()
            asyncio.get_running_loop().create_task(self._off_loop(name, req))

    async def _off_loop(self, name: str, req: Any) -> None:
        try:
            self._answer(name, await self.s.handlers.invoke(name, req), None)
        except Exception as e:
            self._answer(name, None, e)
        self.busy = False
        if self.t is not None and not self.t.is_closing():
            self.t.resume_reading()
            try:
                self._calls()
            except (ValueError, struct.error):
                self.close()

    def _answer(self, name: str, result: tuple[Any, Any] | None, err: Exception | None) -> None:
        if err is None and result is not None:
            resp, trailers = result
            data = resp if type(resp) is bytes else resp.SerializeToString()
            out = [U32.pack(len(data)), data, pack_trailers(trailers)]
            status = 0
        else:
            assert err is not None
            code, msg, trailers = status_of(err, name)
            status = code.value[0]
            m = msg.encode()[:60_000]
            out = [U16.pack(len(m)), m, pack_trailers(trailers)]
        self._send(HDR.pack(sum(len(o) for o in out), status) + b"".join(out))

    def _send(self, data: bytes) -> None:
        if self.t is not None and not self.t.is_closing():
            self.t.write(data)
