"""Test and benchmark helpers for the sidecar, shipped in the package like `store.testing`:
run `mooncake sidecar` as a real process, and build engine-like pages of scattered regions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

REGIONS = 60
"""Regions per page, as SGLang's host KV pool hands them out (one per layer and K/V)."""


def page_bytes(seed: int, i: int, size: int) -> npt.NDArray[np.uint8]:
    """Page i's content for `seed`: the same in every process, so a reader can check it."""
    return np.random.default_rng(seed * 100_003 + i).integers(0, 256, size, dtype=np.uint8)


class Pages:
    """`n` pages of `size` bytes, each split into REGIONS regions scattered through one buffer
    (the pages interleave), which is how an engine's host KV pool lays pages out."""

    def __init__(self, n: int, size: int, fill: int = 0) -> None:
        if size % REGIONS:
            raise ValueError(f"page size must be a multiple of {REGIONS}")
        self.n, self.size, self.region = n, size, size // REGIONS
        self.buf = np.full(n * size, fill, dtype=np.uint8)
        self.base = int(self.buf.ctypes.data)

    def regions(self, i: int) -> list[tuple[int, int]]:
        return [(self.base + (j * self.n + i) * self.region, self.region) for j in range(REGIONS)]

    def all(self) -> list[list[tuple[int, int]]]:
        return [self.regions(i) for i in range(self.n)]

    def content(self, i: int) -> npt.NDArray[np.uint8]:
        return np.concatenate([self.buf[a - self.base : a - self.base + n]
                               for a, n in self.regions(i)])

    def fill_from(self, seed: int, i: int) -> None:
        data = page_bytes(seed, i, self.size)
        for j, (a, n) in enumerate(self.regions(i)):
            self.buf[a - self.base : a - self.base + n] = data[j * n : (j + 1) * n]


@dataclass
class SidecarProc:
    socket: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    token: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
        self.popen.wait(timeout=15)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the sidecar answers `stats` on its socket."""
        from mooncake_k8s.sidecar.client import SidecarPagePool

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"sidecar exited:\n{self.log()[-3000:]}")
            if os.path.exists(self.socket):
                with SidecarPagePool(self.socket, self.token, timeout_s=1.0) as pool:
                    try:
                        pool.stats()
                        return
                    except ConnectionError:
                        pass
            time.sleep(0.05)
        raise TimeoutError(f"sidecar at {self.socket} not ready within {timeout}s")


def start_sidecar(
    socket_path: str, master: str, token: str, log_path: Path, *extra: str, wait: bool = True
) -> SidecarProc:
    """`mooncake sidecar` as a child process (its own session, output to `log_path`)."""
    env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "mooncake_k8s.cli", "sidecar", "--socket", socket_path,
             "--master", master, "--log-format", "text", *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    proc = SidecarProc(socket_path, popen, log_path, token)
    if wait:
        proc.wait_ready()
    return proc
