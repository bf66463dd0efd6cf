"""The reference systems the store is compared with: memcpy, raw loopback TCP, Redis, Mooncake.

Adapted from the shared anchor harness (`shared/anchors/kvstore_bench.py`) so our numbers sit
next to the real Mooncake store measured the same way in the same run.

This file is also the entry point of the helper processes (`python bench/_peers.py WORKER ...`):
the raw-TCP server, the Mooncake segment holder and the Mooncake client. Cross-process rows
need a second process, otherwise the kernel or the library can short-circuit the transfer.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
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
    batch_k,
    free_port,
    make_pools,
    measure,
    n_items,
    recv_exact,
    row,
    wait_port,
)

SELF = str(Path(__file__).resolve())
Row = dict[str, Any]

# -- memcpy: the one-core ceiling for any same-host path -------------------------------------


def bench_memcpy(sizes: list[int], budget: Budget) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        n = n_items(size, budget)
        src, dst = make_pools(size, n)
        for op, a, b in (("put", src, dst), ("get", dst, src)):
            res = measure(size, 1, n, _copier(a, b, size), budget)
            ok = bool(np.array_equal(src, dst))
            rows.append(row("memcpy", "local", op, size, res,
                            f"np.copyto 1 thread; verify={_ok(ok)}"))
        del src, dst
    return rows


def _copier(a: np.ndarray, b: np.ndarray, size: int) -> Callable[[int, int, int], None]:
    def copy(r: int, i0: int, k: int) -> None:
        for i in range(i0, i0 + k):
            np.copyto(b[i * size : (i + 1) * size], a[i * size : (i + 1) * size])

    return copy


def _ok(flag: bool) -> str:
    return "ok" if flag else "FAIL"


# -- raw TCP: sendall / recv_into between two processes, no protocol beyond a header -----------

# op (P=put, G=get, Q=quit), object size, object count, index of the first object
_HDR = struct.Struct("!cQII")


def tcp_server_main(port: int, pool_bytes: int) -> None:
    """Echo-free sink/source: puts land in slot i of a pool, gets send slot i back.

    Storing by index lets the client check after a get that it read what it put.
    """
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((HOST, port))
    ls.listen(1)
    print("READY", flush=True)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pool = np.zeros(pool_bytes, dtype=np.uint8).data
    hdr = bytearray(_HDR.size)
    while True:
        recv_exact(conn, memoryview(hdr))
        op, size, count, first = _HDR.unpack(hdr)
        if op == b"Q":
            break
        slots = pool_bytes // size
        for i in range(first, first + count):
            buf = pool[(i % slots) * size : (i % slots + 1) * size]
            if op == b"P":
                recv_exact(conn, buf)
            else:
                conn.sendall(buf)
        if op == b"P":
            conn.sendall(b"A")  # one ack per message batch: the put is "done" when it landed
    conn.close()
    ls.close()


def bench_tcp(sizes: list[int], budget: Budget, procs: Procs) -> list[Row]:
    port = free_port()
    pool_bytes = max(n_items(s, budget) * s for s in sizes)
    srv = procs.start("tcp-server",
                      [sys.executable, SELF, "tcp-server", str(port), str(pool_bytes)],
                      stdout_pipe=True)
    assert srv.stdout is not None
    if srv.stdout.readline().strip() != "READY":  # a connect probe would eat its one accept()
        raise RuntimeError(f"tcp server failed, see {procs.log_path('tcp-server')}")
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rows: list[Row] = []
    ack = memoryview(bytearray(1))
    try:
        for size in sizes:
            n = n_items(size, budget)
            src, dst = make_pools(size, n)
            smv, dmv = src.data, dst.data

            def put(r: int, i0: int, k: int, size: int = size, smv: memoryview = smv) -> None:
                sock.sendall(_HDR.pack(b"P", size, k, i0))
                for i in range(i0, i0 + k):
                    sock.sendall(smv[i * size : (i + 1) * size])
                recv_exact(sock, ack)

            def get(r: int, i0: int, k: int, size: int = size, dmv: memoryview = dmv) -> None:
                sock.sendall(_HDR.pack(b"G", size, k, i0))
                for i in range(i0, i0 + k):
                    recv_exact(sock, dmv[i * size : (i + 1) * size])

            for k in (1, batch_k(size)):
                note = "sendall/recv_into, 1 ack/msg" if k == 1 else f"stream {k} msgs/ack"
                res = measure(size, k, n, put, budget)
                rows.append(row("tcp-raw", "tcp", "put", size, res, note))
                dst[:] = 0
                res = measure(size, k, n, get, budget)
                ok = bool(np.array_equal(src, dst))
                rows.append(row("tcp-raw", "tcp", "get", size, res, f"{note}; verify={_ok(ok)}"))
            del src, dst, smv, dmv
        sock.sendall(_HDR.pack(b"Q", 1, 0, 0))
    finally:
        sock.close()
        procs.stop(srv)
    return rows


# -- Redis: the common answer to "just use a KV store" ----------------------------------------


def start_redis(procs: Procs, logdir: Path) -> tuple[subprocess.Popen[str], int, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not installed (apt-get install redis-server)")
    port = free_port()
    p = procs.start(
        "redis",
        [exe, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no",
         "--protected-mode", "yes", "--dir", str(logdir), "--daemonize", "no"],
    )
    wait_port(port, p)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()
    return p, port, version[2] if len(version) > 2 else "?"


def bench_redis(sizes: list[int], budget: Budget, port: int) -> list[Row]:
    import redis

    r_ = redis.Redis(host=HOST, port=port)
    rows: list[Row] = []
    try:
        for size in sizes:
            rows += _redis_size(r_, size, budget)
    finally:
        r_.close()
    return rows


def _redis_size(r_: Any, size: int, budget: Budget) -> list[Row]:
    n = n_items(size, budget)
    src, _ = make_pools(size, n)
    smv = src.data
    rows: list[Row] = []

    def obj(i: int) -> memoryview:
        return smv[i * size : (i + 1) * size]

    for k in (1, batch_k(size)):
        state: dict[str, Any] = {"keys": [], "round": -1}

        def prep_put(r: int | None, state: dict[str, Any] = state) -> None:
            if r is None:  # check the last timed round landed intact, then clean up
                state["ok"] = r_.get(f"p{state['round']}:{n - 1}") == bytes(obj(n - 1))
            if state["keys"]:
                r_.delete(*state["keys"])
            state["keys"] = [] if r is None else [f"p{r}:{i}" for i in range(n)]
            state["round"] = r

        def put(r: int, i0: int, kk: int, k: int = k) -> None:
            if k == 1:
                r_.set(f"p{r}:{i0}", obj(i0))
                return
            pipe = r_.pipeline(transaction=False)
            for i in range(i0, i0 + kk):
                pipe.set(f"p{r}:{i}", obj(i))
            pipe.execute()

        res = measure(size, k, n, put, budget, prep_put)
        rows.append(row("redis", "tcp", "put", size, res, f"verify={_ok(state['ok'])}"))

        pipe = r_.pipeline(transaction=False)
        for i in range(n):
            pipe.set(f"g:{i}", obj(i))
        pipe.execute()
        got: dict[int, bytes] = {}

        def get(r: int, i0: int, kk: int, k: int = k, got: dict[int, bytes] = got) -> None:
            if k == 1:
                got[i0] = r_.get(f"g:{i0}")
                return
            pipe = r_.pipeline(transaction=False)
            for i in range(i0, i0 + kk):
                pipe.get(f"g:{i}")
            for i, v in enumerate(pipe.execute(), start=i0):
                got[i] = v

        res = measure(size, k, n, get, budget)
        ok = all(got[i] == bytes(obj(i)) for i in range(n))
        got.clear()
        r_.flushall()
        note = "get returns new bytes (no get_into)"
        rows.append(row("redis", "tcp", "get", size, res, f"{note}; verify={_ok(ok)}"))
    return rows


# -- Mooncake: holder process owns the segment, client process moves bytes over TCP -------------


def mooncake_env() -> dict[str, str]:
    """Environment for the wheel's processes; fails with the reason if the wheel is unusable."""
    env = dict(os.environ)
    # Without a LAN address the transfer engine refuses to start unless told to use loopback.
    env["MC_TCP_BIND_ADDRESS"] = HOST
    env.pop("MC_STORE_MEMCPY", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, env=env
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"mooncake wheel not importable: {last}")
    return env


