"""The transfer sidecar: the container in a pod that owns the pod's store client and staging
memory; workers reach it over a Unix socket (`protocol`) and share bytes through /dev/shm.

Why a sidecar: the engine container then carries no store client, no gRPC and no transfer
threads, the pod's transfer resources outlive engine restarts, and one process per pod talks to
the store (one set of connections, one location cache) however many engine processes it runs.

Staging: one shared-memory segment (`Segment.create_shm`, replaced on restart under the same
name) split into `slots` equal slots. A connection is granted one slot in its `hello` and keeps
it until it closes. Chosen over per-request allocation because it needs no allocator and no
lease protocol, cannot leak (a crashed client's slot is freed when the kernel closes its
socket), isolates concurrent requests from each other, and makes every span check a bounds
check against one slot. The price is a per-request size bound (a batch larger than a slot is
split by the client) and a bound on concurrent connections (`slots`).

Trust: the socket file is created with mode 0600 (only the pod's own user, typically the
worker container sharing the volume, can connect) and `hello` must also present the cluster
token. The sidecar opens no listener of its own; its store client dials out. Hostile or broken
clients are bounded: `hello_timeout_s` to authenticate, `io_timeout_s` to finish a frame once
started, `idle_timeout_s` between requests, `max_connections` threads in all.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import signal
import socket
import stat
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_k8s.common import auth
from mooncake_k8s.common.errors import InvalidArgument, ProtocolError
from mooncake_k8s.sidecar import protocol as p
from mooncake_k8s.store.client.pagepool import DirectPagePool, PoolUnavailable
from mooncake_k8s.transfer.segments import Segment

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/mooncake/sidecar.sock"
DEFAULT_STAGING = 256 << 20


@dataclass
class SidecarConfig:
    master: str
    token: str = ""
    socket_path: str = DEFAULT_SOCKET
    staging_size: int = DEFAULT_STAGING
    slots: int = 8
    transport: str = "auto"
    staging_name: str | None = None
    """The /dev/shm segment's name; default derived from the socket path, so a restarted
    sidecar on the same socket replaces its predecessor's segment rather than leaking it."""
    store_timeout_s: float = 1.5
    """Bounds each store call; below the client library's default 2 s wait for a reply."""
    hello_timeout_s: float = 2.0
    io_timeout_s: float = 5.0
    idle_timeout_s: float = 600.0
    max_connections: int = 64

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_connections < 1:
            raise InvalidArgument("slots and max_connections must be >= 1")
        slot = (self.staging_size - p.STAGING_HEADER) // self.slots
        if slot < p.SLOT_ALIGN:
            raise InvalidArgument(
                f"staging of {self.staging_size} bytes leaves under {p.SLOT_ALIGN} bytes for "
                f"each of {self.slots} slots"
            )
        if not self.socket_path or len(os.fsencode(self.socket_path)) > 107:
            raise InvalidArgument(f"socket path must be 1..107 bytes: {self.socket_path!r}")
        for name in ("store_timeout_s", "hello_timeout_s", "io_timeout_s", "idle_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0")

    @property
    def slot_size(self) -> int:
        raw = (self.staging_size - p.STAGING_HEADER) // self.slots
        return raw - raw % p.SLOT_ALIGN

    def segment_name(self) -> str:
        if self.staging_name:
            return self.staging_name
        digest = hashlib.sha256(os.path.abspath(self.socket_path).encode()).hexdigest()[:16]
        return f"sidecar-{digest}"


