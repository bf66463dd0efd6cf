"""Master high availability on Redis: one leader by lease, fenced writes, a short commit journal.

Several masters run against one Redis (`--metadata-backend redis --redis-url ...`). Exactly one
holds the lease key `<prefix>:leader`; the others are standbys that answer every call with
UNAVAILABLE plus the leader's address (clients and nodes follow it, see `masterlink`) and try
to take the lease as soon as it lapses.

**Lease and fencing token.** Taking the lease increments `<prefix>:epoch`; the lease value is
`epoch|master id|address`, so every leadership has a token larger than all before it. The
leader renews every quarter lease. It considers itself leader only until `renewed_at + 0.8 *
lease` by its own monotonic clock, which is always before Redis lets the key lapse, so a paused
(SIGSTOP) or partitioned leader stops answering before a standby can take over. Every answer
carries the epoch (`mooncake-epoch` trailer); clients and nodes ignore answers from an epoch
below one they have seen. A leader that loses its lease never leads again with the state it
has (another leader may have changed the world meanwhile): it is *deposed*, refuses
everything, and its process exits so that its supervisor starts a clean standby.

**What the leader persists, and why that is enough.** The metadata is soft: the storage nodes
hold the bytes and an inventory of what they hold, and a new leader rebuilds from their
re-registrations like a restarted master (`recovery`). What the inventories can lack is a put
acknowledged in the last moments: the node learns of a commit from the master's command stream,
after the writer was told "stored". So the leader writes each commit to a *journal* in Redis
before acknowledging it, a per-node hash `<prefix>:journal:<node>` keyed by segment and offset
(a reused location overwrites its stale entry). Entries older than `journal_keep_s` (the node
has long applied them, or has been declared dead) are trimmed. When a node registers with a new
leader, the journal entries for its *current incarnation* are restored with its inventory and
sent to it, so an acknowledged put survives a failover at any moment. Also persisted: the
roster of registered nodes (whom the next leader waits for) and the pinned keys. Not
persisted: pending puts (their writers get PutNotFound at `PutEnd` and put again), read leases
(lookups are retried against the new leader; a lease only protects space, and the new leader
frees nothing it did not allocate until it has seen the nodes), and the event stream (watchers
resubscribe and rebuild their index).

Every write is one Lua script that first checks the lease value is still this master's, so a
deposed leader cannot write anything, whatever its clock believes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mooncake_k8s.common import defaults
from mooncake_k8s.common.rpc import store_pb2 as pb

log = logging.getLogger(__name__)

#: The lease is trusted locally for this fraction of its length after the renewal was sent.
TRUST = 0.8
SEP = "|"

# KEYS: leader, epoch. ARGV: master id, address, lease ms. Returns {epoch or 0, holder value}.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then return {0, cur} end
local e = redis.call('INCR', KEYS[2])
local v = e .. '|' .. ARGV[1] .. '|' .. ARGV[2]
redis.call('SET', KEYS[1], v, 'PX', ARGV[3])
return {e, v}
"""
# KEYS: leader. ARGV: own value, lease ms.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_REFUSED = 0
"""What `_FENCED` answers when the lease is not ours (it wrote nothing); 1 when it wrote. A
typed answer: an error reply would be told apart from Redis's own errors only by its text."""
# KEYS: leader. ARGV: own value, then (op, key, field, value) quadruples.
_FENCED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 2, #ARGV, 4 do
  local op, k, f, v = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if op == 'hset' then redis.call('HSET', k, f, v)
  elseif op == 'hdel' then redis.call('HDEL', k, f)
  elseif op == 'zadd' then redis.call('ZADD', k, v, f)
  elseif op == 'zrem' then redis.call('ZREM', k, f)
  elseif op == 'sadd' then redis.call('SADD', k, f)
  elseif op == 'srem' then redis.call('SREM', k, f)
  elseif op == 'del' then redis.call('DEL', k)
  end
