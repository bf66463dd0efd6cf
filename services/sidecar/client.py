"""`SidecarPagePool`: the `PagePool` an engine uses when the pod's transfer sidecar owns the
store client. Control goes over the sidecar's Unix socket, bytes through its staging segment.

Put: copy each page's regions into this connection's staging slot (one memcpy per region),
then ask the sidecar to store the spans. Get: ask the sidecar to fill spans of the slot (it
verifies header, size and checksum before writing a span), then scatter the spans that came
back ok into the page's regions. A batch larger than the slot goes in several requests.

Failure contract (the sidecar is a separate container that may restart at any time):
- sidecar down (no socket, refused, EOF): the op returns False / 0 at once; a miss costs the
  engine a recompute, never correctness. Nothing waits longer than `timeout_s` for a reply.
- sidecar restarted: the broken connection is noticed (EOF, reset), the client reconnects,
  maps the new staging segment and retries the interrupted request once.
- never bytes from a stale mapping: a connection maps the segment after its `hello` and checks
  that the mapped memory carries the incarnation id that `hello` returned; a reply is only
  trusted on the connection (and so the mapping) it was requested on, and any connection
  error, timeout or malformed reply discards the whole request's results.
- a store that is unreachable behind a live sidecar raises `PoolUnavailable` from reads, as
  `DirectPagePool` does; a wrong token raises `AuthError`: configuration, not a miss.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mooncake_k8s.common.errors import AuthError, InvalidArgument, ProtocolError, TransferError
from mooncake_k8s.sidecar import protocol as p
from mooncake_k8s.store.client.pagepool import (
    Page,
    PoolUnavailable,
    check_pages,
    page_views,
)
from mooncake_k8s.transfer.segments import Segment, SegmentDesc, Tier

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/mooncake/sidecar.sock"
T = TypeVar("T")
_BODY_BUDGET = p.MAX_BODY - (64 << 10)
KEYS_PER_REQUEST = 512
"""Pages per request: keeps each request well inside the reply timeout (a batch of thousands
of pages is several store round trips on a slow host) and its misses independent."""


class _Broken(Exception):
    """This connection can no longer be trusted; `retry` says whether a fresh one may."""

    def __init__(self, why: str, *, retry: bool) -> None:
        super().__init__(why)
        self.retry = retry


class _Conn:
    """One authenticated connection, its staging slot and the mapping it was granted."""

    def __init__(self, path: str, token: str, timeout_s: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.seg: Segment | None = None
        self.slot = memoryview(b"")
        self.timeout_s = timeout_s
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(path)
            hello = self.call(p.Op.HELLO, {"token": token})
            seg, slot = hello["segment"], hello["slot"]
            self.incarnation = bytes.fromhex(str(hello["incarnation"]))
            self.max_keys = max(1, min(int(hello.get("max_keys", p.MAX_KEYS)), KEYS_PER_REQUEST))
            desc = SegmentDesc(str(seg["name"]), Tier.DRAM, int(seg["size"]), str(seg["path"]))
            off, size = int(slot["offset"]), int(slot["size"])
            if off < p.STAGING_HEADER or size < 1 or off + size > desc.size:
                raise ProtocolError(f"slot [{off}, {size}] outside a {desc.size}-byte segment")
            self.seg = Segment.open(desc, writable=True)
            if not self.current():
                raise ProtocolError("the mapped staging segment is not this sidecar's")
            self.slot = self.seg.buf[off : off + size]
            self.slot_size = size
        except BaseException:
            self.close()
            raise

    def current(self) -> bool:
        """True while the mapping still carries the incarnation this connection's hello named."""
        seg = self.seg
        n = p.STAGING_ID.size
        return seg is not None and bytes(seg.buf[:n]) == p.staging_id(self.incarnation)

    def call(self, op: p.Op, body: dict[str, Any]) -> dict[str, Any]:
        """One request and its reply. SidecarError for an error status; OSError, ConnectionError
        or ProtocolError when the connection broke (the caller then drops it)."""
        self.sock.settimeout(self.timeout_s)
        self.sock.sendall(p.encode(p.Kind.REQUEST, op, body))
        kind, code, data = p.read_frame(self.sock)
        if kind != p.Kind.RESPONSE:
            raise ProtocolError("expected a response frame")
        try:
            reply = p.decode_body(data)
            status = p.Status(code)
        except ValueError as e:
            raise ProtocolError(f"bad reply: {e}") from e
        if status != p.Status.OK:
            raise p.SidecarError(status, str(reply.get("message", "")))
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.seg is not None:
            with contextlib.suppress(Exception):
                self.slot.release()
            self.seg.close()


