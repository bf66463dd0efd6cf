"""Our own forward pass over a Hugging Face Llama-family model's weights, with our own KV cache.

Why not call the HF model: we need (a) prefill that starts at any position with KV imported
from the store, written straight into a cache laid out like the block payload
(`[layer, k|v, kv_head, token, head_dim]`), (b) a decode step that advances many sequences of
different lengths in one pass, and (c) exact control of the computation's shapes, because
floating-point results depend on them (see `prefill_chunk`).

Weights are taken from the HF modules once (q/k/v and gate/up fused into single matrices, one
GEMM each instead of three/two) and the HF model is then dropped. RoPE cos/sin come from the
model's own rotary module, so any rope scaling it implements (llama3, linear, yarn...) is
honoured; they are tabulated once for every position up to the context length.

Attention uses scaled_dot_product_attention without ever repeating K and V in memory. On the
CPU, the query heads that share a KV head are stacked along the sequence axis and an explicit
bottom-right causal mask is passed (measured fastest there). On CUDA, a chunk uses the fused
kernels through `causal_lower_right` with native GQA; if this torch cannot run that combination,
the first chunk falls back to the CPU formulation for good, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mooncake_k8s.common.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wdown: torch.Tensor
    bdown: torch.Tensor | None


def _cat_bias(*mods: Any) -> torch.Tensor | None:
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros_like(m.weight[:, 0])
                      for b, m in zip(biases, mods, strict=True)])


class Transformer:
    """The model's math. Stateless between calls: callers own the KV tensors."""

    def __init__(self, model: Any, max_context: int | None = None) -> None:
        cfg = model.config
        inner = model.model
        self.device: torch.device = inner.embed_tokens.weight.device
        self.dtype: torch.dtype = inner.embed_tokens.weight.dtype
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.hidden: int = cfg.hidden_size
        self.vocab: int = cfg.vocab_size
        self.eps: float = float(cfg.rms_norm_eps)
        self.groups = self.num_heads // self.num_kv_heads
        self.max_context: int = max_context or int(cfg.max_position_embeddings)
        self.act: Callable[[torch.Tensor], torch.Tensor] = inner.layers[0].mlp.act_fn
        # CUDA chunk attention: "gqa" (native), "repeat" (K/V heads repeated), None (masks)
        self._fused: str | None = "gqa" if self.device.type == "cuda" else None
        with torch.inference_mode():
            self.embed = inner.embed_tokens.weight.detach()
            self.norm = inner.norm.weight.detach()
            self.lm_head = model.lm_head.weight.detach()
            self.layers = [self._take(layer) for layer in inner.layers]
            positions = torch.arange(self.max_context, device=self.device)[None]
            probe = torch.empty(0, device=self.device, dtype=self.dtype)
            cos, sin = inner.rotary_emb(probe, positions)
            self.cos: torch.Tensor = cos[0].to(self.dtype).contiguous()  # [T, head_dim]
            self.sin: torch.Tensor = sin[0].to(self.dtype).contiguous()

    @staticmethod
    def _take(layer: Any) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        return _Layer(
            ln1=layer.input_layernorm.weight.detach(),
            wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
            bqkv=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
            wo=a.o_proj.weight.detach(),
            bo=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
            ln2=layer.post_attention_layernorm.weight.detach(),
            wgu=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
            bgu=_cat_bias(m.gate_proj, m.up_proj),
            wdown=m.down_proj.weight.detach(),
            bdown=None if m.down_proj.bias is None else m.down_proj.bias.detach(),
        )

    # -- KV tensors ---------------------------------------------------------------------

    def kv_shape(self, tokens: int, layers: int | None = None) -> tuple[int, int, int, int, int]:
        """`[layer, k|v, kv_head, token, head_dim]`: the block payload's layout, so importing
        or exporting a block is one strided copy of a token range. `layers`: a pipeline
        stage's count (default: all of them)."""
        nl = self.num_layers if layers is None else layers
        return (nl, 2, self.num_kv_heads, tokens, self.head_dim)

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def new_kv(self, tokens: int, layers: int | None = None) -> torch.Tensor:
        return torch.empty(self.kv_shape(tokens, layers), device=self.device, dtype=self.dtype)

    # -- building blocks ----------------------------------------------------------------

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [n, heads, d]; cos/sin [n, 1, d]; the HF "rotate_half" convention
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, hd = x.shape[0], self.head_dim
        h = F.rms_norm(x, (self.hidden,), layer.ln1, self.eps)
        qkv = F.linear(h, layer.wqkv, layer.bqkv)
        q, k, v = torch.split(
            qkv, [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1
        )
        q = self._rope(q.view(n, self.num_heads, hd), cos, sin)
        k = self._rope(k.view(n, self.num_kv_heads, hd), cos, sin)
        return q, k, v.view(n, self.num_kv_heads, hd)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (self.hidden,), layer.ln2, self.eps)
        gate, up = F.linear(h, layer.wgu, layer.bgu).chunk(2, dim=-1)
        return x + F.linear(self.act(gate) * up, layer.wdown, layer.bdown)

    def _group(self, q: torch.Tensor) -> torch.Tensor:
        """[n, heads, d] -> [1, kv_heads, groups*n, d]: queries sharing a KV head stacked."""
        n = q.shape[0]
        return (
            q.view(n, self.num_kv_heads, self.groups, self.head_dim)
            .permute(1, 2, 0, 3)
            .reshape(1, self.num_kv_heads, self.groups * n, self.head_dim)
        )

    def _ungroup(self, o: torch.Tensor, n: int) -> torch.Tensor:
        return (
            o.view(self.num_kv_heads, self.groups, n, self.head_dim)
            .permute(2, 0, 1, 3)
            .reshape(n, self.num_heads * self.head_dim)
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for hidden states [n, hidden] -> float32 logits [n, vocab]."""
        h = F.rms_norm(x, (self.hidden,), self.norm, self.eps)
        return F.linear(h, self.lm_head).float()

    # -- prefill ------------------------------------------------------------------------

    def embed_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] (on this device) -> the first layer's input, hidden states [n, hidden]."""
        return F.embedding(token_ids, self.embed)

    def prefill_chunk(
        self, token_ids: torch.Tensor, start: int, kv: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions [start, start+n) of one sequence whose KV for [0, start) is
        already in `kv`; write their KV into `kv` and return the last token's hidden state.
        `on_layer(i)` is called as soon as layer i's KV of these tokens is in `kv` (final:
        nothing writes it again), so a caller can ship it while later layers compute.

        Determinism: every output depends on the shapes of the GEMMs and of the attention
        call (CPU and GPU kernels pick different reduction orders for different M). Callers
        keep the chunk boundaries a function of absolute positions only, so a block's KV is
        the same bits whether this prompt, or another sharing the prefix, computed it.
        """
        x = self.embed_ids(token_ids)
        return self.run_layers(x, start, kv, 0, self.num_layers, on_layer)[-1:]

    def run_layers(
        self, x: torch.Tensor, start: int, kv: torch.Tensor, lo: int, hi: int,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Layers [lo, hi) of `prefill_chunk` for hidden states x [n, hidden] at positions
        [start, start+n): what a pipeline stage holding those layers computes. `kv` holds
        only those layers (kv[i - lo] is layer i's); `on_layer` gets the global layer index.
        Returns the hidden states after layer hi-1, [n, hidden]. The whole model's pass is
        this over [0, num_layers), so a stage and a single instance run the same kernels on
        the same inputs: splitting the layers changes no bit."""
        n = x.shape[0]
        end = start + n
        cos, sin = self.cos[start:end, None], self.sin[start:end, None]
        mask: torch.Tensor | None = None
        for i in range(lo, hi):
            layer, j = self.layers[i], i - lo
            q, k, v = self._qkv(layer, x, cos, sin)
            kv[j, 0, :, start:end].copy_(k.transpose(0, 1))
            kv[j, 1, :, start:end].copy_(v.transpose(0, 1))
            if on_layer is not None:
                on_layer(i)
            keys, values = kv[j, 0, None, :, :end], kv[j, 1, None, :, :end]
            o: torch.Tensor | None = None
            if self._fused is not None and n > 1:
                o = self._attend_fused(q, keys, values)
            if o is None:
                if mask is None and n > 1:  # bottom-right causal: query i sees keys <= start+i
                    qpos = (torch.arange(n, device=self.device) + start).repeat(self.groups)
                    mask = torch.arange(end, device=self.device)[None, :] <= qpos[:, None]
                g = F.scaled_dot_product_attention(self._group(q), keys, values, attn_mask=mask)
                o = self._ungroup(g[0], n)
            x = x + F.linear(o, layer.wo, layer.bo)
            x = self._mlp(layer, x)
        return x

    def _attend_fused(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor | None:
        """Chunk attention through the fused CUDA kernels; None if they cannot run here."""
        from torch.nn.attention.bias import causal_lower_right

        n, end = q.shape[0], keys.shape[2]
        while self._fused is not None:
            gqa = self._fused == "gqa"
            if not gqa:
                keys = keys.repeat_interleave(self.groups, dim=1)
                values = values.repeat_interleave(self.groups, dim=1)
            try:
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], keys, values,
                    attn_mask=causal_lower_right(n, end), enable_gqa=gqa,
                )
                return o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
            except (RuntimeError, ValueError, TypeError) as e:
                log.warning("fused causal attention (%s) unavailable: %s", self._fused, e)
                self._fused = "repeat" if gqa else None
        return None

    # -- decode -------------------------------------------------------------------------

    def decode(
        self,
        token_ids: torch.Tensor,
        positions: Sequence[int],
        kvs: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """One token for each of B sequences in one pass: sequence b's token sits at
        positions[b] and its KV lives in kvs[b]. Projections and MLP run batched over B;
        attention runs per sequence over its own length (no padding, no copying of KV).
        Returns float32 logits [B, vocab]."""
        b = token_ids.shape[0]
        if b != len(positions) or b != len(kvs):
            raise InvalidArgument("token_ids, positions and kvs must have the same length")
        x = self.embed_ids(token_ids)
        return self.logits(self.decode_layers(x, positions, kvs, 0, self.num_layers))

    def decode_layers(
        self, x: torch.Tensor, positions: Sequence[int], kvs: Sequence[torch.Tensor],
        lo: int, hi: int,
    ) -> torch.Tensor:
        """Layers [lo, hi) of `decode` for hidden states x [B, hidden]; kvs[b] holds only
        those layers (kvs[b][i - lo] is layer i's). Returns the hidden states [B, hidden]."""
        b = x.shape[0]
        pos = torch.tensor(positions, device=self.device)
        cos, sin = self.cos[pos, None], self.sin[pos, None]
        for i in range(lo, hi):
            layer, li = self.layers[i], i - lo
            q, k, v = self._qkv(layer, x, cos, sin)
            kvnew = torch.stack((k, v), dim=1)  # [B, 2, kv_heads, d]
            outs = []
            for j in range(b):
                p, cache = positions[j], kvs[j]
                cache[li, :, :, p].copy_(kvnew[j])
                keys, values = cache[li, 0, :, : p + 1], cache[li, 1, :, : p + 1]
                outs.append(self._attend_one(q[j], keys, values))
            attn = outs[0] if b == 1 else torch.cat(outs)
            x = x + F.linear(attn, layer.wo, layer.bo)
            x = self._mlp(layer, x)
        return x

    def _attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """One query token [heads, d] against K/V [kv_heads, n, d] -> [1, heads*d]."""
        if self._fused == "gqa":  # CUDA: 4-D inputs reach the fused (flash) kernels
            try:
                o = F.scaled_dot_product_attention(
                    q.view(1, self.num_heads, 1, self.head_dim), keys[None], values[None],
                    enable_gqa=True,
                )
                return o.reshape(1, self.num_heads * self.head_dim)
            except (RuntimeError, ValueError, TypeError) as e:
                log.warning("fused GQA decode attention unavailable: %s", e)
                self._fused = "repeat"
        # the query heads sharing a KV head become that head's rows: no K/V repetition. 4-D,
        # so the CPU's fused kernel runs it (3-D goes to the math path: 2x slower, measured)
        qg = q.view(1, self.num_kv_heads, self.groups, self.head_dim)
        o = F.scaled_dot_product_attention(qg, keys[None], values[None])
        return o.reshape(1, self.num_heads * self.head_dim)

    def forward_single(
        self, token_id: int, position: int, kv: torch.Tensor
    ) -> torch.Tensor:
        """Logits [1, vocab] of one token at `position` over kv[..., :position]. The token's
        own KV is written at `position` and left there (callers restore it if it matters)."""
        ids = torch.tensor([token_id], device=self.device)
        return self.decode(ids, [position], [kv])
