"""A harness that runs a real store cluster (master + nodes as child processes) on loopback:
`cluster.LocalCluster` with what tests need (restarts, pauses, waits on metrics).

Shipped in the package, like `kopf.testing`, so tests, benchmarks and users' own tests start
the same processes the CLI starts, and nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mooncake_k8s.common.errors import StoreError
from mooncake_k8s.common.netutil import free_port
from mooncake_k8s.common.procs import Proc
from mooncake_k8s.store.client.masterlink import parse_masters
from mooncake_k8s.store.cluster import LocalCluster
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.transfer.segments import cluster_tag, reap_stale


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` whose label set contains `labels` (e.g. 'result="hit"')."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def pause_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP a process and return once every one of its threads is stopped (a signal is
    only a request: a thread inside a system call may still finish it)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                stat = (task / "stat").read_text()
                states.append(stat[stat.rindex(")") + 2])
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {timeout}s")


def _with_metrics_port(args: list[str], port: int) -> list[str]:
    i = args.index("--metrics-port")
    return [*args[: i + 1], str(port), *args[i + 2 :]]


@dataclass
class StoreCluster(LocalCluster):
    """A `LocalCluster` for tests: nodes and the master restarted, paused and waited for."""

    token: str = "test-token"

    def restart_node(self, node_id: str, sig: int = signal.SIGKILL) -> Proc:
        """Kill a node's process and start a new one with the same id and arguments; returns
        once the new process has registered with the master."""
        old = self.nodes[node_id]
        self.kill(old, sig)
        mport = free_port()
        proc = self._spawn(f"node-{node_id}", _with_metrics_port(old.args, mport), mport)
        self.nodes[node_id] = proc
        self.wait_registered(proc)
        return proc

    def wait_registered(self, proc: Proc, timeout: float = 30.0) -> None:
        """Until `proc` (a node) has registered with a master at least once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
            with contextlib.suppress(OSError):
                if metric_value(proc.metrics(), "mooncake_node_registrations_total") >= 1:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{proc.name} did not register within {timeout}s")

    def restart_master(self, *extra: str, wait: bool = True) -> Proc:
        """Kill the master (SIGKILL: no goodbye) and start a new one on the same port."""
        assert self.master is not None
        self.kill(self.master)
        mport = free_port()
        args = [*_with_metrics_port(self.master.args, mport), *extra]
        self.master = self._spawn("master", args, mport)
        if wait:
            self.wait_master()
        return self.master

    def pause(self, proc: Proc) -> None:
        """Freeze `proc` (SIGSTOP) until `resume`: alive to the kernel, silent to everyone."""
        pause_pid(proc.popen.pid)

    def resume(self, proc: Proc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGCONT)

    def wait_inventory(self, objects: int, timeout: float = 30.0) -> None:
        """Until the live nodes' inventories hold `objects` replicas in all: what a restarted
        master can rebuild from (nodes learn commits from the master's command stream)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                held = sum(metric_value(p.metrics(), "mooncake_node_objects")
                           for p in self.nodes.values() if p.alive())
                if held >= objects:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"nodes did not report {objects} objects within {timeout}s")


def start_host_node(cluster: StoreCluster, node_id: str, host_id: str,
                    dram_size: int) -> StorageNode:
    """An in-process storage node of `cluster` that says it lives on `host_id` (an emulated
    host: the master places and reads by host), registered before it is returned."""
    node = StorageNode(NodeConfig(master=cluster.master_address, node_id=node_id,
                                  token=cluster.token, dram_size=dram_size, host_id=host_id,
                                  prefault=False))
    node.start()
    if not node.wait_registered(20):
        node.stop()
        raise StoreError(f"storage node {node_id!r} did not register with the master")
    return node


@contextlib.contextmanager
def store_cluster(
    nodes: int = 1, dram_size: str = "64MiB", token: str = "test-token", **kw: object
) -> Iterator[StoreCluster]:
    """A started cluster with `nodes` nodes named n0, n1, ..."""
    with StoreCluster(token=token) as cluster:
        cluster.start_master(*[str(a) for a in kw.get("master_args", [])])  # type: ignore[attr-defined]
        for i in range(nodes):
            cluster.start_node(f"n{i}", dram_size)
        yield cluster


def load_payload(key: str, size: int) -> bytes:
    """Bytes determined by the key, so any reader can check what it got."""
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@dataclass
class PutGetLoad:
    """Writers put fresh keys and remember what was acknowledged; a reader checks bytes."""

    cluster: StoreCluster
    size: int = 16 << 10
    acked: list[str] = field(default_factory=list)
    wrong: int = 0
    failed_puts: int = 0
    last_ack: float = 0.0
    last_ack_started: float = 0.0  # when the last acknowledged put was sent
    last_read: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    """The reader's own generator: a load thread that outlives a failed test must not move
    the global `random` state under a later test (Hypothesis fails a test whose strategies see
    the global generator change)."""

    def start(self) -> None:
        for w in range(2):
            self.threads.append(threading.Thread(target=self._write, args=(w,), daemon=True))
        self.threads.append(threading.Thread(target=self._read, daemon=True))
        for t in self.threads:
            t.start()

    def _write(self, w: int) -> None:
        with self.cluster.client(timeout_s=5) as c:
            i = 0
            while not self.stop.is_set():
                key = f"w{w}-{i:08d}"
                i += 1
                started = time.monotonic()
                try:
                    c.put(key, load_payload(key, self.size), replicas=1)
                except StoreError:
                    self.failed_puts += 1
                    continue
                self.acked.append(key)
                self.last_ack_started = started
                self.last_ack = time.monotonic()

    def _read(self) -> None:
        with self.cluster.client(timeout_s=5) as c:
            while not self.stop.is_set():
                if not self.acked:
                    time.sleep(0.01)
                    continue
                key = self.rng.choice(self.acked)
                try:
                    if bytes(c.get(key)) != load_payload(key, self.size):
                        self.wrong += 1
                    self.last_read = time.monotonic()
                except StoreError:
                    pass  # unavailable during the failover: retried with another key

    def acks_after(self, t: float, n: int, timeout: float = 30.0) -> float:
        """Wait until `n` puts were acknowledged after time `t`; returns the delay to the
        first acknowledgement of a put sent after `t` (an answer already on its way when the
        master was stopped says nothing about a takeover)."""
        before = len(self.acked)
        deadline = time.monotonic() + timeout
        first = 0.0
        while time.monotonic() < deadline:
            if self.last_ack_started > t and not first:
                first = self.last_ack - t
            if len(self.acked) >= before + n and first:
                return first
            time.sleep(0.01)
        raise TimeoutError("no puts acknowledged after the failover")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def verify_all(self) -> tuple[int, int]:
        """(acknowledged objects missing, objects with wrong bytes) after the load."""
        lost = wrong = 0
        with self.cluster.client(timeout_s=10) as c:
            for key in self.acked:
                try:
                    if bytes(c.get(key)) != load_payload(key, self.size):
                        wrong += 1
                except StoreError:
                    lost += 1
        return lost, wrong


class RedisServer:
    """A throwaway redis-server on loopback (no persistence) for HA tests and benchmarks."""

    def __init__(self, workdir: Path, binary: str = "redis-server") -> None:
        self.port = free_port()
        self.log_path = workdir / "redis.log"
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                 "--appendonly", "no", "--dir", str(workdir)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{self.log_path.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


@dataclass
class HaStoreCluster(StoreCluster):
    """Several masters on one real Redis (`--metadata-backend redis`); nodes and clients are
    given the list of all masters. `master` is whichever was found leading last."""

    redis: RedisServer | None = None
    masters: dict[str, Proc] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    lease_ms: int = 1000

    def __post_init__(self) -> None:
        self.master_state = False
        self.redis = RedisServer(self.workdir)

    @property
    def master_address(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports.values())

    def start_masters(self, names: tuple[str, ...] = ("m0", "m1")) -> None:
        for name in names:
            self.ports[name] = free_port()
        for name in names:
            self.start_ha_master(name)
        self.wait_master()

    def start_ha_master(self, name: str) -> Proc:
        """Start (or restart after it exited) master `name` on its port."""
        assert self.redis is not None
        mport = free_port()
        args = ["master", "--port", str(self.ports[name]), "--metrics-port", str(mport),
                "--metadata-backend", "redis", "--redis-url", self.redis.url,
                "--ha-lease-ms", str(self.lease_ms), *self.master_args]
        proc = self.masters[name] = self._spawn(name, args, mport)
        return proc

    def leader(self, timeout: float = 30.0) -> tuple[str, Proc]:
        """The master that reports itself leader now (waits for one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.masters.items():
                if not proc.alive():
                    continue
                with contextlib.suppress(OSError):
                    if metric_value(proc.metrics(), "mooncake_master_leader") == 1:
                        return name, proc
            time.sleep(0.05)
        raise TimeoutError(f"no master leads within {timeout}s")

    def __enter__(self) -> HaStoreCluster:
        return self

    def stop(self) -> None:
        for proc in [*self.nodes.values(), *self.masters.values()]:
            if proc.alive():
                self.kill(proc, signal.SIGTERM)
        self.master = None
        if self.redis is not None:
            self.redis.stop()
        reap_stale(cluster_tag(parse_masters(self.master_address)))  # what killed nodes left
