"""`mooncake up`'s cluster with every component on its own emulated host (`Testbed`).

The master, one storage node, N prefill and M decode workers and the Conductor run the same
`mooncake` commands `up.LocalCluster` starts, each bound to its host's address: KV then moves
between hosts over TCP through shaped links, where the byte counters see it. Hosts are named
`master`, `store`, `prefill-<i>`, `decode-<i>` and `conductor`; clients run on the Conductor's
host (`BedCluster.client_call`), so their traffic stays off the bridge.

Prefill groups (issue 21, `BedConfig.prefill_groups`): group `g<k>` of size G puts its stages on
hosts `g<k>-s0` .. `g<k>-s<G-1>`, each a `mooncake prefill` with the `--pipeline-*` flags (stage
s's next is stage s+1's serving address). The Conductor is given every stage, as it would
find every prefill pod: it routes only to leaders (`-s0`, the only stage taking Prefill calls)
of whole groups, and polling the later stages lets it see a dead stage before the leader does.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mooncake_k8s.testbed.bed import Host, Testbed
from mooncake_k8s.transfer.segments import cluster_tag, reap_stale
from mooncake_k8s.up import UpConfig, prepare_model

T = TypeVar("T")


@dataclass
class BedConfig:
    prefill: int = 2
    decode: int = 2
    rate: str | None = "1gbit"
    """Every host's link rate, both directions (None: unlimited)."""
    delay: str | None = None
    loss: str | None = None
    store_size: int = 256 << 20
    decode_segment_size: int = 128 << 20
    prefill_segment_size: int | None = None
    """Pool memory each prefill host serves (`--local-segment-size`); None = the default."""
    prefill_groups: list[int] = field(default_factory=list)
    """Sizes of the prefill groups started beside the `prefill` single instances (e.g. [2]:
    one group of two stages, each on its own host)."""
    pipeline_chunk_tokens: int | None = None
    """`--pipeline-chunk-tokens` of every stage (None: the worker's default)."""
    pipeline_chunks: int | None = None
    """`--pipeline-chunks` of every stage (None: the worker's default; 0 = fixed chunks)."""
    pipeline_stage_timeout_s: float | None = None
    """`--pipeline-stage-timeout` of every stage (None: the worker's default)."""
    store_replicas: int = 2
    threads: int = 1
    ready_timeout_s: float = 300.0
    log_dir: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


