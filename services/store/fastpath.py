"""The master's fast path: its hot unary calls over a lean framed TCP protocol.

Why: a put is two master round trips (`PutStart`, `PutEnd`) and a cold get one (`GetReplicas`).
Through gRPC in Python each costs about a millisecond of CPU between client and server (the
store logic itself is a few microseconds), which made a 64 KiB put 5x slower than Mooncake's.
The same calls over a plain socket, one request in flight per connection, cost a fraction of
that. gRPC stays for everything else (node registration and command streams, `Watch`) and is
the fallback: a client learns the fast port from the `mooncake-fast-port` trailer of any gRPC
answer and uses it from then on; without it (older master, `--fast-port -1`, a `dns:` target)
nothing changes.

The protocol (little-endian), on a connection from the client:

    hello    "MCFP" u8 version u16 token_len token        -> u8 ok(0)|denied(1) u16 len msg
    request  u32 body_len u8 method body(protobuf)        -> u32 body_len u8 status body
    ok body: u32 len, the response's protobuf, then the trailers (u16 count, then for each
             key and value: u16 len, bytes)
    error:   u16 len message, then the trailers

`status` is the gRPC status code's number, and errors carry the same messages and trailers
(standby, leader, recovering, epoch) as over gRPC: the client raises them as `grpc.RpcError`,
so retries and failover (`masterlink`) treat both paths alike. The handler is the same
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
import select
import socket
import struct
import threading
from collections import OrderedDict
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mooncake_k8s.common.auth import token_matches
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.common.rpcserver import MAX_MESSAGE

log = logging.getLogger(__name__)

MAGIC = b"MCFP"
VERSION = 1
HELLO_DEADLINE_S = 5.0
MAX_UNAUTHENTICATED = 64
MAX_CONNECTIONS = 4096
#: Calls the fast path carries, by method number (the order is the wire protocol).
METHODS: tuple[tuple[str, Any, Any], ...] = (
    ("PutStart", pb.PutStartRequest, pb.PutStartResponse),
    ("PutEnd", pb.PutEndRequest, pb.PutEndResponse),
    ("PutRevoke", pb.PutRevokeRequest, pb.PutRevokeResponse),
    ("BatchPutStart", pb.BatchPutStartRequest, pb.BatchPutStartResponse),
    ("BatchPutEnd", pb.BatchPutEndRequest, pb.BatchPutEndResponse),
    ("GetReplicas", pb.GetReplicasRequest, pb.GetReplicasResponse),
    ("ReleaseLease", pb.ReleaseLeaseRequest, pb.ReleaseLeaseResponse),
    ("Exists", pb.ExistsRequest, pb.ExistsResponse),
    ("Remove", pb.RemoveRequest, pb.RemoveResponse),
    ("Pin", pb.PinRequest, pb.PinResponse),
    ("Stats", pb.StatsRequest, pb.StatsResponse),
    ("SpaceLease", pb.SpaceLeaseRequest, pb.SpaceLeaseResponse),
    ("PutCommit", pb.PutCommitRequest, pb.PutCommitResponse),
    ("SpaceRelease", pb.SpaceReleaseRequest, pb.SpaceReleaseResponse),
)
METHOD_IDS = {name: i for i, (name, _, _) in enumerate(METHODS)}
_HDR = struct.Struct("<IB")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _pack_trailers(trailers: tuple[tuple[str, str], ...]) -> bytes:
    out = [_U16.pack(len(trailers))]
    for k, v in trailers:
        for part in (k.encode(), v.encode()):
            out += [_U16.pack(len(part)), part]
    return b"".join(out)


def _unpack_trailers(data: bytes | memoryview, pos: int) -> tuple[tuple[str, str], ...]:
    (n,) = _U16.unpack_from(data, pos)
    pos += 2
    out = []
    for _ in range(n):
        parts = []
        for _ in range(2):
            (ln,) = _U16.unpack_from(data, pos)
            parts.append(bytes(data[pos + 2: pos + 2 + ln]).decode())
            pos += 2 + ln
        out.append((parts[0], parts[1]))
    return tuple(out)


# -- server ---------------------------------------------------------------------------------


class FastPathServer:
    """Serves `METHODS` through the master's `Handlers` on its event loop.

    A protocol object per connection rather than a coroutine: a call that runs on the loop is
    parsed, run and answered within one `data_received`, which is what keeps a round trip near
    a hundred microseconds in Python."""

    def __init__(self, handlers: Any, token: str) -> None:
        from mooncake_k8s.store.servicer import status_of

        self.handlers = handlers
        self.token = token
        self.status_of = status_of
        self._server: asyncio.Server | None = None
        self.pending: OrderedDict[int, _Conn] = OrderedDict()
        self.connections = 0
        self.rejected = 0

    async def start(self, host: str, port: int) -> int:
        # An unspecified address (any spelling) means every interface of both families,
        # as gRPC binds it; asyncio would make an IPv6 one IPv6-only.
        any_host = host in ("", "0") or ipaddress.ip_address(host).is_unspecified
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Conn(self), None if any_host else host, port, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)


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
            self._send(b"\x02" + _reply(f"expected {MAGIC!r} version {VERSION}"))
            self.close()
            return False
        (n,) = _U16.unpack_from(buf, 5)
        if len(buf) < 7 + n:
            return False
        token = bytes(buf[7:7 + n])
        del buf[:7 + n]
        if self.s.token and not token_matches(self.s.token, token):
            self._send(b"\x01" + _reply("missing or wrong cluster token"))
            self.close()
            return False
        self.authed = True
        self.s.pending.pop(id(self), None)
        if self.deadline is not None:
            self.deadline.cancel()
        sock = self.t.get_extra_info("socket") if self.t else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(b"\x00" + _reply(""))
        return True

    def _calls(self) -> None:
        buf = self.buf
        while not self.busy and len(buf) >= _HDR.size:
            size, method = _HDR.unpack_from(buf)
            if size > MAX_MESSAGE or method >= len(METHODS):
                raise ValueError("bad frame")
            if len(buf) < _HDR.size + size:
                return
            body = bytes(buf[_HDR.size:_HDR.size + size])
            del buf[:_HDR.size + size]
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
            out = [_U32.pack(len(data)), data, _pack_trailers(trailers)]
            status = 0
        else:
            assert err is not None
            code, msg, trailers = self.s.status_of(err, name)
            status = code.value[0]
            m = msg.encode()[:60_000]
            out = [_U16.pack(len(m)), m, _pack_trailers(trailers)]
        self._send(_HDR.pack(sum(len(o) for o in out), status) + b"".join(out))

    def _send(self, data: bytes) -> None:
        if self.t is not None and not self.t.is_closing():
            self.t.write(data)


def _reply(msg: str) -> bytes:
    m = msg.encode()
    return _U16.pack(len(m)) + m


# -- client ---------------------------------------------------------------------------------


class FastPathError(grpc.RpcError):
    """A fast-path failure, shaped like gRPC's so callers handle both paths alike."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailers: tuple[tuple[str, str], ...] = (), sent: bool = True) -> None:
        super().__init__(details)
        self.sent = sent
        """False when the call never reached the master (no connection): safe to repeat."""
        self._code = code
        self._details = details
        self._trailers = trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers


