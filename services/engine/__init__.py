"""The embedded engine: a Hugging Face Llama-family model run by our own forward pass, with
prefill from imported KV blocks, block export (DESIGN §3) and continuous-batching decode.

The prefill and decode services wrap an `Engine`; nothing else here is public API.
"""

from __future__ import annotations

from .engine import Engine, load_engine
from .loading import BUILTIN_NAME, ModelLoadError
from .structs import (
    BatchLoad,
    EngineConfig,
    EngineFull,
    PrefillResult,
    SamplingParams,
    StepOutput,
)

__all__ = [
    "BUILTIN_NAME",
    "BatchLoad",
    "Engine",
    "EngineConfig",
    "EngineFull",
    "ModelLoadError",
    "PrefillResult",
    "SamplingParams",
    "StepOutput",
    "load_engine",
]
