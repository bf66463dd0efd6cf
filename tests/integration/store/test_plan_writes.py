"""Blocks whose layers are written by several processes (a pipeline group's stages), against a
real master process and real storage nodes: the leader's `StreamPut.plan()`, a stage's
`PlanWriter` writing its layers into every replica, the leader's `fill_remote`, headers and
commit (issue 21, docs/kv-block-contract.md "Blocks computed by a pipeline group").

The nodes run in this test's process with host ids of their own ("hA", "hB"), as in
test_copies_by_host: the leader's client is "on" hA and the stage's on hB, so each writes one
replica through shared memory and the other over TCP, and the leader reads back through shared
memory (its host's replica) or TCP (the tail, whose only replica is on hB).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from mooncake_k8s.common.blocks import (
    HEADER_SIZE,
    BlockLayout,
    decode_block,
    encode_block,
    encode_header,
)
from mooncake_k8s.common.checksum import checksum
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.client.planwrite import PlanWriter
from mooncake_k8s.store.client.streamput import StreamFailed, StreamPut
from mooncake_k8s.store.node.server import StorageNode
from mooncake_k8s.store.testing import StoreCluster, start_host_node
from mooncake_k8s.transfer import ReadOp

MiB = 1 << 20
LAYOUT = BlockLayout(b"\x07" * 16, "float16", layers=6, kv_heads=2, head_dim=16)
PER_TOKEN_LAYER = 2 * 2 * 16 * 2  # k|v x heads x head_dim x 2 bytes
SPLIT = 3  # the leader computes layers [0, 3), the stage [3, 6)


@dataclass
class Bed:
    cluster: StoreCluster
    nodes: dict[str, StorageNode]

    def client(self, host: str, **kw: object) -> StoreClient:
        return self.cluster.client(host_id=host, **kw)


@pytest.fixture
def bed() -> Iterator[Bed]:
    with StoreCluster() as cluster:
        cluster.start_master()
        nodes = {n: start_host_node(cluster, n, h, 8 * MiB)
                 for n, h in (("na", "hA"), ("nb", "hB"))}
        try:
            cluster.wait_nodes(len(nodes))
            yield Bed(cluster, nodes)
        finally:
            for n in nodes.values():
                n.stop()


def layer_range(tokens: int, lo: int, hi: int) -> tuple[int, int]:
    """Bytes of layers [lo, hi) in a block's encoding (header, then [layer, k|v, ...])."""
    per_layer = PER_TOKEN_LAYER * tokens
    return HEADER_SIZE + lo * per_layer, HEADER_SIZE + hi * per_layer


def blocks(token_counts: list[int], seed: int) -> list[bytes]:
    """Whole encodings, as a single instance computes and puts them."""
    rng = np.random.default_rng(seed)
    return [encode_block(LAYOUT, t, rng.integers(0, 256, LAYOUT.payload_bytes(t),
                                                 dtype=np.uint8).tobytes())
            for t in token_counts]


def partial(whole: list[bytes], tokens: list[int], lo: int, hi: int) -> list[bytearray]:
    """What a stage computing layers [lo, hi) holds: those layers, the rest junk."""
    out = []
    for w, t in zip(whole, tokens, strict=True):
        buf = bytearray(b"\xee" * len(w))
        a, b = layer_range(t, lo, hi)
        buf[a:b] = w[a:b]
        out.append(buf)
    return out


def stage_writes(writer: PlanWriter, tokens: list[int], results: list[object]) -> None:
    """A stage's side: layer by layer (as computed), every block, then its per-object report."""
    for layer in range(SPLIT, LAYOUT.layers):
        for i, t in enumerate(tokens):
            writer.ready(i, *layer_range(t, layer, layer + 1))
    results.extend(writer.finish())


def test_a_block_written_by_two_stages_equals_a_single_instance_block(bed: Bed) -> None:
    tokens = [64, 64, 64, 64, 10]  # four full blocks and a tail
    whole = blocks(tokens, 1)
    keys = [f"k{i}" for i in range(5)]
    with bed.client("hA") as lead, bed.client("hB") as other:
        segs = [["na-dram-0", "nb-dram-0"]] * 4 + [["nb-dram-0"]]
        mine = partial(whole, tokens, 0, SPLIT)
        put = StreamPut(lead, keys, mine, segs)
        plan = put.plan()
        assert put.plan() == plan  # leased once
        got: list[object] = []
        writer = PlanWriter(other, plan, partial(whole, tokens, SPLIT, LAYOUT.layers))
        stage = threading.Thread(target=stage_writes, args=(writer, tokens, got))
        stage.start()
        for layer in range(SPLIT):
            for i, t in enumerate(tokens):
                put.ready(i, *layer_range(t, layer, layer + 1))
        stage.join()
        assert got == [None] * 5
        assert writer.written == [b - a for a, b in
                                  (layer_range(t, SPLIT, LAYOUT.layers) for t in tokens)]
        assert writer.bytes_written == sum(w * len(s) for w, s in zip(writer.written, segs,
                                                                     strict=True))
        put.fill_remote([(i, *layer_range(t, SPLIT, LAYOUT.layers))
                         for i, t in enumerate(tokens)])
        for i, t in enumerate(tokens):
            mine[i][:HEADER_SIZE] = encode_header(LAYOUT, t, memoryview(mine[i])[HEADER_SIZE:])
            put.ready(i, 0, HEADER_SIZE)
        assert put.finish() == [None] * 5
        assert [bytes(m) for m in mine] == whole
        assert lead.batch_put([f"p{i}" for i in range(5)], whole, segments=segs[0]) == [None] * 5
    with bed.client("hC", location_cache=False) as reader:
        for i, key in enumerate(keys):
            info = reader._lookup([key])[0]
            plain = reader._lookup([f"p{i}"])[0]
            assert info is not None and plain is not None
            assert info.checksum == plain.checksum == checksum(whole[i])
            assert sorted(loc.segment.name for loc in info.replicas) == sorted(segs[i])
            for loc in info.replicas:  # every replica holds the single instance's bytes
                buf = bytearray(info.size)
                sums = reader.engine.read(loc.peer, [ReadOp(loc.segment, loc.offset,
                                                            memoryview(buf))], True)
                assert sums == [info.checksum] and bytes(buf) == whole[i]
            data = reader.get(key)  # the store-verified read any reader does
            header, _ = decode_block(data, LAYOUT)
            assert header.tokens == tokens[i]