class SidecarPagePool:
    """A `PagePool` backed by the pod's transfer sidecar at `socket_path` (module docstring).

    `token` defaults to $MOONCAKE_CLUSTER_TOKEN. `timeout_s` bounds connecting and each reply;
    `connections` is how many requests may be in flight at once (each holds a sidecar slot).
    Construction tries to connect once (a wrong token raises `AuthError` here) but does not
    need the sidecar up: it connects on demand.
    """

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        token: str | None = None,
        *,
        timeout_s: float = 2.0,
        connections: int = 2,
    ) -> None:
        if timeout_s <= 0 or connections < 1:
            raise InvalidArgument("timeout_s must be > 0 and connections >= 1")
        self.socket_path = socket_path
        self._token = os.environ.get("MOONCAKE_CLUSTER_TOKEN", "") if token is None else token
        self._timeout = timeout_s
        self._idle: queue.LifoQueue[_Conn | None] = queue.LifoQueue()
        for _ in range(connections):
            self._idle.put(None)
        self._closed = False
        self._lock = threading.Lock()
        self._warned_at = 0.0
        self.counters = {"connects": 0, "broken": 0, "unavailable": 0}
        """Connections made, connections dropped as broken, connects that failed."""
        self._run(lambda c: None, None)

    # -- PagePool --------------------------------------------------------------------------

    def prefix_exists(self, keys: Sequence[str]) -> int:
        if isinstance(keys, str):
            raise InvalidArgument("keys must be a sequence of strings, not one string")
        keys = list(keys)
        _check_keys(keys)
        total = 0
        for start in range(0, len(keys), KEYS_PER_REQUEST):  # a long prefix: several requests
            part = keys[start : start + KEYS_PER_REQUEST]
            n = self._run(functools.partial(_prefix, keys=part), 0)
            total += n
            if n < len(part):
                break
        return total

    def put_pages(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        return self._transfer(p.Op.PUT, keys, pages)

    def get_pages(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        return self._transfer(p.Op.GET, keys, pages)

    def stats(self) -> dict[str, Any]:
        """The sidecar's counters; PoolUnavailable when it cannot be reached."""
        got = self._run(lambda c: c.call(p.Op.STATS, {}), None)
        if got is None:
            raise PoolUnavailable(f"sidecar at {self.socket_path} is not reachable")
        return got

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                return
            if conn is not None:
                conn.close()

    def __enter__(self) -> SidecarPagePool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- batches ---------------------------------------------------------------------------

    def _transfer(self, op: p.Op, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        sizes = check_pages(keys, pages)
        _check_keys(keys)
        views = page_views(pages)
        cost = [len(json.dumps(k)) + 32 for k in keys]  # a key's share of a request body
        out = [False] * len(keys)
        todo = [0]  # next page to send; kept across a reconnect so a retry resumes, not redoes

        def work(conn: _Conn) -> None:
            while todo[0] < len(keys):
                chunk: list[int] = []
                used = body = 0
                i = todo[0]
                while i < len(keys) and len(chunk) < conn.max_keys:
                    if sizes[i] > conn.slot_size:  # can never fit: a miss, and say why once
                        if not chunk:
                            self._warn(f"page {keys[i]!r} of {sizes[i]} bytes exceeds the "
                                       f"sidecar's {conn.slot_size}-byte slot")
                            i += 1
                            todo[0] = i
                            continue
                        break
                    if used + sizes[i] > conn.slot_size or body + cost[i] > _BODY_BUDGET:
                        break
                    chunk.append(i)
                    used += sizes[i]
                    body += cost[i]
                    i += 1
                if not chunk:
                    continue
                self._one_chunk(conn, op, keys, views, sizes, chunk, out)
                todo[0] = chunk[-1] + 1

        self._run(work, None)
        return out

    def _one_chunk(
        self, conn: _Conn, op: p.Op, keys: Sequence[str], views: list[list[memoryview]],
        sizes: list[int], chunk: list[int], out: list[bool],
    ) -> None:
        spans: list[list[int]] = []
        pos = 0
        for i in chunk:
            if op == p.Op.PUT:
                at = pos
                for v in views[i]:
                    conn.slot[at : at + len(v)] = v
                    at += len(v)
            spans.append([pos, sizes[i]])
            pos += sizes[i]
        try:
            reply = conn.call(op, {"keys": [keys[i] for i in chunk], "spans": spans})
        except p.SidecarError as e:
            if e.status == p.Status.POOL_UNAVAILABLE and op == p.Op.PUT:
                return  # a lost save is a later recompute, never an error
            raise
        ok = reply.get("ok")
        if not isinstance(ok, list) or len(ok) != len(chunk) or not all(
            isinstance(x, bool) for x in ok
        ):
            raise ProtocolError("reply 'ok' is not one bool per key")
        if op == p.Op.GET and not conn.current():
            raise ProtocolError("staging mapping changed under a read")
        for (off, _n), i, good in zip(spans, chunk, ok, strict=True):
            if not good:
                continue
            if op == p.Op.GET:
                at = off
                for v in views[i]:
                    v[:] = conn.slot[at : at + len(v)]
                    at += len(v)
            out[i] = True

    # -- connections -----------------------------------------------------------------------

    def _run(self, work: Callable[[_Conn], T], fallback: T) -> T:
        """Run `work` on a connection, reconnecting and retrying once when the one it had
        broke the way a restarted sidecar breaks it (EOF, reset); `fallback` when the sidecar
        cannot be reached. Bounded: each wait is at most `timeout_s`."""
        if self._closed:
            raise InvalidArgument("the page pool is closed")
        try:
            conn = self._idle.get(timeout=self._timeout)
        except queue.Empty:
            return fallback
        try:
            for _attempt in range(2):
                if conn is None:
                    conn = self._connect()
                    if conn is None:
                        return fallback
                try:
                    return self._attempt(conn, work)
                except _Broken as e:
                    conn.close()
                    conn = None
                    with self._lock:
                        self.counters["broken"] += 1
                    if not e.retry:
                        self._warn(f"sidecar request failed: {e}")
                        return fallback
            return fallback
        finally:
            if self._closed and conn is not None:
                conn.close()
                conn = None
            self._idle.put(conn)

    @staticmethod
    def _attempt(conn: _Conn, work: Callable[[_Conn], T]) -> T:
        try:
            return work(conn)
        except PoolUnavailable:  # the store, not this connection: keep it
            raise
        except p.SidecarError as e:
            if e.status == p.Status.POOL_UNAVAILABLE:
                raise PoolUnavailable(f"via sidecar: {e.message}") from e
            if e.status == p.Status.NO_SLOT or e.status == p.Status.INTERNAL:
                raise _Broken(str(e), retry=False) from e
            raise
        except TimeoutError as e:  # alive but stuck: another try would only wait again
            raise _Broken("no reply within the timeout", retry=False) from e
        except (ConnectionError, OSError, ProtocolError) as e:
            raise _Broken(f"{type(e).__name__}: {e}", retry=True) from e

    def _connect(self) -> _Conn | None:
        try:
            conn = _Conn(self.socket_path, self._token, self._timeout)
            with self._lock:
                self.counters["connects"] += 1
            return conn
        except p.SidecarError as e:
            if e.status == p.Status.UNAUTHENTICATED:
                raise AuthError(f"sidecar at {self.socket_path}: {e.message}") from e
            self._down(str(e))
        except (OSError, ConnectionError, ProtocolError, TransferError, InvalidArgument,
                KeyError, TypeError, ValueError) as e:
            self._down(f"{type(e).__name__}: {e}")
        return None

    def _down(self, why: str) -> None:
        with self._lock:
            self.counters["unavailable"] += 1
        self._warn(f"sidecar at {self.socket_path} unavailable: {why}")

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._warned_at < 10.0:
                return
            self._warned_at = now
        log.warning(msg)


def _check_keys(keys: Sequence[str]) -> None:
    """The sidecar's key rules, checked here so a bad key is the caller's InvalidArgument."""
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not 0 < len(k) <= p.MAX_KEY_LEN:
            raise InvalidArgument(f"key {i} must be a string of 1..{p.MAX_KEY_LEN} characters")


def _prefix(conn: _Conn, keys: list[str]) -> int:
    return int(conn.call(p.Op.PREFIX_EXISTS, {"keys": keys})["n"])