class FastPathClient:
    """Connections to one master's fast port, one per calling thread (a call is a blocking
    request and answer on its own connection). Thread-safe."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host = host
        self.port = port
        self._token = token.encode()
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                with contextlib.suppress(OSError):
                    s.close()
            self._all.clear()

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(MAGIC + bytes([VERSION]) + _U16.pack(len(self._token)) + self._token)
            head = _recv(sock, 3)
            (n,) = _U16.unpack_from(head, 1)
            msg = _recv(sock, n).decode(errors="replace")
            if head[0] != 0:
                code = (grpc.StatusCode.UNAUTHENTICATED if head[0] == 1
                        else grpc.StatusCode.FAILED_PRECONDITION)
                raise FastPathError(code, msg)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._all.append(sock)
        return sock

    def call(self, method: str, request: Any,
             timeout: float) -> tuple[Any, tuple[tuple[str, str], ...]]:
        """One call: (response, trailers). Raises FastPathError (UNAVAILABLE when the
        connection failed: like gRPC, the outcome of a call cut off after it was sent is
        unknown)."""
        mid = METHOD_IDS[method]
        resp_type = METHODS[mid][2]
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is not None and _hung_up(sock):
            # The master closed this idle connection (it restarted, or failed over): nothing
            # was sent on it, so a fresh connection may carry even a call that is not safe
            # to repeat.
            self._drop()
            sock = None
        if sock is None:
            try:
                sock = self._local.sock = self._connect(timeout)
            except OSError as e:
                raise FastPathError(grpc.StatusCode.UNAVAILABLE,
                                    f"master fast path {self.host}:{self.port}: {e}",
                                    sent=False) from e
        try:
            sock.settimeout(timeout)
            body = request.SerializeToString()
            sock.sendall(_HDR.pack(len(body), mid) + body)
            size, status = _HDR.unpack(_recv(sock, _HDR.size))
            data = memoryview(_recv(sock, size))
        except (OSError, ConnectionError) as e:
            self._drop()
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, TimeoutError)
                    else grpc.StatusCode.UNAVAILABLE)
            raise FastPathError(code, f"master fast path {self.host}:{self.port}: {e}") from e
        if status == 0:
            (n,) = _U32.unpack_from(data, 0)
            return resp_type.FromString(data[4:4 + n]), _unpack_trailers(data, 4 + n)
        (n,) = _U16.unpack_from(data, 0)
        msg = bytes(data[2:2 + n]).decode(errors="replace")
        raise FastPathError(_CODES.get(status, grpc.StatusCode.UNKNOWN), msg,
                            _unpack_trailers(data, 2 + n))

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            with self._lock:
                if sock in self._all:
                    self._all.remove(sock)
            with contextlib.suppress(OSError):
                sock.close()


def _hung_up(sock: socket.socket) -> bool:
    """Whether an idle connection's peer has closed it (or sent what nobody asked for)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _recv(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the master closed the connection")
        got += k
    return buf
