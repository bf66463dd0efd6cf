"""Extend attention for SGLang's torch-native backend (the one the worker picks on CPU) that
attends from the new tokens only.

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` runs, for a request with a
cached prefix, causal attention over the whole sequence: it allocates a query buffer of the full
length with `torch.empty`, copies the new tokens' queries into its tail and throws away every
row but those. So a prefix hit (the whole point of HiCache and our pool) pays the attention of a
cold prompt, quadratic in its length (a 2.4K-token hit with 32 new tokens: about 250 ms per
layer instead of 12 ms here), and the prefix rows it computes are uninitialised memory, whose
values (huge floats, infinities) make the kernel up to twice slower again, at random. Issue 20
saw a hit wait 53 s after its pages arrived (6 s cold); that time was this forward.

`extend` computes the same output from the new tokens' queries alone: each attends to the
whole prefix and causally among the new tokens (a boolean mask, lower triangle shifted by the
prefix length). Without a prefix it is SGLang's own call. Cases this does not cover (encoder
and cross attention, non-causal layers, sliding windows) go to SGLang's code unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

TARGET = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
          "_run_sdpa_forward_extend")


def _covered(encoder_lens: Any, causal: bool, is_cross_attn: bool,
             sliding_window_size: int | None) -> bool:
    windowed = sliding_window_size is not None and sliding_window_size > -1
    return encoder_lens is None and causal and not is_cross_attn and not windowed


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
            scaling: float | None, enable_gqa: bool) -> torch.Tensor:
    """q [heads, new, dim] against k, v [kv_heads, prefix + new, dim]: the new rows' output."""
    if k.dtype != q.dtype:  # as SGLang: the kernel wants one dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    mask = None
    if prefix > 0:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool,
                          device=q.device).tril(diagonal=prefix)
    return scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
        is_causal=mask is None, scale=scaling, enable_gqa=enable_gqa).squeeze(0)


def extend(original: Any, backend: Any, query: torch.Tensor, output: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
           extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
           encoder_lens: torch.Tensor | None = None, scaling: float | None = None,
           enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
           sliding_window_size: int | None = None) -> torch.Tensor:
    """AROUND hook for `TARGET` (same arguments and result: `output`, filled in place)."""
    if not _covered(encoder_lens, causal, is_cross_attn, sliding_window_size):
        return original(  # type: ignore[no-any-return]
            backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
            seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling,
            enable_gqa=enable_gqa, causal=causal, is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size)
    heads_first = query.movedim(0, 1)  # [tokens, heads, dim] -> [heads, tokens, dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        new, prefix, total = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :total]
        k = k_cache[tokens].movedim(0, 1)
        v = v_cache[tokens].movedim(0, 1)
        out = _attend(heads_first[:, start:start + new], k, v, prefix, scaling, enable_gqa)
        output[start:start + new] = out.movedim(0, 1)
        start += new
    return output
