"""Between vLLM's paged KV tensors and our block payload `[layer, k|v, kv_head, token, head_dim]`.

vLLM hands a connector one tensor per attention layer whose shape depends on the attention
backend. Two are understood here:

- CPU backend: `[num_blocks, kv_heads, block_size, 2 * head_dim]`, which the backend itself
  reads as `[num_blocks, kv_heads, 2 * block_size, head_dim]` with K in the first `block_size`
  rows and V in the rest (so one block-head is K then V).
- Flash-attention style (CUDA): `[2, num_blocks, block_size, kv_heads, head_dim]`.

Anything else is refused at registration (`UnsupportedLayout`): the connector then stays off and
vLLM computes everything, which costs time but never correctness. Gather and scatter are pure
torch and never depend on vLLM, so they are tested without it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncake_k8s.common.errors import MooncakeError

_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class UnsupportedLayout(MooncakeError):
    """A KV cache layout this connector cannot translate."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise UnsupportedLayout(f"KV cache dtype {dtype} is not supported") from None


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


@dataclass
class PagedKV:
    """The engine's per-layer KV tensors, in model order, and how to read them as blocks."""

    layers: list[torch.Tensor]
    kind: str
    """"cpu" or "flash"."""
    kv_heads: int
    block_size: int
    head_dim: int

    @classmethod
    def from_caches(cls, caches: dict[str, torch.Tensor]) -> PagedKV:
        if not caches:
            raise UnsupportedLayout("no KV cache tensors were registered")
        names = sorted(caches, key=lambda n: (_layer_index(n), n))
        layers = [caches[n] for n in names]
        t = layers[0]
        if any(x.shape != t.shape or x.dtype != t.dtype for x in layers):
            raise UnsupportedLayout("layers differ in KV shape or dtype (hybrid models)")
        if t.dim() == 4 and t.shape[3] % 2 == 0:
            _, heads, bs, two_d = t.shape
            return cls(layers, "cpu", heads, bs, two_d // 2)
        if t.dim() == 5 and t.shape[0] == 2:
            _, _, bs, heads, d = t.shape
            return cls(layers, "flash", heads, bs, d)
        raise UnsupportedLayout(f"KV cache shape {tuple(t.shape)} is not a known layout")

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (len(self.layers), 2, self.kv_heads, self.block_size, self.head_dim)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks into `out` ([n, layer, k|v, head, token, dim], contiguous)."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        n = len(block_ids)
        h, bs, d = self.kv_heads, self.block_size, self.head_dim
        for li, kv in enumerate(self.layers):
            if self.kind == "cpu":
                src = kv.index_select(0, idx).view(n, h, 2, bs, d).permute(0, 2, 1, 3, 4)
            else:
                src = kv.index_select(1, idx).permute(1, 0, 3, 2, 4)
            out[:, li].copy_(src)

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Copy blocks from `src` ([n, layer, k|v, head, token, dim]) into the paged KV."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        n = len(block_ids)
        h, bs, d = self.kv_heads, self.block_size, self.head_dim
        for li, kv in enumerate(self.layers):
            part = src[:, li].to(kv.device, non_blocking=True)
            if self.kind == "cpu":
                kv.index_copy_(0, idx, part.permute(0, 2, 1, 3, 4).reshape(n, h, bs, 2 * d))
            else:
                kv.index_copy_(1, idx, part.permute(1, 0, 3, 2, 4))
