"""Deployments to measure: an existing server, or `mooncake up` started by the benchmark.

The issue asks for a baseline "the same deployment with the store disabled" measured in the
same run, which an existing server cannot give us, so by default the benchmark launches
`mooncake up` itself, once with the prefix cache and once with `--no-prefix-cache`, one after
the other (never both at once: on a 2-core box they would steal each other's CPU and the
comparison would be about scheduling noise). It goes through the real CLI in a child process,
exactly what a user runs, rather than importing the cluster code: the benchmark must measure
the product, not a test harness.

Each launch gets a fresh free port, its own session (process group) and a log file; readiness
is `GET /readyz == 200`; stopping is SIGTERM to `mooncake up` (which stops its children) and a
wait, then TERM/KILL to whatever of its process tree is left after the grace period.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.serve import client

HOST = "127.0.0.1"
LOG_TAIL = 40  # lines of a failed deployment's log shown to the user


@dataclass(frozen=True)
class Target:
    """A server to measure and how we got it."""

    base_url: str
    label: str  # "cache" or "baseline"
    launched: bool
    log_path: str | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def default_command() -> list[str]:
    """How to run the `mooncake` CLI: this interpreter when it has the package, else PATH."""
    if importlib.util.find_spec("mooncake_k8s") is not None:
        return [sys.executable, "-m", "mooncake_k8s.cli"]
    found = shutil.which("mooncake")
    if found:
        return [found]
    raise RuntimeError("cannot launch a deployment: the `mooncake_k8s` package is not "
                       "importable and `mooncake` is not on PATH (install the project, or pass "
                       "--base-url for a running server)")


def ready(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/readyz", timeout=timeout_s) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, n: int = LOG_TAIL) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may contain spaces
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> list[tuple[int, int]]:
    """Every process below `root` as (pid, start time): the components `mooncake up` started.

    They run in sessions of their own, so signalling our process group does not reach them;
    the start time guards against signalling a recycled pid later.
    """
    parent_of: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _proc_stat(int(entry))) is not None:
                parent_of[int(entry)] = st
    found: list[tuple[int, int]] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parent_of.items():
            if ppid == parent:
                found.append((pid, started))
                frontier.append(pid)
    return found


def _alive(pid: int, started: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[1] == started


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM `mooncake up`, wait for it to stop its components; force only what is left.

    The component list is taken before signalling: once `mooncake up` exits, its children are
    re-parented and could no longer be found.
    """
    kids = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"  mooncake up (pid {proc.pid}) still running after {grace_s:.0f} s; "
                  "stopping its processes directly", file=sys.stderr)
    left = [(pid, st) for pid, st in kids if _alive(pid, st)]
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 3.0)):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # start_new_session=True: this group is ours alone
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            left = [(pid, st) for pid, st in left if _alive(pid, st)]
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.2)
            elif not left:
                return
            else:
                time.sleep(0.2)
    if proc.poll() is None or left:
        print(f"  could not stop every process of mooncake up (pid {proc.pid}): "
              f"{[pid for pid, _ in left]}", file=sys.stderr)


@contextlib.contextmanager
def launch(label: str, *, command: Sequence[str], up_args: Sequence[str], log_dir: Path,
           ready_timeout_s: float) -> Iterator[Target]:
    """Start `mooncake up` on a free port, yield once /readyz is 200, always stop it."""
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"up-{label}.log"
    argv = [*command, "up", "--host", HOST, "--port", str(port),
            "--log-dir", str(log_dir / f"components-{label}"), *up_args]
    print(f"  launching ({label}): {shlex.join(argv)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not ready(base_url):
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake up ({label}) exited with {proc.returncode} before "
                                   f"it was ready; last lines of {log_path}:\n{_tail(log_path)}")
            if time.monotonic() - t0 > ready_timeout_s:
                raise RuntimeError(f"mooncake up ({label}) not ready after {ready_timeout_s:.0f}"
                                   f" s; last lines of {log_path}:\n{_tail(log_path)}")
            time.sleep(1.0)
        print(f"  {label} ready at {base_url} after {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
        yield Target(base_url, label, launched=True, log_path=str(log_path))
    finally:
        stop(proc)


@contextlib.contextmanager
def attach(label: str, base_url: str) -> Iterator[Target]:
    """An existing server: nothing to start or stop."""
    yield Target(base_url.rstrip("/"), label, launched=False)


async def discover(base_url: str, api_key: str | None) -> dict[str, Any]:
    """The served model's name and context length from `GET /v1/models`."""
    async with aiohttp.ClientSession() as session:
        doc = await client.get_json(session, base_url.rstrip("/") + "/v1/models", api_key)
    models = doc.get("data") or [] if isinstance(doc, dict) else []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    first = models[0]
    ctx = first.get("max_model_len") or first.get("context_length")
    return {"model": str(first.get("id")), "max_model_len": int(ctx) if ctx else None}


async def scrape(base_url: str) -> str | None:
    """The server's Prometheus metrics text, or None when it has none."""
    async with aiohttp.ClientSession() as session:
        return await client.get_text(session, base_url.rstrip("/") + "/metrics")
