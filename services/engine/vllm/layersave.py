"""One step's block saves, staged layer by layer from vLLM's `save_kv_layer` hook.

vLLM calls `save_kv_layer(name, ...)` right after each attention layer has written its KV for
the step, in model order, then `wait_for_save` once after the forward pass. A block object is
header + payload `[layer, k|v, kv_head, token, head_dim]` (common.blocks), so layer L of a block
is one contiguous byte range of the object: `HEADER_SIZE + L * layer_bytes`, `layer_bytes` long.

`StepSave` copies layer L of every block the step saves into a host staging buffer as soon as
the hook names it (on a GPU this is the device-to-host copy that then overlaps the next
layers' compute; on a CPU it is a memcpy that would happen anyway, now split per layer), and
hands that byte range to a `LayerSink`. `finish` stages any layer the hook did not name (vLLM
skips the hooks in steps without attention metadata: correctness never depends on them),
writes the headers (checksum over the whole payload, so only after the last layer) and lets the
sink commit. The bytes stored are exactly those of a whole-block gather: same staging layout,
same header codec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from mooncake_k8s.common.blocks import HEADER_SIZE, BlockLayout, encode_header
from mooncake_k8s.common.errors import ObjectExists
from mooncake_k8s.engine.vllm.kvlayout import PagedKV


@dataclass(frozen=True)
class SaveGroup:
    """Blocks saved together: their keys, vLLM block ids and the segments of their replicas
    (in order; empty = the store places one)."""

    keys: list[str]
    block_ids: list[int]
    segments: tuple[str, ...] = ()


class LayerSink(Protocol):
    """Where staged blocks go. `layer` is told each layer's rows as soon as they are staged
    (a streaming sink writes them at their offsets in the background); `commit` gets the whole
    staged objects, headers included, once every layer is there, and returns one result per
    key of each group (None or ObjectExists = stored)."""

    def layer(self, li: int, lo: int, hi: int) -> None: ...

    def abort(self) -> None: ...

    def commit(self, groups: Sequence[SaveGroup], objects: np.ndarray
               ) -> list[list[Exception | None]]: ...


class StepSave:
    """One step's saves: a staging row per block, filled a layer at a time."""

    def __init__(self, paged: PagedKV, layout: BlockLayout, block_tokens: int,
                 groups: Sequence[SaveGroup], staging: np.ndarray, sink: LayerSink) -> None:
        self._paged, self._layout, self._bs = paged, layout, block_tokens
        self.groups = list(groups)
        self._buf = staging  # [blocks, block_bytes] uint8, owned by this step until finish
        flat = torch.from_numpy(staging[:, HEADER_SIZE:]).view(paged.dtype)
        self._payloads = flat.view(staging.shape[0], *paged.block_shape())
        self._rows: list[tuple[slice, list[int]]] = []
        row = 0
        for g in self.groups:
            self._rows.append((slice(row, row + len(g.keys)), list(g.block_ids)))
            row += len(g.keys)
        self._layer_bytes = layout.payload_bytes(block_tokens) // len(paged.layers)
        self._staged = [False] * len(paged.layers)
        self.sink = sink

    @property
    def blocks(self) -> int:
        return int(self._buf.shape[0])

    def layer(self, name: str) -> bool:
        """Stage the layer vLLM just computed; False when `name` is not one of ours or was
        staged already (nothing done)."""
        li = self._paged.index(name)
        if li < 0 or self._staged[li]:
            return False
        self._stage(li)
        return True

    def _stage(self, li: int) -> None:
        for rows, ids in self._rows:
            self._paged.gather_layer(li, ids, self._payloads[rows, li])
        self._staged[li] = True
        lo = HEADER_SIZE + li * self._layer_bytes
        self.sink.layer(li, lo, lo + self._layer_bytes)

    @property
    def layers(self) -> int:
        return len(self._staged)

    @property
    def staged_layers(self) -> int:
        return sum(self._staged)

    def finish(self) -> list[list[Exception | None]]:
        """Stage what the hooks missed, write the headers, commit: a result per key."""
        for li, done in enumerate(self._staged):
            if not done:
                self._stage(li)
        for i in range(self.blocks):
            self._buf[i, :HEADER_SIZE] = np.frombuffer(
                encode_header(self._layout, self._bs, self._buf[i, HEADER_SIZE:]),
                dtype=np.uint8)
        return self.sink.commit(self.groups, self._buf)


PutFn = Callable[[list[str], list[np.ndarray], tuple[str, ...]], list[Exception | None]]


class PutAtCommit:
    """The sink without a streaming put: the staged objects go to the store in one batched put
    per group at `commit` (the layers were only copied out of vLLM's cache early)."""

    def __init__(self, put: PutFn) -> None:
        self._put = put

    def layer(self, li: int, lo: int, hi: int) -> None:
        """Nothing to send before the whole objects are ready."""

    def abort(self) -> None:
        """Nothing was sent."""

    def commit(self, groups: Sequence[SaveGroup], objects: np.ndarray
               ) -> list[list[Exception | None]]:
        out: list[list[Exception | None]] = []
        row = 0
        for g in groups:
            n = len(g.keys)
            out.append(self._put(g.keys, list(objects[row:row + n]), g.segments))
            row += n
        return out


class StreamSink:
    """The streaming sink (store.client.streamput): the step's objects are leased up front on
    their segments (in the background, while layer 0 computes); each staged layer's byte
    range of every object is sent at once by the stream's sender thread, so the writes overlap
    the following layers; `commit` sends the headers last and publishes. An object the stream
    could not store (no lease, a node lost mid-stream) is put the plain way by `fallback`."""

    def __init__(self, stream: Any, fallback: PutFn) -> None:
        self._stream = stream
        self._fallback = fallback
        self.streamed = 0
        """Objects the last commit published through the stream."""

    @classmethod
    def open(cls, client: Any, groups: Sequence[SaveGroup], staging: np.ndarray,
             fallback: PutFn) -> StreamSink:
        from mooncake_k8s.store.client.streamput import StreamPut

        keys = [k for g in groups for k in g.keys]
        segments = [g.segments for g in groups for _ in g.keys]
        return cls(StreamPut(client, keys, list(staging), segments), fallback)

    def layer(self, li: int, lo: int, hi: int) -> None:
        for i in range(len(self._stream.keys)):
            self._stream.ready(i, lo, hi)

    def abort(self) -> None:
        """Nothing is committed; the leased space is released."""
        self._stream.abort()

    def commit(self, groups: Sequence[SaveGroup], objects: np.ndarray
               ) -> list[list[Exception | None]]:
        for i in range(len(self._stream.keys)):
            self._stream.ready(i, 0, HEADER_SIZE)
        flat: list[Exception | None] = list(self._stream.finish())
        self.streamed = sum(r is None for r in flat)
        out: list[list[Exception | None]] = []
        row = 0
        for g in groups:
            n = len(g.keys)
            res = flat[row:row + n]
            again = [j for j, r in enumerate(res) if _retry(r)]
            if again:
                redo = self._fallback([g.keys[j] for j in again],
                                      [objects[row + j] for j in again], g.segments)
                for j, r in zip(again, redo, strict=True):
                    res[j] = r
            out.append(res)
            row += n
        return out


def _retry(result: Exception | None) -> bool:
    """A stream result the plain put should try again (not stored, and not there already)."""
    return result is not None and not isinstance(result, ObjectExists)
