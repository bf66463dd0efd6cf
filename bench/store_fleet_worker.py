"""The per-host side of bench/store_fleet_bench.py: one role per process, spawned on an
emulated host (`python bench/store_fleet_worker.py SPEC`).

A role reads its JSON spec, writes `<name>.ready` in the run's work directory when it is set
up, waits for the `go` file where its phase is timed, and writes `<name>.result.json`. Roles
that serve (a storage node in the process, an HTTP server) stay up until the `stop` file.
Clients here use the process's own host id, so a storage node in the same process is "this
host" to them: its replicas are read through shared memory, as a worker reads its own segment.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from mooncake_k8s.common.errors import StoreError
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.store.testing import load_payload

MiB = 1 << 20


class Ctx:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.work = Path(spec["work"])
        self.name: str = spec["name"]
        self.node: StorageNode | None = None

    def ready(self) -> None:
        (self.work / f"{self.name}.ready").write_text("")

    def wait(self, what: str = "go", timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.work / what).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} file")
            time.sleep(0.005)

    def done(self, result: dict[str, Any]) -> None:
        tmp = self.work / f"{self.name}.result.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(self.work / f"{self.name}.result.json")

    def client(self, **kw: Any) -> StoreClient:
        return StoreClient(self.spec["master"], self.spec["token"], **kw)

    def start_node(self, dram: int) -> StorageNode:
        """A storage node in this process, on this host (its segment is `<name>-dram-0`)."""
        node = StorageNode(NodeConfig(master=self.spec["master"], node_id=self.name,
                                      token=self.spec["token"], host=self.spec["addr"],
                                      dram_size=dram, prefault=False))
        node.start()
        if not node.wait_registered(30):
            raise RuntimeError(f"node {self.name} did not register")
        self.node = node
        return node

    def serve_until_stop(self) -> None:
        self.wait("stop", timeout=24 * 3600)
        if self.node is not None:
            self.node.stop()


def keys_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(n)]


# -- row 1: the hot prefix ------------------------------------------------------------------


def role_hold(ctx: Ctx) -> None:
    """A node holding the hot prefix: puts it into its own segment and serves it."""
    s = ctx.spec
    ctx.start_node(s["node_dram"])
    keys = keys_of("hot", s["keys"])
    with ctx.client(replicas=1) as c:
        for i in range(0, len(keys), 8):
            part = keys[i:i + 8]
            errs = c.batch_put(part, [load_payload(k, s["size"]) for k in part], replicas=1,
                               segments=[f"{ctx.name}-dram-0"])
            if any(errs):
                raise RuntimeError(f"put failed: {[e for e in errs if e]}")
    ctx.ready()
    ctx.serve_until_stop()


def role_read(ctx: Ctx) -> None:
    """A reader host: its own node (where fan-out may add replicas) and `clients` readers, each
    reading the whole prefix in batches for `duration` seconds from the go."""
    s = ctx.spec
    ctx.start_node(s["node_dram"])
    keys = keys_of("hot", s["keys"])
    want = {k: load_payload(k, s["size"]) for k in keys}
    clients = [ctx.client(location_cache=False) for _ in range(s["clients"])]
    stats = [{"bytes": 0, "bytes_half": -1, "passes": 0, "wrong": 0, "misses": 0}
             for _ in clients]
    ctx.ready()
    ctx.wait()
    t0 = time.monotonic()
    threads = [threading.Thread(target=_reader, args=(c, keys, want, s, t0, st))
               for c, st in zip(clients, stats, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.monotonic() - t0
    result = {"bytes": sum(st["bytes"] for st in stats), "seconds": secs,
              "bytes_late": sum(st["bytes"] - st["bytes_half"] for st in stats),
              "wrong": sum(st["wrong"] for st in stats),
              "misses": sum(st["misses"] for st in stats),
              "passes": [st["passes"] for st in stats],
              "local_reads": sum(c.local_reads for c in clients),
              "remote_reads": sum(c.remote_reads for c in clients)}
    for c in clients:
        c.close()
    ctx.done(result)
    ctx.serve_until_stop()


def _reader(c: StoreClient, keys: list[str], want: dict[str, bytes], s: dict[str, Any],
            t0: float, st: dict[str, int]) -> None:
    """Reads the prefix in batches of 16 blocks, round and round, until `duration`; the clock
    is checked per batch (a pass of a large prefix at a shared 1 Gbit/s takes seconds)."""
    batches = [keys[i:i + 16] for i in range(0, len(keys), 16)]
    bufs = [bytearray(s["size"]) for _ in range(16)]
    n = 0
    while (now := time.monotonic() - t0) < s["duration"]:
        if st["bytes_half"] < 0 and now >= s["duration"] / 2:
            st["bytes_half"] = st["bytes"]  # the second half: fan-out's replicas are in place
        part = batches[n % len(batches)]
        check = (n // len(batches)) % 4 == 0  # verify every 4th pass (the CPU is shared)
        n += 1
        got = c.batch_get_into(part, bufs[:len(part)])
        for k, m, b in zip(part, got, bufs, strict=False):
            if m is None:
                st["misses"] += 1
                continue
            st["bytes"] += m
            if check and bytes(b[:m]) != want[k]:
                st["wrong"] += 1
    st["passes"] = n // len(batches)
    if st["bytes_half"] < 0:
        st["bytes_half"] = st["bytes"]


# -- rows 2 and 3: a directory to many hosts ------------------------------------------------


def role_http_serve(ctx: Ctx) -> None:
    """The source alone: an HTTP server on the source host serving the directory."""
    port = int(ctx.spec["master"].rsplit(":", 1)[1]) + 5
    root = ctx.spec["dir"]

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=root, **kw)

        def log_message(self, *_a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer((ctx.spec["addr"], port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ctx.ready()
    ctx.serve_until_stop()
    srv.shutdown()


def role_http_get(ctx: Ctx) -> None:
    """Copy every file of the directory from the source's HTTP server (after the go)."""
    s = ctx.spec
    dest = Path(s["dir"])
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    ctx.ready()
    ctx.wait()
    t0 = time.monotonic()
    total = 0
    for name in s["files"]:
        out = dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        with opener.open(f"{s['url']}/{name}", timeout=600) as r, open(out, "wb") as fh:
            while chunk := r.read(1 * MiB):
                fh.write(chunk)
                total += len(chunk)
    ctx.done({"seconds": time.monotonic() - t0, "bytes": total, "rc": 0})


