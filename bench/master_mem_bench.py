#!/usr/bin/env python3
"""Store master memory per object and in-process lookup rate, at a million objects.

How big a cluster one master serves is decided by its bytes per object: Mooncake's master ran
out of memory at tens of millions of keys. This benchmark builds a `MasterState` with N
committed single-replica objects through the real `put_start` / `put_end` path (in process, no
gRPC: the gRPC shell adds nothing per object) and reports:

  rss B/obj     (RSS after - RSS before) / N, read from /proc/self/statm; "puts" right after
                the N puts, "looked" after one lookup of every key (what lookups cache stays)
  traced B/obj  the same from tracemalloc (a second child process: tracing slows Python down
                and its own bookkeeping would inflate the RSS figure)
  lookups       `get_replicas` keys/s (from the median call) and p99 per call, batches of
                256 keys and of 1, uniform random keys over all N, after the warm-up pass;
                "+enc" also counts `Lookup.encode()` (what the gRPC handler sends). "dict.get
                floor" is `list(map(objects.get, keys))` on the master's own key dict for other
                random batches of the same size, interleaved with the lookups: the cost of just
                finding random keys in a Python dict, which no Python master goes below.
                "cold" is the first pass over every key (batches of 256): a lookup of a key
                never looked up before.

Each measurement runs in a fresh child process so one run's heap never colours another's.
Keys are 32 hex chars by default (`common.blocks.block_keys`: 128-bit blake2b, hex), 64 with
`--key-len 64` (SGLang page keys are SHA-256 hex); every key, size and checksum is a fresh
object per call, as the gRPC layer hands them over, so nothing is shared by accident. Node
commands are drained as a live command stream would.

`--before-ref REF` also measures the store code of git revision REF (extracted to a temporary
directory and imported instead of this checkout) in the same way in the same run, reported as
the "before" row. Without it, a "before" row saved earlier (`--save-before`) is shown.

Usage:
  python bench/master_mem_bench.py                 # N = 1,000,000 (several minutes)
  python bench/master_mem_bench.py --quick         # N = 200,000
  python bench/master_mem_bench.py --before-ref main
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
SELF = str(Path(__file__).resolve())
CODE_ENV = "MASTER_MEM_BENCH_CODE"  # a directory holding a `mooncake_k8s` package to import
OBJECT_SIZE = 368_640 + 64  # one 16-token KV block of SmolLM2-135M (30 layers x 3 heads x 64)
TARGET_BYTES_PER_OBJECT = 300
TARGET_KEYS_PER_S = 1_000_000
Row = dict[str, Any]


# -- child: one measurement -----------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_key(i: int, key_len: int) -> str:
    """A fresh key string, like `block_keys` makes them (hex of a blake2b digest)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=key_len // 2).hexdigest()


