"""Shared pieces of the store benchmark: sizes, the round-based timer, buffers, child processes.

Every system is timed by the same `measure` so the rows are comparable: rounds over a fixed
working set, one untimed warm-up round, then rounds until enough bytes moved or the per-case
time cap is hit. GB/s is the median over rounds of (round bytes / summed op time), so the
untimed bookkeeping between rounds (deleting keys, re-looking-up) never counts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HOST = "127.0.0.1"
BENCH_DIR = Path(__file__).resolve().parent
SYSTEMS = ("ours", "mooncake", "redis", "tcp-raw", "memcpy")


@dataclass(frozen=True)
class Budget:
    """How much work one case (system x size x op x mode) may do."""

    working_set: int  # bytes touched per round
    target: int  # stop once this many bytes were timed ...
    cap_s: float  # ... or this many seconds passed (after min_rounds)
    min_rounds: int = 3
    master_keys: int = 20_000  # objects for the master lookup / memory rows

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Budget(working_set=64 * MiB, target=256 * MiB, cap_s=0.8, master_keys=20_000)
FULL = Budget(working_set=128 * MiB, target=1 * GiB, cap_s=3.5, master_keys=100_000)


def batch_k(size: int) -> int:
    """Objects per batch in batched rows: 16 MiB per batch, between 4 and 256 objects."""
    return max(4, min(256, (16 * MiB) // size))


def n_items(size: int, budget: Budget) -> int:
    """Objects per round: the working set, but always at least one full batch."""
    return max(batch_k(size), budget.working_set // size)


def fmt_size(size: int) -> str:
    if size >= MiB and size % MiB == 0:
        return f"{size // MiB} MiB"
    if size >= KiB and size % KiB == 0:
        return f"{size // KiB} KiB"
    return f"{size} B"


def parse_size(text: str) -> int:
    """'64KiB' / '1MiB' / '16 MiB' / '4096' -> bytes (binary units only: these are buffers)."""
    t = text.strip().lower().replace(" ", "").removesuffix("b").removesuffix("i")
    units = {"k": KiB, "m": MiB, "g": GiB}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


@dataclass
class Result:
    """One timed direction of one case."""

    gbps: float
    gbps_min: float
    gbps_max: float
    p50_us: float
    p99_us: float
    samples: int
    rounds: int
    moved_bytes: int
    k: int


def measure(
    size: int,
    k: int,
    n: int,
    do_batch: Callable[[int, int, int], None],
    budget: Budget,
    prep_round: Callable[[int | None], None] | None = None,
) -> Result:
    """Time `do_batch(round, first, count)` over rounds of `n` objects, `k` per call.

    `prep_round(r)` runs untimed before round r (r = -1 is the warm-up round) and once more
    with None at the end, so put cases can delete the previous round's keys without the
    deletion being charged to put. Latency samples are per call: per op at k=1, per batch
    otherwise.
    """
    lat_ns: list[int] = []
    per_round: list[float] = []
    moved = 0
    r = -1
    start = time.perf_counter()
    while True:
        if prep_round is not None:
            prep_round(r)
        round_ns = 0
        for i0 in range(0, n, k):
            kk = min(k, n - i0)
            t0 = time.perf_counter_ns()
            do_batch(r, i0, kk)
            dt = time.perf_counter_ns() - t0
            if r >= 0:
                lat_ns.append(dt)
                round_ns += dt
        if r >= 0:
            moved += n * size
            per_round.append(n * size / (max(round_ns, 1) / 1e9))
        r += 1
        enough = moved >= budget.target or time.perf_counter() - start > budget.cap_s
        if r >= budget.min_rounds and enough:
            break
    if prep_round is not None:
        prep_round(None)
    lat_us = np.asarray(lat_ns, dtype=np.float64) / 1e3
    return Result(
        gbps=statistics.median(per_round) / 1e9,
        gbps_min=min(per_round) / 1e9,
        gbps_max=max(per_round) / 1e9,
        p50_us=float(np.percentile(lat_us, 50)),
        p99_us=float(np.percentile(lat_us, 99)),
        samples=len(lat_ns),
        rounds=r,
        moved_bytes=moved,
        k=k,
    )


def make_pools(size: int, n: int, seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    """Random source and zeroed, pre-faulted destination of n objects of `size` bytes.

    Random bytes so no layer can win by compressing; pages faulted in up front so the first
    timed round does not pay for them.
    """
    src = np.frombuffer(np.random.default_rng(seed).bytes(n * size), dtype=np.uint8).copy()
    dst = np.zeros(n * size, dtype=np.uint8)
    dst[::4096] = 1
    return src, dst


def mode_label(k: int) -> str:
    return "qd1" if k == 1 else f"batch k={k}"


def row(
    system: str,
    path: str,
    op: str,
    size: int,
    res: Result,
    notes: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """One output row in the JSON schema the report and the targets read."""
    out: dict[str, Any] = {
        "system": system,
        "path": path,
        "op": op,
        "mode": mode_label(res.k),
        "size_bytes": size,
        "gbps": round(res.gbps, 4),
        "p50_us": round(res.p50_us, 2),
        "p99_us": round(res.p99_us, 2),
        "notes": notes,
        "k": res.k,
        "gbps_min": round(res.gbps_min, 4),
        "gbps_max": round(res.gbps_max, 4),
        "samples": res.samples,
        "rounds": res.rounds,
        "moved_bytes": res.moved_bytes,
    }
    out.update(extra)
    return out


def log(msg: str) -> None:
    print(f"[store_bench] {msg}", flush=True)


# -- networking -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = sock.recv_into(mv[got:], len(mv) - got)
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n


def wait_port(port: int, proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    """Block until something accepts on 127.0.0.1:port; fail early if `proc` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with rc={proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {HOST}:{port} after {timeout_s:.0f}s")


# -- child processes ------------------------------------------------------------------------


class Procs:
    """Every process the benchmark starts, so one `finally` can stop them all.

    Children get their own session: a Ctrl-C reaches only the benchmark, whose cleanup then
    stops them in reverse start order (TERM, then KILL after a grace period), including any
    grandchildren in their process group.
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._procs: list[tuple[str, subprocess.Popen[Any]]] = []
        self._logs: list[TextIO] = []

    def start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        stdout_pipe: bool = False,
        stdin_pipe: bool = False,
    ) -> subprocess.Popen[str]:
        logf = open(self.logdir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop_all
        self._logs.append(logf)
        p = subprocess.Popen(
            args,
            stdout=subprocess.PIPE if stdout_pipe else logf,
            stderr=logf,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
        self._procs.append((name, p))
        return p

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    @staticmethod
    def stop(p: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
        if p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)  # the group this benchmark created for it
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop_all(self) -> None:
        for _, p in reversed(self._procs):
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()
            self.stop(p)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks clean up on `kill` too."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
