"""The embedded engine: a Hugging Face Llama-family model run by our own forward pass, with
prefill from imported KV blocks, block export (DESIGN §3) and continuous-batching decode.

`Engine` is the engine itself (tests and benchmarks drive it directly); `adapter` puts it
behind the engine seam (`engine.api`) and `kind` names it to the registry. The names below are
loaded on first use, so the kind (and `structs`) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake_k8s.engine.embedded.engine import Engine, load_engine
    from mooncake_k8s.engine.embedded.structs import (
        BatchLoad,
        EngineConfig,
        EngineFull,
        PrefillResult,
        SamplingParams,
        StepOutput,
    )
    from mooncake_k8s.engine.loading import BUILTIN_NAME, ModelLoadError

_HOMES = {
    "BUILTIN_NAME": "..loading", "ModelLoadError": "..loading",
    "Engine": ".engine", "load_engine": ".engine",
    "BatchLoad": ".structs", "EngineConfig": ".structs", "EngineFull": ".structs",
    "PrefillResult": ".structs", "SamplingParams": ".structs", "StepOutput": ".structs",
}
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


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