def _mooncake_master_bin() -> str:
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if not found:
        raise RuntimeError("mooncake_master not found "
                           "(pip install mooncake-transfer-engine-non-cuda)")
    return found


def _mc_setup(segment: int, meta_port: int, master_port: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, f"http://{HOST}:{meta_port}/metadata", segment, 256 << 20, "tcp", "",
                     f"{HOST}:{master_port}")
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def mc_holder_main(meta_port: int, master_port: int, segment: int) -> None:
    """Own a segment of the store until the parent closes stdin."""
    store = _mc_setup(segment, meta_port, master_port)
    print("READY", flush=True)
    sys.stdin.read()
    store.close()


def mc_client_main(meta_port: int, master_port: int, sizes: list[int], budget: Budget) -> None:
    """Put into / get from the holder's segment; prints one `RESULT <json rows>` line."""
    store = _mc_setup(0, meta_port, master_port)
    rows: list[Row] = []
    try:
        for size in sizes:
            rows += _mc_size(store, size, budget)
            print(f"progress: mooncake {size} done", file=sys.stderr, flush=True)
    finally:
        print("RESULT " + json.dumps(rows), flush=True)
        store.close()


def _mc_size(store: Any, size: int, budget: Budget) -> list[Row]:
    n = n_items(size, budget)
    src, dst = make_pools(size, n)
    for buf in (src, dst):
        rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer rc={rc}")
    sp, dp = src.ctypes.data, dst.ctypes.data
    rows: list[Row] = []
    for k in (1, batch_k(size)):
        api = "put_from/get_into" if k == 1 else "batch_put_from/batch_get_into"
        state: dict[str, Any] = {"round": -1}

        def prep_put(r: int | None, state: dict[str, Any] = state) -> None:
            if r is None:
                got = store.get(f"p{state['round']}_{n - 1}")
                state["ok"] = bytes(got) == src[(n - 1) * size :].tobytes()
            store.remove_all(True)
            state["round"] = r

        def put(r: int, i0: int, kk: int, k: int = k) -> None:
            if k == 1:
                rc = store.put_from(f"p{r}_{i0}", sp + i0 * size, size)
            else:
                rcs = store.batch_put_from(
                    [f"p{r}_{i}" for i in range(i0, i0 + kk)],
                    [sp + i * size for i in range(i0, i0 + kk)], [size] * kk,
                )
                rc = next((x for x in rcs if x != 0), 0)
            if rc != 0:
                raise RuntimeError(f"mooncake put rc={rc} size={size} k={k}")

        res = measure(size, k, n, put, budget, prep_put)
        rows.append(row("mooncake", "tcp", "put", size, res, f"{api}; verify={_ok(state['ok'])}"))

        store.remove_all(True)
        for i in range(n):
            rc = store.put_from(f"g{i}", sp + i * size, size)
            if rc != 0:
                raise RuntimeError(f"mooncake load put rc={rc}")
        dst[:] = 0

        def get(r: int, i0: int, kk: int, k: int = k) -> None:
            if k == 1:
                ok = store.get_into(f"g{i0}", dp + i0 * size, size) == size
            else:
                got = store.batch_get_into(
                    [f"g{i}" for i in range(i0, i0 + kk)],
                    [dp + i * size for i in range(i0, i0 + kk)], [size] * kk,
                )
                ok = all(x == size for x in got)
            if not ok:
                raise RuntimeError(f"mooncake get failed size={size} k={k}")

        res = measure(size, k, n, get, budget)
        ok = bool(np.array_equal(src, dst))
        store.remove_all(True)
        rows.append(row("mooncake", "tcp", "get", size, res, f"{api}; verify={_ok(ok)}"))
    for buf in (src, dst):
        store.unregister_buffer(buf.ctypes.data)
    return rows


