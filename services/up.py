"""`mooncake up`: the whole architecture as local processes, one command.

The master, one storage node, N prefill and M decode workers and the Conductor each run as a
child process on 127.0.0.1 (the same `mooncake` commands a Kubernetes pod runs), sharing a
random cluster token that exists only in their environment. `LocalCluster` is also what the
end-to-end tests and the serving benchmark start, so they exercise exactly this.

`run_up` keeps them running as Kubernetes would: a child that exits is started again with the
same arguments (`supervise` decides when, and when a crash loop ends it all); `LocalCluster`
alone, as tests use it, still fails as soon as any child exits (`check_alive`).
"""

from __future__ import annotations

import contextlib
import json
import os
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

from mooncake_k8s.common import defaults
from mooncake_k8s.common.defaults import BLOCK_TOKENS
from mooncake_k8s.common.netutil import free_service_port
from mooncake_k8s.common.procs import Proc
from mooncake_k8s.common.tenants import read_api_keys
from mooncake_k8s.supervise import RestartPolicy, Supervisor
from mooncake_k8s.transfer.segments import cluster_tag, reap_stale


@dataclass
class UpConfig:
    host: str = "127.0.0.1"
    port: int = defaults.CONDUCTOR_PORT
    prefill: int = 1
    decode: int = 1
    prefill_group_size: int = 1
    """Prefill instances per pipeline group: consecutive instances form groups g0, g1, ...,
    each instance one stage (`--pipeline-stage`) passing hidden states to the next. The
    Conductor polls every stage but routes only to leaders (stage 0) of whole groups. 1: every
    instance on its own."""
    store_size: int = 1 << 30
    decode_segment_size: int = 256 << 20
    prefill_segment_size: int = 256 << 20
    """DRAM each prefill instance serves to the store (`--local-segment-size`): where it keeps
    the prefixes it computed. Smaller than `mooncake prefill`'s default: here every process
    shares one host (and CI's memory), so a prefill segment saves no network, only keeps the
    copy the placement design gives it. 0 = none."""
    store_replicas: int = 2
    """Copies of each KV block prefill writes (`--store-replicas`): the first in the decode
    instance's own segment, the second on another node, so a decode that dies mid-stream is
    resumed elsewhere from the pool (decode failover). 1 saves DRAM and a little TTFT
    (bench/failover_bench.py) but a dead decode then takes its streams' KV with it."""
    api_keys_file: str | None = None
    use_prefix_cache: bool = True
    log_dir: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    block_tokens: int = BLOCK_TOKENS
    device: str | None = None
    threads: int | None = None
    ready_timeout_s: float = 600.0
    extra_env: dict[str, str] = field(default_factory=dict)
    engine: str = "embedded"
    engine_args: list[str] = field(default_factory=list)
    """Passed through to every prefill and decode engine (vLLM flags)."""
    sidecar: bool = False
    """Give each worker a transfer sidecar (`mooncake sidecar`), as the operator does in a pod:
    the engine's KV pool traffic then goes through its Unix socket (SGLang workers)."""
    sidecar_staging_size: int = 64 << 20
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    """How `run_up` restarts a child that exits, and when it gives up (`supervise`)."""
    drain_timeout_s: float | None = None
    """Every worker's `--drain-timeout` (its grace after SIGTERM); None = the workers' own."""
    stream_stall_timeout_s: float | None = None
    """The Conductor's `--stream-stall-timeout` (0 = off); None = its own default."""
    store_fanout: bool = False
    """The master's hot-object fan-out (`--fanout`; off by default, as Mooncake ships it)."""


#: vLLM flags `mooncake up --engine vllm` adds when none are given and no GPU is present:
#: eager mode (compiling on a laptop's cores takes minutes) and a short context.
VLLM_CPU_DEFAULTS = ("--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048",
                     "--max-num-seqs", "16")
#: SGLang flags `mooncake up --engine sglang` adds when none are given and no GPU is present:
#: SGLang picks float16 for a float32 checkpoint, which a CPU without AVX512-FP16 emulates;
#: float32 served the built-in model about 3.6x faster here (bench/sglang_compare.py).
SGLANG_CPU_DEFAULTS = ("--dtype", "float32")