class Sidecar:
    """Serves page operations over the Unix socket; `start()`, then `stop()`.

    `pool` may be given (tests, embedding); otherwise a `DirectPagePool` on `cfg.master`.
    """

    def __init__(self, cfg: SidecarConfig, pool: DirectPagePool | None = None) -> None:
        self.cfg = cfg
        self.incarnation = secrets.token_bytes(16)
        self._pool = pool
        self._staging: Segment | None = None
        self._listener: socket.socket | None = None
        self._sock_ino: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._free = list(range(cfg.slots))
        self._conns: set[socket.socket] = set()
        self._counters: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        self._listener = _bind_unix(cfg.socket_path)
        st = os.stat(cfg.socket_path)
        self._sock_ino = (st.st_dev, st.st_ino)
        self._staging = Segment.create_shm(cfg.segment_name(), cfg.staging_size, replace=True)
        self._staging.buf[: p.STAGING_ID.size] = p.staging_id(self.incarnation)
        if self._pool is None:
            self._pool = DirectPagePool(
                cfg.master, cfg.token, cfg.transport, timeout_s=cfg.store_timeout_s
            )
        self._listener.settimeout(0.2)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="sidecar-accept", daemon=True
        )
        self._accept_thread.start()
        log.info(
            "sidecar serving",
            extra={"socket": cfg.socket_path, "staging_bytes": cfg.staging_size,
                   "staging_path": self._staging.desc.path, "slots": cfg.slots,
                   "slot_bytes": cfg.slot_size, "master": cfg.master,
                   "transport": cfg.transport, "incarnation": self.incarnation.hex()},
        )

    def stop(self) -> None:
        """Close the listener and every connection, remove the socket and the segment."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):  # only our own socket file, not a successor's
            st = os.stat(self.cfg.socket_path)
            if (st.st_dev, st.st_ino) == self._sock_ino:
                os.unlink(self.cfg.socket_path)
        if self._staging is not None:
            self._staging.close()
        if self._pool is not None:
            self._pool.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["connections"] = len(self._conns)
            out["slots_free"] = len(self._free)
        out["slots"] = self.cfg.slots
        out["staging_bytes"] = self.cfg.staging_size
        out["incarnation"] = self.incarnation.hex()
        return out

    def _count(self, **inc: int) -> None:
        with self._lock:
            self._counters.update(inc)

    # -- connections ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            with self._lock:
                full = len(self._conns) >= self.cfg.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._count(rejected_busy=1)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="sidecar-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        slot: int | None = None
        self._count(connections_total=1)
        try:
            while not self._stopping.is_set():
                conn.settimeout(
                    self.cfg.idle_timeout_s if slot is not None else self.cfg.hello_timeout_s
                )
                try:
                    header = p.recv_exact(conn, p.HEADER.size)
                    conn.settimeout(self.cfg.io_timeout_s)
                    kind, code, length = p.decode_header(header)
                    data = p.recv_exact(conn, length) if length else b""
                except ProtocolError as e:
                    self._reply_error(conn, p.Status.BAD_FRAME, str(e))
                    return
                except (OSError, ConnectionError):  # EOF, reset, or a timeout (idle, stalled)
                    return
                if kind != p.Kind.REQUEST:
                    self._reply_error(conn, p.Status.BAD_FRAME, "expected a request frame")
                    return
                status, body, slot, keep = self._handle(code, data, slot)
                if status != p.Status.OK:
                    self._count(**{f"errors_{status.name.lower()}": 1})
                if not self._send(conn, p.encode(p.Kind.RESPONSE, status, body)) or not keep:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
                if slot is not None:
                    self._free.append(slot)
            conn.close()

    def _reply_error(self, conn: socket.socket, status: p.Status, message: str) -> None:
        self._count(**{f"errors_{status.name.lower()}": 1})
        self._send(conn, p.encode(p.Kind.RESPONSE, status, {"message": message}))

    def _send(self, conn: socket.socket, frame: bytes) -> bool:
        try:
            conn.settimeout(self.cfg.io_timeout_s)
            conn.sendall(frame)
            return True
        except OSError:
            return False

    def _handle(
        self, code: int, data: bytes, slot: int | None
    ) -> tuple[p.Status, dict[str, Any], int | None, bool]:
        """(status, body, the connection's slot, keep the connection open)."""
        try:
            op = p.Op(code)
        except ValueError:
            return p.Status.BAD_REQUEST, {"message": f"unknown op {code}"}, slot, slot is not None
        try:
            body = p.decode_body(data)
        except ValueError as e:
            return p.Status.BAD_REQUEST, {"message": str(e)}, slot, slot is not None
        if op == p.Op.HELLO:
            return self._hello(body, slot)
        if slot is None:
            return p.Status.NEED_HELLO, {"message": "send hello first"}, None, False
        self._count(**{f"ops_{op.name.lower()}": 1})
        try:
            return p.Status.OK, self._op(op, body, slot), slot, True
        except PoolUnavailable as e:
            return p.Status.POOL_UNAVAILABLE, {"message": str(e)}, slot, True
        except (ValueError, InvalidArgument) as e:
            return p.Status.BAD_REQUEST, {"message": str(e)}, slot, True
        except Exception as e:  # never let one request take the sidecar down
            log.exception("sidecar op failed", extra={"op": op.name})
            return p.Status.INTERNAL, {"message": f"{type(e).__name__}: {e}"}, slot, True

    def _hello(
        self, body: dict[str, Any], slot: int | None
    ) -> tuple[p.Status, dict[str, Any], int | None, bool]:
        if slot is not None:
            return p.Status.BAD_REQUEST, {"message": "hello sent twice"}, slot, True
        token = body.get("token")
        if self.cfg.token and not (
            isinstance(token, str) and auth.token_matches(self.cfg.token, token)
        ):
            return p.Status.UNAUTHENTICATED, {"message": "missing or wrong cluster token"}, \
                None, False
        with self._lock:
            got = self._free.pop() if self._free else None
        if got is None:
            return p.Status.NO_SLOT, {"message": f"all {self.cfg.slots} slots are in use"}, \
                None, False
        assert self._staging is not None
        desc = self._staging.desc
        return p.Status.OK, {
            "version": p.VERSION,
            "incarnation": self.incarnation.hex(),
            "segment": {"name": desc.name, "path": desc.path, "size": desc.size},
            "slot": {"offset": self._slot_offset(got), "size": self.cfg.slot_size},
            "max_keys": p.MAX_KEYS,
        }, got, True

    def _slot_offset(self, slot: int) -> int:
        return p.STAGING_HEADER + slot * self.cfg.slot_size

    def _op(self, op: p.Op, body: dict[str, Any], slot: int) -> dict[str, Any]:
        pool = self._pool
        assert pool is not None and self._staging is not None
        if op == p.Op.STATS:
            return self.stats()
        keys = p.check_keys(body)
        if op == p.Op.PREFIX_EXISTS:
            return {"n": pool.prefix_exists(keys) if keys else 0}
        spans = p.check_spans(body, len(keys), self.cfg.slot_size)
        base = self._slot_offset(slot)
        views = [[self._staging.buf[base + off : base + off + n]] for off, n in spans]
        nbytes = sum(n for _, n in spans)
        if op == p.Op.PUT:
            ok = pool.put_views(keys, views)
            self._count(pages_put=sum(ok), pages_put_failed=len(ok) - sum(ok),
                        bytes_put=sum(n for (_, n), o in zip(spans, ok, strict=True) if o))
        else:
            ok = pool.get_views(keys, views)
            self._count(pages_hit=sum(ok), pages_missed=len(ok) - sum(ok),
                        bytes_got=sum(n for (_, n), o in zip(spans, ok, strict=True) if o))
        self._count(bytes_requested=nbytes)
        return {"ok": ok}


def _bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from the moment it exists.

    A socket file left by a killed predecessor is removed; a live one (it accepts a connect),
    or anything that is not a socket, is refused rather than stolen or deleted.
    """
    parent = Path(path).parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise InvalidArgument(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except TimeoutError as e:  # alive but not accepting: still not ours to take
            raise InvalidArgument(f"{path} is held by a process that does not answer") from e
        except OSError:  # refused (or gone): nobody serves it any more
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            raise InvalidArgument(f"another sidecar is serving {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the file is born 0600: no window where others may connect
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def run_sidecar(cfg: SidecarConfig) -> None:
    """Serve until SIGTERM or SIGINT."""
    done = threading.Event()

    def _stop(_sig: int, _frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sidecar = Sidecar(cfg)
    sidecar.start()
    try:
        done.wait()
    finally:
        log.info("sidecar stopping", extra={"socket": cfg.socket_path})
        sidecar.stop()
