"""The client side of master failover: a list of masters, whichever of them leads.

Every `--master` option (and `StoreClient`'s and the storage node's address) accepts a
comma-separated list, e.g. `master-0:50051,master-1:50051`. `MasterLink` keeps a channel per
master and sends each call to the one it believes leads:

- a standby answers UNAVAILABLE with `mooncake-standby` and, when it knows, the leader's
  address in `mooncake-leader`: the call did nothing, so it is retried there (an address not
  in the list is followed too, so one Service address in front of all masters is enough);
- a master that cannot be reached (killed, partitioned) is left for the next one in the list;
  calls that are safe to repeat are retried there, the others fail with MasterUnavailable;
- with several masters each attempt is bounded (`attempt_s`), so a paused leader costs one
  attempt, not the whole call's timeout;
- the hot calls go over the master's fast path (`fastpath`) once a gRPC answer named its
  port;
- every leader's answer carries its fencing token (`mooncake-epoch`); an answer with a token
  below one already seen comes from a deposed leader and is discarded like an unreachable
  master's.

Used by `client.StoreClient` and `node.server.StorageNode`; it knows nothing of their calls.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.common.rpc import store_pb2_grpc as pb_grpc
from mooncake_k8s.store.client.fastpath import FastPathClient, FastPathError
from mooncake_k8s.store.wire import (
    EPOCH_KEY,
    FAST_PORT_KEY,
    LEADER_KEY,
    METHOD_IDS,
    RECOVERING_KEY,
    STANDBY_KEY,
)

_RETRY_FIRST_S = 0.02
_RETRY_MAX_S = 0.25
_FAST_OFF_S = 30.0
_DOWN_S = 1.0
"""A master that could not be reached is not returned to (even when a standby still names it
as the leader, its lease not yet lapsed) for this long."""


def parse_masters(spec: str) -> list[str]:
    """`host:port[,host:port...]` -> addresses; InvalidArgument names the bad entry."""
    out: list[str] = []
    for raw in spec.split(","):
        addr = raw.strip()
        if not addr:
            raise InvalidArgument(f"empty master address in {spec!r}")
        host, sep, port = addr.rpartition(":")
        if addr.startswith(("dns:", "unix:", "ipv4:", "ipv6:")):
            out.append(addr)  # a gRPC target name; gRPC resolves it
            continue
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"master address {addr!r} is not host:port")
        if addr not in out:
            out.append(addr)
    return out


def trailers_of(e: grpc.RpcError) -> dict[str, str]:
    meta: Any = e.trailing_metadata() or ()  # type: ignore[attr-defined]
    return {k: v for k, v in meta if isinstance(v, str)}


class StaleLeader(grpc.RpcError):
    """An answer from a deposed leader (fencing token below one already seen)."""

    def __init__(self, address: str, epoch: int, seen: int) -> None:
        super().__init__(f"master {address} answered with epoch {epoch} < {seen}")
        self.address = address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self.args[0])

    def trailing_metadata(self) -> tuple[()]:
        return ()


class MasterLink:
    """Channels to a list of masters and the choice of which one to call. Thread-safe."""

    def __init__(
        self, masters: str, metadata: tuple[tuple[str, str], ...] = (),
        options: list[tuple[str, Any]] | None = None, attempt_s: float = 2.0,
        token: str | None = None,
    ) -> None:
        self.addresses = parse_masters(masters)
        self._md = metadata
        self._token = token  # None: never use the fast path
        self._fast: dict[str, FastPathClient] = {}
        self._fast_off: dict[str, float] = {}  # fast port unreachable: gRPC until then
        self._options = options or []
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self._current = self.addresses[0]
        self._down: dict[str, float] = {}
        self.epoch = 0
        self.switches = 0
        # One master: the whole call's deadline applies, as it always did.
        self.attempt_s = attempt_s if len(self.addresses) > 1 else None

    @property
    def current(self) -> str:
        return self._current

    def stub(self, address: str | None = None) -> tuple[str, Any]:
        with self._lock:
            addr = address or self._current
            stub = self._stubs.get(addr)
            if stub is None:
                ch = grpc.insecure_channel(addr, options=self._options)
                self._channels[addr] = ch
                stub = self._stubs[addr] = pb_grpc.MasterStub(ch)  # type: ignore[no-untyped-call]
            return addr, stub

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            for f in self._fast.values():
                f.close()
            self._channels.clear()
            self._stubs.clear()
            self._fast.clear()

    def _learn_fast(self, address: str, trailers: Any) -> None:
        """Note the master's fast-path port from a gRPC answer (see `fastpath`)."""
        if (self._token is None or address in self._fast
                or self._fast_off.get(address, 0.0) > time.monotonic()):
            return
        for k, v in trailers or ():
            if k == FAST_PORT_KEY and v.isdigit():
                host = address.rpartition(":")[0].strip("[]")
                if host and not address.startswith(("dns:", "unix:", "ipv4:", "ipv6:")):
                    with self._lock:
                        self._fast.setdefault(address, FastPathClient(host, int(v), self._token))
                return

    def _forget_fast(self, address: str) -> None:
        with self._lock:
            f = self._fast.pop(address, None)
        if f is not None:
            f.close()

    def failed(self, address: str, hint: str = "", unreachable: bool = False) -> None:
        """`address` did not answer as the leader: go to `hint` (the leader it named) unless
        that one was just found unreachable, else to the next master in the list."""
        with self._lock:
            now = time.monotonic()
            if unreachable:
                self._down[address] = now + _DOWN_S
            if self._current != address:
                return  # another thread already moved on
            if hint and hint != address:
                if self._down.get(hint, 0.0) > now:
                    return  # stay with this standby: it takes over once the lease lapses
                nxt = hint
            elif len(self.addresses) > 1:
                i = self.addresses.index(address) if address in self.addresses else -1
                nxt = self.addresses[(i + 1) % len(self.addresses)]
            else:
                return
            self._current = nxt
            self.switches += 1

    def check_epoch(self, address: str, trailers: Any) -> None:
        """Raise StaleLeader if `trailers` carry a fencing token below the highest seen."""
        for k, v in trailers or ():
            if k == EPOCH_KEY:
                epoch = int(v)
                with self._lock:
                    if epoch < self.epoch:
                        raise StaleLeader(address, epoch, self.epoch)
                    self.epoch = epoch
                return

    def call(
        self, method: str, request: Any, timeout: float,
        retryable: Callable[[grpc.RpcError, str], bool],
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> Any:
        """One call to the leader, following failovers until `timeout`. `retryable(e,
        method)` says whether an UNAVAILABLE that is not a standby's (which is always retried)
        may be repeated."""
        deadline = time.monotonic() + timeout
        delay = _RETRY_FIRST_S
        md = self._md if metadata is None else metadata
        while True:
            left = deadline - time.monotonic()
            addr, stub = self.stub()
            attempt = max(left if self.attempt_s is None else min(left, self.attempt_s), 0.001)
            fast = self._fast.get(addr) if method in METHOD_IDS else None
            try:
                if fast is not None:
                    resp, trailers = fast.call(method, request, attempt)
                    self.check_epoch(addr, trailers)
                    return resp
                resp, call = getattr(stub, method).with_call(
                    request, metadata=md, timeout=attempt)
                trailers = call.trailing_metadata()
                self.check_epoch(addr, trailers)
                self._learn_fast(addr, trailers)
                return resp
            except grpc.RpcError as e:
                code = e.code()
                if isinstance(e, FastPathError) and not e.sent:
                    # The fast port cannot be reached although gRPC could: use gRPC a while.
                    self._forget_fast(addr)
                    self._fast_off[addr] = time.monotonic() + _FAST_OFF_S
                    continue
                if fast is not None and code in (
                        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.UNAUTHENTICATED) and not trailers_of(e):
                    self._forget_fast(addr)  # gRPC again; it names the port anew
                t = trailers_of(e)
                if code == grpc.StatusCode.UNAVAILABLE and STANDBY_KEY in t:
                    self.failed(addr, t.get(LEADER_KEY, ""))
                    again = True
                elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    recovering = RECOVERING_KEY in t
                    if not recovering:
                        self.failed(addr, unreachable=True)
                    again = recovering or retryable(e, method)
                else:
                    again = False
                if not again or time.monotonic() + delay >= deadline:
                    raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, _RETRY_MAX_S)