def child(n: int, key_len: int, nodes: int, traced: bool) -> Row:
    code = os.environ.get(CODE_ENV)
    if code:
        sys.path.insert(0, code)
    import mooncake_k8s
    from mooncake_k8s.common.rpc import store_pb2 as pb
    from mooncake_k8s.store.master.state import MasterState

    clock = [1000.0]
    st = MasterState(now=lambda: clock[0], wall=lambda: 1_700_000_000.0)
    per_node = -(-n // nodes)
    seg_size = int(per_node * OBJECT_SIZE / 0.9)  # every object fits under the 0.95 watermark
    streams = {}
    for j in range(nodes):
        nid = f"node-{j}"
        st.register_node(nid, f"127.0.0.1:{7000 + j}", f"host-{j}", [pb.SegmentInfo(
            name=f"{nid}-dram-0", tier=pb.DRAM, size=seg_size, path=f"/dev/shm/{nid}-dram-0")])
        streams[nid] = st.open_command_stream(nid)
    size_bytes = OBJECT_SIZE.to_bytes(4, "little")
    rng = random.Random(7)
    gc.collect()
    if traced:
        tracemalloc.start()
    base_rss, base_traced = rss(), tracemalloc.get_traced_memory()[0]

    def drain() -> None:
        for nid, stream in streams.items():
            st.next_commands(nid, stream or 0, 0)

    t0 = time.perf_counter()
    for i in range(n):
        size = int.from_bytes(size_bytes, "little")  # a fresh int, as protobuf parsing gives
        r = st.put_start(make_key(i, key_len), size)
        st.put_end(make_key(i, key_len), r.put_id, rng.getrandbits(64))
        if i % 1024 == 1023:
            drain()
    drain()
    put_s = time.perf_counter() - t0
    gc.collect()
    puts_rss, puts_traced = rss(), tracemalloc.get_traced_memory()[0]

    # Warm-up pass: every key looked up once, in a scrambled order, 256 keys per call.
    step = 1_000_003 if n % 1_000_003 else 999_983  # coprime with n: a permutation
    cold_s = 0.0
    for b0 in range(0, n, 256):
        keys = [make_key(i * step % n, key_len) for i in range(b0, min(n, b0 + 256))]
        t = time.perf_counter()
        lk = st.get_replicas(keys)
        cold_s += time.perf_counter() - t
        assert lk.found == len(keys), "a stored key was not found"
        st.release_lease(lk.lease_id)
    gc.collect()
    looked_rss, looked_traced = rss(), tracemalloc.get_traced_memory()[0]
    if traced:
        tracemalloc.stop()
    row: Row = {
        "n": n, "key_len": key_len, "nodes": nodes, "object_size": OBJECT_SIZE,
        "code": str(Path(mooncake_k8s.__file__).parent), "put_per_s": round(n / put_s),
        "cold_keys_per_s": round(n / cold_s),
    }
    if traced:
        row["traced_puts_b_per_obj"] = round((puts_traced - base_traced) / n, 1)
        row["traced_looked_b_per_obj"] = round((looked_traced - base_traced) / n, 1)
        return row
    row["rss_puts_b_per_obj"] = round((puts_rss - base_rss) / n, 1)
    row["rss_looked_b_per_obj"] = round((looked_rss - base_rss) / n, 1)
    get = st._objects.get  # the floor: the dict lookup every Python master does per key
    for batch, calls in ((256, max(200, 100_000 // 256)), (1, 50_000)):
        times, enc_times, floor_times = [], [], []
        for _ in range(calls):
            keys = [make_key(rng.randrange(n), key_len) for _ in range(batch)]
            t = time.perf_counter()
            lk = st.get_replicas(keys)
            t1 = time.perf_counter()
            lk.encode()
            enc_times.append(time.perf_counter() - t1)
            times.append(t1 - t)
            st.release_lease(lk.lease_id)
            # Other random keys (the same ones would be in cache now), fresh strings (unhashed,
            # as the gRPC layer parses them).
            keys = [make_key(rng.randrange(n), key_len) for _ in range(batch)]
            t = time.perf_counter()
            list(map(get, keys))
            floor_times.append(time.perf_counter() - t)
        # Rates from the median call: this 2-core box is shared, and a preempted call says
        # nothing about the code (the p99 column shows the tail, preemptions included).
        med, enc_med = statistics.median(times), statistics.median(enc_times)
        row[f"b{batch}_keys_per_s"] = round(batch / med)
        row[f"b{batch}_enc_keys_per_s"] = round(batch / (med + enc_med))
        row[f"b{batch}_floor_keys_per_s"] = round(batch / statistics.median(floor_times))
        row[f"b{batch}_mean_keys_per_s"] = round(batch * calls / sum(times))
        times.sort()
        row[f"b{batch}_p50_us"] = round(med * 1e6, 2)
        row[f"b{batch}_p99_us"] = round(times[int(0.99 * (len(times) - 1))] * 1e6, 2)
    return row


# -- parent: run children, print, save ------------------------------------------------------


def run_child(n: int, key_len: int, nodes: int, traced: bool, code: str | None) -> Row:
    env = dict(os.environ)
    if code:
        env[CODE_ENV] = code
    cmd = [sys.executable, SELF, "--child", str(n), "--key-len", str(key_len),
           "--nodes", str(nodes)] + (["--traced"] if traced else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(label: str, n: int, key_len: int, nodes: int, code: str | None,
            traced: bool = True) -> Row:
    print(f"[{label}] n={n} key_len={key_len}: RSS and lookups ...", file=sys.stderr, flush=True)
    row = run_child(n, key_len, nodes, False, code)
    if traced:
        print(f"[{label}] tracemalloc ...", file=sys.stderr, flush=True)
        tr = run_child(n, key_len, nodes, True, code)
        row.update({k: v for k, v in tr.items() if k.startswith("traced_")})
    return {"label": label, **row}


def extract_ref(ref: str, into: str) -> str:
    """The store code of git revision `ref` as an importable `mooncake_k8s` package."""
    repo = BENCH_DIR.parent
    tar = subprocess.run(["git", "-C", str(repo), "archive", ref, "services"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=tar, check=True)
    pkg = Path(into) / "pkg"
    pkg.mkdir()
    (pkg / "mooncake_k8s").symlink_to(Path(into) / "services")
    return str(pkg)


COLUMNS = [
    ("label", "code", "{}"), ("n", "objects", "{:,}"), ("key_len", "key", "{}"),
    ("rss_puts_b_per_obj", "rss B/obj puts", "{:.0f}"),
    ("rss_looked_b_per_obj", "rss B/obj looked", "{:.0f}"),
    ("traced_puts_b_per_obj", "traced puts", "{:.0f}"),
    ("traced_looked_b_per_obj", "traced looked", "{:.0f}"),
    ("b256_keys_per_s", "keys/s b256", "{:,}"), ("b256_enc_keys_per_s", "+enc", "{:,}"),
    ("b256_floor_keys_per_s", "dict.get floor", "{:,}"),
    ("b256_p99_us", "p99 us b256", "{:.0f}"), ("b1_keys_per_s", "keys/s b1", "{:,}"),
    ("b1_p99_us", "p99 us b1", "{:.1f}"), ("cold_keys_per_s", "cold keys/s", "{:,}"),
    ("put_per_s", "puts/s", "{:,}"),
]


def table(rows: list[Row]) -> str:
    head = [c[1] for c in COLUMNS]
    body = [[fmt.format(r[k]) if k in r else "-" for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = [line, sep]
    out += ["| " + " | ".join(x.rjust(w) for x, w in zip(b, widths, strict=True)) + " |"
            for b in body]
    return "\n".join(out)


def verdicts(row: Row) -> list[str]:
    mem = max(row["rss_puts_b_per_obj"], row["rss_looked_b_per_obj"])
    rate = row["b256_keys_per_s"]
    return [
        f"{'PASS' if mem <= TARGET_BYTES_PER_OBJECT else 'MISS'} memory: {mem:.0f} B/object "
        f"RSS at {row['n']:,} objects (target <= {TARGET_BYTES_PER_OBJECT})",
        f"{'PASS' if rate >= TARGET_KEYS_PER_S else 'MISS'} lookups: {rate:,} keys/s in "
        f"batches of 256 (target >= {TARGET_KEYS_PER_S:,})",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200,000 objects instead of 1,000,000")
    ap.add_argument("--n", type=int, default=0, help="objects (overrides --quick)")
    ap.add_argument("--key-len", type=int, default=32, choices=range(2, 129, 2), metavar="LEN",
                    help="key length in hex chars (even, 2..128; default 32)")
    ap.add_argument("--nodes", type=int, default=4, help="storage nodes, one DRAM segment each")
    ap.add_argument("--before-ref", default="", help="also measure this git revision's code")
    ap.add_argument("--save-before", action="store_true",
                    help="save this run's row as the 'before' row shown by later runs")
    ap.add_argument("--no-traced", action="store_true",
                    help="skip the tracemalloc runs (they take 3-7x longer than the others)")
    ap.add_argument("--out", default="", help="JSON path (default bench/results/...)")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.key_len, args.nodes, args.traced)))
        return
    n = args.n or (200_000 if args.quick else 1_000_000)
    suffix = "-quick" if args.quick and not args.n else ""
    before_path = RESULTS / f"master_mem_bench-before{suffix}.json"
    rows: list[Row] = []
    if args.before_ref:
        with tempfile.TemporaryDirectory() as tmp:
            rev = subprocess.run(["git", "-C", str(BENCH_DIR.parent), "rev-parse", "--short",
                                  args.before_ref], capture_output=True, text=True).stdout.strip()
            rows.append(measure(f"before ({args.before_ref} {rev})", n, args.key_len, args.nodes,
                                extract_ref(args.before_ref, tmp), not args.no_traced))
    elif before_path.exists() and not args.save_before:
        saved = json.loads(before_path.read_text())
        if saved["n"] == n and saved["key_len"] == args.key_len:
            rows.append(saved)
    now = measure("before" if args.save_before else "this", n, args.key_len, args.nodes, None,
                  not args.no_traced)
    rows.append(now)
    RESULTS.mkdir(exist_ok=True)
    if args.save_before:
        before_path.write_text(json.dumps(now, indent=1) + "\n")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "n": n,
            "key_len": args.key_len, "nodes": args.nodes, "object_size": OBJECT_SIZE}
    text = "\n".join([
        f"master memory and lookup rate, {n:,} single-replica objects, {args.key_len}-char "
        f"keys, {args.nodes} nodes; {meta['date']}, Python {meta['python']}, {meta['machine']}",
        "", table(rows), "", *verdicts(now),
    ])
    print(text)
    out = Path(args.out) if args.out else RESULTS / f"master_mem_bench{suffix}.json"
    if not args.save_before:
        out.write_text(json.dumps({"meta": meta, "rows": rows, "verdicts": verdicts(now)},
                                  indent=1) + "\n")
        out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
