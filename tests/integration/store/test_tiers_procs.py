"""Watermarks on every tier with real processes: a burst of puts from several clients into a
node with DRAM and SSD never takes either tier above its high watermark, while DRAM victims
spill into SSD and SSD makes room by evicting its own coldest objects."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path

import numpy as np

from mooncake_k8s.common.errors import ObjectNotFound
from mooncake_k8s.store.testing import StoreCluster, metric_value

KiB, MiB = 1 << 10, 1 << 20
HIGH = 0.8


def test_watermarks_hold_on_dram_and_ssd_during_a_burst(tmp_path: Path) -> None:
    size = 256 * KiB
    n_threads, per_thread = 4, 40  # 40 MiB into 8 MiB of DRAM and 16 MiB of SSD
    with StoreCluster(master_args=["--high-watermark", str(HIGH), "--low-watermark", "0.6"]) as c:
        c.start_master()
        node = c.start_node("t", "8MiB", "--ssd-dir", str(tmp_path), "--ssd-size", "16MiB")
        peak: dict[str, float] = {}
        stop = threading.Event()

        def sample() -> None:  # the master's view, as often as it answers
            with c.client() as cl:
                while not stop.is_set():
                    for s in cl.stats().segments:
                        peak[s.name] = max(peak.get(s.name, 0.0), s.used / s.size)

        def burst(t: int) -> list[str]:
            keys = []
            with c.client() as cl:
                for i in range(per_thread):
                    key = f"burst-{t}-{i}"
                    cl.put(key, np.full(size, (t * per_thread + i) % 251, dtype=np.uint8))
                    keys.append(key)
            return keys

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with cf.ThreadPoolExecutor(n_threads) as ex:
                keys = [k for ks in ex.map(burst, range(n_threads)) for k in ks]
            time.sleep(1.0)  # spills still running settle
        finally:
            stop.set()
            sampler.join(timeout=10)
        with c.client(location_cache=False) as cl:
            st = cl.stats()
            node_used = {s: metric_value(node.metrics(), "mooncake_node_used_bytes",
                                         f'segment="{s}"') for s in ("t-dram-0", "t-ssd-0")}
            survivors = 0
            for k in keys:  # whatever survived reads back intact
                t, i = (int(x) for x in k.split("-")[1:])
                try:
                    got = cl.get(k)
                except ObjectNotFound:
                    continue
                assert got == bytes([(t * per_thread + i) % 251]) * size, k
                survivors += 1
    print(f"\npeak fill: {', '.join(f'{n} {f:.1%}' for n, f in sorted(peak.items()))} "
          f"(high watermark {HIGH:.0%}); spills {st.spills}, evictions {st.evictions}, "
          f"{survivors} of {len(keys)} objects kept")
    assert set(peak) == {"t-dram-0", "t-ssd-0"}
    assert all(f <= HIGH for f in peak.values()), peak
    assert node_used["t-dram-0"] <= HIGH * 8 * MiB and node_used["t-ssd-0"] <= HIGH * 16 * MiB
    assert st.spills > 0 and st.evictions > 0  # both tiers were really under pressure
    assert survivors >= int(0.6 * 24 * MiB / size)  # DRAM and SSD both hold data at the end