def test_a_stage_whose_node_vanished_reports_failures_and_nothing_is_committed(
    bed: Bed,
) -> None:
    tokens = [64, 64, 64, 64, 10]
    whole = blocks(tokens, 2)
    keys = [f"v{i}" for i in range(5)]
    # the stage on a third host: every write of it goes over TCP (a same-host shared-memory
    # write into a dead node's file would not fail)
    with bed.client("hA") as lead, bed.client("hC", timeout_s=5) as other:
        segs = [["na-dram-0", "nb-dram-0"]] * 2 + [["na-dram-0"]] * 2 + [["nb-dram-0"]]
        mine = partial(whole, tokens, 0, SPLIT)
        put = StreamPut(lead, keys, mine, segs)
        writer = PlanWriter(other, put.plan(), partial(whole, tokens, SPLIT, LAYOUT.layers))
        bed.nodes.pop("nb").stop()
        got: list[object] = []
        stage_writes(writer, tokens, got)
        # per object: those with a replica on nb failed, those only on na reached it
        assert [g is None for g in got] == [False, False, True, True, False]
        assert all(isinstance(g, StreamFailed) and "nb" in str(g) for g in got if g)
        assert writer.written[:2] == [0, 0] and writer.written[2] > 0
        failed = [i for i, g in enumerate(got) if g is not None]
        # the tail's only replica was on nb: the leader cannot read it back
        with pytest.raises(StreamFailed, match="object 4"):
            put.fill_remote([(4, *layer_range(10, SPLIT, LAYOUT.layers))])
        for layer in range(SPLIT):
            for i, t in enumerate(tokens):
                put.ready(i, *layer_range(t, layer, layer + 1))
        res = put.finish(skip=failed)
        assert all(isinstance(r, StreamFailed) for r in res)
        assert lead.exists(keys) == [False] * 5


def test_ranges_no_stage_wrote_are_never_committed(bed: Bed) -> None:
    tokens = [64, 64]
    whole = blocks(tokens, 3)
    with bed.client("hA") as lead:
        mine = partial(whole, tokens, 0, SPLIT)
        put = StreamPut(lead, ["g0", "g1"], mine, [["na-dram-0", "nb-dram-0"]] * 2)
        put.plan()
        for layer in range(SPLIT):  # the stage died: its layers never arrive
            for i, t in enumerate(tokens):
                put.ready(i, *layer_range(t, layer, layer + 1))
        # object 1's stage layers are filled back, object 0's are not
        put.fill_remote([(1, *layer_range(64, SPLIT, LAYOUT.layers))])
        for i in range(2):
            put.ready(i, 0, HEADER_SIZE)
        res = put.finish()
        assert isinstance(res[0], StreamFailed) and "never written" in str(res[0])
        assert res[1] is None  # filled (here: zeros the leased space held) counts as written
        assert lead.exists(["g0", "g1"]) == [False, True]


def test_bad_plans_and_ranges_are_refused(bed: Bed) -> None:
    tokens = [64, 10]
    whole = blocks(tokens, 4)
    with bed.client("hA") as lead:
        put = StreamPut(lead, ["r0", "r1"], partial(whole, tokens, 0, 1),
                        [["na-dram-0"]] * 2)
        plan = put.plan()
        views = [bytearray(len(w)) for w in whole]
        for bad, why in ((b"", "not a stream plan"), (b"garbage!", "not a stream plan"),
                         (b"MCPL\x02" + plan[5:], "version 2 is not supported"),
                         (plan[:5] + b"\xff\xff\xff", "corrupt"),
                         (plan[:5], "names no objects")):
            with pytest.raises(InvalidArgument, match=why):
                PlanWriter(lead, bad, views)
        with pytest.raises(InvalidArgument, match="3 views for a plan of 2 objects"):
            PlanWriter(lead, plan, [*views, bytearray(5)])
        with pytest.raises(InvalidArgument, match="view 1 has"):
            PlanWriter(lead, plan, [views[0], bytearray(7)])
        writer = PlanWriter(lead, plan, views)
        for i, s, e in ((1, 0, len(whole[1]) + 1), (0, -1, 5), (0, 9, 9), (2, 0, 1)):
            with pytest.raises(InvalidArgument, match="outside"):
                writer.ready(i, s, e)
            with pytest.raises(InvalidArgument, match="outside"):
                put.fill_remote([(i, s, e)])
            with pytest.raises(InvalidArgument, match="outside"):
                put.ready(i, s, e)
        assert writer.finish() == [None, None] and writer.bytes_written == 0
        gone = PlanWriter(lead, plan, views)
        gone.abort()
        gone.ready(0, 0, 64)  # after abort: ignored, nothing written
        assert all(isinstance(r, StreamFailed) for r in gone.finish())
        assert gone.bytes_written == 0
        put.abort()
        assert lead.exists(["r0", "r1"]) == [False, False]
