"""The multi-host bed of bench/store_fleet_bench.py: a store master on its own emulated host,
storage nodes and worker processes (`store_fleet_worker.py` roles) spawned on others, and what
the rows ask of the features that may or may not have landed (fan-out switch, quotas, P2P).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.multihost_bench import metric_sum
from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.bed import Host
from mooncake_k8s.testbed.cluster import http_ok
from mooncake_k8s.transfer.segments import cluster_tag, reap_stale

MiB = 1 << 20
GiB = 1 << 30

RATE = "1gbit"
LINK_BPS = 1e9 / 8
CLI = [sys.executable, "-m", "mooncake_k8s.cli"]
WORKER = [sys.executable, str(Path(__file__).resolve().with_name("store_fleet_worker.py"))]


@dataclass
class Sizes:
    """What each row moves (full: the issue's sizes; tiny: a dry run of every code path)."""

    block: int = 64 * 46080
    """One KV block: 64 tokens of SmolLM2-135M in float32."""
    blocks: int = 64
    read_s: float = 30.0
    checkpoint: int = 512 * MiB
    fetchers: int = 6
    model_dir: str = ""
    """Row 3's model directory ("" = the real model, prepared as `mooncake up` does)."""
    later_pods: int = 3
    pool: int = 256 * MiB
    tenant_object: int = 1 * MiB
    ssd_bytes: int = 1 * GiB
    ssd_object: int = 4 * MiB
    ssd_dram: int = 64 * MiB
    timeout_s: float = 600.0

    def scaled(self, f: float) -> Sizes:
        """Every byte count times `f` (a dry run at scale; row 3 then uses a synthetic model
        of half the checkpoint's size)."""
        def mb(n: int) -> int:
            return max(1 * MiB, int(n * f)) // 4096 * 4096
        return Sizes(block=mb(self.block * 16) // 16, blocks=self.blocks,
                     read_s=max(5.0, self.read_s * f), checkpoint=mb(self.checkpoint),
                     model_dir="synthetic" if f < 1 else "", pool=mb(self.pool),
                     tenant_object=mb(self.pool) // 256, ssd_bytes=mb(self.ssd_bytes),
                     ssd_object=max(64 << 10, mb(self.ssd_bytes) // 256),
                     ssd_dram=mb(self.ssd_dram), timeout_s=self.timeout_s)

    @staticmethod
    def tiny() -> Sizes:
        return Sizes(block=64 << 10, blocks=64, read_s=3.0, checkpoint=8 * MiB,
                     model_dir="synthetic", later_pods=2, pool=32 * MiB,
                     tenant_object=256 << 10, ssd_bytes=24 * MiB, ssd_object=512 << 10,
                     ssd_dram=16 * MiB, timeout_s=120.0)


# -- the bed --------------------------------------------------------------------------------


@dataclass
class Fleet:
    """One row's bed: a master on host `master`, and whatever the row spawns on other hosts."""

    bed: Testbed
    work: Path
    master_args: list[str] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = field(default_factory=lambda: random.randrange(20000, 30000, 10))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    args: dict[str, list[str]] = field(default_factory=dict)
    rate: str | None = RATE  # every host's link; None: unshaped

    @property
    def master(self) -> str:
        return f"{self.bed.hosts['master'].addr}:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "MOONCAKE_CLUSTER_TOKEN": self.token, "PYTHONUNBUFFERED": "1",
                "MOONCAKE_LOG_FORMAT": "text", "PYTHONSAFEPATH": "1"}

    def host(self, name: str) -> Host:
        return self.bed.hosts.get(name) or self.bed.host(name, rate=self.rate)

    def spawn(self, name: str, host: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.args[name] = argv
        p = self.host(host).spawn(argv, env=self.env(), log=self.work / f"{name}.log")
        self.procs[name] = p
        return p

    def start_master(self) -> None:
        m = self.host("master")
        self.spawn("master", "master", [
            *CLI, "store", "master", "--host", m.addr, "--port", str(self.port),
            "--metrics-port", str(self.port + 1), "--recovery-grace-s", "0",
            *self.master_args])
        self.wait_http("master", f"http://{m.addr}:{self.port + 1}/metrics")

    def master_samples(self, prefix: str) -> dict[str, float]:
        """The master's Prometheus samples whose name starts with `prefix` (labels kept)."""
        m = self.host("master")
        text = m.call(_fetch_text, f"http://{m.addr}:{self.port + 1}/metrics")
        out = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def store_node(self, name: str, host: str, dram: int, *extra: str) -> None:
        """`mooncake store node` on `host` (its own process, as a storage pod), registered."""
        h = self.host(host)
        self.spawn(name, host, [
            *CLI, "store", "node", "--master", self.master, "--host", h.addr,
            "--node-id", name, "--dram-size", str(dram), "--no-prefault",
            "--metrics-port", str(self.port + 2), *extra])
        self.wait_registered(name, host)

    def wait_registered(self, name: str, host: str, timeout: float = 60.0) -> float:
        """Until node `name` on `host` counts a registration; the seconds it took."""
        h, t0 = self.host(host), time.monotonic()
        url = f"http://127.0.0.1:{self.port + 2}/metrics"  # the node binds metrics on loopback
        while time.monotonic() - t0 < timeout:
            self.check(name)
            with contextlib.suppress(OSError):
                if h.call(metric_sum, url, "mooncake_node_registrations_total") >= 1:
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not register; see {self.work / name}.log")

    def wait_http(self, name: str, url: str, timeout: float = 60.0) -> None:
        host = self.host("master") if name == "master" else self.host(name)
        deadline = time.monotonic() + timeout
        while not host.call(http_ok, url):
            self.check(name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not up; see {self.work / name}.log")
            time.sleep(0.1)

    def check(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode}: {self.tail(name)}")

    def tail(self, name: str, n: int = 600) -> str:
        with contextlib.suppress(OSError):
            return (self.work / f"{name}.log").read_text(errors="replace")[-n:].strip()
        return ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        p.wait(timeout=30)

    # -- workers (this file's --worker mode, on a host) ----------------------------------------

    def worker(self, name: str, host: str, role: str, **params: Any) -> None:
        spec = {"role": role, "name": name, "master": self.master, "token": self.token,
                "addr": self.host(host).addr, "work": str(self.work), **params}
        path = self.work / f"{name}.spec.json"
        path.write_text(json.dumps(spec))
        self.spawn(name, host, [*WORKER, str(path)])

    def go(self) -> None:
        (self.work / "go").write_text(str(time.time()))

    def result(self, name: str, timeout: float) -> dict[str, Any]:
        """The worker's result file (waits for it; fails when the worker died first)."""
        path, deadline = self.work / f"{name}.result.json", time.monotonic() + timeout
        while not path.exists():
            p = self.procs[name]
            if p.poll() is not None and not path.exists():
                raise RuntimeError(f"worker {name} exited {p.returncode}: {self.tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {name}: no result in {timeout:.0f}s")
            time.sleep(0.05)
        out: dict[str, Any] = json.loads(path.read_text())
        return out

    def wait_ready(self, names: list[str], timeout: float) -> None:
        for n in names:
            path, deadline = self.work / f"{n}.ready", time.monotonic() + timeout
            while not path.exists():
                self.check(n)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {n} not ready: {self.tail(n)}")
                time.sleep(0.05)


def _fetch_text(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return str(r.read().decode())


@contextlib.contextmanager
def fleet(label: str, master_args: list[str] | None = None,
          rate: str | None = RATE) -> Iterator[Fleet]:
    """A master on its own host, and hosts made on demand with links of `rate` (None:
    unshaped, what the box's CPUs allow)."""
    work = Path(tempfile.mkdtemp(prefix=f"fleet-{label}-"))
    with Testbed() as bed:
        f = Fleet(bed, work, list(master_args or []), rate=rate)
        try:
            f.start_master()
            yield f
        finally:
            (work / "stop").write_text("")
    # what a SIGKILLed node (row 5) left in /dev/shm: this cluster's files of dead owners
    reap_stale(cluster_tag([f.master]))


# -- features present? (other work lands while this is written: each row adapts) -----------


def cli_help(*cmd: str) -> str:
    r = subprocess.run([*CLI, *cmd, "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONSAFEPATH": "1"})
    return r.stdout if r.returncode == 0 else ""


FANOUT_THRESHOLD = 2
"""Lookups of an object per window from one host that add a replica there. The default (8 in
10 s) is never reached here at full size: 2 readers per host each pass over the 180 MiB prefix
about once per 10 s while 6 readers share the source's 1 Gbit/s."""


def fanout_args(on: bool) -> list[str] | None:
    """The master's fan-out switch, on or off; None when the master has none."""
    text = cli_help("store", "master")
    for opt in ("--fanout", "--hot-fanout", "--fan-out"):
        if f"{opt} / --no-{opt[2:]}" in text or f"{opt}/--no-{opt[2:]}" in text:
            if on and "--fanout-threshold" in text:
                return [opt, "--fanout-threshold", str(FANOUT_THRESHOLD)]
            return [opt if on else f"--no-{opt[2:]}"]
    return None


def quota_args(tenant: str, quota: int) -> list[str] | None:
    """The master's flag giving `tenant` a quota of `quota` bytes; None when it has none."""
    text = cli_help("store", "master")
    for opt in ("--tenant-quota", "--quota"):
        if opt + " " in text:
            return [opt, f"{tenant}={quota}"]
    return None


def tenant_put_ok() -> bool:
    from mooncake_k8s.store.client.client import StoreClient

    return "tenant" in inspect.signature(StoreClient.batch_put).parameters


def p2p_present() -> bool:
    return bool(cli_help("p2p"))
