"""Layer-wise KV streaming on loopback (issue 20 item 3): a ~3K-token prompt's prefill with the
blocks stored after the prefill vs streamed layer by layer, through a real store (master + two
nodes; the prefill writes each block to both, as with a home and a write segment).

Prints, per mode and transport: the forward pass's time (`compute_s`), the time from the end of
the forward pass until the last block is committed (`store_s`), and their sum (time until
the KV is all in the store). Not a test: numbers depend on the machine and its load.

    python bench/layerwise_probe.py [--tokens 2925] [--repeat 2] [--transport auto tcp]
"""

from __future__ import annotations

import argparse
import json

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.engine.api import KVPlan, PrefillWork
from mooncake_k8s.engine.embedded import EngineConfig
from mooncake_k8s.engine.embedded.prefill import EmbeddedPrefill
from mooncake_k8s.engine.embedded.testing import prompt_tokens
from mooncake_k8s.store.testing import store_cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2925)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--transport", nargs="+", default=["auto", "tcp"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    rows = []
    with store_cluster(nodes=2, dram_size="1GiB") as cluster:
        for transport in args.transport:
            with cluster.client(transport=transport) as client:
                segs = sorted(client.stats().segments, key=lambda s: s.node_id)
                home, write = segs[0].name, segs[1].name
                for on in (False, True):
                    p = EmbeddedPrefill(EngineConfig(threads=args.threads, layerwise_kv=on),
                                        client)
                    tokens = prompt_tokens(p.engine, args.tokens, variant=9)
                    for r in range(args.repeat + 1):  # the first run warms up
                        tenant = f"{transport}-{on}-{r}"
                        plan = KVPlan(tuple(p.info.block_keys(tokens, tenant)),
                                      write_segment=write, home_segment=home)
                        work = PrefillWork(f"probe-{tenant}", tokens, tenant,
                                           pb.Sampling(temperature=0, max_tokens=4), plan)
                        done = p.prefill(work)
                        client.remove([*plan.keys, done.tail_key], force=True)
                        if r == 0:
                            continue
                        rows.append({"transport": transport, "layerwise": on,
                                     "compute_s": round(done.compute_s, 3),
                                     "store_s": round(done.store_s, 3),
                                     "all_stored_s": round(done.compute_s + done.store_s, 3),
                                     "blocks": done.stored_blocks,
                                     "streamed": p.counters()[0].value})
                        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'transport':9} {'layerwise':9} {'compute_s':>9} {'store_s':>8} {'stored_s':>8}")
    for row in rows:
        print(f"{row['transport']:9} {row['layerwise']!s:9} {row['compute_s']:9.3f} "
              f"{row['store_s']:8.3f} {row['all_stored_s']:8.3f}")


if __name__ == "__main__":
    main()
