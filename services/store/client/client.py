"""The store client: put / get / get_into / exists / remove over the master and transfer engine.

The protocol is visible in the calls: a put writes into an extent the master leased to the
client and publishes with one call (`spacewriter`), or takes the classic two phases, `PutStart`
(the master allocates), the client writes the bytes itself, then `PutEnd` (publish) or
`PutRevoke` (free) (`classic`). Reads ask the master for replicas
and a read lease, then copy straight into the caller's buffer from the nearest replica (shm on
the same host, else tcp), verifying the xxh3-64 checksum recorded at put time. Any replica that
fails, or whose bytes do not verify, is skipped; when none is left the answer is a miss
(`ObjectNotFound`), never wrong bytes.

Retries: a master that is restarting or rebuilding its metadata answers UNAVAILABLE; reads
(lookups, exists, stats) are retried with backoff until the call's timeout, and so is any call
the master refused on purpose while rebuilding (it did nothing). A put whose outcome is unknown
(the connection broke mid-call) is not retried blindly.

Failover: each transfer attempt is bounded by `attempt_timeout_s` (about a second: connecting,
the handshake, and any send or receive that stalls), far below the whole call's `timeout_s`, so
a paused or black-holed replica costs about one attempt before the next replica is read; the
failed peer is then read last for a few seconds (`failover.PeerHealth`).

Several masters (`master` is a comma-separated list; `--metadata-backend redis`): calls go to
whichever one leads and follow a failover, see `masterlink`.

Location cache: a lookup's read lease guarantees the master will neither free nor evict the
object's space until it expires, so the client may reuse the replica list until shortly before
then without asking again. That turns a repeated get into a pure data-path copy. The checksum
is still verified on every read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from mooncake_k8s.common import auth, defaults
from mooncake_k8s.common.buffers import byte_view
from mooncake_k8s.common.errors import (
    BufferTooSmall,
    InvalidArgument,
    ObjectNotFound,
    TransferError,
)
from mooncake_k8s.common.netutil import local_host_id
from mooncake_k8s.common.rpc import store_pb2 as pb
from mooncake_k8s.store.client.classic import ClassicWriter
from mooncake_k8s.store.client.errors import retryable, rpc_error
from mooncake_k8s.store.client.failover import PeerHealth
from mooncake_k8s.store.client.keeper import Keeper
from mooncake_k8s.store.client.masterlink import MasterLink, trailers_of
from mooncake_k8s.store.client.replica_access import ReplicaAccess
from mooncake_k8s.store.client.spacewriter import LEASE_BYTES, RETRY, SpaceWriter
from mooncake_k8s.store.wire import (
    LEADER_KEY,
    STANDBY_KEY,
    Location,
    ObjectInfo,
    SegmentInfo,
    located,
    location,
)
from mooncake_k8s.transfer import Peer, ReadOp, Tier, TransferEngine, WriteOp
from mooncake_k8s.transfer.engine import TRANSPORTS

log = logging.getLogger(__name__)

_PLACEMENTS = {
    "local_first": pb.LOCAL_FIRST,
    "preferred": pb.PREFERRED,
    "most_free": pb.MOST_FREE,
}
_MAX_MSG = 64 << 20
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", _MAX_MSG),
    ("grpc.max_send_message_length", _MAX_MSG),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def default_replicas() -> int:
    """MOONCAKE_STORE_REPLICAS, or 1; InvalidArgument names the variable when it is bad."""
    raw = os.environ.get("MOONCAKE_STORE_REPLICAS", "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 8:
        raise InvalidArgument(f"MOONCAKE_STORE_REPLICAS must be an integer 1..8, not {raw!r}")
    return int(raw)


class StoreClient(ReplicaAccess):
    """A thread-safe client of one store cluster.

    `transport` forces "shm" or "tcp" (benchmarks, tests); "auto" picks shm for same-host
    replicas. `lease_ms` is the read lease asked for on lookups; `location_cache=False` makes
    every get ask the master. `master` is one address or a comma-separated list of them (the
    masters of an HA pair); with several, `master_attempt_s` bounds each attempt on one of them.
    `timeout_s` bounds a whole call (master retries included);
    `replicas` is the copies a put makes unless it says otherwise; by default
    MOONCAKE_STORE_REPLICAS (what the operator renders from `store.replicationFactor`, so it
    reaches the engines' plug-ins in their child processes too) or 1.
    `attempt_timeout_s` bounds one transfer attempt against one replica's node without
    progress, and `suspect_s` is how long a node that failed one is read last.
    `space_lease_bytes` is the extent a put leases so that later puts cost one master round
    trip each (`spacewriter`); 0 makes every put take the classic two.

    Counters (what a worker exports): `local_reads` and `remote_reads` count objects read from
    a replica on this client's host (shared memory) and on another host (the network);
    `kept_blocks`, `keep_skipped`, `keep_failures` what `batch_get_into(keep_on=...)` kept.
    """

    def __init__(
        self,
        master: str,
        token: str = "",
        *,
        transport: str = "auto",
        connections_per_peer: int = 4,
        lease_ms: int = defaults.LEASE_MS,
        location_cache: bool = True,
        cache_entries: int = 100_000,
        timeout_s: float = defaults.CLIENT_TIMEOUT_S,
        attempt_timeout_s: float = 1.0,
        suspect_s: float = 5.0,
        verify: bool = True,
        host_id: str | None = None,
        master_attempt_s: float = 2.0,
        replicas: int | None = None,
        space_lease_bytes: int = LEASE_BYTES,
    ) -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if timeout_s <= 0 or not 0 < attempt_timeout_s <= timeout_s:
            raise InvalidArgument(
                f"need 0 < attempt_timeout_s <= timeout_s, got {attempt_timeout_s} and {timeout_s}"
            )
        if suspect_s < 0:
            raise InvalidArgument(f"suspect_s must be >= 0, got {suspect_s}")
        self.replicas = default_replicas() if replicas is None else replicas
        if not 1 <= self.replicas <= 8:
            raise InvalidArgument(f"replicas must be 1..8, got {self.replicas}")
        self._health = PeerHealth(suspect_s)
        self._host_id = host_id or local_host_id()
        self._md = auth.call_metadata(token)
        self._link = MasterLink(master, self._md, options=list(_CHANNEL_OPTIONS),
                                attempt_s=master_attempt_s, token=token)
        self._timeout = timeout_s
        self._lease_ms = lease_ms
        self._verify = verify
        self._cache_on = location_cache
        self._cache_max = cache_entries
        self._cache: OrderedDict[str, tuple[float, ObjectInfo]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.engine = TransferEngine(
            token, host_id=self._host_id, connections_per_peer=connections_per_peer,
            transport=transport, timeout_s=timeout_s, io_timeout_s=attempt_timeout_s,
        )
        self._spaces = SpaceWriter(
            self._call, self._write_checksummed, located, self._host_id, space_lease_bytes)
        self._classic = ClassicWriter(self._call, self._write_checksummed, self._host_id)
        self._keeper = Keeper(self._call, self._write_checksummed)
        self._keep_pool: ThreadPoolExecutor | None = None
        self._keeping: list[Future[None]] = []
        self._keeping_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.local_reads = self.remote_reads = 0

    def close(self) -> None:
        self.wait_kept()
        if self._keep_pool is not None:
            self._keep_pool.shutdown(wait=True)
        self._spaces.close()
        self.engine.close()
        self._link.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- writes ----------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: Any,
        *,
        replicas: int | None = None,
        placement: str = "local_first",
        preferred_segment: str | None = None,
        segments: Sequence[str] = (),
        tenant: str = "",
    ) -> None:
        """Store `data` under `key`; raises ObjectExists if the key is already stored.
        `replicas` defaults to the client's (`replicas` at construction); `segments` and
        `tenant` as for `batch_put`."""
        err = self.batch_put(
            [key], [data], replicas=replicas, placement=placement,
            preferred_segment=preferred_segment, segments=segments, tenant=tenant,
        )[0]
        if err is not None:
            raise err

    def batch_put(
        self,
        keys: Sequence[str],
        datas: Sequence[Any],
        *,
        replicas: int | None = None,
        placement: str = "local_first",
        preferred_segment: str | None = None,
        segments: Sequence[str] = (),
        tenant: str = "",
    ) -> list[Exception | None]:
        """Put many objects; a result per key. One master round trip (`PutCommit`) when the
        client's leased extent has room for them, else a lease first; puts too large for an
        extent, or whose lease was lost, take PutStart and PutEnd (one of each per batch).

        `segments` places one replica on each named segment, in order (copies placed by host:
        the writer's own and its reader's), so each object gets max(`replicas`, len(segments))
        replicas on distinct nodes where that many nodes have room; a named segment that is
        unknown, full (after the eviction any put there may do) or on a node named before is
        replaced by what `placement` picks on a node not used yet.

        `tenant`: whose quota the objects count against (the master's `--tenant-quota`); a
        tenant at its quota that cannot evict its own objects gets QuotaExceeded (a NoSpace)."""
        if len(keys) != len(datas):
            raise InvalidArgument("keys and datas differ in length")
        views = [byte_view(d) for d in datas]
        replicas = self.replicas if replicas is None else replicas
        if placement not in _PLACEMENTS:
            raise InvalidArgument(f"placement must be one of {sorted(_PLACEMENTS)}")
        for k, v in zip(keys, views, strict=True):
            if not len(v):
                raise InvalidArgument(
                    f"object {k!r} is empty; the store keeps objects of >= 1 byte")
        if isinstance(segments, str):
            raise InvalidArgument("segments is a sequence of segment names, not one string")
        shape = (replicas, _PLACEMENTS[placement], preferred_segment or "", tuple(segments),
                 tenant)
        fast = self._spaces.put(keys, views, shape)
        if fast is None:
            return self._classic.put(keys, views, *shape)
        again = [i for i, r in enumerate(fast) if r is RETRY]
        if again:
            redo = self._classic.put([keys[i] for i in again], [views[i] for i in again],
                                     *shape)
            for i, r in zip(again, redo, strict=True):
                fast[i] = r
        return fast

    def _write_checksummed(self, peer: Peer, ops: list[WriteOp]) -> list[int]:
        try:
            got = self.engine.write(peer, ops, with_checksum=True)
        except TransferError:
            self._failed(peer)
            raise
        assert got is not None
        return got

    # -- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> bytearray:
        """The object's bytes (a fresh buffer). Raises ObjectNotFound on a miss."""
        info = self._lookup([key])[0]
        if info is None:
            raise ObjectNotFound(f"object {key!r} not found")
        buf = bytearray(info.size)
        if self._read_into([key], [memoryview(buf)], [info])[0] is None:
            raise ObjectNotFound(f"object {key!r} not found")
        return buf

    def get_into(self, key: str, buf: Any) -> int:
        """Copy the object into `buf` (no intermediate copy); returns its size."""
        n = self.batch_get_into([key], [buf])[0]
        if n is None:
            raise ObjectNotFound(f"object {key!r} not found")
        return n

    def batch_get_into(
        self, keys: Sequence[str], bufs: Sequence[Any], *, keep_on: str = "",
        keep_later: bool = False,
    ) -> list[int | None]:
        """Read many objects; each result is the size read or None for a miss. Each object is
        read from its nearest replica (this host's through shared memory first).

        `keep_on` names a segment (on this client's host, typically its own): every object
        that had to be read from another host is then added as a replica there, from the
        bytes just read, before this returns, so the next read here is local (hot-block
        replication, `keeper`). Only free room under the segment's watermark is used, never
        evicting; objects with a replica on that segment's host already are skipped. Keeping
        never fails the read: what could not be kept is counted (`kept_blocks`,
        `keep_skipped`, `keep_failures`, `last_keep_error`) and logged at debug, an unknown
        segment name included. "" keeps nothing.

        `keep_later`: return as soon as the reads are done and keep in the background (off
        the caller's critical path: a prefill computes meanwhile); the caller must leave
        `bufs` unchanged until `wait_kept()` returns."""
        if len(keys) != len(bufs):
            raise InvalidArgument("keys and bufs differ in length")
        if not isinstance(keep_on, str):
            raise InvalidArgument(f"keep_on is a segment name, not {type(keep_on).__name__}")
        views = [byte_view(b, writable=True) for b in bufs]
        infos = self._lookup(keys)
        for k, info, v in zip(keys, infos, views, strict=True):
            if info is not None and len(v) < info.size:
                raise BufferTooSmall(f"buffer of {len(v)} bytes for object {k!r} of {info.size}")
        src: list[tuple[str, ObjectInfo] | None] = [None] * len(keys)
        out = self._read_into(keys, views, infos, src)
        if keep_on and keep_later:
            with self._keeping_lock:
                if self._keep_pool is None:
                    self._keep_pool = ThreadPoolExecutor(1, thread_name_prefix="store-keep")
                self._keeping.append(self._keep_pool.submit(self._keep, keep_on, keys, views,
                                                            src))
        elif keep_on:
            self._keep(keep_on, keys, views, src)
        return out

    def wait_kept(self) -> None:
        """Block until every keep `batch_get_into(keep_later=True)` started has ended (its
        buffers may then be reused). Keeping never raises: see `batch_get_into`."""
        with self._keeping_lock:
            pending, self._keeping = self._keeping, []
        for f in pending:
            try:
                f.result()
            except Exception as e:  # counted by the keeper when it can; never the caller's
                log.debug("keeping in the background failed", extra={"error": str(e)})

    def _keep(self, segment: str, keys: Sequence[str], views: Sequence[memoryview],
              src: Sequence[tuple[str, ObjectInfo] | None]) -> None:
        """Keep on `segment` what was read from another host (see `batch_get_into`)."""
        items = []
        there = 0
        for i, got in enumerate(src):
            if got is None or got[0] == self._host_id:
                continue  # a miss, or read here already
            info = got[1]
            if any(loc.segment.name == segment for loc in info.replicas):
                there += 1
            else:
                items.append((keys[i], info, views[i]))
        if there:
            self._keeper.count(skipped=there)
        for key, loc in self._keeper.keep(segment, items).items():
            self._cache_add(key, loc)

    def _cache_add(self, key: str, loc: Location) -> None:
        """A replica was added to a cached object: list it (the object's read lease covers it
        as much as the others), so the next read here takes it without asking the master."""
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                info = hit[1]
                reps = sorted((loc, *info.replicas), key=self._nearness)
                self._cache[key] = (hit[0], ObjectInfo(info.size, info.checksum, tuple(reps)))

    def _nearness(self, loc: Location) -> tuple[bool, bool]:
        """Sort key of replicas, nearest first: this host's, then DRAM before SSD."""
        return loc.peer.host_id != self._host_id, loc.segment.tier != Tier.DRAM

    @property
    def kept_blocks(self) -> int:
        """Replicas `batch_get_into(keep_on=...)` added (see `keeper`)."""
        return self._keeper.kept

    @property
    def keep_skipped(self) -> int:
        """Objects not kept because their segment's host had a replica already."""
        return self._keeper.skipped

    @property
    def keep_failures(self) -> int:
        """Objects that could not be kept (no room, gone, unknown segment, errors)."""
        return self._keeper.failures

    @property
    def last_keep_error(self) -> str:
        return self._keeper.last_error

    def _read_into(
        self, keys: Sequence[str], views: Sequence[memoryview], infos: Sequence[ObjectInfo | None],
        src: list[tuple[str, ObjectInfo] | None] | None = None,
    ) -> list[int | None]:
        """Read each object; `src`, when given, gets the host each one was read from (and
        the replica list it was read by)."""
        out: list[int | None] = [None] * len(keys)
        if src is None:
            src = [None] * len(keys)
        retry = self._read_batch(keys, infos, views, out, src)
        if retry:
            # Stale cache entries first get a fresh lookup, then every other replica is tried.
            for i in retry:
                self._forget(keys[i])
            fresh = self._lookup([keys[i] for i in retry], use_cache=False)
            for i, info in zip(retry, fresh, strict=True):
                host = None if info is None else self._read_any(keys[i], info, views[i])
                if info is not None and host is not None:
                    out[i] = info.size
                    src[i] = (host, info)
        self._count_reads(src)
        return out

    def _count_reads(self, src: Sequence[tuple[str, ObjectInfo] | None]) -> None:
        local = sum(1 for got in src if got is not None and got[0] == self._host_id)
        remote = sum(1 for got in src if got is not None) - local
        with self._count_lock:
            self.local_reads += local
            self.remote_reads += remote

    def _read_batch(
        self,
        keys: Sequence[str],
        infos: Sequence[ObjectInfo | None],
        views: Sequence[memoryview],
        out: list[int | None],
        src: list[tuple[str, ObjectInfo] | None],
    ) -> list[int]:
        """Read each object's nearest replica, grouped by peer; returns indexes that failed."""
        by_peer: dict[str, tuple[Peer, list[tuple[int, ReadOp]]]] = {}
        order = self._health.order
        for i, info in enumerate(infos):
            if info is None or not info.replicas:
                continue
            loc = order(info.replicas)[0]
            entry = by_peer.setdefault(loc.peer.address, (loc.peer, []))
            entry[1].append((i, ReadOp(loc.segment, loc.offset, views[i][: info.size])))
        failed: list[int] = []
        for peer, items in by_peer.values():
            try:
                sums = self.engine.read(peer, [op for _, op in items], with_checksum=self._verify)
            except TransferError:
                self._failed(peer)
                failed.extend(i for i, _ in items)
                continue
            self._health.succeeded(peer.address)
            for n, (i, _) in enumerate(items):
                info = infos[i]
                assert info is not None
                if sums is not None and sums[n] != info.checksum:
                    failed.append(i)
                else:
                    out[i] = info.size
                    src[i] = (peer.host_id, info)
        return failed

    def _failed(self, peer: Peer) -> None:
        self.engine.forget(peer)
        self._health.failed(peer.address)

    def _read_any(self, key: str, info: ObjectInfo, view: memoryview) -> str | None:
        """Read the object from whichever replica answers with its bytes, nearest first; the
        host it was read from, or None."""
        for loc in self._health.order(info.replicas):
            try:
                sums = self.engine.read(
                    loc.peer, [ReadOp(loc.segment, loc.offset, view[: info.size])],
                    with_checksum=self._verify,
                )
            except TransferError:
                self._failed(loc.peer)
                continue
            self._health.succeeded(loc.peer.address)
            if sums is None or sums[0] == info.checksum:
                return loc.peer.host_id
        self._forget(key)
        return None

    def _lookup(self, keys: Sequence[str], use_cache: bool = True) -> list[ObjectInfo | None]:
        """Replica lists for `keys`, from the lease-bounded cache where possible."""
        result: list[ObjectInfo | None] = [None] * len(keys)
        missing: list[int] = []
        if use_cache and self._cache_on:
            now = time.monotonic()
            with self._cache_lock:
                for i, k in enumerate(keys):
                    hit = self._cache.get(k)
                    if hit is not None and hit[0] > now:
                        result[i] = hit[1]
                    else:
                        missing.append(i)
        else:
            missing = list(range(len(keys)))
        if not missing:
            return result
        sent = time.monotonic()
        resp = self._call(
            "GetReplicas",
            pb.GetReplicasRequest(
                keys=[keys[i] for i in missing], lease_ms=self._lease_ms,
                client_host_id=self._host_id,
            ),
        )
        # Trust the lease for 80% of its length, measured from when the request left.
        valid_until = sent + 0.8 * self._lease_ms / 1000.0
        fresh: list[tuple[str, ObjectInfo]] = []
        for i, obj in zip(missing, resp.objects, strict=True):
            if not obj.found:
                continue
            locs = sorted((location(r) for r in obj.replicas), key=self._nearness)
            info = ObjectInfo(obj.size, obj.checksum, tuple(locs))
            result[i] = info
            fresh.append((keys[i], info))
        if self._cache_on and fresh:
            with self._cache_lock:
                for k, info in fresh:
                    self._cache[k] = (valid_until, info)
                    self._cache.move_to_end(k)
                while len(self._cache) > self._cache_max:
                    self._cache.popitem(last=False)
        return result

    def _forget(self, key: str) -> None:
        with self._cache_lock:
            self._cache.pop(key, None)

    # -- metadata --------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self._call("Exists", pb.ExistsRequest(keys=list(keys))).exists)

    def prefix_len(self, keys: Sequence[str]) -> int:
        """How many leading keys of `keys` are all stored (the longest cached prefix)."""
        return int(self._call("Exists", pb.ExistsRequest(keys=list(keys))).prefix_len)

    def remove(self, keys: str | Sequence[str], *, force: bool = False) -> list[bool]:
        keys = [keys] if isinstance(keys, str) else list(keys)
        for k in keys:
            self._forget(k)
        return list(self._call("Remove", pb.RemoveRequest(keys=keys, force=force)).removed)

    def pin(self, keys: Sequence[str], pin: bool = True) -> list[bool]:
        return list(self._call("Pin", pb.PinRequest(keys=list(keys), pin=pin)).ok)

    def lease(self, keys: Sequence[str], lease_ms: int) -> tuple[int, list[bool]]:
        """Take an explicit read lease; returns (lease id, found per key)."""
        resp = self._call(
            "GetReplicas",
            pb.GetReplicasRequest(keys=list(keys), lease_ms=lease_ms, client_host_id=self._host_id),
        )
        return int(resp.lease_id), [o.found for o in resp.objects]

    def release_lease(self, lease_id: int) -> None:
        self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

    def stats(self) -> pb.StatsResponse:
        resp: pb.StatsResponse = self._call("Stats", pb.StatsRequest())
        return resp

    def segments(self) -> list[SegmentInfo]:
        """Every segment of the cluster with its node's host (from Stats): which segments are
        on one host, so "local" can mean "on this instance's host"."""
        return [SegmentInfo(s.name, s.node_id, s.host_id, "ssd" if s.tier == pb.SSD else "dram",
                            s.size, s.used) for s in self.stats().segments]

    def watch(self, node_id: str = "", snapshot: bool = False) -> Iterator[pb.BlockEvent]:
        """Block events (stored, evicted, removed, spilled, promoted) as they happen; with
        `snapshot`, first one STORED per replica stored now and a SNAPSHOT_END."""
        addr, stub = self._link.stub()
        try:
            yield from stub.Watch(pb.WatchRequest(node_id=node_id, snapshot=snapshot),
                                  metadata=self._md)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                t = trailers_of(e)
                self._link.failed(addr, t.get(LEADER_KEY, "") if STANDBY_KEY in t else "")
                raise rpc_error(e, "Watch") from e

    def _call(self, method: str, request: Any) -> Any:
        """One master call, retried on UNAVAILABLE where that is safe (module docstring), and
        sent to whichever master leads (`masterlink`)."""
        try:
            return self._link.call(method, request, self._timeout, retryable)
        except grpc.RpcError as e:
            raise rpc_error(e, method) from e
