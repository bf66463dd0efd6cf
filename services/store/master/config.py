"""The store master's settings (`mooncake store master`'s flags and their variables), apart from
the server so that the handlers can name them without importing the process that serves them."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake_k8s.common import defaults


@dataclass
class MasterConfig:
    """Settings of the master (flags / env vars of `mooncake store master`)."""

    host: str = "127.0.0.1"
    """Address to bind; exactly this one (never every interface by default)."""
    port: int = defaults.MASTER_PORT
    """gRPC port; 0 picks a free one (see `MasterServer.port`)."""
    token: str = ""
    """Cluster token required on every RPC; empty disables the check."""
    metrics_port: int | None = None
    """Prometheus port on `metrics_host`; 0 picks a free one, None or -1 disables."""
    metrics_host: str | None = None
    """Defaults to `host`."""
    high_watermark: float = defaults.HIGH_WATERMARK
    low_watermark: float = defaults.LOW_WATERMARK
    put_timeout_s: float = defaults.PUT_TIMEOUT_S
    """A put not ended within this time is revoked and its space reclaimed."""
    put_claim_s: float = 1.0
    """How long a pending put keeps other writers of its key away (plus time for its size): a
    crashed writer blocks its key this long, not for the whole put timeout."""
    state_dir: str | None = None
    """Where the master keeps the ids of its registered nodes, so that after a restart it knows
    whom to wait for. None: it cannot tell a first start from a restart and always waits for
    `recovery_grace_s`."""
    recovery_grace_s: float = defaults.RECOVERY_GRACE_S
    """After a restart, answer UNAVAILABLE at most this long while nodes re-register (nodes
    re-register within about a heartbeat interval); 0 disables recovery."""
    lease_ms: int = defaults.LEASE_MS
    max_lease_ms: int = 60_000
    node_timeout_s: float = defaults.NODE_TIMEOUT_S
    heartbeat_interval_ms: int = 1000
    max_object_size: int = 1 << 30
    tick_interval_s: float = 0.05
    fast_port: int = 0
    """Port of the fast path for the hot calls (`fastpath`) on `host`; 0 picks a free one,
    -1 turns it off (clients then use gRPC for everything)."""
    workers: int = 8
    """Threads of the executor for the calls kept off the event loop (RegisterNode); streams
    and other calls need none."""
    event_queue: int = 10_000
    """Events buffered per Watch subscriber before it is disconnected as too slow."""
    metadata_backend: str = "embedded"
    """"embedded": one master, metadata in its memory (rebuilt from the nodes after a restart).
    "redis": several masters, one leads by a lease in Redis (`ha`)."""
    redis_url: str = ""
    """Redis for the "redis" backend (may hold a password: never logged)."""
    advertise: str = ""
    """host:port under which clients reach this master (the leader hint standbys give);
    defaults to the bound address."""
    ha_prefix: str = "mooncake"
    """Prefix of this cluster's keys in Redis (one Redis may serve several clusters)."""
    ha_lease_ms: int = defaults.HA_LEASE_MS
    """Leader lease: a dead leader is replaced about this long after it stopped renewing."""
    tenant_quotas: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    """Tenant -> (DRAM bytes, SSD bytes), None = unlimited in that tier (`quotas`); a tenant
    not named (and the shared "" tenant unless named) is unlimited."""
    journal_keep_s: float = defaults.JOURNAL_KEEP_S
    """How long the commit journal keeps an entry (far beyond a node applying it)."""
    fanout: bool = False
    """Hot-object fan-out (`fanout`): add replicas of objects read often from other hosts."""
    fanout_threshold: int = 4
    """Lookups per window from one host without a replica that add one there."""
    fanout_window_s: float = 10.0
    fanout_max_replicas: int = 4
