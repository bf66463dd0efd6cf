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
                 first: int, n: int, sink: LayerSink) -> None:
        self.kv = kv
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
        self._cursor = [first] * layout.layers  # per layer: the first block not yet exported
        self._tail_done = [False] * layout.layers
        self._cuda = cuda
        sink.open(first, self.views, bool(self.tail))

    def _payload(self, index: int, tokens: int) -> torch.Tensor:
        """Encoding `index`'s payload as `[layer, k|v, head, token, d]` of the KV's dtype."""
        lay = self.layout
        return self._objects[index][HEADER_SIZE:].view(self.kv.dtype).view(
            lay.layers, 2, lay.kv_heads, tokens, lay.head_dim)

    def after_layer(self, layer: int, end: int) -> None:
        """KV of positions [0, end) is final for `layer`: export what that completes."""
        lo, hi = self._cursor[layer], min(self.full, end // self.bt)
        items: list[tuple[int, int]] = [(b - self.first, self.bt) for b in range(lo, hi)]
        self._cursor[layer] = max(lo, hi)
        if self.tail and end >= self.n and not self._tail_done[layer]:
            items.append((self.full - self.first, self.tail))
            self._tail_done[layer] = True
        if not items:
            return
        for index, tokens in items:
            t0 = (self.first + index) * self.bt
            self._payload(index, tokens)[layer].copy_(
                self.kv[layer, :, :, t0:t0 + tokens], non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.kv.device))
        for index, tokens in items:
            step = self.layout.payload_bytes(tokens) // self.layout.layers
            start = HEADER_SIZE + layer * step
            self.sink.ready(index, start, start + step, event)

    def finish(self) -> tuple[list[memoryview], memoryview | None]:
        """Headers written and sent: (full blocks' encodings, the tail's or None)."""
        if self._cuda:
            torch.cuda.current_stream(self.kv.device).synchronize()
        missing = [i for i, c in enumerate(self._cursor) if c < self.full]
        if missing or (self.tail and not all(self._tail_done)):
            raise AssertionError(f"layers {missing} of the prefill's blocks were not exported")
        for i, view in enumerate(self.views):
            tokens = self.tail if (self.tail and i == len(self.views) - 1) else self.bt
            self._objects[i][:HEADER_SIZE].numpy()[:] = np.frombuffer(
                encode_header(self.layout, tokens, view[HEADER_SIZE:]), np.uint8)
            self.sink.ready(i, 0, HEADER_SIZE)
        full = self.views[: self.full - self.first]
        return full, (self.views[-1] if self.tail else None)