end
return 1
"""
# KEYS: leader. ARGV: own value. Deletes the leader key only if it is still ours.
_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Fenced(Exception):
    """This master is not (or no longer) the leader: the write was refused."""


@dataclass(frozen=True)
class Holder:
    """Who holds the lease, parsed from its value."""

    epoch: int
    master_id: str
    address: str

    @staticmethod
    def parse(value: str | bytes | None) -> Holder | None:
        if not value:
            return None
        text = value.decode() if isinstance(value, bytes) else value
        epoch, _, rest = text.partition(SEP)
        master_id, _, address = rest.partition(SEP)
        try:
            return Holder(int(epoch), master_id, address)
        except ValueError:
            return None


@dataclass(frozen=True)
class JournalEntry:
    """One committed replica, as the leader recorded it before acknowledging the put."""

    node_id: str
    incarnation: str
    item: pb.InventoryItem


def redis_location(url: str) -> str:
    """The Redis server for log lines: host and port only, never the password."""
    try:
        kw: dict[str, Any] = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError:
        return "an invalid URL"
    if "path" in kw:
        return f"unix:{kw['path']}"
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"


class RedisCoordinator:
    """Leader election, fenced writes and the journal for one master process. Thread-safe.

    `on_promoted(epoch)` runs on the election thread when this master becomes leader;
    `on_deposed(reason)` when it loses the lease (never called twice).
    """

    def __init__(
        self,
        url: str,
        address: str,
        *,
        prefix: str = "mooncake",
        lease_ms: int = defaults.HA_LEASE_MS,
        journal_keep_s: float = defaults.JOURNAL_KEEP_S,
        master_id: str | None = None,
        on_promoted: Callable[[int], None] = lambda _e: None,
        on_deposed: Callable[[str], None] = lambda _r: None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_ms < 200:
            raise ValueError(f"the leader lease must be >= 200 ms, got {lease_ms}")
        timeout = max(0.05, lease_ms / 4000)
        self._redis: Any = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout,
            decode_responses=False,
        )
        self.location = redis_location(url)
        self.address = address
        self.master_id = master_id or uuid.uuid4().hex
        self.lease_ms = lease_ms
        self.journal_keep_s = journal_keep_s
        self._p = prefix
        self._on_promoted = on_promoted
        self._on_deposed = on_deposed
        self._now = now
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._fenced = self._redis.register_script(_FENCED)
        self._resign = self._redis.register_script(_RESIGN)
        self._lock = threading.Lock()
        self._value = ""
        self._trusted_until = 0.0
        self.epoch = 0
        self.leader: Holder | None = None  # the last holder seen (for standbys' hints)
        self.deposed = threading.Event()
        self.deposed_reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- keys ------------------------------------------------------------------------------

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    # -- election --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="master-election", daemon=True)
        self._thread.start()

    def stop(self, resign: bool = True) -> None:
        """Stop the election thread; a leader hands the lease back so a standby need not wait
        for it to lapse."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if resign and self._value:
            with contextlib.suppress(redis.RedisError):
                self._resign(keys=[self._k("leader")], args=[self._value])
        with contextlib.suppress(redis.RedisError):
            self._redis.close()

    @property
    def is_leader(self) -> bool:
        """True while this master may answer: it holds a lease it renewed recently enough."""
        return bool(self._value) and not self.deposed.is_set() and (
            self._now() < self._trusted_until)

    def leader_hint(self) -> str:
        """The current leader's address as last seen ("" when unknown or when it is us)."""
        h = self.leader
        return h.address if h is not None and h.master_id != self.master_id else ""

    def _run(self) -> None:
        period = self.lease_ms / 4000
        while not self._stop.is_set() and not self.deposed.is_set():
            try:
                if self._value:
                    self._keep()
                else:
                    self._try_acquire()
            except redis.RedisError as e:
                log.warning("redis unreachable for leader election",
                            extra={"redis": self.location, "error": type(e).__name__})
                if self._value and self._now() >= self._trusted_until:
                    self._depose("the lease could not be renewed before it lapsed")
            self._stop.wait(period if self._value else period / 2)

    def _try_acquire(self) -> None:
        sent = self._now()
        epoch, value = self._acquire(
            keys=[self._k("leader"), self._k("epoch")],
            args=[self.master_id, self.address, self.lease_ms],
        )
        holder = Holder.parse(value)
        self.leader = holder
        if not epoch:
            return
        with self._lock:
            self._value = value.decode() if isinstance(value, bytes) else str(value)
            self.epoch = int(epoch)
            self._trusted_until = sent + TRUST * self.lease_ms / 1000
        log.info("became the store master leader",
                 extra={"epoch": self.epoch, "master_id": self.master_id, "redis": self.location})
        self._on_promoted(self.epoch)

    def _keep(self) -> None:
        if self._now() >= self._trusted_until:
            self._depose("the lease lapsed before it was renewed (paused or partitioned)")
            return
        sent = self._now()
        if not self._renew(keys=[self._k("leader")], args=[self._value, self.lease_ms]):
            self._depose("another master holds the lease")
            return
        self._trusted_until = sent + TRUST * self.lease_ms / 1000

    def _depose(self, reason: str) -> None:
        if self.deposed.is_set():
            return
        self.deposed_reason = reason
        self.deposed.set()
        log.error("no longer the store master leader; refusing every call",
                  extra={"epoch": self.epoch, "reason": reason})
        self._on_deposed(reason)

    # -- fenced writes ---------------------------------------------------------------------

    def _write(self, ops: Sequence[tuple[str, str, str, str | int]]) -> None:
        if not ops:
            return
        if not self.is_leader:
            raise Fenced("not the leader")
        args: list[Any] = [self._value]
        for op in ops:
            args.extend(op)
        if self._fenced(keys=[self._k("leader")], args=args) == _REFUSED:
            self._depose("a write found another master holding the lease")
            raise Fenced("another master holds the lease")

    def journal_commits(self, entries: Iterable[JournalEntry]) -> None:
        """Record committed replicas; must succeed before the put is acknowledged."""
        now_ms = int(time.time() * 1000)
        ops: list[tuple[str, str, str, str | int]] = []
        for e in entries:
            field = f"{e.item.segment}{SEP}{e.item.offset}"
            value = SEP.join((e.incarnation, str(e.item.size), str(e.item.checksum), e.item.key))
            ops.append(("hset", self._k("journal", e.node_id), field, value))
            ops.append(("zadd", self._k("journal-age", e.node_id), field, now_ms))
        self._write(ops)

    def journal_forget(self, entries: Iterable[JournalEntry]) -> None:
        """Drop entries of removed objects, so a failover cannot bring them back."""
        ops: list[tuple[str, str, str, str | int]] = []
        for e in entries:
            field = f"{e.item.segment}{SEP}{e.item.offset}"
            ops.append(("hdel", self._k("journal", e.node_id), field, ""))
            ops.append(("zrem", self._k("journal-age", e.node_id), field, ""))
        self._write(ops)

    def journal_for(self, node_id: str, incarnation: str) -> list[pb.InventoryItem]:
        """The journal entries for this node process (entries of its earlier processes name
        memory that no longer exists and are skipped)."""
        raw = self._redis.hgetall(self._k("journal", node_id))
        out = []
        for f, v in raw.items():
            segment, _, offset = f.decode().rpartition(SEP)
            inc, size, checksum, key = v.decode().split(SEP, 3)
            if inc != incarnation or not offset.isdigit():
                continue
            out.append(pb.InventoryItem(key=key, segment=segment, offset=int(offset),
                                        size=int(size), checksum=int(checksum)))
        return out

    def trim_journal(self, node_ids: Iterable[str]) -> int:
        """Drop journal entries older than `journal_keep_s`; returns how many."""
        cutoff = int((time.time() - self.journal_keep_s) * 1000)
        ops: list[tuple[str, str, str, str | int]] = []
        for node_id in node_ids:
            old = self._redis.zrangebyscore(self._k("journal-age", node_id), 0, cutoff,
                                            start=0, num=10_000)
            for f in old:
                field = f.decode()
                ops.append(("hdel", self._k("journal", node_id), field, ""))
                ops.append(("zrem", self._k("journal-age", node_id), field, ""))
        self._write(ops)
        return len(ops) // 2

    # -- roster and pins -------------------------------------------------------------------

    def load_roster(self) -> frozenset[str]:
        return frozenset(m.decode() for m in self._redis.smembers(self._k("nodes")))

    def save_roster(self, node_ids: Iterable[str], previous: frozenset[str]) -> None:
        ids = frozenset(node_ids)
        ops: list[tuple[str, str, str, str | int]] = [
            ("sadd", self._k("nodes"), n, "") for n in ids - previous]
        ops += [("srem", self._k("nodes"), n, "") for n in previous - ids]
        self._write(ops)

    def load_pins(self) -> list[str]:
        return [m.decode() for m in self._redis.smembers(self._k("pins"))]

    def save_pins(self, keys: Iterable[str], pin: bool) -> None:
        op = "sadd" if pin else "srem"
        self._write([(op, self._k("pins"), k, "") for k in keys])
