"""`mooncake store demo`: a store cluster on loopback, a round trip over shm and tcp, the stats.

The quickest way to see the data plane work: it starts the same processes an operator would
run (master and a storage node), moves a KV-block-sized object both ways, and stops them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import numpy as np
from google.protobuf.json_format import MessageToDict

from mooncake_k8s.store.cluster import LocalCluster


def run_demo(size: int = 4 << 20, say: Callable[[str], None] = print) -> None:
    token = secrets.token_hex(16)
    with LocalCluster(token=token) as cluster:
        t0 = time.monotonic()
        cluster.start_master()
        cluster.start_node("demo-node", "256MiB")
        say(f"store up in {time.monotonic() - t0:.1f}s: master {cluster.master_address}, "
            f"logs in {cluster.workdir}")
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        for transport in ("shm", "tcp"):
            with cluster.client(transport=transport) as c:
                key = f"demo-{transport}"
                t = time.perf_counter()
                c.put(key, data)
                put_ms = (time.perf_counter() - t) * 1e3
                out = np.empty_like(data)
                t = time.perf_counter()
                c.get_into(key, out)
                get_ms = (time.perf_counter() - t) * 1e3
                ok = "verified" if np.array_equal(out, data) else "MISMATCH"
                say(f"{transport}: put {size >> 20} MiB in {put_ms:.2f} ms, "
                    f"get in {get_ms:.2f} ms ({ok})")
        with cluster.client() as c:
            stats = MessageToDict(c.stats())
        say(f"objects={stats.get('objects')} nodes={stats.get('nodes')} segments="
            + ", ".join(f"{s['name']}:{int(s.get('used', 0)) >> 20}/{int(s['size']) >> 20} MiB"
                        for s in stats.get("segments", [])))
    say("stopped")
