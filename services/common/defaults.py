"""Defaults that several components must agree on, each written once.

A value here is what every process assumes when nothing says otherwise; a cluster that changes
one must change it everywhere (the CLI's options, the operator's renders and the engines all
read these names).
"""

from __future__ import annotations

BLOCK_TOKENS = 64
"""Tokens per KV block: the unit of prefix reuse, of block keys and of store objects. Every
process of one cluster must use the same value (it is part of the block key namespace)."""

# -- ports: the CLI's defaults, and the ports the operator gives containers and Services -------

CONDUCTOR_PORT = 8000
"""The Conductor's OpenAI-compatible HTTP API."""
CONDUCTOR_METRICS_PORT = 9093
"""The Conductor's /metrics (and /healthz, /readyz): apart from the API, so that scraping needs
no API key and a NetworkPolicy can open the two to different clients."""
MASTER_PORT = 50051
"""The store master's gRPC port."""
MASTER_FAST_PORT = 50052
"""The master's fast path in a cluster (the CLI's default is any free port: clients find it
through the master)."""
MASTER_ADDRESS = f"127.0.0.1:{MASTER_PORT}"
"""Where a process looks for the master when told nothing."""
NODE_TRANSFER_PORT = 50055
"""A storage node's transfer port in a cluster (the CLI's default is any free port)."""
PREFILL_PORT = 50061
DECODE_PORT = 50071
WORKER_METRICS_PORT = 9090
"""Prefill and decode workers' health, readiness and /metrics."""
MASTER_METRICS_PORT = 9091
NODE_METRICS_PORT = 9092

# -- the store master ------------------------------------------------------------------------

HIGH_WATERMARK = 0.95
"""A tier above this fraction used starts evicting (or spilling)."""
LOW_WATERMARK = 0.85
"""... down to this fraction."""
LEASE_MS = 2000
"""The read lease a lookup grants by default: replicas it names are not evicted meanwhile."""
PUT_TIMEOUT_S = 30.0
"""A put not ended within this time is revoked and its space reclaimed."""
NODE_TIMEOUT_S = 10.0
"""A storage node silent this long is dead; its replicas are dropped."""
RECOVERY_GRACE_S = 3.0
"""After a restart the master answers UNAVAILABLE at most this long while nodes re-register."""
HA_LEASE_MS = 2000
"""The HA leader's lease in Redis: a dead leader is replaced about this long after it stopped."""
JOURNAL_KEEP_S = 30.0
"""How long the HA commit journal keeps an entry."""
CONDUCTOR_SHUTDOWN_TIMEOUT_S = 60.0
"""After SIGTERM the Conductor finishes in-flight requests and streams for at most this long."""
CONDUCTOR_INDEX_WARMUP_S = 30.0
"""How long a starting Conductor reports not-ready while it waits for the store's snapshot to
fill its KV index; past it, it reports ready with what it has (cache-blind if the store is
unreachable) and the snapshot replaces the index whenever it comes."""
STREAM_STALL_TIMEOUT_S = 2.0
"""The Conductor's per-token deadline on a decode stream after its first chunk: a stream that
sends nothing for this long is resumed elsewhere (its instance frozen, partitioned or hung).
Measured (bench/stream_gaps.py, 2 busy CPU cores, 6 streams per decode arriving while others
run): healthy gaps p50 0.48 s, p99.9 and max 1.08 s, so 2 s is about twice the worst; plus a
failover resume (p50 1.7 s, bench/results/failover.json) a frozen decode's streams flow again
within about 4 s."""
CONDUCTOR_GRACE_S = 120
"""A Conductor pod's terminationGracePeriodSeconds unless the spec says otherwise: the preStop
pause, the drain above and a margin must fit in it."""
CONDUCTOR_PRESTOP_S = 5
"""The Conductor pod's preStop pause: endpoints drop the pod before SIGTERM closes its listener."""
CLIENT_TIMEOUT_S = 10.0
"""A store client's whole-call timeout (each transfer attempt has a far shorter one)."""
