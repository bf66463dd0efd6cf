"""Layer-wise export of a prefill's new blocks: each layer's slice of each block is copied into
the block's encoding as soon as the forward pass has made it final, and handed to a sink that
can send it on while the next layers compute.

A block is `header + payload[layer, k|v, kv_head, token, head_dim]`, so layer L of a block is
one contiguous byte range of its encoding. Prefill computes in chunks at absolute positions;
layer L of block b is final once the chunk holding b's last token has written layer L's KV
(before that layer's attention even runs: nothing later writes those positions again). Chunks
that are not block multiples leave a straddling block for a later chunk; the per-layer cursor
below picks it up there. The headers hold the payload's checksum, so they come last.

The encodings are byte-identical to `BlockCodec.export`'s, so a block streamed here and one
stored after the prefill are the same object.

A pipeline stage (`stage`) holds only layers [lo, hi): its export fills just those layers'
ranges of the full-size encodings (byte offsets are always those of the whole block, so every
stage's ranges land where a single instance's would) and writes no headers; the leader fills
the other stages' ranges from the store, then writes the headers over the whole payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from mooncake_k8s.common.blocks import HEADER_SIZE, BlockLayout, encode_header
from mooncake_k8s.common.buffers import byte_view


class LayerSink(Protocol):
    """Where a prefill streams its new blocks (the adapter's `StreamPut`)."""

    def open(self, first_block: int, views: Sequence[memoryview], tail: bool) -> None:
        """The encodings about to be filled: full blocks `first_block`, `first_block + 1`, ...
        and, when `tail`, the partial last block after them."""
        ...

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        """Bytes [start, end) of encoding `index` are final (once `event` completes, if any)."""
        ...


class LayerExport:
    """The new blocks' encodings of one prefill, filled layer by layer (see the module doc)."""

    def __init__(self, kv: torch.Tensor, layout: BlockLayout, block_tokens: int,
                 first: int, n: int, sink: LayerSink,
                 layers: tuple[int, int] | None = None) -> None:
        """`kv` holds layers `layers` = [lo, hi) (default all; kv[i - lo] is layer i's)."""
        self.kv = kv
        self.lo, self.hi = layers if layers is not None else (0, layout.layers)
        if not 0 <= self.lo < self.hi <= layout.layers or kv.shape[0] != self.hi - self.lo:
            raise ValueError(f"layers [{self.lo}, {self.hi}) do not match a KV tensor of "
                             f"{kv.shape[0]} layers in a model of {layout.layers}")
        self.layout = layout
        self.bt = block_tokens
        self.first, self.full, self.n = first, n // block_tokens, n
        self.tail = n % block_tokens
        self.sink = sink
        sizes = [layout.block_bytes(block_tokens)] * (self.full - first)
        if self.tail:
            sizes.append(layout.block_bytes(self.tail))
        cuda = kv.device.type == "cuda"
        buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=cuda) if cuda else None
        self._buf = buf if buf is not None else torch.from_numpy(np.empty(sum(sizes), np.uint8))
        self._objects: list[torch.Tensor] = []
        pos = 0
        for size in sizes:
            self._objects.append(self._buf[pos:pos + size])
            pos += size
        self.views = [byte_view(o.numpy()) for o in self._objects]
        nl = self.hi - self.lo  # per own layer: the first block not yet exported
        self._cursor = [first] * nl
        self._tail_done = [False] * nl
        self._cuda = cuda
        sink.open(first, self.views, bool(self.tail))

    def _payload(self, index: int, tokens: int) -> torch.Tensor:
        """Encoding `index`'s payload as `[layer, k|v, head, token, d]` of the KV's dtype."""
        lay = self.layout
        return self._objects[index][HEADER_SIZE:].view(self.kv.dtype).view(
            lay.layers, 2, lay.kv_heads, tokens, lay.head_dim)

    def after_layer(self, layer: int, end: int) -> None:
        """KV of positions [0, end) is final for `layer`: export what that completes."""
        j = layer - self.lo
        lo, hi = self._cursor[j], min(self.full, end // self.bt)
        items: list[tuple[int, int]] = [(b - self.first, self.bt) for b in range(lo, hi)]
        self._cursor[j] = max(lo, hi)
        if self.tail and end >= self.n and not self._tail_done[j]:
            items.append((self.full - self.first, self.tail))
            self._tail_done[j] = True
        if not items:
            return
        for index, tokens in items:
            t0 = (self.first + index) * self.bt
            self._payload(index, tokens)[layer].copy_(
                self.kv[j, :, :, t0:t0 + tokens], non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.kv.device))
        for index, _ in items:
            start, end = self.layer_range(index, layer, layer + 1)
            self.sink.ready(index, start, end, event)

    def tokens(self, index: int) -> int:
        """Tokens in encoding `index` (the tail's are fewer)."""
        return self.tail if (self.tail and index == len(self.views) - 1) else self.bt

    def layer_range(self, index: int, lo: int, hi: int) -> tuple[int, int]:
        """Byte range [start, end) of layers [lo, hi) in encoding `index` (header included
        in the offsets: the coordinates of the whole block)."""
        step = self.layout.payload_bytes(self.tokens(index)) // self.layout.layers
        return HEADER_SIZE + lo * step, HEADER_SIZE + hi * step

    def finish(self, headers: bool = True) -> tuple[list[memoryview], memoryview | None]:
        """Check every own layer was exported; with `headers`, write and send the headers
        (every layer's bytes must be in the encodings by then). Returns (full blocks'
        encodings, the tail's or None)."""
        if self._cuda:
            torch.cuda.current_stream(self.kv.device).synchronize()
        missing = [self.lo + i for i, c in enumerate(self._cursor) if c < self.full]
        if missing or (self.tail and not all(self._tail_done)):
            raise AssertionError(f"layers {missing} of the prefill's blocks were not exported")
        full = self.views[: self.full - self.first]
        tail = self.views[-1] if self.tail else None
        if not headers:
            return full, tail
        for i, view in enumerate(self.views):
            self._objects[i][:HEADER_SIZE].numpy()[:] = np.frombuffer(
                encode_header(self.layout, self.tokens(i), view[HEADER_SIZE:]), np.uint8)
            self.sink.ready(i, 0, HEADER_SIZE)
        return full, tail