def role_cmd(ctx: Ctx) -> None:
    """Run a command (`mooncake p2p publish|get`), timed from the go (or from ready)."""
    s = ctx.spec
    ctx.ready()
    if s.get("after_go", True):
        ctx.wait()
    t0 = time.monotonic()
    p = subprocess.run(s["argv"], capture_output=True, text=True, timeout=1800)
    secs = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{s['argv'][3:5]} exited {p.returncode}: "
                           f"{(p.stdout + p.stderr)[-800:]}")
    ctx.done({"seconds": secs, "rc": p.returncode, "output": (p.stdout + p.stderr)[-400:]})
    if not s.get("after_go", True):
        ctx.serve_until_stop()  # the publisher's host keeps serving


def role_p2p_publish(ctx: Ctx) -> None:
    """The source host: its storage node, and the directory published into it."""
    from mooncake_k8s.store.p2p.api import publish

    s = ctx.spec
    ctx.start_node(s["node_dram"])
    t0 = time.monotonic()
    with ctx.client() as c:
        publish(s["dir"], s["p2p_name"], client=c)
        ctx.done({"seconds": time.monotonic() - t0, "host_id": c.host_id})
    ctx.ready()
    ctx.serve_until_stop()


def role_p2p_get(ctx: Ctx) -> None:
    """A fetching host: its storage node (kept chunks land there: `keep_segment` picks this
    host's node) and `p2p.get` from the go; the host keeps serving afterwards."""
    from mooncake_k8s.store.p2p.api import get

    s = ctx.spec
    ctx.start_node(s["node_dram"])
    with ctx.client() as c:
        ctx.ready()
        ctx.wait()
        t0 = time.monotonic()
        got = get(s["p2p_name"], s["dir"], client=c, parallel=s.get("parallel", 8))
        secs = time.monotonic() - t0
        k = got.counters
    ctx.done({"seconds": secs, "fetched": k.fetched, "kept": k.kept, "corrupt": k.corrupt,
              "by_host": k.by_host, "host_id": c.host_id, "keep_failures": c.keep_failures,
              "last_keep_error": c.last_keep_error[:200]})
    ctx.serve_until_stop()


# -- row 4: tenants -------------------------------------------------------------------------


def _tenant_kw(tenant: str) -> dict[str, str]:
    return {"tenant": tenant} if tenant else {}


def read_back(c: Any, keys: list[str], size: int) -> tuple[int, int]:
    """Every key read back: (how many were found, how many of those held wrong bytes)."""
    found = wrong = 0
    buf = bytearray(size)
    for k in keys:
        try:
            n = c.get_into(k, buf)
        except StoreError:
            continue
        found += 1
        wrong += bytes(buf[:n]) != load_payload(k, size)
    return found, wrong


