"""The store's embedding API (store/local.py): a DRAM segment served from another process,
as the decode worker serves the KV written for it. A real master process; the segment lives in
this test's process and is the cluster's only segment, so every byte read back came from it."""

from __future__ import annotations

import time

from mooncake_k8s.store.local import LocalSegment, LocalSegmentConfig
from mooncake_k8s.store.testing import StoreCluster


def test_a_local_segment_registers_serves_and_leaves() -> None:
    with StoreCluster() as cluster:
        cluster.start_master()
        seg = LocalSegment(LocalSegmentConfig(master=cluster.master_address,
                                              owner_id="decode-embed-test", size=8 << 20,
                                              token=cluster.token))
        assert seg.name == "decode-embed-test-dram-0"
        seg.start()
        try:
            deadline = time.monotonic() + 20
            while not seg.registered() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert seg.registered()
            cluster.wait_nodes(1)
            payload = bytes(range(256)) * 256
            with cluster.client() as c:
                c.put("embedded-key", payload, preferred_segment=seg.name)
                assert bytes(c.get("embedded-key")) == payload
        finally:
            seg.stop()
