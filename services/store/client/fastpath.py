"""The client half of the master's fast path (`master.fastpath` has the protocol and the
server): a connection per calling thread, failures raised shaped like gRPC's so `masterlink`
handles both paths alike."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Any

import grpc

from mooncake_k8s.store.wire import (
    HDR,
    MAGIC,
    METHOD_IDS,
    METHODS,
    U16,
    U32,
    VERSION,
    unpack_trailers,
)

_CODES = {c.value[0]: c for c in grpc.StatusCode}


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
        self._closed = False
        """Set by close(): a call still running in another thread (a lease handed back in the
        background) then opens no new connection that nothing would ever close."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for s in self._all:
                with contextlib.suppress(OSError):
                    s.close()
            self._all.clear()

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(MAGIC + bytes([VERSION]) + U16.pack(len(self._token)) + self._token)
            head = _recv(sock, 3)
            (n,) = U16.unpack_from(head, 1)
            msg = _recv(sock, n).decode(errors="replace")
            if head[0] != 0:
                code = (grpc.StatusCode.UNAUTHENTICATED if head[0] == 1
                        else grpc.StatusCode.FAILED_PRECONDITION)
                raise FastPathError(code, msg)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if not self._closed:
                self._all.append(sock)
                return sock
        sock.close()
        raise OSError("the client was closed")

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
            sock.sendall(HDR.pack(len(body), mid) + body)
            size, status = HDR.unpack(_recv(sock, HDR.size))
            data = memoryview(_recv(sock, size))
        except (OSError, ConnectionError) as e:
            self._drop()
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(e, TimeoutError)
                    else grpc.StatusCode.UNAVAILABLE)
            raise FastPathError(code, f"master fast path {self.host}:{self.port}: {e}") from e
        if status == 0:
            (n,) = U32.unpack_from(data, 0)
            return resp_type.FromString(data[4:4 + n]), unpack_trailers(data, 4 + n)
        (n,) = U16.unpack_from(data, 0)
        msg = bytes(data[2:2 + n]).decode(errors="replace")
        raise FastPathError(_CODES.get(status, grpc.StatusCode.UNKNOWN), msg,
                            unpack_trailers(data, 2 + n))

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
