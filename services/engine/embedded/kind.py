"""The `embedded` engine kind: our PyTorch engine in the worker's process (`prefill.py`,
`adapter.py`). Its settings are its `EngineConfig`, which extends the shared `ModelConfig`."""

from __future__ import annotations

from dataclasses import fields

from mooncake_k8s.engine.api import (
    DecodeEngine,
    EngineContext,
    EngineKind,
    ModelConfig,
    PrefillEngine,
)
from mooncake_k8s.engine.embedded.structs import EngineConfig


def engine_config(model: ModelConfig) -> EngineConfig:
    """The embedded engine's config: the one given when it is one already (its own settings
    included), else the shared model settings with the engine's defaults."""
    if isinstance(model, EngineConfig):
        return model
    return EngineConfig(**{f.name: getattr(model, f.name) for f in fields(ModelConfig)})


class EmbeddedKind(EngineKind):
    """`--engine embedded` (the default)."""

    name = "embedded"

    @classmethod
    def open_prefill(cls, ctx: EngineContext) -> PrefillEngine:
        from mooncake_k8s.engine.embedded.prefill import EmbeddedPrefill

        return EmbeddedPrefill(engine_config(ctx.model), ctx.store)

    @classmethod
    def open_decode(cls, ctx: EngineContext) -> DecodeEngine:
        from mooncake_k8s.engine.embedded.adapter import EmbeddedDecode

        return EmbeddedDecode(engine_config(ctx.model), ctx.store)
