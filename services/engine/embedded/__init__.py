"""The embedded engine: a Hugging Face Llama-family model run by our own forward pass, with
prefill from imported KV blocks, block export (DESIGN §3) and continuous-batching decode.

`Engine` is the engine itself (tests and benchmarks drive it directly); `adapter` puts it
behind the engine seam (`engine.api`) as the `embedded` kind.
"""

from __future__ import annotations

from ..loading import BUILTIN_NAME, ModelLoadError
from .engine import Engine, load_engine
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