def role_tenant_b(ctx: Ctx) -> None:
    """Tenant B: puts its working set, then reads it (a pass every 0.2 s at most) during A's
    flood and once after it: the fractions of its gets that hit."""
    s = ctx.spec
    keys = keys_of("b", s["keys"])
    with ctx.client(replicas=1, location_cache=False) as c:
        for k in keys:
            errs = c.batch_put([k], [load_payload(k, s["size"])], replicas=1,
                               **_tenant_kw(s["tenant"]))
            if errs[0] is not None:
                raise RuntimeError(f"B's put failed: {errs[0]}")
        ctx.ready()
        ctx.wait()
        hits = reads = 0
        while not (ctx.work / "flood-done").exists():
            t = time.monotonic()
            got = c.exists(keys)
            hits, reads = hits + sum(got), reads + len(got)
            time.sleep(max(0.0, 0.2 - (time.monotonic() - t)))
        after, wrong = read_back(c, keys, s["size"])
    ctx.done({"during_hit": hits / reads if reads else 1.0, "after_hit": after / len(keys),
              "wrong": wrong, "keys": len(keys)})


def role_flood(ctx: Ctx) -> None:
    """Tenant A: puts `bytes` of new objects as fast as it can from the go."""
    s = ctx.spec
    n = max(1, s["bytes"] // s["size"]) if s["bytes"] else 0
    payload = load_payload("flood", s["size"])
    acked = failed = 0
    ctx.ready()
    ctx.wait()
    t0 = time.monotonic()
    with ctx.client(replicas=1) as c:
        for i in range(0, n, 8):
            part = [f"a-{j:06d}" for j in range(i, min(n, i + 8))]
            errs = c.batch_put(part, [payload] * len(part), replicas=1,
                               **_tenant_kw(s["tenant"]))
            acked += sum(e is None for e in errs)
            failed += sum(e is not None for e in errs)
    ctx.done({"puts": n, "acked": acked, "failed": failed, "seconds": time.monotonic() - t0})


# -- row 5: restart -------------------------------------------------------------------------


def role_fill(ctx: Ctx) -> None:
    """Puts `keys` objects into the one node (DRAM fills and spills to SSD); waits until the
    spills settle; reports bytes per tier."""
    s = ctx.spec
    keys = keys_of("ssd", s["keys"])
    acked = 0
    with ctx.client(replicas=1) as c:
        for i in range(0, len(keys), 4):
            part = keys[i:i + 4]
            errs = c.batch_put(part, [load_payload(k, s["size"]) for k in part], replicas=1)
            acked += sum(e is None for e in errs)
        last, stable = -1, 0
        while stable < 10:  # spills are copies in the background: wait for them to settle
            used = {t: sum(g.used for g in c.segments() if g.tier == t) for t in ("dram", "ssd")}
            stable = stable + 1 if used["ssd"] == last else 0
            last = used["ssd"]
            time.sleep(0.2)
        listed = sum(c.exists(keys))
        infos = c.locate(keys)
        on_ssd = sum(1 for i in infos
                     if i and any(str(loc.segment.tier.value) == "ssd" for loc in i.replicas))
    ctx.done({"acked": acked, "listed": listed, "ssd_used": used["ssd"],
              "dram_used": used["dram"], "ssd_objects": on_ssd})


def role_check(ctx: Ctx) -> None:
    """After the restart: polls until the listed objects stop changing for `settle_s` (or all
    are listed), then reads every listed object back and verifies it."""
    s = ctx.spec
    keys = keys_of("ssd", s["keys"])
    with ctx.client(replicas=1, location_cache=False) as c:
        ctx.ready()
        ctx.wait()  # the go: the node was started again and has registered (or died)
        s["t0"] = float((ctx.work / "t0").read_text())
        listed, since, adopt_s = 0, time.monotonic(), None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                now = sum(c.exists(keys))
                if now != listed:
                    listed, since = now, time.monotonic()
                    adopt_s = time.time() - s["t0"]
            if listed == len(keys) or time.monotonic() - since > s["settle_s"]:
                break
            time.sleep(0.05)
        found, wrong = read_back(c, keys, s["size"])
        verified = found - wrong
    ctx.done({"listed": listed, "adopt_s": adopt_s if listed else None, "verified": verified,
              "wrong": wrong})


ROLES = {"hold": role_hold, "read": role_read, "http_serve": role_http_serve,
         "http_get": role_http_get, "cmd": role_cmd, "tenant_b": role_tenant_b,
         "flood": role_flood, "p2p_publish": role_p2p_publish, "p2p_get": role_p2p_get,
         "fill": role_fill, "check": role_check}


def _exit_on_term(_sig: int, _frame: object) -> None:
    raise SystemExit(0)  # the bed ends a worker with SIGTERM: stop its node (frees /dev/shm)


def run_worker(spec_path: Path) -> int:
    signal.signal(signal.SIGTERM, _exit_on_term)
    spec = json.loads(spec_path.read_text())
    ctx = Ctx(spec)
    try:
        ROLES[spec["role"]](ctx)
    finally:
        if ctx.node is not None:
            with contextlib.suppress(Exception):
                ctx.node.stop()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(run_worker(Path(sys.argv[1])))
