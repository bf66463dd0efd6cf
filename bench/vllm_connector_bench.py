"""What vLLM's forward pass waits for in our KV connector: saves whole vs layer by layer, and
the load before the forward (issue 20 item 3).

Runs the real connector (worker side) on tensors of vLLM's CPU KV layout shaped like the
built-in model (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, bfloat16, 64-token blocks)
against a real store (master + one node on loopback), driving the hooks as vLLM's attention
wrapper does. Each "layer" of the forward pass is stood in for by `--layer-ms` of matrix
multiplies on this process's threads (the sender thread competes for the same cores, as it does
in vLLM). Reported per mode: the hooks' time inside the forward, and `wait_for_save` (what the
step waits for after its last layer: the exposed save time); for the load: the fetch, the
verification and the scatter into vLLM's cache, and the rate.

    python bench/vllm_connector_bench.py                # about 30 s on the 2-core dev box
    python bench/vllm_connector_bench.py --blocks 45 --layer-ms 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
import warnings
from types import SimpleNamespace as NS
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mooncake_k8s.common.blocks import decode_block
    from mooncake_k8s.engine.vllm.connector import MooncakeK8sConnector, MooncakeMeta, _Load
    from mooncake_k8s.engine.vllm.layersave import SaveGroup

from mooncake_k8s.store.testing import StoreCluster, store_cluster

LAYERS, HEADS, BT, DIM = 30, 3, 64, 64
FP = "cd" * 16


def _caches(blocks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(blocks + 8, HEADS, BT, 2 * DIM, generator=g).to(torch.bfloat16)
            for i in range(LAYERS)}


def _connector(cluster: StoreCluster, caches: dict[str, torch.Tensor], stream: bool
               ) -> MooncakeK8sConnector:
    os.environ["MOONCAKE_CLUSTER_TOKEN"] = cluster.token
    extra = {"master": cluster.master_address, "fingerprint": FP, "stream_saves": stream}
    cfg = NS(kv_transfer_config=NS(kv_connector_extra_config=extra, is_kv_producer=True),
             cache_config=NS(block_size=BT, cache_dtype="auto"),
             model_config=NS(dtype=torch.bfloat16, max_model_len=4096))
    c = MooncakeK8sConnector(cfg, KVConnectorRole.WORKER, None)
    c.register_kv_caches(caches)
    return c


class _Compute:
    """`ms` of matrix multiplies (timed, not counted, so a busy box still gives each layer its
    time): one layer's compute, stood in for."""

    def __init__(self, ms: float) -> None:
        self.a = torch.randn(128, 128)
        self.s = ms / 1000

    def __call__(self) -> None:
        end = time.perf_counter() + self.s
        while time.perf_counter() < end:
            self.a @ self.a


def _save(c: MooncakeK8sConnector, names: list[str], blocks: int, hooks: bool,
          compute: _Compute) -> dict[str, float]:
    keys = [uuid.uuid4().hex for _ in range(blocks)]
    saves = [SaveGroup(keys, list(range(blocks)))] if blocks else []
    c.bind_connector_metadata(MooncakeMeta(saves=saves))
    hooked = 0.0
    t0 = time.perf_counter()
    for name in names:
        compute()
        if hooks:
            h = time.perf_counter()
            c.save_kv_layer(name, torch.empty(0), None)
            hooked += time.perf_counter() - h
    t1 = time.perf_counter()
    c.wait_for_save()
    t2 = time.perf_counter()
    c.clear_connector_metadata()
    assert c._stats["save_failed"] == 0, c._stats
    return {"forward_s": t1 - t0, "hooks_s": hooked, "wait_for_save_s": t2 - t1,
            "step_s": t2 - t0, "keys": keys}  # type: ignore[dict-item]


def _load(cluster: StoreCluster, caches: dict[str, torch.Tensor], keys: list[str]
          ) -> dict[str, float]:
    c = _connector(cluster, caches, True)
    c._client().batch_get_into(keys[:1], [c._buffer(1)[0]])  # warm-up: the client connects
    # (its staging buffer was made at registration, as in vLLM)
    ids = list(range(8, 8 + len(keys)))
    c.bind_connector_metadata(MooncakeMeta(loads=[_Load(keys, ids)]))
    t0 = time.perf_counter()
    c.start_load_kv(None)
    total = time.perf_counter() - t0
    c.clear_connector_metadata()
    assert c._stats["loaded"] == len(keys), c._stats
    # The same three phases, timed apart.
    buf = c._buffer(len(keys))
    t0 = time.perf_counter()
    sizes = c._client().batch_get_into(keys, list(buf))
    t1 = time.perf_counter()
    for i, size in enumerate(sizes):
        decode_block(buf[i, :size], c._layout)
    t2 = time.perf_counter()
    assert c._paged is not None
    c._paged.scatter(ids, c._payloads(buf))
    t3 = time.perf_counter()
    nbytes = int(buf.nbytes)
    c.shutdown()
    return {"load_s": total, "fetch_s": t1 - t0, "verify_s": t2 - t1, "scatter_s": t3 - t2,
            "scatter_per_layer_ms": (t3 - t2) / LAYERS * 1000, "bytes": nbytes,
            "load_gb_s": nbytes / total / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=45, help="blocks saved/loaded (45 = 2.9K tokens)")
    ap.add_argument("--layer-ms", type=float, default=20.0, help="compute per layer, stood in")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    caches = _caches(args.blocks)
    names = sorted(caches, key=lambda n: int(n.split(".")[2]))
    compute = _Compute(args.layer_ms)
    modes = {"no saves (baseline)": (False, True), "whole (before)": (False, False),
             "layer-wise, put at end": (False, True), "layer-wise, streamed": (True, True)}
    out: dict[str, Any] = {"blocks": args.blocks, "layer_ms": args.layer_ms, "modes": {}}
    with store_cluster(nodes=1, dram_size="1GiB") as cluster:
        keys: list[str] = []
        for mode, (stream, hooks) in modes.items():
            c = _connector(cluster, caches, stream)
            n = 0 if mode.startswith("no saves") else args.blocks
            _save(c, names, n, hooks, compute)  # warm-up: the client connects
            runs = [_save(c, names, n, hooks, compute) for _ in range(args.rounds)]
            keys = runs[-1].pop("keys") or keys  # type: ignore[assignment]
            for r in runs:
                r.pop("keys", None)
            out["modes"][mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            out["modes"][mode]["streamed"] = c._stats["streamed"]
            c.shutdown()
        out["load"] = _load(cluster, caches, keys)
    mb = args.blocks * LAYERS * 2 * HEADS * BT * DIM * 2 / 1e6
    print(f"{args.blocks} blocks ({mb:.0f} MB of KV), {LAYERS} layers, ~{args.layer_ms} ms "
          "compute per layer, median of", args.rounds)
    print(f"{'save mode':26} {'forward s':>10} {'in hooks s':>11} {'wait_for_save s':>16}")
    for mode, r in out["modes"].items():
        print(f"{mode:26} {r['forward_s']:10.3f} {r['hooks_s']:11.3f} "
              f"{r['wait_for_save_s']:16.3f}")
    ld = out["load"]
    print(f"load before the forward: {ld['load_s']:.3f} s ({ld['load_gb_s']:.2f} GB/s): fetch "
          f"{ld['fetch_s']:.3f}, verify {ld['verify_s']:.3f}, scatter {ld['scatter_s']:.3f} "
          f"({ld['scatter_per_layer_ms']:.2f} ms per layer)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
