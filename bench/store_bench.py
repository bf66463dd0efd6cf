#!/usr/bin/env python3
"""Store benchmark: our KV store beside the real Mooncake store, Redis and the raw ceilings.

Measures put/get throughput (GB/s, 1 GB = 1e9 B) and p50/p99 latency for KV-cache-block sized
objects on one host over loopback, all systems in one run so they share the machine's noise:

  memcpy    np.copyto between preallocated buffers: the one-core ceiling of any same-host path
  tcp-raw   two processes, sendall/recv_into: the loopback TCP ceiling
  redis     redis-server (no persistence) with redis-py + hiredis
  mooncake  mooncake-transfer-engine wheel, the anchor's "mc-xproc" set-up: a holder process
            owns the segment, a client process puts/gets over the TCP transport
  ours      master + one storage node started via the CLI; the client runs in this process,
            with transport forced to shm and to tcp; plus master lookup rate and memory

Then it evaluates the project's targets from the same run and prints PASS/MISS for each.

Mooncake's transfer-engine listeners bind 0.0.0.0 whatever it is told, so when Mooncake is
selected the whole benchmark re-executes itself inside a private network namespace
(`unshare -n`, loopback only). If that is impossible the Mooncake rows are skipped.

Usage:
  python bench/store_bench.py [--quick] [--json [OUT.json]] [--only ours,mooncake,...]
                              [--sizes 64KiB,1MiB,16MiB]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Run as a script: make the `bench` package importable. Appended, not prepended, so the repo
# root (it holds an `operator/` directory) cannot shadow the standard library.
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench import _ours, _peers
from bench._common import (
    BENCH_DIR,
    FULL,
    QUICK,
    SYSTEMS,
    Budget,
    MiB,
    Procs,
    fmt_size,
    log,
    parse_size,
    sigterm_as_interrupt,
)

Row = dict[str, Any]
SELF = str(Path(__file__).resolve())
NETNS_ENV = "STORE_BENCH_IN_NETNS"
DEFAULT_SIZES = "64KiB,1MiB,16MiB"
# Throughput targets are about large transfers; 64 KiB is judged on latency instead.
THROUGHPUT_SIZES = (1 * MiB, 16 * MiB)
LATENCY_SIZE = 64 * 1024
MASTER_LOOKUPS_TARGET = 100_000


# -- network namespace ----------------------------------------------------------------------


def isolated_netns() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def bring_lo_up() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)


def enter_netns_or_reason(only: set[str]) -> str | None:
    """Re-exec inside `unshare -n` when Mooncake runs; returns why Mooncake must be skipped.

    Returns None when it is fine to go on in this process (already isolated, or Mooncake not
    selected). Does not return when it re-executed: it exits with the child's status.
    """
    if "mooncake" not in only:
        return None
    if isolated_netns():
        try:
            bring_lo_up()
        except (OSError, subprocess.CalledProcessError) as e:
            return f"cannot bring lo up in the private namespace: {e}"
        return None
    if os.environ.get(NETNS_ENV):
        return "re-exec under unshare -n did not isolate the network"
    if shutil.which("unshare") is None:
        return "unshare not found"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = probe.stderr.strip() or f"rc={probe.returncode}"
        return f"unshare -n failed ({why}); it needs root or CAP_SYS_ADMIN"
    log("re-executing inside a private network namespace (unshare -n), loopback only")
    sys.exit(_run_child(["unshare", "-n", "--", sys.executable, SELF, *sys.argv[1:]],
                        dict(os.environ, **{NETNS_ENV: "1"})))


def _run_child(args: list[str], env: dict[str, str]) -> int:
    """Run the namespaced copy; on Ctrl-C / TERM let it clean up its processes before exiting."""
    child = subprocess.Popen(args, env=env)
    with sigterm_as_interrupt():
        try:
            return child.wait()
        except KeyboardInterrupt:
            # The terminal's SIGINT reached the child too; a TERM covers `kill` of us alone.
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
            return 130


# -- running the systems ----------------------------------------------------------------------


@dataclass
class Run:
    sizes: list[int]
    budget: Budget
    procs: Procs
    rows: list[Row]
    notes: list[str]
    unavailable: dict[str, str]
    started: float

    def section(self, name: str, fn: Callable[[], list[Row]]) -> None:
        """Run one system; a failure skips its rows with a printed reason, never the run."""
        t0 = time.monotonic()
        try:
            got = fn()
        except KeyboardInterrupt:
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            self.unavailable[name] = reason
            log(f"{name}: SKIPPED ({reason})")
            return
        self.rows += got
        log(f"{name}: {len(got)} rows in {time.monotonic() - t0:.0f}s "
            f"(t={time.time() - self.started:.0f}s)")


def run_all(run: Run, only: set[str], mooncake_skip: str | None) -> None:
    if "memcpy" in only:
        run.section("memcpy", lambda: _peers.bench_memcpy(run.sizes, run.budget))
    if "tcp-raw" in only:
        run.section("tcp-raw", lambda: _peers.bench_tcp(run.sizes, run.budget, run.procs))
    if "redis" in only:
        run.section("redis", lambda: _redis(run))
    if "mooncake" in only:
        if mooncake_skip:
            run.unavailable["mooncake"] = mooncake_skip
            log(f"mooncake: SKIPPED ({mooncake_skip})")
        else:
            run.section("mooncake", lambda: _mooncake(run))
    if "ours" in only:
        _run_ours(run)


def _redis(run: Run) -> list[Row]:
    proc, port, version = _peers.start_redis(run.procs, run.procs.logdir)
    import redis

    try:
        import hiredis

        parser = f"hiredis {hiredis.__version__}"
    except ImportError:
        parser = "pure-python parser"
    run.notes.append(f"redis: redis-server {version}, redis-py {redis.__version__} ({parser}), "
                     "no persistence")
    try:
        return _peers.bench_redis(run.sizes, run.budget, port)
    finally:
        run.procs.stop(proc)  # free the core for the systems measured after it


def _mooncake(run: Run) -> list[Row]:
    cases = len(run.sizes) * 4 * 2  # sizes x (qd1, batch) x (put, get) x rounds slack
    timeout = 90 + cases * (run.budget.cap_s + 3) * 2
    rows, notes = _peers.bench_mooncake(run.sizes, run.budget, run.procs, timeout)
    run.notes.append(f"mooncake: {_peers.mooncake_version()}")
    run.notes += notes
    if not rows:
        raise RuntimeError(notes[-1])
    return rows


def _run_ours(run: Run) -> None:
    why = _ours.client_available()
    if why is not None:
        run.unavailable["ours"] = f"mooncake_k8s.store.client not importable ({why})"
        log(f"ours: SKIPPED ({run.unavailable['ours']})")
        return
    try:
        cluster = _ours.start_cluster(run.procs)
    except Exception as e:
        run.unavailable["ours"] = f"cluster did not start: {type(e).__name__}: {e}"
        log(f"ours: SKIPPED ({run.unavailable['ours']})")
        return
    run.notes.append(f"ours: master {cluster.address} pid {cluster.master.pid}, node pid "
                     f"{cluster.node.pid} (1 GiB DRAM), client in the benchmark process "
                     f"pid {os.getpid()}")
    for transport in ("shm", "tcp"):
        run.section(f"ours-{transport}",
                    functools.partial(_ours.bench_data, cluster, transport, run.sizes,
                                      run.budget, run.notes))
    run.section("ours-master", lambda: _ours.bench_master(cluster, run.budget))


# -- report -----------------------------------------------------------------------------------

_SYS_ORDER = {s: i for i, s in enumerate(reversed(SYSTEMS))}
_OP_ORDER = {"put": 0, "get": 1, "get-cold": 2, "memory": 3, "lookup": 4}


def _sort_key(r: Row) -> tuple[Any, ...]:
    return (r["path"] == "master", r["size_bytes"], _SYS_ORDER.get(r["system"], 9), r["path"],
            _OP_ORDER.get(r["op"], 9), r.get("k", 1))


def print_table(rows: list[Row]) -> None:
    cols = ("system", "path", "op", "mode", "size", "GB/s", "p50 us", "p99 us")
    widths = (8, 6, 8, 13, 6, 7, 9, 9)
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=False)) + " | notes")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|------")
    for r in sorted(rows, key=_sort_key):
        master = r["path"] == "master"
        cells = (
            r["system"], r["path"], r["op"], r["mode"],
            "-" if master else fmt_size(r["size_bytes"]),
            "-" if master else f"{r['gbps']:.2f}",
            "-" if r["op"] == "memory" else f"{r['p50_us']:.1f}",
            "-" if r["op"] == "memory" else f"{r['p99_us']:.1f}",
        )
        left = [str(c).ljust(w) if i < 4 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        print("| " + " | ".join(left) + " | " + r.get("notes", ""))


@dataclass
class Target:
    name: str
    verdict: str  # PASS / MISS / N/A
    measured: str
    values: dict[str, Any]


def _find(rows: list[Row], system: str, path: str, op: str, size: int,
          mode: str | None = None) -> list[Row]:
    return [r for r in rows if r["system"] == system and r["path"] == path and r["op"] == op
            and r["size_bytes"] == size and (mode is None or r["mode"] == mode)]


def _best(rows: list[Row], system: str, path: str, op: str, size: int) -> Row | None:
    found = _find(rows, system, path, op, size)
    return max(found, key=lambda r: r["gbps"]) if found else None


def _ratio_target(name: str, ours: Row | None, ref: Row | None, need: float,
                  ref_label: str) -> Target:
    if ours is None or ref is None:
        missing = "ours" if ours is None else ref_label
        return Target(name, "N/A", f"no {missing} row", {})
    ratio = ours["gbps"] / ref["gbps"] if ref["gbps"] else float("inf")
    verdict = "PASS" if ratio >= need else "MISS"
    text = (f"ours {ours['gbps']:.2f} GB/s ({ours['mode']}) vs {ref_label} {ref['gbps']:.2f} "
            f"GB/s ({ref['mode']}) = {ratio:.2f}x, need >= {need:g}x")
    return Target(name, verdict, text, {"ours_gbps": ours["gbps"], "ref_gbps": ref["gbps"],
                                        "ratio": round(ratio, 3), "need": need})


def evaluate_targets(rows: list[Row], sizes: list[int]) -> list[Target]:
    out: list[Target] = []
    for size in (s for s in THROUGHPUT_SIZES if s in sizes):
        label = fmt_size(size)
        tcp = _best(rows, "ours", "tcp", "get", size)
        shm = _best(rows, "ours", "shm", "get", size)
        mc = _best(rows, "mooncake", "tcp", "get", size)
        out.append(_ratio_target(f"tcp get {label} >= 1.2x mooncake", tcp, mc, 1.2,
                                 "mooncake (best of qd1/batch)"))
        out.append(_ratio_target(f"tcp get {label} >= 85% tcp-raw", tcp,
                                 _best(rows, "tcp-raw", "tcp", "get", size), 0.85,
                                 "tcp-raw (best of qd1/stream)"))
        out.append(_ratio_target(f"shm get {label} >= 2.5x mooncake", shm, mc, 2.5,
                                 "mooncake (best of qd1/batch)"))
        out.append(_ratio_target(f"shm get {label} >= 65% memcpy", shm,
                                 _best(rows, "memcpy", "local", "get", size), 0.65, "memcpy"))
    if LATENCY_SIZE in sizes:
        out += _latency_targets(rows)
    out += _put_targets(rows, sizes)
    out += _tail_targets(rows, sizes)
    out.append(_master_target(rows))
    return out


def _latency_targets(rows: list[Row]) -> list[Target]:
    mc = _find(rows, "mooncake", "tcp", "get", LATENCY_SIZE, "qd1")
    out = []
    for path in ("tcp", "shm"):
        name = f"{path} get 64 KiB p50 <= mooncake's"
        ours = _find(rows, "ours", path, "get", LATENCY_SIZE, "qd1")
        if not ours or not mc:
            out.append(Target(name, "N/A", f"no {'ours' if not ours else 'mooncake'} row", {}))
            continue
        a, b = ours[0]["p50_us"], mc[0]["p50_us"]
        out.append(Target(name, "PASS" if a <= b else "MISS",
                          f"ours qd1 p50 {a:.1f} us vs mooncake qd1 p50 {b:.1f} us",
                          {"ours_p50_us": a, "mooncake_p50_us": b}))
    return out


def _put_targets(rows: list[Row], sizes: list[int]) -> list[Target]:
    """Issue 10's small puts: 64 KiB and 1 MiB put p50 no worse than Mooncake's (qd1), and a
    batch of 256 x 64 KiB at >= 2x Mooncake's batch put. Ours: the better of shm and tcp
    (a client on the node's host takes shm, as every engine beside its node does)."""
    out = []
    for size in (s for s in (LATENCY_SIZE, 1 << 20) if s in sizes):
        label = fmt_size(size)
        name = f"put {label} p50 <= mooncake's"
        mc = _find(rows, "mooncake", "tcp", "put", size, "qd1")
        ours = [r for path in ("shm", "tcp") for r in _find(rows, "ours", path, "put", size,
                                                             "qd1")]
        if not ours or not mc:
            out.append(Target(name, "N/A", f"no {'ours' if not ours else 'mooncake'} row", {}))
            continue
        best = min(ours, key=lambda r: r["p50_us"])
        a, b = best["p50_us"], mc[0]["p50_us"]
        out.append(Target(name, "PASS" if a <= b else "MISS",
                          f"ours {best['path']} qd1 p50 {a:.1f} us vs mooncake qd1 p50 {b:.1f} us"
                          f" = {a / b:.2f}x", {"ours_p50_us": a, "mooncake_p50_us": b}))
    if LATENCY_SIZE in sizes:
        mode = "batch k=256"
        ours_b = [r for path in ("shm", "tcp")
                  for r in _find(rows, "ours", path, "put", LATENCY_SIZE, mode)]
        best_b = max(ours_b, key=lambda r: r["gbps"]) if ours_b else None
        mc_b = _find(rows, "mooncake", "tcp", "put", LATENCY_SIZE, mode)
        out.append(_ratio_target(f"put 64 KiB {mode} >= 2x mooncake", best_b,
                                 mc_b[0] if mc_b else None, 2.0, "mooncake"))
    return out


def _tail_targets(rows: list[Row], sizes: list[int]) -> list[Target]:
    """p99 <= 3x p50 for our qd1 put and get rows (per-op latency; batch rows time batches)."""
    out = []
    for path in ("shm", "tcp"):
        for op in ("put", "get"):
            found = [r for s in sizes for r in _find(rows, "ours", path, op, s, "qd1")]
            name = f"{path} {op} p99 <= 3x p50 (qd1, every size)"
            if not found:
                out.append(Target(name, "N/A", "no ours rows", {}))
                continue
            ratios = {fmt_size(r["size_bytes"]): r["p99_us"] / max(r["p50_us"], 1e-9)
                      for r in found}
            ok = all(v <= 3.0 for v in ratios.values())
            text = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
            out.append(Target(name, "PASS" if ok else "MISS", text,
                              {"p99_over_p50": {k: round(v, 2) for k, v in ratios.items()}}))
    return out


def _master_target(rows: list[Row]) -> Target:
    name = f"master >= {MASTER_LOOKUPS_TARGET // 1000}k lookups/s"
    found = [r for r in rows if r["system"] == "ours" and r["op"] == "lookup"]
    if not found:
        return Target(name, "N/A", "no master lookup row", {})
    rate = found[0]["lookups_per_s"]
    return Target(name, "PASS" if rate >= MASTER_LOOKUPS_TARGET else "MISS",
                  f"{rate:,.0f} lookups/s (exists, 1000-key batches)", {"lookups_per_s": rate})


def print_targets(targets: list[Target]) -> None:
    print("\n## targets (same run)")
    width = max((len(t.name) for t in targets), default=10)
    for t in targets:
        print(f"  {t.verdict:<4}  {t.name:<{width}}  {t.measured}")
    counts = {v: sum(t.verdict == v for t in targets) for v in ("PASS", "MISS", "N/A")}
    print(f"  -- {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['N/A']} N/A")


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smaller working sets and per-case caps (< 5 min on 2 cores)")
    ap.add_argument("--json", nargs="?", const="auto", default=None, metavar="OUT.json",
                    help="write rows/targets/meta as JSON; without a path: bench/results/")
    ap.add_argument("--only", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="object sizes, e.g. 64KiB,1MiB")
    a = ap.parse_args(argv)
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    unknown = only - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    a.only_set = only
    try:
        a.size_list = sorted({parse_size(s) for s in a.sizes.split(",") if s.strip()})
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    if not a.size_list or min(a.size_list) < 1:
        ap.error("--sizes needs at least one positive size")
    return a


def _git_head() -> str:
    out = subprocess.run(["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(BENCH_DIR), "status", "--porcelain"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + ("+dirty" if dirty else "")


def _json_path(arg: str, started: float) -> Path:
    if arg != "auto":
        return Path(arg)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    return BENCH_DIR / "results" / f"store_bench-{stamp}.json"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    mooncake_skip = enter_netns_or_reason(a.only_set)
    budget = QUICK if a.quick else FULL
    started = time.time()
    logdir = Path(tempfile.mkdtemp(prefix="store_bench_", dir="/tmp"))
    run = Run(a.size_list, budget, Procs(logdir), [], [], {}, started)
    log(f"{time.strftime('%Y-%m-%d %H:%M:%S')} nproc={os.cpu_count()} "
        f"netns_isolated={isolated_netns()} budget={'quick' if a.quick else 'full'} "
        f"sizes={','.join(fmt_size(s) for s in a.size_list)} logs={logdir}")
    interrupted = False
    with sigterm_as_interrupt():
        try:
            run_all(run, a.only_set, mooncake_skip)
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: stopping every process this benchmark started")
        finally:
            # Cleanup must not itself be interrupted: it is bounded (TERM, then KILL).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            run.procs.stop_all()
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        return 130
    wall = time.time() - started
    targets = evaluate_targets(run.rows, a.size_list)
    print(f"\n## store_bench results ({time.strftime('%Y-%m-%d %H:%M:%S')}, wall {wall:.0f}s, "
          f"{'quick' if a.quick else 'full'}: {budget.working_set // MiB} MiB working set, "
          f"<= {budget.cap_s}s per case)")
    print("GB/s = 1e9 B/s, median over rounds; p50/p99 per op for qd1, per batch of k for "
          "batch rows; get = location-cache hit, get-cold = master lookup on every get\n")
    print_table(run.rows)
    for system, reason in run.unavailable.items():
        print(f"- UNAVAILABLE {system}: {reason}")
    for note in run.notes:
        print(f"- {note}")
    print_targets(targets)
    if a.json:
        path = _json_path(a.json, started)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "wall_s": round(wall, 1), "quick": a.quick, "budget": budget.to_json(),
            "sizes": a.size_list, "only": sorted(a.only_set), "nproc": os.cpu_count(),
            "netns_isolated": isolated_netns(), "python": platform.python_version(),
            "git": _git_head(), "unavailable": run.unavailable, "notes": run.notes,
            "logs": str(logdir),
        }
        doc = {"rows": sorted(run.rows, key=_sort_key),
               "targets": [asdict(t) for t in targets], "meta": meta}
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {path}")
    if not run.unavailable:
        shutil.rmtree(logdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
