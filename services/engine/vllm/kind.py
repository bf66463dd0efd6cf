"""The `vllm` engine kind: a vLLM server per worker, KV handed over through the pool
(`adapter.py`). Importing this needs no vLLM: the CLI asks it what is missing first."""

from __future__ import annotations

from mooncake_k8s.engine.adapter import ChildKind
from mooncake_k8s.engine.api import DecodeEngine, EngineContext, PrefillEngine
from mooncake_k8s.engine.vllm.server import OWNED_FLAGS, check_installed


class VllmKind(ChildKind):
    """`--engine vllm` (its settings: `ChildSettings`)."""

    name = "vllm"
    owned_flags = OWNED_FLAGS

    @classmethod
    def missing(cls) -> str | None:
        return check_installed()

    @classmethod
    def open_prefill(cls, ctx: EngineContext) -> PrefillEngine:
        from mooncake_k8s.engine.vllm.adapter import VllmPrefill

        return VllmPrefill(ctx)

    @classmethod
    def open_decode(cls, ctx: EngineContext) -> DecodeEngine:
        from mooncake_k8s.engine.vllm.adapter import VllmDecode

        return VllmDecode(ctx)
