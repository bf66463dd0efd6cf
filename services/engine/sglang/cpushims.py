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
"""

from __future__ import annotations

import os
from typing import Any

import torch

HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"
HOST_RESERVE = "sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES"
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


def check() -> list[str]:
    """The SGLang symbols these shims depend on that are missing (empty: all there)."""
    import importlib

    missing = []
    for dotted in (HOST_REGISTER, HOST_RESERVE,
                   "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender",
                   "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"):
        mod, _, name = dotted.rpartition(".")
        try:
            if not hasattr(importlib.import_module(mod), name):
                missing.append(dotted)
        except ImportError:
            missing.append(dotted)
    return missing
