"""The `sglang` engine kind: an SGLang server per worker, KV handed over in PD pairs
(`adapter.py`). Importing this needs no SGLang: the CLI asks it what is missing first."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_k8s.engine.adapter import ChildKind, ChildSettings
from mooncake_k8s.engine.api import DecodeEngine, EngineContext, PrefillEngine
from mooncake_k8s.engine.sglang.server import OWNED_FLAGS, check_installed


@dataclass(frozen=True)
class SglangSettings(ChildSettings):
    """What an SGLang worker takes beyond any engine server's settings."""

    bootstrap_port: int = 0
    """Prefill: port of its PD bootstrap server (0 = any free port)."""
    pd_port: int = 0
    """Port of the transfer server that receives or sends PD KV (0 = any free port)."""
    sidecar: str = ""
    """Unix socket of the pod's transfer sidecar: HiCache's pool traffic goes through it
    ("" = SGLang's processes talk to the store themselves)."""


class SglangKind(ChildKind):
    """`--engine sglang`."""

    name = "sglang"
    settings_type = SglangSettings
    owned_flags = OWNED_FLAGS

    @classmethod
    def missing(cls) -> str | None:
        return check_installed()

    @classmethod
    def open_prefill(cls, ctx: EngineContext) -> PrefillEngine:
        from mooncake_k8s.engine.sglang.adapter import SglangPrefill

        return SglangPrefill(ctx)

    @classmethod
    def open_decode(cls, ctx: EngineContext) -> DecodeEngine:
        from mooncake_k8s.engine.sglang.adapter import SglangDecode

        return SglangDecode(ctx)
