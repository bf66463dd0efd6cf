"""SGLang plugin (entry point group `sglang.srt.plugins`): hooks our parts into SGLang.

SGLang loads it in each of its processes (engine, scheduler, detokenizer). It does nothing
unless the worker started that SGLang (`MOONCAKE_K8S_SGLANG=1`), so an SGLang someone else runs
in the same environment is untouched. Then it:
- replaces SGLang's mooncake transfer engine with ours for PD handoff (`transfer.py`);
- on CPU (`SGLANG_USE_CPU_ENGINE=1`), applies the CPU shims (`cpushims.py`).
The HiCache storage backend needs no hook: SGLang's `dynamic` backend loads it by module path.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

TE_TARGET = ("sglang.srt.distributed.device_communicators.mooncake_transfer_engine."
             "MooncakeTransferEngine")


def register() -> None:
    if os.environ.get("MOONCAKE_K8S_SGLANG") != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from mooncake_k8s.engine.sglang.transfer import OurTransferEngine

    HookRegistry.register(TE_TARGET, OurTransferEngine, HookType.REPLACE)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from mooncake_k8s.engine.sglang import cpushims

        cpushims.apply()