class BedCluster:
    """Start with `with BedCluster(bed, BedConfig()) as c:`; `c.base_url` is the Conductor's
    API, reachable from its host (`c.client_call(fn)`)."""

    def __init__(self, bed: Testbed, config: BedConfig,
                 echo: Callable[[str], None] = print) -> None:
        self.bed = bed
        self.config = config
        self.echo = echo
        self.token = secrets.token_hex(16)
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="mooncake-bed-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # One port per role on every host (each host has its own ports). Random per cluster:
        # shared-memory names (host-wide, /dev/shm is shared) include the decode's port.
        base = random.randrange(20000, 30000, 10)
        self.master_port, self.service_port, self.metrics_port = base, base + 1, base + 2
        self.hosts: dict[str, Host] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def master(self) -> str:
        return f"{self.hosts['master'].addr}:{self.master_port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.hosts['conductor'].addr}:{self.service_port}"

    @property
    def workers(self) -> list[str]:
        """Every worker host: single prefills, every stage of every group, decodes."""
        c = self.config
        return ([f"prefill-{i}" for i in range(c.prefill)] + self.stages()
                + [f"decode-{i}" for i in range(c.decode)])

    def groups(self) -> list[list[str]]:
        """Each prefill group's stage hosts, stage 0 (the leader) first."""
        return [[f"g{k}-s{s}" for s in range(size)]
                for k, size in enumerate(self.config.prefill_groups)]

    def stages(self, group: int | None = None) -> list[str]:
        """The stage hosts of one group, or of every group."""
        gs = self.groups()
        return gs[group] if group is not None else [n for g in gs for n in g]

    @property
    def prefill_targets(self) -> list[str]:
        """What the Conductor routes prefill to: single instances and group leaders."""
        return ([f"prefill-{i}" for i in range(self.config.prefill)]
                + [g[0] for g in self.groups()])

    def addr(self, name: str) -> str:
        """A worker's serving address (host:port)."""
        return f"{self.hosts[name].addr}:{self.service_port}"

    def metrics_url(self, name: str) -> str:
        return f"http://{self.hosts[name].addr}:{self.metrics_port}/metrics"

    def client_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn` run on the Conductor's host (a client there talks to it over loopback)."""
        return self.hosts["conductor"].call(fn, *args, **kwargs)

    def _host(self, name: str) -> Host:
        c = self.config
        self.hosts[name] = self.bed.host(name, rate=c.rate, delay=c.delay, loss=c.loss)
        return self.hosts[name]

    def env(self) -> dict[str, str]:
        """The environment of this cluster's processes (the token, the config's extras)."""
        return {**os.environ, **self.config.extra_env, "MOONCAKE_CLUSTER_TOKEN": self.token,
                "PYTHONUNBUFFERED": "1", "MOONCAKE_LOG_FORMAT": "text"}

    def _spawn(self, name: str, args: list[str]) -> None:
        env = self.env()
        self.procs[name] = self.hosts[name].spawn(
            [sys.executable, "-m", "mooncake_k8s.cli", *args], env=env,
            log=self.log_dir / f"{name}.log")

    def start(self) -> None:
        c = self.config
        prepare_model(UpConfig(), self.echo)
        for name in ("master", "store", *self.workers, "conductor"):
            self._host(name)
        m = self.hosts["master"].addr
        self._spawn("master", ["store", "master", "--host", m, "--port", str(self.master_port),
                               "--metrics-port", str(self.metrics_port),
                               "--state-dir", str(self.log_dir / "master-state")])
        self._spawn("store", ["store", "node", "--master", self.master,
                              "--host", self.hosts["store"].addr,
                              "--node-id", f"store-{self.token[:12]}",
                              "--dram-size", str(c.store_size),
                              "--metrics-port", str(self.metrics_port)])
        for name in self.workers:
            self._spawn(name, self.worker_args(name))
        prefills = ",".join(self.addr(n) for n in self.workers if not n.startswith("decode"))
        decodes = ",".join(self.addr(n) for n in self.workers if n.startswith("decode"))
        self._spawn("conductor", [
            "conductor", "--host", self.hosts["conductor"].addr, "--port", str(self.service_port),
            "--master", self.master, "--prefill", prefills, "--decode", decodes,
            "--metrics-port", str(self.metrics_port), "--metrics-on-api-port",
            *self._model_args()])

    def _model_args(self) -> list[str]:
        return ["--block-tokens", str(UpConfig().block_tokens),
                "--threads", str(self.config.threads)]

    def worker_args(self, name: str) -> list[str]:
        """The `mooncake prefill|decode` command line of worker host `name` (from the config
        as it is now: a respawn picks up a changed chunk size)."""
        c = self.config
        role = "decode" if name.startswith("decode") else "prefill"
        args = [role, "--host", self.hosts[name].addr, "--port", str(self.service_port),
                "--master", self.master, "--metrics-port", str(self.metrics_port),
                "--instance-id", name, *self._model_args()]
        if role == "decode":
            return [*args, "--local-segment-size", str(c.decode_segment_size)]
        args += ["--store-replicas", str(c.store_replicas)]
        if c.prefill_segment_size is not None:
            args += ["--local-segment-size", str(c.prefill_segment_size)]
        for k, group in enumerate(self.groups()):
            if name in group:
                args += self._stage_args(k, group, group.index(name))
        return args

    def _stage_args(self, k: int, group: list[str], stage: int) -> list[str]:
        c = self.config
        args = ["--pipeline-group", f"g{k}", "--pipeline-group-size", str(len(group)),
                "--pipeline-stage", str(stage)]
        if stage + 1 < len(group):
            args += ["--pipeline-next", self.addr(group[stage + 1])]
        if c.pipeline_chunk_tokens is not None:
            args += ["--pipeline-chunk-tokens", str(c.pipeline_chunk_tokens)]
        if c.pipeline_chunks is not None:
            args += ["--pipeline-chunks", str(c.pipeline_chunks)]
        if c.pipeline_stage_timeout_s is not None:
            args += ["--pipeline-stage-timeout", str(c.pipeline_stage_timeout_s)]
        return args

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a component's process group (a stage killed mid-prompt: SIGKILL) and reap it;
        one that outlives a SIGTERM by 20 s is killed."""
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def respawn(self, names: list[str]) -> None:
        """Start workers `names` again (stopped or not) with their current command lines and
        wait until each is ready: a restarted stage, or every stage of a group with another
        `pipeline_chunk_tokens`."""
        for name in names:
            if self.procs[name].poll() is None:
                self.kill(name, signal.SIGTERM)
        for name in names:
            self._spawn(name, self.worker_args(name))
        self.wait_ready(names)

    def wait_ready(self, names: list[str] | None = None) -> None:
        """Block until every worker's and the Conductor's (or `names`') /readyz says 200, each
        asked from its own host (no bytes on the bridge); fail at once if any process exits."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        for name in names if names is not None else [*self.workers, "conductor"]:
            url = f"http://{self.hosts[name].addr}:{self.metrics_port}/readyz"
            while not self.hosts[name].call(http_ok, url):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready within "
                                       f"{self.config.ready_timeout_s:.0f}s; see {self.log(name)}")
                time.sleep(0.2)
            self.echo(f"  {name} ready on {self.hosts[name].addr}")

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = self.log(name).read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM front to back (Conductor, workers, store, master), SIGKILL stragglers."""
        order = ["conductor", *self.workers, "store", "master"]
        procs = [self.procs[n] for n in order if n in self.procs]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        # What killed processes left in /dev/shm (files of this cluster no one holds).
        reap_stale(cluster_tag([self.master]))

    def __enter__(self) -> BedCluster:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def http_ok(url: str) -> bool:
    """Whether `url` answers 200 (no proxy; any failure is False)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False
