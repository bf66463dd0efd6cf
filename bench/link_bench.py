#!/usr/bin/env python3
"""Link benchmark: our TCP transfer transport between two emulated hosts, beside the plain link.

Issue 20 item 5 asks KV transfers of 1 MiB and more to reach >= 85% of the configured link rate
at 1 and 10 Gbit/s. Loopback cannot say that (no link, and a same-host peer is a memcpy), so this
runs on the multi-host test bed (`mooncake_k8s.testbed`): host `srv` owns a 128 MiB DRAM segment
served by a `TransferServer`, host `cli` reads from it with a `TransferEngine` forced to TCP, as
host B fetching a prefix that host A computed. Both links are shaped with the same tbf rate
(1gbit, 10gbit) or left unlimited.

Beside each row, the *plain* link measured in the same run between the same two hosts: one TCP
connection with default (autotuned) socket buffers, the client asks for N bytes with an 8-byte
request and `recv_into`s them into a preallocated buffer; the server `sendall`s them from memory.
That is what a simple socket loop gets from the link here, the peer baseline.

Cases (all reads, as a prefix fetch is): one 1 MiB op, one 8 MiB op, one 64 MiB op, and one
batch of 64 ops of 1 MiB (a prompt's KV as blocks; plain: the same 64 MiB as one stream).
MB/s = 1e6 B/s of payload over the summed time of the timed calls (one untimed warm-up call per
case). The wire bytes per rate (bridge counters) say whether the payload crossed once.

Usage: python bench/link_bench.py [--rates 1gbit,10gbit,unlimited] [--seconds 2.0]  (about 70 s)
Needs root and network namespaces (see docs/testbed.md). Writes bench/results/link_bench.json
and .txt.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KiB, MiB = 1 << 10, 1 << 20
TOKEN = "link-bench-token"
SEGMENT = 128 * MiB
BENCH_DIR = Path(__file__).resolve().parent
CASES: list[tuple[str, int, int]] = [  # label, op size, ops per call
    ("1MiB", 1 * MiB, 1),
    ("8MiB", 8 * MiB, 1),
    ("64MiB", 64 * MiB, 1),
    ("64x1MiB batch", 1 * MiB, 64),
]


def rate_bps(rate: str) -> float | None:
    """tc's rate units (decimal: 1gbit = 1e9 bit/s) as bytes per second; None = unlimited."""
    if rate == "unlimited":
        return None
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, mult in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult / 8
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 100mbit or unlimited")


# -- the server host ------------------------------------------------------------------------------


def _plain_serve(lst: socket.socket, payload: memoryview) -> None:
    """The peer baseline's server: per 8-byte request of N, sendall N bytes from memory."""
    while True:
        conn, _ = lst.accept()
        with conn:
            while True:
                req = conn.recv(8, socket.MSG_WAITALL)
                if len(req) < 8:
                    break
                conn.sendall(payload[: struct.unpack("!Q", req)[0]])


