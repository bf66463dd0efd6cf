"""Gather/scatter between vLLM's paged KV layouts and our block payload (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from mooncake_k8s.engine.vllm.kvlayout import PagedKV, UnsupportedLayout

L, B, H, BS, D = 3, 6, 2, 4, 8


def _cpu_caches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(B, H, BS, 2 * D, generator=g)
            for i in reversed(range(L))}  # registration order must not matter


def test_cpu_layout_k_then_v_rows_per_head() -> None:
    caches = _cpu_caches()
    paged = PagedKV.from_caches(caches)
    assert (paged.kind, paged.kv_heads, paged.block_size, paged.head_dim) == ("cpu", H, BS, D)
    out = torch.empty(2, *paged.block_shape())
    paged.gather([4, 1], out)
    layer1 = caches["model.layers.1.self_attn.attn"]
    rows = layer1[4].view(H, 2 * BS, D)  # the backend's own reading: K rows, then V rows
    assert torch.equal(out[0, 1, 0], rows[:, :BS])
    assert torch.equal(out[0, 1, 1], rows[:, BS:])


@pytest.mark.parametrize("flash", [False, True])
def test_scatter_inverts_gather_into_other_blocks(flash: bool) -> None:
    if flash:
        caches = {f"model.layers.{i}.attn": torch.randn(2, B, BS, H, D) for i in range(L)}
    else:
        caches = _cpu_caches()
    paged = PagedKV.from_caches(caches)
    assert paged.kind == ("flash" if flash else "cpu")
    blocks = torch.empty(2, *paged.block_shape())
    paged.gather([0, 3], blocks)
    before = {n: t.clone() for n, t in caches.items()}
    paged.scatter([5, 2], blocks)
    again = torch.empty_like(blocks)
    paged.gather([5, 2], again)
    assert torch.equal(again, blocks)
    for n, t in caches.items():  # only the target blocks changed
        dim = 1 if flash else 0
        keep = [i for i in range(B) if i not in (5, 2)]
        assert torch.equal(t.index_select(dim, torch.tensor(keep)),
                           before[n].index_select(dim, torch.tensor(keep)))


def test_flash_layout_matches_the_payload_contract() -> None:
    kv = torch.randn(2, B, BS, H, D)
    paged = PagedKV.from_caches({"model.layers.0.attn": kv})
    out = torch.empty(1, *paged.block_shape())
    paged.gather([2], out)
    # payload [layer, k|v, head, token, dim]
    assert torch.equal(out[0, 0, 0, 1], kv[0, 2].permute(1, 0, 2)[1])
    assert torch.equal(out[0, 0, 1, 0, :, 3], kv[1, 2, :, 0, 3])


@pytest.mark.parametrize("caches", [
    {},
    {"model.layers.0.attn": torch.zeros(4, 4, 4)},
    {"model.layers.0.attn": torch.zeros(4, 2, 4, 8),
     "model.layers.1.attn": torch.zeros(4, 2, 4, 16)},
])
def test_unknown_layouts_are_refused(caches: dict[str, torch.Tensor]) -> None:
    with pytest.raises(UnsupportedLayout):
        PagedKV.from_caches(caches)
