"""Three CUDA assumptions in SGLang's host-memory paths, made to hold on a CPU-only build, and
one GPU-host sizing rule relaxed.

Applied by the plugin (`plugin.py`) in SGLang's processes when the worker runs SGLang on CPU
(`SGLANG_USE_CPU_ENGINE=1`); never on a GPU, where SGLang's own CUDA paths run. Each one names
the private SGLang symbol it touches, so an SGLang upgrade that moves it fails loudly at start
(`check()`), not at the first request. Verified against sglang 0.5.23.

1. HiCache's host pool registers its buffer with CUDA (`cudaHostRegister`): a no-op on CPU.
2. Device<->host KV copies use `sgl_kernel.kvcacheio` (CUDA); on CPU, with the `layer_first`
   layout and the `direct` I/O backend, the copy is an index copy per layer in torch, and
   `torch.cpu.Stream` gets the `synchronize` SGLang's cache controller calls.
3. The PD sender's pinned-memory page-index path needs CUDA events; the plain path is used.
4. HiCache refuses a host pool unless 10 GiB of RAM stay free besides it: sized for GPU hosts
   with hundreds of GiB. On a CPU box the device pool is in the same RAM and the worker sizes
   the host pool equal to it (`--hicache-ratio 1`, 0.76 GiB for the built-in model); with a
   few engines loading on a 24 GiB machine the 10 GiB rule refused that pool at random. The
   reserve is `MOONCAKE_SGLANG_HOST_RESERVE_MIB` (default 1024).
5. A scheduler with no batch to run but work in flight (a decode waiting for its KV, a prefill
   whose KV is still being sent or backed up) loops with `time.sleep(0)`: on a GPU box a spare
   core; on a small CPU box it takes a core from the process computing that very KV. It naps
   `MOONCAKE_SGLANG_WAIT_POLL_MS` (default 1; 0 keeps SGLang's spin) per pass instead.
6. The torch-native backend's extend attention computes a prefix hit's whole sequence from
   uninitialised queries (a hit paid a cold prompt's attention, and at random far more: issue
   20's 53 s hit); `cpuattn.extend` attends from the new tokens only.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mooncake_k8s.engine.sglang import cpuattn

HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"
HOST_RESERVE = "sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES"
ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
DEFAULT_HOST_RESERVE_MIB = 1024


def _no_host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
    return None


def _transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor],
                        src_indices: torch.Tensor, dst_indices: torch.Tensor,
                        page_size: int) -> None:
    src = src_indices.to("cpu", torch.int64)
    dst = dst_indices.to("cpu", torch.int64)
    for s, d in zip(src_layers, dst_layers, strict=True):
        d[dst] = s[src].to(d.dtype)


def apply() -> None:
    missing = check()
    if missing:
        raise RuntimeError("this SGLang lacks what the CPU shims replace (not the tested "
                           f"sglang 0.5.23?): {', '.join(missing)}")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOST_REGISTER, _no_host_register, HookType.REPLACE)
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]
    import sglang.srt.mem_cache.pool_host.mha as mha

    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = _transfer_kv_direct
    import sglang.srt.disaggregation.mooncake.conn as conn

    conn.MooncakeKVSender.supports_host_tensor_indices = False
    import sglang.srt.mem_cache.pool_host.base as pool_base

    mib = int(os.environ.get("MOONCAKE_SGLANG_HOST_RESERVE_MIB", DEFAULT_HOST_RESERVE_MIB))
    pool_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = mib << 20
    HookRegistry.register(cpuattn.TARGET, cpuattn.extend, HookType.AROUND)
    nap = float(os.environ.get("MOONCAKE_SGLANG_WAIT_POLL_MS", "1")) / 1000
    if nap > 0:
        HookRegistry.register(ON_IDLE, _napping(nap), HookType.AROUND)


def _napping(nap_s: float) -> Any:
    def on_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(scheduler, *args, **kwargs)
        if not scheduler.is_fully_idle():  # SGLang returned after sleep(0): work in flight
            time.sleep(nap_s)
        return out

    return on_idle


def check() -> list[str]:
    """The SGLang symbols these shims depend on that are missing (empty: all there)."""
    import pkgutil

    missing = []
    for dotted in (HOST_REGISTER, HOST_RESERVE, ON_IDLE, cpuattn.TARGET,
                   "sglang.srt.managers.scheduler.Scheduler.is_fully_idle",
                   "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender",
                   "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"):
        try:
            pkgutil.resolve_name(dotted)
        except (ImportError, AttributeError, ValueError):
            missing.append(dotted)
    return missing
