#!/usr/bin/env python3
"""What hostile traffic costs the Conductor: CPU and memory per refused request, and decode
tokens generated for clients that hung up.

Starts a local cluster (`mooncake up`'s: 1 prefill, 1 decode, the built-in model), sends each
case `--repeat` times and reads the Conductor's CPU time (utime + stime from /proc) and RSS
around it, and the decode worker's token counter around the hang-ups. An ordinary small
request is the reference row. Numbers are per request, on whatever machine runs it: compare
rows within one run.

Usage:
  python bench/edge_bench.py                 # about 1.5 min on the 2-core dev VM
  python bench/edge_bench.py --json          # also write bench/results/edge_bench.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake_k8s.store.testing import metric_value
from mooncake_k8s.up import LocalCluster, UpConfig

MODEL = b"SmolLM2-135M-Instruct"
RESULTS = Path(__file__).resolve().parent / "results"


def _send(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode() + body


def cases() -> dict[str, bytes]:
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "%%s"}], %%s}' % MODEL
    return {
        "ordinary chat request (2 tokens)": _post("/v1/chat/completions",
                                                  chat % (b"hi", b'"max_tokens": 2')),
        "10 MB body (413)": _post("/v1/completions", b'{"model": "%s", "prompt": "' % MODEL +
                                  b"a" * (10 << 20) + b'"}'),
        "3 MB prompt, fits the body limit (400)": _post(
            "/v1/completions", b'{"model": "%s", "prompt": "' % MODEL +
            b"lorem ipsum " * 250_000 + b'"}'),
        "JSON nested 100,000 deep (400)": _post("/v1/chat/completions",
                                                b"[" * 100_000 + b"]" * 100_000),
        "seed = 2**64 (400)": _post("/v1/chat/completions",
                                    chat % (b"hi", b'"seed": 18446744073709551616')),
        "lone surrogate in content (400)": _post("/v1/chat/completions",
                                                 chat % (b"\\ud800", b'"max_tokens": 2')),
    }


class Conductor:
    def __init__(self, cluster: LocalCluster) -> None:
        self.pid = cluster.procs["conductor"].popen.pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib / 1024


def refusal_rows(cluster: LocalCluster, repeat: int) -> list[dict[str, Any]]:
    conductor = Conductor(cluster)
    rows = []
    for name, request in cases().items():
        _send(cluster.port, request)  # warm-up (lazy imports, first-use allocations)
        cpu0, t0 = conductor.cpu_s(), time.monotonic()
        status = b""
        for _ in range(repeat):
            status = _send(cluster.port, request).split(b" ", 2)[1]
        rows.append({"case": name, "status": int(status),
                     "cpu_ms_per_request": round((conductor.cpu_s() - cpu0) / repeat * 1e3, 1),
                     "wall_ms_per_request": round((time.monotonic() - t0) / repeat * 1e3, 1),
                     "conductor_rss_mb_after": round(conductor.rss_mb())})
    return rows


def hang_up_row(cluster: LocalCluster, hang_ups: int) -> dict[str, Any]:
    def decode(name: str) -> float:
        return metric_value(cluster.procs["decode-0"].metrics(), name)

    def wait(cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.2)

    tokens0, cancelled0 = decode("mooncake_decode_tokens_total"), decode(
        "mooncake_decode_cancelled_total")
    seen = 0
    for i in range(hang_ups):
        body = json.dumps({"model": MODEL.decode(), "prompt": f"Story {i}: once upon a time",
                           "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", cluster.port), timeout=120) as s:
            s.sendall(_post("/v1/completions", body))
            got = b""
            while got.count(b"data:") < 4:
                got += s.recv(65536)
        seen += got.count(b"data:") - 1  # the first event's token comes from prefill
    wait(lambda: decode("mooncake_decode_cancelled_total") >= cancelled0 + hang_ups)
    wait(lambda: decode("mooncake_decode_running") == 0)
    time.sleep(1.0)
    generated = decode("mooncake_decode_tokens_total") - tokens0
    return {"case": f"{hang_ups} streams hung up after 4 events (max_tokens 2000)",
            "decode_tokens_generated": int(generated), "tokens_the_clients_read": seen,
            "wasted_tokens": int(generated - seen),
            "cancelled_at_decode": int(decode("mooncake_decode_cancelled_total") - cancelled0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20, help="requests per refusal case")
    ap.add_argument("--hang-ups", type=int, default=25)
    ap.add_argument("--json", nargs="?", const=str(RESULTS / "edge_bench.json"), default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edge_bench_") as d:
        cfg = UpConfig(port=0, prefill=1, decode=1, store_size=256 << 20, log_dir=d,
                       threads=1, ready_timeout_s=300)
        with LocalCluster(cfg, echo=lambda _m: None) as cluster:
            rows = refusal_rows(cluster, args.repeat)
            hang = hang_up_row(cluster, args.hang_ups)
    lines = [f"{'case':42} {'status':>6} {'CPU ms/req':>10} {'wall ms/req':>11} {'RSS MB':>7}"]
    lines += [f"{r['case']:42} {r['status']:>6} {r['cpu_ms_per_request']:>10} "
              f"{r['wall_ms_per_request']:>11} {r['conductor_rss_mb_after']:>7}" for r in rows]
    lines += ["", f"{hang['case']}: decode generated {hang['decode_tokens_generated']} tokens, "
              f"the clients read {hang['tokens_the_clients_read']}, wasted "
              f"{hang['wasted_tokens']} (cancelled at decode: {hang['cancelled_at_decode']})"]
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.json:
        out = {"rows": rows, "hang_up": hang, "meta": {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "repeat": args.repeat,
            "python": sys.version.split()[0]}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        Path(args.json).with_suffix(".txt").write_text(table)
        print(f"wrote {args.json} and its .txt")


if __name__ == "__main__":
    main()
