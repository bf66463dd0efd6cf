"""Start and talk to the SGLang server a worker runs its requests through.

The worker starts `sglang.launch_server` as its child (`engine.child`) in PD mode:
- prefill: `--disaggregation-mode prefill` with its bootstrap server, and HiCache whose L3 is our
  pool (`hicache.py`), so every prefill instance reuses pages any other one computed;
- decode: `--disaggregation-mode decode`; its KV arrives from the paired prefill.
Both use SGLang's mooncake PD backend, whose transfer engine our plugin replaces with ours
(`plugin.py`, `transfer.py`). The worker owns the flags that make this work (OWNED_FLAGS); the
rest of SGLang's options pass through.

On CPU (`--device cpu`, or no GPU) the worker also gives SGLang our CPU compatibility layer:
`cpu_path/` on its PYTHONPATH, `SGLANG_USE_CPU_ENGINE=1`, the torch-native attention backend,
no overlap scheduler, HiCache with `layer_first` host layout and direct I/O (the shims in
`cpushims.py` cover exactly those paths).

SGLang's HTTP API and bootstrap server bind the worker's own address. Off loopback (a pod IP)
the API requires the cluster token (`--api-key`); the bootstrap server is SGLang's, reachable
by the decode pods as SGLang's own router expects.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_k8s.common.blocks import KeyNamespace, sglang_key_prefix
from mooncake_k8s.common.netutil import free_service_port
from mooncake_k8s.engine.child import EngineChild, EngineHttpError, owned_flag

#: Our HiCache storage backend (`hicache.py`) as SGLang's `dynamic` backend loads it; named, not
#: imported: it imports SGLang, which only the child process needs.
BACKEND_NAME = "mooncake_k8s"
MODULE = "mooncake_k8s.engine.sglang.hicache"
CLASS = "MooncakeK8sHiCache"
CPU_PATH = Path(__file__).with_name("cpu_path")
#: Flags the worker owns; a pass-through argument may not set them.
OWNED_FLAGS = ("--model-path", "--host", "--port", "--served-model-name", "--page-size",
               "--disaggregation-mode", "--disaggregation-bootstrap-port",
               "--disaggregation-transfer-backend", "--hicache-storage-backend",
               "--hicache-storage-backend-extra-config", "--enable-hierarchical-cache",
               "--api-key")
#: SGLang flags for a CPU: what runs without SGLang's CUDA kernels (see the module docstring).
#: `--sleep-on-idle`: an idle SGLang scheduler otherwise polls at 100% of a core, which on a
#: small CPU box starves the instances that have work (measured: 16 tokens 20 s vs 1.8 s).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native",
             "--disable-overlap-schedule", "--hicache-io-backend", "direct",
             "--hicache-mem-layout", "layer_first", "--sleep-on-idle"]


def check_installed() -> str | None:
    """None when SGLang can be imported here, else what to install."""
    if importlib.util.find_spec("sglang") is None:
        return ("--engine sglang needs SGLang in this environment: on a GPU machine "
                "pip install 'sglang[all]==0.5.23'; on a CPU-only machine run "
                "MOONCAKE_WITH_SGLANG=1 bash scripts/setup.sh (see the README)")
    return None


class SglangError(EngineHttpError):
    """SGLang answered with an error status (the message is its own)."""


def _arg(args: list[str], flag: str, default: str) -> str:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


@dataclass
class SglangServerConfig:
    model_dir: Path
    served_name: str
    fingerprint: str
    page_tokens: int
    master: str
    token: str
    role: str
    host: str = "127.0.0.1"
    advertise_host: str = ""
    device: str = "cpu"
    bootstrap_port: int = 0
    pd_port: int = 0
    sidecar: str = ""
    extra_args: list[str] = field(default_factory=list)
    transport: str = "auto"
    python: str = sys.executable
    ready_timeout_s: float = 900.0
    work_dir: Path | None = None


class SglangServer(EngineChild):
    """One SGLang server child process in PD mode (see the module docstring)."""

    name = "SGLang"
    error_type = SglangError

    def __init__(self, cfg: SglangServerConfig) -> None:
        bad = owned_flag(cfg.extra_args, OWNED_FLAGS)
        if bad:
            raise ValueError(f"{bad} is set by the worker; pass the worker's own option instead")
        if cfg.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {cfg.role!r}")
        super().__init__(cfg.role, cfg.ready_timeout_s, cfg.work_dir)
        self.cfg = cfg
        self.cpu = cfg.device == "cpu"
        args = [*(CPU_FLAGS if self.cpu else []), *cfg.extra_args]
        self.mem_layout = _arg(args, "--hicache-mem-layout", "page_first")
        self.tp = int(_arg(args, "--tp-size", _arg(args, "--tp", "1")))
        # The namespace's dtype tag: the KV dtype as asked for. SGLang derives "auto" from the
        # model, the same way in every instance given the same flags, so the tag only has to
        # be stable, and the HiCache key prefix must be fixed before SGLang starts.
        kv = _arg(args, "--kv-cache-dtype", "auto")
        self.dtype = _dtype_name(kv if kv != "auto" else _arg(args, "--dtype", "auto"))
        self.kv_layout = f"sglang/{self.mem_layout}/tp{self.tp}"
        self.bootstrap_port = cfg.bootstrap_port or (
            free_service_port(cfg.host) if cfg.role == "prefill" else 0)
        self.public = cfg.host not in ("127.0.0.1", "::1", "localhost")
        self.info: dict[str, Any] = {}
        self.max_context = 0

    def namespace(self) -> KeyNamespace:
        return KeyNamespace(self.cfg.fingerprint, self.dtype, self.cfg.page_tokens,
                            kv_layout=self.kv_layout)

    def hicache_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "backend_name": BACKEND_NAME, "module_path": MODULE, "class_name": CLASS,
            "interface_v1": 1, "key_prefix": sglang_key_prefix(self.namespace()),
            "master": self.cfg.master, "transport": self.cfg.transport,
            "stats_prefix": str(self.stats_prefix),
        }
        if self.cfg.sidecar:
            extra["sidecar"] = self.cfg.sidecar
        return extra

    def command(self) -> list[str]:
        c = self.cfg
        cmd = [c.python, "-m", "sglang.launch_server", "--model-path", str(c.model_dir),
               "--served-model-name", c.served_name, "--host", c.host, "--port", str(self.port),
               "--page-size", str(c.page_tokens), "--enable-metrics",
               "--disaggregation-mode", c.role, "--disaggregation-transfer-backend", "mooncake"]
        if self.public:
            cmd += ["--api-key", c.token]
        if c.role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port),
                    "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
                    "--hicache-storage-backend-extra-config",
                    json.dumps(self.hicache_config())]
            if self.cpu and not {"--hicache-size", "--hicache-ratio"} & set(c.extra_args):
                # Host pool as large as the device pool: a CPU box runs several instances
                # side by side, and SGLang refuses to start when its host pool does not fit.
                cmd += ["--hicache-ratio", "1"]
        if self.cpu:
            cmd += CPU_FLAGS
            if "--max-total-tokens" not in c.extra_args:
                cmd += ["--max-total-tokens", "16384"]
        return [*cmd, *c.extra_args]

    def env(self) -> dict[str, str]:
        c = self.cfg
        env = {**super().env(), "MOONCAKE_CLUSTER_TOKEN": c.token, "MOONCAKE_K8S_SGLANG": "1",
               "MOONCAKE_PD_HOST": c.advertise_host or c.host,
               "MOONCAKE_PD_PORT": str(c.pd_port),
               "SGLANG_HOST_IP": c.advertise_host or c.host,
               "MOONCAKE_PD_STATS": str(self.stats_prefix)}
        if self.cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CPU_PATH), env.get("PYTHONPATH", "")) if p)
        return env

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.token}"} if self.public else {}

    def after_ready(self) -> None:
        self.info = json.loads(self.request("GET", "/get_server_info")[1])
        models = json.loads(self.request("GET", "/v1/models")[1])
        self.max_context = int(models["data"][0].get("max_model_len") or 0)

    @property
    def bootstrap_addr(self) -> str:
        if self.cfg.role != "prefill":
            return ""
        return f"{self.cfg.advertise_host or self.cfg.host}:{self.bootstrap_port}"

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.post_json("/generate", body)
        return out


def _dtype_name(s: str) -> str:
    s = s.replace("torch.", "")
    return {"half": "float16", "float": "float32", "bf16": "bfloat16", "auto": "float16",
            "fp8_e4m3": "float8_e4m3fn"}.get(s, s)
