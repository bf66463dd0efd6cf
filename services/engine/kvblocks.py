"""Move KV between the engine's cache tensors and encoded blocks (DESIGN §3).

Import verifies each block (header, model layout, token count, payload checksum) and copies its
payload straight into a token range of a cache tensor: one strided copy, no intermediate
tensor. A block handed over as a pinned CPU tensor goes to the GPU by DMA without staging.
Verification (an xxh3 pass over the payload) runs on a thread pool when blocks are large: xxhash
releases the GIL, and on a GPU host one core checksums slower than PCIe copies.

Export copies a token range out into one contiguous buffer and prefixes the header.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..common.blocks import HEADER_SIZE, BlockLayout, decode_block, encode_header
from ..common.buffers import byte_view
from ..common.errors import IntegrityError

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _payload_tensor(block: Any, payload: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """The payload as a flat tensor of `dtype`, sharing memory with `block`."""
    if isinstance(block, torch.Tensor):  # keep it a tensor: pinned memory stays pinned
        return block.reshape(-1)[HEADER_SIZE:].view(dtype)
    with warnings.catch_warnings():  # read-only buffers are fine: we only read from them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=dtype)


class BlockCodec:
    """Verifies, imports and exports blocks of one model layout."""

    def __init__(self, layout: BlockLayout, block_tokens: int, verify_threads: int = 1) -> None:
        self.layout = layout
        self.block_tokens = block_tokens
        self.dtype = _TORCH[layout.dtype]
        self._threads = verify_threads
        self._pool: ThreadPoolExecutor | None = None

    def _verify(self, block: Any, tokens: int) -> torch.Tensor:
        header, payload = decode_block(block, self.layout)
        if header.tokens != tokens:
            raise IntegrityError(f"block holds {header.tokens} tokens, expected {tokens}")
        shape = (self.layout.layers, 2, self.layout.kv_heads, tokens, self.layout.head_dim)
        return _payload_tensor(block, payload, self.dtype).view(shape)

    def verified(
        self, blocks: Sequence[Any], tokens: Sequence[int]
    ) -> Iterator[torch.Tensor | IntegrityError]:
        """Each block's payload as a `kv_shape` tensor, or the IntegrityError it failed with.
        Results come in order; with a pool, later blocks are verified while earlier ones are
        being copied by the caller."""

        def one(i: int) -> torch.Tensor | IntegrityError:
            try:
                return self._verify(blocks[i], tokens[i])
            except IntegrityError as e:
                return e

        big = len(blocks) > 1 and self.layout.block_bytes(self.block_tokens) >= (1 << 20)
        if self._threads <= 1 or not big:
            return (one(i) for i in range(len(blocks)))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kv-verify")
        return self._pool.map(one, range(len(blocks)))

    def copy_in(self, kv: torch.Tensor, start: int, payload: torch.Tensor) -> None:
        """Write a verified payload into kv[..., start:start+tokens, :]."""
        end = start + payload.shape[3]
        pinned = payload.device.type == "cpu" and kv.device.type == "cuda" and payload.is_pinned()
        kv[:, :, :, start:end].copy_(payload, non_blocking=pinned)

    def export(self, kv: torch.Tensor, start: int, end: int) -> bytes:
        """Encode kv[..., start:end, :] as one block (header + payload)."""
        part = kv[:, :, :, start:end].contiguous()
        if part.device.type != "cpu":
            part = part.cpu()
        view = byte_view(part.reshape(-1).view(torch.uint8))
        return b"".join((encode_header(self.layout, end - start, view), view))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
