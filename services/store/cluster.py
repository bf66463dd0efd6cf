"""A store on loopback as child processes: a master and storage nodes, started the way the
CLI starts them (`mooncake store master`, `mooncake store node`), and clients of it.

`mooncake store demo` runs one to show the data plane; the test harness (`testing.StoreCluster`)
extends it with what tests need (restarts, pauses, waits on metrics). Nothing here is mocked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from mooncake_k8s.common.errors import StoreError
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.procs import Proc
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.client.masterlink import parse_masters
from mooncake_k8s.transfer.segments import cluster_tag, reap_stale


@dataclass
class LocalCluster:
    """Master and nodes as real processes. Use as a context manager."""

    token: str
    master_args: list[str] = field(default_factory=list)
    master_state: bool = True
    """Give the master a --state-dir under `workdir`: a first start is then not gated, and a
    restart waits exactly for the nodes it knew (see `master.recovery`)."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mc-store-")))
    master_port: int = field(default_factory=free_port)
    master: Proc | None = None
    nodes: dict[str, Proc] = field(default_factory=dict)

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, args: list[str], metrics_port: int) -> Proc:
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "mooncake_k8s.cli", "store", *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        return Proc(name, args, popen, log_path, metrics_port)

    def start_master(self, *extra: str) -> Proc:
        mport = free_port()
        args = ["master", "--port", str(self.master_port), "--metrics-port", str(mport),
                *self.master_args, *extra]
        if self.master_state:
            args += ["--state-dir", str(self.workdir / "master-state")]
        self.master = self._spawn("master", args, mport)
        self.wait_master()
        return self.master

    def start_node(
        self, node_id: str, dram_size: str = "64MiB", *extra: str, wait: bool = True
    ) -> Proc:
        mport = free_port()
        args = ["node", "--master", self.master_address, "--node-id", node_id,
                "--dram-size", dram_size, "--metrics-port", str(mport), *extra]
        proc = self._spawn(f"node-{node_id}", args, mport)
        self.nodes[node_id] = proc
        if wait:
            self.wait_nodes(len([n for n in self.nodes.values() if n.alive()]))
        return proc

    def client(self, **kwargs: object) -> StoreClient:
        return StoreClient(self.master_address, self.token, **kwargs)  # type: ignore[arg-type]

    def wait_master(self, timeout: float = 30.0) -> None:
        self._wait(lambda c: c.stats() is not None, timeout, "master")

    def wait_nodes(self, n: int, timeout: float = 30.0) -> None:
        self._wait(lambda c: c.stats().nodes >= n, timeout, f"{n} nodes")

    def _wait(self, ready: Callable[[StoreClient], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with StoreClient(self.master_address, self.token, timeout_s=2) as c:
            while time.monotonic() < deadline:
                if self.master is not None and not self.master.alive():
                    raise RuntimeError(f"master exited:\n{self.master.log()[-3000:]}")
                with contextlib.suppress(StoreError):
                    if ready(c):
                        return
                time.sleep(0.05)
        raise TimeoutError(f"{what} not ready within {timeout}s")

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, sig)
        proc.popen.wait(timeout=15)

    def stop(self) -> None:
        """Stop every process, then remove the shared-memory files of nodes that were killed
        (`kill -9` leaves them; no live owner holds them any more)."""
        for proc in [*self.nodes.values(), *([self.master] if self.master else [])]:
            if proc.alive():
                self.kill(proc, signal.SIGTERM)
        reap_stale(cluster_tag(parse_masters(self.master_address)))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
