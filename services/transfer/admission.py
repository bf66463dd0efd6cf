"""The transfer server's front door: accepting connections and authenticating them.

A transfer port must stay usable for the cluster while anyone who can reach it misbehaves:
connections that never send a byte (half-open), that drip their hello one byte at a time, or
that arrive by the hundred. So connections that have not authenticated yet are kept apart from
real clients:

- Where the kernel offers it (Linux TCP_DEFER_ACCEPT), a connection is not even handed to
  accept until its first bytes arrived: sockets that never speak stay in the kernel, and a real
  client's hello (one small segment, sent right after connecting) is complete at accept.
- One thread (`FrontDoor.run`) accepts and runs every handshake, non-blocking, under a selector.
  An unauthenticated connection costs a file descriptor and a few bytes of buffer, never a
  thread, and never a slot of the server's connection budget.
- At most `max_pending` connections may be in the handshake at once. A newcomer beyond that
  pushes out the *oldest* pending one: a real client sends its hello the moment it connects and
  is through in well under a millisecond, while whoever holds a slot longest is the likeliest to
  be stalling. Refusing newcomers instead would let a few hundred idle sockets lock real
  clients out. To keep a flood of reconnects from pushing out a real client before its hello
  was even looked at, a new connection's hello is read right at accept, pending connections
  are read before new ones are accepted, and a connection accepted in the current burst is
  never the one pushed out (so pending may briefly exceed `max_pending` by one burst).
- Each handshake has one overall deadline (`handshake_timeout_s`, from accept to the last hello
  byte), so dripping bytes buys no time.
- Only a connection that presented the cluster token is handed to `admit`, the server's own,
  separate budget of authenticated connections; when that is full the client is told so
  (HELLO_BUSY) instead of being silently dropped.

Bytes are read exactly as far as the hello goes, never past it, so requests a client pipelines
behind its hello stay in the socket for the serving thread.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from mooncake_k8s.common.auth import token_matches
from mooncake_k8s.common.errors import ProtocolError
from mooncake_k8s.transfer.frames import (
    HELLO,
    HELLO_AUTH_FAILED,
    HELLO_BAD_VERSION,
    HELLO_BUSY,
    HELLO_OK,
    VERSION,
    decode_hello_header,
    encode_hello_reply,
)

log = logging.getLogger(__name__)

ACCEPT_BURST = 64
"""Connections accepted per wake-up before pending handshakes get their turn again."""
SHED_LOG_INTERVAL_S = 10.0
"""Shed and timed-out handshakes are logged as one summary line per interval, not one each."""

Admit = Callable[[socket.socket, str], bool]
"""Called with an authenticated, still non-blocking socket and its peer; True if the server
took it (the front door then sends HELLO_OK and forgets it), False if its budget is full."""


class _Pending:
    __slots__ = ("buf", "deadline", "need", "peer", "sock")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.buf = bytearray()
        self.need = HELLO.size  # grows by the token length once the header is in


class FrontDoor:
    """Accepts on `listener` and authenticates on one thread; see the module docstring."""

    def __init__(
        self,
        listener: socket.socket,
        token: str,
        admit: Admit,
        *,
        max_pending: int = 64,
        handshake_timeout_s: float = 3.0,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        self._listener = listener
        self._token = token
        self._admit = admit
        self._max_pending = max_pending
        self._timeout = handshake_timeout_s
        self._on_event = on_event
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # by fd, oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] = dict.fromkeys(
            ("accepted", "authenticated", "evicted", "timed_out", "rejected", "busy"), 0
        )
        self._shed_logged = 0.0
        self._shed_since_log = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if hasattr(socket, "TCP_DEFER_ACCEPT"):
            with contextlib.suppress(OSError):
                self._listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT,
                                          max(1, int(self._timeout + 0.999)))
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self.run, name="transfer-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and close every pending connection (not the listener: its owner's)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for p in list(self._pending.values()):
            self._close(p)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    @property
    def pending(self) -> int:
        """Connections in the handshake right now."""
        return len(self._pending)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping:
            timeout = 0.5
            if self._pending:
                first = min(p.deadline for p in self._pending.values())
                timeout = min(timeout, max(0.0, first - time.monotonic()))
            try:
                events = self._sel.select(timeout)
            except OSError:
                if self._stopping:
                    return
                log.exception("transfer front door: select failed")
                time.sleep(0.05)
                continue
            accept = False
            for key, _mask in events:  # hellos first, then newcomers (see module docstring)
                if key.data == "listen":
                    accept = True
                elif key.data == "wake":
                    return
                else:
                    pend = self._pending.get(key.fd)
                    if pend is not None:
                        self._progress(pend)
            if accept:
                self._accept_burst()
            self._expire(time.monotonic())

    def _accept_burst(self) -> None:
        older = len(self._pending)  # pending before this burst: the only ones to push out
        for _ in range(ACCEPT_BURST):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: back off instead of spinning
                log.warning("transfer accept failed: %s", e)
                time.sleep(0.05)
                return
            sock.setblocking(False)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            pend = _Pending(sock, peer, time.monotonic() + self._timeout)
            self._pending[sock.fileno()] = pend
            self._sel.register(sock, selectors.EVENT_READ, "conn")
            self._count("accepted")
            self._progress(pend)  # a real client's hello is usually there already
            while older and len(self._pending) > self._max_pending:
                _fd, oldest = next(iter(self._pending.items()))
                self._close(oldest)
                older -= 1
                self._count("evicted")
                self._shed()

    def _expire(self, now: float) -> None:
        while self._pending:
            # deadlines grow with accept order, so the oldest is the first to expire
            _fd, oldest = next(iter(self._pending.items()))
            if oldest.deadline > now:
                return
            self._close(oldest)
            self._count("timed_out")
            self._shed()

    def _progress(self, pend: _Pending) -> None:
        try:
            chunk = pend.sock.recv(pend.need - len(pend.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(pend)
            return
        if not chunk:
            self._close(pend)  # gone before finishing its hello
            return
        pend.buf += chunk
        if len(pend.buf) < pend.need:
            return
        if pend.need == HELLO.size:
            try:
                _version, tlen = decode_hello_header(pend.buf)
            except ProtocolError as e:
                log.warning("closing transfer connection: %s", e, extra={"peer": pend.peer})
                self._reject(pend)
                return
            if tlen:
                pend.need += tlen
                return
        self._finish(pend)

    def _finish(self, pend: _Pending) -> None:
        version, _tlen = decode_hello_header(pend.buf)
        token = bytes(pend.buf[HELLO.size :])
        if version != VERSION:
            log.warning("transfer handshake rejected: protocol version %d", version,
                        extra={"peer": pend.peer})
            self._reply_and_close(pend, HELLO_BAD_VERSION,
                                  f"unsupported protocol version {version}")
            self._count("rejected")
            return
        if self._token and not token_matches(self._token, token):
            log.warning("transfer handshake rejected: invalid cluster token",
                        extra={"peer": pend.peer})
            self._reply_and_close(pend, HELLO_AUTH_FAILED, "invalid cluster token")
            self._count("rejected")
            return
        self._forget(pend)
        sock = pend.sock
        if not self._admit(sock, pend.peer):
            log.warning("transfer connection refused: the server is at its connection limit",
                        extra={"peer": pend.peer})
            self._send_reply(sock, HELLO_BUSY, "too many connections; retry later")
            with contextlib.suppress(OSError):
                sock.close()
            self._count("busy")
            return
        self._count("authenticated")

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _send_reply(sock: socket.socket, status: int, message: str = "") -> bool:
        """Best effort on a non-blocking socket: a fresh connection's send buffer is empty, so
        a short reply goes out whole unless the peer is already gone."""
        reply = encode_hello_reply(status, message)
        try:
            return sock.send(reply) == len(reply)
        except OSError:
            return False

    def send_ok(self, sock: socket.socket) -> bool:
        """HELLO_OK on an admitted socket (the server calls this before serving it)."""
        return self._send_reply(sock, HELLO_OK)

    def _reply_and_close(self, pend: _Pending, status: int, message: str) -> None:
        self._send_reply(pend.sock, status, message)
        self._close(pend)

    def _reject(self, pend: _Pending) -> None:
        self._count("rejected")
        self._close(pend)

    def _forget(self, pend: _Pending) -> None:
        self._pending.pop(pend.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(pend.sock)

    def _close(self, pend: _Pending) -> None:
        self._forget(pend)
        with contextlib.suppress(OSError):
            pend.sock.close()

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        if self._on_event is not None:
            self._on_event(what)

    def _shed(self) -> None:
        """One summary warning per interval while handshakes are being shed."""
        self._shed_since_log += 1
        now = time.monotonic()
        if now - self._shed_logged >= SHED_LOG_INTERVAL_S:
            log.warning(
                "transfer handshakes shed (stalled, too slow, or too many at once)",
                extra={"shed": self._shed_since_log, "max_pending": self._max_pending,
                       "handshake_timeout_s": self._timeout},
            )
            self._shed_logged = now
            self._shed_since_log = 0
