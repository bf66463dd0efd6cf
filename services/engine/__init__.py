"""Engines behind one seam: `api` (what the prefill and decode services need of an engine),
`registry` (kind name to kind, imported only when asked for) and one folder per kind:
`embedded/` (our PyTorch engine), `vllm/` and `sglang/` (servers a worker runs as its child,
sharing `child` and `adapter`). `loading` finds and names the model every kind serves.

The embedded engine's public names are also importable from here, loaded on first use (from
`embedded`, which loads each from its own module), so importing the seam (`engine.api`) or a
kind never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake_k8s.engine.embedded import (
        BUILTIN_NAME,
        BatchLoad,
        Engine,
        EngineConfig,
        EngineFull,
        ModelLoadError,
        PrefillResult,
        SamplingParams,
        StepOutput,
        load_engine,
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


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module(".embedded", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