def bench_mooncake(
    sizes: list[int], budget: Budget, procs: Procs, timeout_s: float
) -> tuple[list[Row], list[str]]:
    """Metadata server + master + holder + client, the anchor's "mc-xproc" set-up."""
    env = mooncake_env()
    master_bin = _mooncake_master_bin()
    meta_port = free_port()
    meta = procs.start("mc-metadata", [sys.executable, "-m", "mooncake.http_metadata_server",
                                       "--host", HOST, "--port", str(meta_port)], env)
    wait_port(meta_port, meta)
    master_port, metrics_port = free_port(), free_port()
    master = procs.start("mc-master", [master_bin, f"--rpc_address={HOST}",
                                       f"--rpc_port={master_port}", f"--metrics_host={HOST}",
                                       f"--metrics_port={metrics_port}",
                                       "--enable_metric_reporting=false", "--logtostderr"], env)
    wait_port(master_port, master)
    holder = procs.start(
        "mc-holder", [sys.executable, SELF, "mc-holder", str(meta_port), str(master_port),
                      str(1 << 30)], env, stdout_pipe=True, stdin_pipe=True,
    )
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "READY":
        raise RuntimeError(f"mooncake holder failed, see {procs.log_path('mc-holder')}")
    client = procs.start(
        "mc-client", [sys.executable, SELF, "mc-client", str(meta_port), str(master_port),
                      ",".join(map(str, sizes)), json.dumps(budget.to_json())], env,
        stdout_pipe=True,
    )
    try:
        out, _ = client.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"mooncake client ran past {timeout_s:.0f}s") from e
    results = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    rows: list[Row] = json.loads(results[-1][len("RESULT "):]) if results else []
    notes = [f"mooncake: xproc (holder pid {holder.pid} owns a 1 GiB segment, client pid "
             f"{client.pid} puts/gets over the TCP transport); client rc={client.returncode}"]
    if client.returncode != 0 or not results:
        notes.append(f"mooncake: client FAILED (rc={client.returncode}), see "
                     f"{procs.log_path('mc-client')}")
    for p in (client, holder, master, meta):
        if p.stdin is not None:
            p.stdin.close()
        procs.stop(p, grace_s=20)
    return rows, notes


def mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist}=={version(dist)}"
        except PackageNotFoundError:
            continue
    return "not installed"


def _worker(argv: list[str]) -> None:
    kind, *rest = argv
    if kind == "tcp-server":
        tcp_server_main(int(rest[0]), int(rest[1]))
    elif kind == "mc-holder":
        mc_holder_main(int(rest[0]), int(rest[1]), int(rest[2]))
    elif kind == "mc-client":
        sizes = [int(s) for s in rest[2].split(",")]
        mc_client_main(int(rest[0]), int(rest[1]), sizes, Budget(**json.loads(rest[3])))
    else:
        raise SystemExit(f"unknown worker {kind!r}")


if __name__ == "__main__":
    _worker(sys.argv[1:])