def serve(addr: str) -> None:
    """Host `srv`: a TransferServer over one DRAM segment and the plain socket server; prints
    one JSON line with both addresses, runs until SIGTERM (the bed's close), then cleans up."""
    from mooncake_k8s.transfer import Segment, TransferServer

    seg = Segment.create_shm(f"linkbench{os.getpid()}", SEGMENT, replace=True)
    server = TransferServer({seg.desc.name: seg}, addr, 0, TOKEN)
    server.start()
    lst = socket.create_server((addr, 0))
    payload = memoryview(bytearray(os.urandom(1 * MiB)) * 64)
    threading.Thread(target=_plain_serve, args=(lst, payload), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    d = seg.desc
    print(json.dumps({"address": server.address, "plain": [addr, lst.getsockname()[1]],
                      "segment": [d.name, d.tier.value, d.size, d.path]}), flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()
        seg.close()


# -- the client host ------------------------------------------------------------------------------


def _timed(calls: dict[str, Callable[[], object]], nbytes: int,
           seconds: float) -> dict[str, dict[str, Any]]:
    """One untimed warm-up call each, then the systems' calls alternate (so a busy moment of
    the shared machine hits both alike) until each has `seconds` of timed work (at least 3)."""
    for call in calls.values():
        call()
    spent = dict.fromkeys(calls, 0.0)
    cpu = dict.fromkeys(calls, 0.0)
    times: dict[str, list[float]] = {k: [] for k in calls}
    while min(len(t) for t in times.values()) < 3 or min(spent.values()) < seconds:
        for name, call in calls.items():
            c0, t0 = time.process_time(), time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            cpu[name] += time.process_time() - c0
            spent[name] += dt
            times[name].append(dt)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"calls": len(ts), "bytes": nbytes * len(ts), "seconds": spent[name],
                     "mb_s": nbytes * len(ts) / spent[name] / 1e6,
                     "median_mb_s": nbytes / ts[len(ts) // 2] / 1e6,
                     "client_cpu_s_per_gb": cpu[name] / (nbytes * len(ts) / 1e9)}
    return out


def _plain_reader(addr: tuple[str, int], buf: memoryview) -> tuple[Callable[[int], None],
                                                                    socket.socket]:
    sock = socket.create_connection(addr)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(n: int) -> None:
        sock.sendall(struct.pack("!Q", n))
        view, got = buf[:n], 0
        while got < n:
            r = sock.recv_into(view[got:])
            if r == 0:
                raise ConnectionError("plain server closed")
            got += r

    return read, sock


def client(info: dict[str, Any], seconds: float) -> None:
    """Host `cli`: every case over the plain socket, then over our engine; one JSON line."""
    from mooncake_k8s.transfer import Peer, ReadOp, SegmentDesc, Tier, TransferEngine

    name, tier, size, path = info["segment"]
    desc = SegmentDesc(name, Tier(tier), size, path)
    peer = Peer("srv", info["address"], "srv-host")  # another host: TCP, never shm
    view = memoryview(bytearray(64 * MiB))
    plain_read, sock = _plain_reader(tuple(info["plain"]), view)
    rows = []
    with sock, TransferEngine(TOKEN, transport="tcp", host_id="cli-host") as eng:
        for label, op, count in CASES:
            total = op * count
            ops = [ReadOp(desc, i * op, view[i * op : (i + 1) * op]) for i in range(count)]
            timed = _timed({"plain": functools.partial(plain_read, total),
                            "ours": functools.partial(eng.read, peer, ops)}, total, seconds)
            rows.append({"case": label, "bytes_per_call": total, **timed})
    print(json.dumps(rows), flush=True)


# -- the driver -----------------------------------------------------------------------------------


def _wait_line(log: Path, proc: Any, timeout: float, prefix: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        for line in text.splitlines():
            if line.startswith(prefix):
                return line
        if proc.poll() is not None and prefix not in text:
            raise RuntimeError(f"{log.name}: process exited ({proc.returncode}):\n{text[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{log.name}: no {prefix!r} line in {timeout} s")


def run(rates: list[str], seconds: float, workdir: Path) -> dict[str, Any]:
    from mooncake_k8s.testbed import Testbed

    env = dict(os.environ)
    me = str(Path(__file__).resolve())
    results: list[dict[str, Any]] = []
    with Testbed() as bed:
        srv, cli = bed.host("srv"), bed.host("cli")
        slog = workdir / "srv.log"
        sproc = srv.spawn([sys.executable, me, "--serve", srv.addr], env=env, log=slog)
        info = _wait_line(slog, sproc, 60, "{")
        for rate in rates:
            shaped = None if rate == "unlimited" else rate
            srv.shape(rate=shaped)
            cli.shape(rate=shaped)
            clog = workdir / f"cli-{rate}.log"
            before = bed.counters()
            cproc = cli.spawn([sys.executable, me, "--client", info, "--seconds", str(seconds)],
                              env=env, log=clog)
            rows = json.loads(_wait_line(clog, cproc, 120, "["))
            cproc.wait(timeout=30)
            after = bed.counters()
            payload = sum(r["plain"]["bytes"] + r["ours"]["bytes"] for r in rows)
            # warm-up calls move bytes too: one per case and system
            payload += sum(2 * r["bytes_per_call"] for r in rows)
            wire = after["srv"][0] - before["srv"][0]
            results.append({"rate": rate, "rate_bytes_s": rate_bps(rate),
                            "qdisc": srv.qdisc().strip(), "rows": rows,
                            "payload_bytes": payload, "srv_sent_bytes": wire,
                            "wire_over_payload": wire / payload})
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
                       f"kernel {platform.release()}",
            "python": platform.python_version(), "seconds_per_case": seconds,
            "results": results}


def table(doc: dict[str, Any]) -> str:
    """The run as a table: MB/s over all timed calls, then each system's median call."""
    head = (f"{'rate':<10} {'case':<14} {'plain MB/s':>10} {'ours MB/s':>10} "
            f"{'ours %rate':>10} {'plain %rate':>11} {'ours %plain':>11} "
            f"{'p50 plain/ours MB/s':>20}")
    lines = [f"link_bench {doc['date']}  {doc['machine']}  "
             f"({doc['seconds_per_case']} s per case and system)", head, "-" * len(head)]
    for res in doc["results"]:
        bps = res["rate_bytes_s"]
        for r in res["rows"]:
            p, o = r["plain"]["mb_s"], r["ours"]["mb_s"]
            pr = f"{100 * p * 1e6 / bps:.1f}%" if bps else "-"
            orate = f"{100 * o * 1e6 / bps:.1f}%" if bps else "-"
            lines.append(f"{res['rate']:<10} {r['case']:<14} {p:>10.1f} {o:>10.1f} "
                         f"{orate:>10} {pr:>11} {100 * o / p:>10.1f}% "
                         f"{r['plain']['median_mb_s']:>10.1f}/{r['ours']['median_mb_s']:<9.1f}")
        lines.append(f"{'':<10} wire bytes sent by srv / payload = "
                     f"{res['wire_over_payload']:.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit,unlimited")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per case+system")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "link_bench"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.client:
        return client(json.loads(args.client), args.seconds)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="link_bench") as tmp:
        rates = args.rates.split(",")
        for r in rates:
            rate_bps(r)
        doc = run(rates, args.seconds, Path(tmp))
    text = table(doc)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