def group_problem(prefill: int, group_size: int, engine: str) -> str | None:
    """Why `--prefill N --prefill-group-size G` cannot start, or None when it can."""
    if group_size < 1:
        return f"--prefill-group-size must be at least 1, got {group_size}"
    if prefill < 1 or prefill % group_size:
        return (f"--prefill {prefill} is not a positive multiple of --prefill-group-size "
                f"{group_size}: every group needs all of its {group_size} stages")
    if group_size > 1 and engine != "embedded":
        return (f"--prefill-group-size {group_size} needs --engine embedded: the {engine} "
                "worker runs no pipeline stage (see docs/engines.md for its own pipeline "
                "parallelism)")
    return None


def stage_args(index: int, group_size: int, host: str, ports: list[int]) -> list[str]:
    """Prefill instance `index`'s pipeline flags: stage index % G of group g<index // G>,
    passing to the next instance's gRPC port (the last stage has none). No flags when G is 1."""
    if group_size == 1:
        return []
    stage = index % group_size
    args = ["--pipeline-group", f"g{index // group_size}", "--pipeline-group-size",
            str(group_size), "--pipeline-stage", str(stage)]
    if stage < group_size - 1:
        args += ["--pipeline-next", f"{host}:{ports[index + 1]}"]
    return args


class LocalCluster:
    def __init__(self, config: UpConfig, echo: Callable[[str], None] = print) -> None:
        problem = group_problem(config.prefill, config.prefill_group_size, config.engine)
        if problem:  # before any process starts
            raise ValueError(problem)
        self.config = config
        self.echo = echo
        self.token = secrets.token_hex(16)
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="mooncake-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        # Ports outside the ephemeral range: a restarted child binds its port again, and an
        # outgoing connection must not have taken it meanwhile.
        self.master_port = free_service_port(config.host)
        self.port = config.port or free_service_port(config.host)
        self.prefill_ports: list[int] = []
        self.decode_ports: list[int] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def master(self) -> str:
        return f"{self.config.host}:{self.master_port}"

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], metrics_port: int) -> Proc:
        env = {**os.environ, **self.config.extra_env, "MOONCAKE_CLUSTER_TOKEN": self.token,
               "PYTHONUNBUFFERED": "1", "MOONCAKE_LOG_FORMAT": "text"}
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "mooncake_k8s.cli", *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        proc = Proc(name, args, popen, log_path, metrics_port)
        self.procs[name] = proc
        return proc

    def _model_args(self) -> list[str]:
        c = self.config
        args = ["--block-tokens", str(c.block_tokens)]
        # Engines share the host's cores: more threads than cores per process only thrash.
        threads = c.threads or max(1, (os.cpu_count() or 1) // (c.prefill + c.decode))
        for flag, value in (("--model", c.model), ("--served-model-name", c.served_model_name),
                            ("--device", c.device), ("--threads", threads)):
            if value is not None:
                args += [flag, str(value)]
        return args

    def _engine_args(self) -> list[str]:
        c = self.config
        if c.engine == "embedded":
            return []
        extra = list(c.engine_args)
        defaults = {"vllm": VLLM_CPU_DEFAULTS, "sglang": SGLANG_CPU_DEFAULTS}.get(c.engine)
        if defaults and not extra and (c.device or "cpu") == "cpu":
            import torch

            if not torch.cuda.is_available():
                extra = list(defaults)
        return ["--engine", c.engine, *(f"--engine-arg={a}" for a in extra)]

    def master_args(self, metrics_port: int) -> list[str]:
        """The master's command line: tenant quotas from the API-keys file, fan-out when asked."""
        c = self.config
        quotas = read_api_keys(c.api_keys_file).quota_flags() if c.api_keys_file else []
        return ["store", "master", "--host", c.host, "--port", str(self.master_port),
                "--metrics-port", str(metrics_port),
                "--state-dir", str(self.log_dir / "master-state"), *quotas,
                *(["--fanout"] if c.store_fanout else [])]

    def start(self) -> None:
        c = self.config
        h = c.host
        prepare_model(c, self.echo)
        mport = free_service_port(h)
        # A state dir tells the master this is a first start (no nodes to wait for) and, after a
        # restart, exactly which nodes it knew.
        self._spawn("master", self.master_args(mport), mport)
        nport = free_service_port(h)
        # Node ids name shared-memory files, host-wide: unique per cluster (its master port).
        self._spawn("store-node", ["store", "node", "--master", self.master, "--host", h,
                                   "--node-id", f"store-{self.master_port}",
                                   "--dram-size", str(c.store_size),
                                   "--metrics-port", str(nport)], nport)
        # Every prefill port before any stage starts: stage i is told stage i+1's address.
        self.prefill_ports = [free_service_port(h) for _ in range(c.prefill)]
        for role, count in (("prefill", c.prefill), ("decode", c.decode)):
            for i in range(count):
                port = self.prefill_ports[i] if role == "prefill" else free_service_port(h)
                hport = free_service_port(h)
                args = [role, "--host", h, "--port", str(port), "--master", self.master,
                        "--metrics-port", str(hport), "--instance-id", f"{role}-{i}",
                        *self._model_args(), *self._engine_args()]
                if c.drain_timeout_s is not None:
                    args += ["--drain-timeout", str(c.drain_timeout_s)]
                if c.sidecar:
                    sock = self.log_dir / f"sidecar-{role}-{i}.sock"
                    self._spawn(f"sidecar-{role}-{i}", self.sidecar_args(sock), 0)
                    args += ["--sidecar", str(sock)]
                if role == "decode":
                    args += ["--local-segment-size", str(c.decode_segment_size)]
                    self.decode_ports.append(port)
                else:
                    args += ["--store-replicas", str(c.store_replicas),
                             "--local-segment-size", str(c.prefill_segment_size),
                             *stage_args(i, c.prefill_group_size, h, self.prefill_ports)]
                self._spawn(f"{role}-{i}", args, hport)
        # Its /metrics also on the API port (loopback by default): `bench/serve` scrapes there.
        cport = free_service_port(h)
        args = ["conductor", "--host", h, "--port", str(self.port), "--master", self.master,
                # Every stage, not only leaders: the Conductor routes to leaders of whole groups
                # only, and a stage it polls that stops answering takes its group out of
                # rotation before the leader's own check notices (as pod DNS lists them all).
                "--prefill", ",".join(f"{h}:{p}" for p in self.prefill_ports),
                "--decode", ",".join(f"{h}:{p}" for p in self.decode_ports),
                "--metrics-port", str(cport), "--metrics-on-api-port", *self._model_args()]
        if c.api_keys_file:
            args += ["--api-keys-file", c.api_keys_file]
        if not c.use_prefix_cache:
            args.append("--no-prefix-cache")
        if c.stream_stall_timeout_s is not None:
            args += ["--stream-stall-timeout", str(c.stream_stall_timeout_s)]
        self._spawn("conductor", args, cport)

    def sidecar_args(self, sock: Path) -> list[str]:
        return ["sidecar", "--socket", str(sock), "--master", self.master,
                "--staging-size", str(self.config.sidecar_staging_size)]

    def respawn(self, name: str) -> Proc:
        """Start a stopped (killed) process again with its arguments: a restart with the same
        identity, as Kubernetes restarts a container."""
        old = self.procs[name]
        if old.alive():
            raise RuntimeError(f"{name} is still running")
        _kill_group(old)  # what the dead leader left behind (an engine's own processes)
        return self._spawn(name, old.args, old.metrics_port)

    def supervise(self, policy: RestartPolicy) -> Supervisor:
        """A supervisor over every started process; each change is written to `status_path`
        (state, pid and restart count per child: the restart counter of `mooncake up`)."""
        sup = Supervisor(policy)
        sup.on_change = lambda: self.write_status(sup)
        for name in self.procs:
            sup.add(_ClusterChild(self, name))
        self.write_status(sup)
        return sup

    @property
    def status_path(self) -> Path:
        return self.log_dir / "up-status.json"

    def write_status(self, sup: Supervisor) -> None:
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": self.base_url, "children": sup.status()}, indent=1))
        tmp.replace(self.status_path)

    def wait_ready(self, check: Callable[[], None] | None = None) -> None:
        """Block until every worker's /readyz and the Conductor's /readyz say 200. `check`
        runs each round (default: fail as soon as any process has exited)."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = [n for n in self.procs if n.startswith(("prefill", "decode"))] + ["conductor"]
        while pending:
            (check or self.check_alive)()
            name = pending[0]
            if _http_ok(f"http://{self.config.host}:{self.procs[name].metrics_port}/readyz"):
                self.echo(f"  {name} ready")
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready within {self.config.ready_timeout_s:.0f}s;"
                                   f" see {self.procs[name].log_path}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        for p in self.procs.values():
            if not p.alive():
                tail = p.log()[-4000:]
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{tail}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.popen.pid, sig)
        p.popen.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM front to back (Conductor, workers, store), then SIGKILL stragglers."""
        order = sorted(self.procs.values(),
                       key=lambda p: ("conductor", "prefill", "decode", "sidecar", "store",
                                      "master").index(p.name.split("-")[0]))
        for p in order:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in order:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(timeout=10)
        for p in order:
            _kill_group(p)
        # A process killed (-9, or by a crash) left its shared-memory segment: remove the
        # cluster's files that no live process holds any more.
        reap_stale(cluster_tag([self.master]))

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class _ClusterChild:
    """One of `LocalCluster`'s processes as the supervisor sees it (`supervise.Child`)."""

    def __init__(self, cluster: LocalCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name

    @property
    def pid(self) -> int:
        return self.cluster.procs[self.name].popen.pid

    def poll(self) -> int | None:
        return self.cluster.procs[self.name].popen.poll()

    def restart(self) -> None:
        self.cluster.respawn(self.name)

    def log_tail(self) -> str:
        lines = self.cluster.procs[self.name].log().splitlines()
        return "\n".join(lines[-20:])


def _kill_group(p: Proc) -> None:
    """SIGKILL whatever is left in an exited child's process group (each child leads its own
    session). Linux keeps a pid unused while a group of that id has members; an empty group
    gives ESRCH."""
    if p.popen.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.popen.pid, signal.SIGKILL)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def prepare_model(config: UpConfig, echo: Callable[[str], None]) -> None:
    """Convert and cache the model once, with a progress bar, before the workers race to."""
    if config.model:
        return  # a local Hugging Face directory needs no conversion
    from mooncake_k8s.engine.loading import ensure_builtin

    echo("preparing the built-in model (the first run converts it; later runs use the cache)")
    path, _sha = ensure_builtin(progress=True)
    echo(f"  model cache: {path}")


class _Interrupted(Exception):
    pass


def run_up(config: UpConfig, echo: Callable[[str], None] = print) -> None:
    """Start everything, keep it running (`supervise`: a child that exits is restarted with
    backoff) until Ctrl-C/SIGTERM or a crash loop, then stop every child."""
    cluster = LocalCluster(config, echo)
    stop = {"signal": 0}

    def _on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    groups = (f" in {config.prefill // config.prefill_group_size} pipeline group(s) of "
              f"{config.prefill_group_size}" if config.prefill_group_size > 1 else "")
    echo(f"starting master, store node, {config.prefill} prefill{groups}, {config.decode} "
         f"decode and the Conductor (logs: {cluster.log_dir})")
    code = 0
    try:
        cluster.start()
        sup = cluster.supervise(config.restart_policy)

        def tick() -> None:
            if stop["signal"]:
                raise _Interrupted
            sup.step()

        cluster.wait_ready(check=tick)
        url = cluster.base_url
        model = config.served_model_name or "SmolLM2-135M-Instruct"
        auth = ' -H "Authorization: Bearer $KEY"' if config.api_keys_file else ""
        echo(f"\nmooncake is up: OpenAI API at {url}/v1   (Ctrl-C stops everything)\n")
        echo(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
             f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
             f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'\n")
        echo(f"  a child that exits is restarted; restarts are counted in {cluster.status_path}")
        while True:
            tick()
            time.sleep(0.3)
    except _Interrupted:
        pass
    except (RuntimeError, TimeoutError) as e:
        echo(f"error: {e}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        echo("stopping ...")
        cluster.stop()
        echo("stopped")
    if code:
        sys.exit(code)
