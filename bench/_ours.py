"""Our store under the same timer as the peers: a master and one node, each its own process.

The client runs in the benchmark process, so every byte crosses a process boundary (shared
memory or loopback TCP), like the Mooncake cross-process rows. The master and node are
started through the real CLI, the way a user or the operator runs them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script: make the `bench` package importable. Appended, not prepended, so the repo
# root (it holds an `operator/` directory) cannot shadow the standard library.
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench._common import (
    HOST,
    Budget,
    Procs,
    Result,
    batch_k,
    free_port,
    make_pools,
    measure,
    n_items,
    row,
    wait_port,
)

Row = dict[str, Any]
READY_TIMEOUT_S = 30.0
WARM_LEASE_MS = 30_000  # within the master's 60 s cap
SMALL_OBJECT = 1024  # bytes, for the master memory-per-object row
LOOKUP_BATCH = 1000


@dataclass
class Cluster:
    address: str
    token: str
    master: subprocess.Popen[str]
    node: subprocess.Popen[str]


def client_available() -> str | None:
    """None if our client imports, else why not (the rows are then skipped, not faked)."""
    try:
        from mooncake_k8s.store.client import StoreClient  # noqa: F401
    except Exception as e:  # an unfinished package fails in many ways; report whichever
        return f"{type(e).__name__}: {e}"
    return None


def start_cluster(procs: Procs) -> Cluster:
    port, token = free_port(), secrets.token_hex(8)
    address = f"{HOST}:{port}"
    cli = [sys.executable, "-m", "mooncake_k8s.cli", "store"]
    master = procs.start("ours-master", [*cli, "master", "--host", HOST, "--port", str(port),
                                         "--token", token, "--metrics-port", "0"])
    wait_port(port, master, READY_TIMEOUT_S)
    node = procs.start("ours-node", [*cli, "node", "--master", address, "--token", token,
                                     "--host", HOST, "--port", "0", "--dram-size", "1GiB",
                                     "--node-id", "bench-node", "--metrics-port", "0"])
    cluster = Cluster(address, token, master, node)
    _wait_ready(cluster, procs)
    return cluster


def _wait_ready(cluster: Cluster, procs: Procs) -> None:
    """Poll until a put + get round trip works: the node registered and serves bytes."""
    from mooncake_k8s.store.client import StoreClient

    payload = np.random.default_rng(7).bytes(4096)
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no attempt"
    attempt = 0
    while time.monotonic() < deadline:
        for name, p in (("ours-master", cluster.master), ("ours-node", cluster.node)):
            if p.poll() is not None:
                tail = _tail(procs.log_path(name))
                raise RuntimeError(f"{name} exited rc={p.returncode}: {tail}")
        attempt += 1
        try:
            with StoreClient(cluster.address, cluster.token, transport="tcp") as c:
                key = f"bench-ready-{attempt}"
                c.put(key, payload)
                ok = bytes(c.get(key)) == payload
                c.remove([key])
            if ok:
                return
            last = "read back different bytes"
        except Exception as e:  # not ready yet: node not registered, master starting, ...
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.2)
    raise RuntimeError(f"store not ready after {READY_TIMEOUT_S:.0f}s ({last}); "
                       f"node log: {_tail(procs.log_path('ours-node'))}")


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return "(no log)"


def _client(cluster: Cluster, transport: str, cache: bool = True) -> Any:
    """A client; the caching one asks for a lease that outlives any one case.

    `get` rows are defined as repeated gets within the lease (the client's steady state); with
    the default ~2 s lease a multi-second case would cross expiries and mix cold lookups into
    the warm row. Cold lookups have their own `get-cold` rows.
    """
    import inspect

    from mooncake_k8s.store.client import StoreClient

    kwargs: dict[str, Any] = {"transport": transport, "connections_per_peer": 4,
                              "location_cache": cache}
    if cache and "lease_ms" in inspect.signature(StoreClient).parameters:
        kwargs["lease_ms"] = WARM_LEASE_MS
    return StoreClient(cluster.address, cluster.token, **kwargs)


def client_tcp_peers(cluster: Cluster) -> list[str]:
    """Peer addresses of this process's established TCP connections, master excluded.

    Evidence for the notes that the tcp rows moved bytes over sockets (and shm rows did not).
    """
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True)
    mine = f"pid={os.getpid()},"
    peers = [f.split()[-2].replace("[::ffff:", "").replace("]", "")
             for f in out.stdout.splitlines() if mine in f]
    return [p for p in peers if p != cluster.address]


def _remove(client: Any, keys: Sequence[str]) -> None:
    """Drop keys even under a read lease (gets just took one); the harness owns the keys."""
    for i in range(0, len(keys), LOOKUP_BATCH):
        chunk = list(keys[i : i + LOOKUP_BATCH])
        try:
            client.remove(chunk, force=True)
        except TypeError:  # a client without force: leases expire within ~2 s
            client.remove(chunk)


# -- data path ------------------------------------------------------------------------------


def bench_data(cluster: Cluster, transport: str, sizes: list[int], budget: Budget,
               notes: list[str]) -> list[Row]:
    """put, get (warm location cache) and get-cold rows for one transport at every size."""
    warm = _client(cluster, transport)
    cold = _client(cluster, transport, cache=False)
    rows: list[Row] = []
    try:
        for size in sizes:
            rows += _data_size(warm, cold, transport, size, budget)
        peers = client_tcp_peers(cluster)
        notes.append(f"ours-{transport}: client TCP connections besides the master after the "
                     f"run: {len(peers)} {sorted(set(peers))}")
    finally:
        warm.close()
        cold.close()
    return rows


def _data_size(warm: Any, cold: Any, path: str, size: int, budget: Budget) -> list[Row]:
    n = n_items(size, budget)
    src, dst = make_pools(size, n)
    smv, dmv = src.data, dst.data
    objs = [smv[i * size : (i + 1) * size] for i in range(n)]
    outs = [dmv[i * size : (i + 1) * size] for i in range(n)]
    rows: list[Row] = []
    for k in (1, batch_k(size)):
        res, ok = _put_case(warm, objs, size, k, budget)
        rows.append(row("ours", path, "put", size, res, f"verify={_ok(ok)}"))
    gkeys = [f"g{size}_{i}" for i in range(n)]
    for i0 in range(0, n, batch_k(size)):
        errs = warm.batch_put(gkeys[i0 : i0 + batch_k(size)], objs[i0 : i0 + batch_k(size)])
        if any(e is not None for e in errs):
            raise RuntimeError(f"loading get set failed: {next(e for e in errs if e)}")
    try:
        for op, client, note in (("get", warm, "location cache hit (within the lease)"),
                                 ("get-cold", cold, "location_cache=False: master lookup per op")):
            for k in (1, batch_k(size)):
                dst[:] = 0
                res = measure(size, k, n, _getter(client, gkeys, outs, size), budget)
                ok = bool(np.array_equal(src, dst))
                rows.append(row("ours", path, op, size, res, f"{note}; verify={_ok(ok)}"))
    finally:
        _remove(warm, gkeys)
    return rows


def _put_case(client: Any, objs: list[memoryview], size: int, k: int,
              budget: Budget) -> tuple[Result, bool]:
    """Put rounds with fresh keys (a put never overwrites); the previous round is removed."""
    n = len(objs)
    state: dict[str, Any] = {"keys": [], "ok": False}

    def prep(r: int | None) -> None:
        if r is None and state["keys"]:
            probe = bytearray(size)
            got = client.get_into(state["keys"][-1], probe)
            state["ok"] = got == size and probe == objs[-1]
        if state["keys"]:
            _remove(client, state["keys"])
        state["keys"] = [] if r is None else [f"p{size}_{k}_{r}_{i}" for i in range(n)]

    def put(r: int, i0: int, kk: int) -> None:
        keys = state["keys"]
        if kk == 1 and k == 1:
            client.put(keys[i0], objs[i0])
            return
        errs = client.batch_put(keys[i0 : i0 + kk], objs[i0 : i0 + kk])
        bad = next((e for e in errs if e is not None), None)
        if bad is not None:
            raise bad

    res = measure(size, k, n, put, budget, prep)
    return res, bool(state["ok"])


def _getter(client: Any, keys: list[str], outs: list[memoryview], size: int) -> Any:
    def get(r: int, i0: int, kk: int) -> None:
        if kk == 1:
            if client.get_into(keys[i0], outs[i0]) != size:
                raise RuntimeError(f"short read of {keys[i0]}")
            return
        got = client.batch_get_into(keys[i0 : i0 + kk], outs[i0 : i0 + kk])
        if any(g != size for g in got):
            raise RuntimeError(f"batch get missed or short: {got}")

    return get


def _ok(flag: bool) -> str:
    return "ok" if flag else "FAIL"


# -- master ---------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc: what prometheus' process_resident_memory_bytes reports."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def bench_master(cluster: Cluster, budget: Budget) -> list[Row]:
    """Memory per stored object, then batched lookup rate, on the same N small objects."""
    client = _client(cluster, "auto")
    n = budget.master_keys
    keys = [f"m{i:07d}" for i in range(n)]
    payload = np.random.default_rng(3).bytes(SMALL_OBJECT)
    rows: list[Row] = []
    try:
        before = rss_bytes(cluster.master.pid)
        for i0 in range(0, n, LOOKUP_BATCH):
            chunk = keys[i0 : i0 + LOOKUP_BATCH]
            errs = client.batch_put(chunk, [payload] * len(chunk))
            if any(e is not None for e in errs):
                raise RuntimeError(f"small-object put failed: {next(e for e in errs if e)}")
        time.sleep(0.3)  # let the master settle (batched bookkeeping, allocator)
        after = rss_bytes(cluster.master.pid)
        per_obj = (after - before) / n
        rows.append({
            "system": "ours", "path": "master", "op": "memory", "mode": f"n={n}",
            "size_bytes": 0, "gbps": 0.0, "p50_us": 0.0, "p99_us": 0.0,
            "notes": f"master RSS +{(after - before) / 2**20:.1f} MiB for {n} objects of "
                     f"{SMALL_OBJECT} B: {per_obj:.0f} B/object",
            "bytes_per_object": round(per_obj, 1), "objects": n, "object_bytes": SMALL_OBJECT,
            "rss_before": before, "rss_after": after,
        })
        rows.append(_lookup_row(client, keys, budget))
    finally:
        _remove(client, keys)
        client.close()
    return rows


def _lookup_row(client: Any, keys: list[str], budget: Budget) -> Row:
    found: list[bool] = []

    def lookup(r: int, i0: int, kk: int) -> None:
        got = client.exists(keys[i0 : i0 + kk])
        if r == 0:
            found.extend(got)

    # measure() counts "bytes" moved; with size=1 that is keys looked up, so gbps*1e9 = keys/s.
    lookup_budget = Budget(working_set=len(keys), target=10 * len(keys), cap_s=budget.cap_s * 2)
    res = measure(1, LOOKUP_BATCH, len(keys), lookup, lookup_budget)
    rate = res.gbps * 1e9
    ok = len(found) == len(keys) and all(found)
    return {
        "system": "ours", "path": "master", "op": "lookup", "mode": f"batch k={LOOKUP_BATCH}",
        "size_bytes": 0, "gbps": 0.0, "p50_us": round(res.p50_us, 2),
        "p99_us": round(res.p99_us, 2),
        "notes": f"exists() on {LOOKUP_BATCH}-key batches over {len(keys)} keys: {rate:,.0f} "
                 f"lookups/s; p50/p99 per batch; verify={_ok(ok)}",
        "lookups_per_s": round(rate), "k": LOOKUP_BATCH, "keys": len(keys),
        "samples": res.samples, "rounds": res.rounds,
    }
