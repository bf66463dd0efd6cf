"""Cap vLLM's idle busy-wait where instances share cores (see `limit_idle_spin`).

No vLLM import at module level: a `sitecustomize` may call this before vLLM starts (the
benchmark does so for plain vLLM servers, so both sides of a comparison run alike).
"""

from __future__ import annotations

import os
from typing import Any

IDLE_SPIN_ENV = "MOONCAKE_VLLM_IDLE_SPIN_S"


def limit_idle_spin() -> None:
    """Cap how long vLLM's worker spins on a core after its last message (1 s in vLLM).

    vLLM's worker busy-waits on its shared-memory queue for a second after every read. A
    dedicated box does not mind; where prefill and decode instances share cores (a laptop, a
    CI box, a dense node) the idle instance's spin takes a core from the busy one after every
    request. With MOONCAKE_VLLM_IDLE_SPIN_S set (the worker sets 0.05 s by default), a quiet
    worker goes back to blocking on its notify socket that much sooner; a running batch reads
    every step, well inside the window, so decode keeps the fast path.
    """
    limit = os.environ.get(IDLE_SPIN_ENV)
    if not limit:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast as sb
    except ImportError:
        return
    cls = getattr(sb, "SpinCondition", None)
    if cls is None or getattr(cls, "_mooncake_capped", False):
        return
    cap = float(limit)
    original = cls.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        original(self, timeout_ms)

    cls.wait = wait
    cls._mooncake_capped = True
