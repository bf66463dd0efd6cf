"""Engine kinds by name, each imported only when asked for.

A kind is a folder under `engine/` whose `kind.py` holds its `EngineKind` subclass (light: the
kind's adapter, and the engine it needs, are imported when it opens an engine); this table
names where.
Nothing is imported until a kind is looked up, so a worker running the embedded engine never
imports vLLM's or SGLang's adapters (and a machine without them can still run it), and the CLI
can list the kinds without loading any (importing this module loads nothing but it: the
seam itself is imported on the first lookup).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mooncake_k8s.common.errors import InvalidArgument

if TYPE_CHECKING:
    from mooncake_k8s.engine.api import EngineKind

_KINDS: dict[str, str] = {
    "embedded": "mooncake_k8s.engine.embedded.kind:EmbeddedKind",
    "vllm": "mooncake_k8s.engine.vllm.kind:VllmKind",
    "sglang": "mooncake_k8s.engine.sglang.kind:SglangKind",
}

ENGINE_KINDS = tuple(_KINDS)
"""The kinds' names, in the order the CLI lists them."""


class UnknownEngineKind(InvalidArgument):
    """No engine kind has this name."""


def engine_kind(name: str) -> type[EngineKind]:
    """The kind named `name` (its module imported now, once)."""
    target = _KINDS.get(name)
    if target is None:
        raise UnknownEngineKind(f"unknown engine kind {name!r}; known: {', '.join(_KINDS)}")
    from mooncake_k8s.engine.api import EngineKind

    module, _, attr = target.partition(":")
    found = getattr(importlib.import_module(module), attr)
    if not (isinstance(found, type) and issubclass(found, EngineKind)) or found.name != name:
        raise TypeError(f"{target} is not the EngineKind {name!r}")
    return found
