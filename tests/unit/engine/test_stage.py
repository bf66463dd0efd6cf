"""Pipeline stages of a prefill group (issue 21) with the real model, in one process: a group
of 2 or 3 `EmbeddedStage`s, run chunk by chunk as the runtime does (hidden states passed as
raw bytes), gives the single instance's first token and byte-identical KV blocks, cold and
from imported blocks, with pipeline chunks of one and of several compute chunks.

First the KV goes to in-memory stand-ins of the store's streamed put and plan writer (a
`Board` that records each stage's byte ranges and lets the leader read the others' back),
so the engine's side is checked on its own (failures included); then against a real store
(master and nodes on loopback): the blocks a group stores are the single instance's, each
reuses what the other stored, and an object a stage could not write is never committed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from mooncake_k8s.common.blocks import HEADER_SIZE
from mooncake_k8s.common.errors import InvalidArgument, ObjectExists
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.rpc import store_pb2 as spb
from mooncake_k8s.engine.api import EngineFailed, KVPlan, PrefillDone, PrefillWork
from mooncake_k8s.engine.embedded import Engine
from mooncake_k8s.engine.embedded.stage import EmbeddedStage, stage_layers
from mooncake_k8s.engine.embedded.testing import GREEDY, prompt_tokens
from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.client.streamput import StreamFailed
from mooncake_k8s.store.testing import StoreCluster, store_cluster


class Board:
    """Where the group's KV bytes go: the leader's put and the other stages' writers."""

    def __init__(self) -> None:
        self.put: MemPut | None = None
        self.writers: list[MemWriter] = []
        self.fail_writes: set[int] = set()
        self.fail_fill = False
        self.results: list[Exception | None] | None = None

    def make_put(self, work: PrefillWork, first: int, views: Sequence[memoryview],
                 tail: bool) -> MemPut:
        self.put = MemPut(self, views, tail)
        self.writers = []  # a new prompt: the other stages open theirs after this
        return self.put

    def make_writer(self, plan: bytes, views: Sequence[memoryview]) -> MemWriter:
        assert plan == b"mem-plan"
        w = MemWriter(self, views)
        self.writers.append(w)
        return w


def _covered(ranges: list[tuple[int, int, int]], index: int, start: int, end: int) -> bool:
    got = sorted((s, e) for i, s, e in ranges if i == index and start <= s and e <= end)
    pos = start
    for s, e in got:
        if s != pos:
            return False
        pos = e
    return pos == end


class MemPut:
    def __init__(self, board: Board, views: Sequence[memoryview], tail: bool) -> None:
        self.board, self.views, self.tail = board, views, tail
        self.ranges: list[tuple[int, int, int]] = []
        self.filled: list[tuple[int, int, int]] = []
        self.aborted = False
        self.skipped: Sequence[int] = ()
        self.committed: list[bytes] = []

    def plan(self) -> bytes:
        return b"mem-plan"

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        self.ranges.append((index, start, end))

    def fill_remote(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        if self.board.fail_fill:
            raise StreamFailed("no replica answered")
        for i, s, e in ranges:
            src = [w for w in self.board.writers if _covered(w.ranges, i, s, e)]
            assert len(src) == 1, f"no stage wrote exactly [{s}, {e}) of object {i}"
            self.views[i][s:e] = src[0].views[i][s:e]
            self.filled.append((i, s, e))

    def finish(self, skip: Sequence[int] = ()) -> list[Exception | None]:
        self.skipped = skip
        self.committed = [bytes(v) for v in self.views]
        if self.board.results is not None:
            return self.board.results
        return [StreamFailed("skipped") if i in skip else None for i in range(len(self.views))]

    def abort(self) -> None:
        self.aborted = True


class MemWriter:
    def __init__(self, board: Board, views: Sequence[memoryview]) -> None:
        self.board, self.views = board, views
        self.ranges: list[tuple[int, int, int]] = []
        self.bytes_written = 0
        self.aborted = False

    def ready(self, index: int, start: int, end: int, event: Any = None) -> None:
        self.ranges.append((index, start, end))
        self.bytes_written += end - start

    def finish(self) -> list[Exception | None]:
        return [StreamFailed("lost") if i in self.board.fail_writes else None
                for i in range(len(self.views))]

    def abort(self) -> None:
        self.aborted = True


NO_STORE: Any = None
"""These stages read no blocks (no reuse) and write through the board: no store needed."""


def make_group(engine: Engine, size: int, board: Board,
               store: Any = NO_STORE) -> list[EmbeddedStage]:
    return [EmbeddedStage(engine, store, s, size, put_factory=board.make_put,
                          writer_factory=board.make_writer) for s in range(size)]


def work_for(engine: Engine, rid: str, ids: list[int], reuse: int = 0,
             max_tokens: int = 20, tenant: str = "", **plan: Any) -> PrefillWork:
    """The work for a prompt; `tenant` salts its keys (a store test's own namespace)."""
    kv = KVPlan(tuple(engine.block_keys(ids, tenant)), local_blocks=reuse, **plan)
    return PrefillWork(rid, ids, tenant, pb.Sampling(temperature=0, max_tokens=max_tokens), kv)


def wire(stages: list[EmbeddedStage], i: int, hidden: torch.Tensor | None,
         tokens: int) -> torch.Tensor | None:
    """Stage i-1's output as stage i receives it: raw bytes, rebuilt."""
    if hidden is None:
        return None
    return stages[i].hidden_from_bytes(bytes(stages[i - 1].hidden_view(hidden)), tokens)


def run_group(stages: list[EmbeddedStage], work: PrefillWork, chunk: int,
              reuse_keys: Sequence[str] = (), fail: Sequence[int] = ()) -> PrefillDone:
    """What the runtime does, in one thread: begin everywhere, agree on the start, open the
    KV writes, push each pipeline chunk through every stage (hidden states as bytes)."""
    ids, rid = work.token_ids, work.request_id
    verified = [st.begin(rid, ids, reuse_keys) for st in stages]
    leader = stages[0]
    first = leader.recompute_from(verified)
    plan = leader.open_put(work, first)
    for st in stages[1:]:
        st.open_writer(first, plan)
    n, bt = len(ids), leader.engine.block_tokens
    last: torch.Tensor | None = None
    for s in range(first * bt, n, chunk):
        e = min(n, s + chunk)
        hidden: torch.Tensor | None = None
        for i, st in enumerate(stages):
            hidden = st.forward(s, e, wire(stages, i, hidden, e - s))
            assert hidden.shape == (e - s, st.hidden_size) and hidden.is_contiguous()
        assert hidden is not None
        last = hidden[-1:]
    if leader.needs_last_token_pass():
        last = None
        for i, st in enumerate(stages):
            last = st.last_token_pass(wire(stages, i, last, 1))
    failed: list[int] = []
    for st in stages[1:]:
        f, _ = st.end_writes()
        failed += f
    assert last is not None
    return leader.complete(work, last, [(st.lo, st.hi) for st in stages[1:]], [*failed, *fail])


def test_stage_layers_are_balanced_and_contiguous() -> None:
    assert [stage_layers(30, 2, s) for s in range(2)] == [(0, 15), (15, 30)]
    for layers in (1, 7, 30, 32):
        for size in range(1, min(layers, 9) + 1):
            spans = [stage_layers(layers, size, s) for s in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            widths = [hi - lo for lo, hi in spans]
            assert min(widths) >= 1 and max(widths) - min(widths) <= 1


@pytest.mark.parametrize(("layers", "size", "stage", "msg"), [
    (30, 2, 2, r"pipeline stage 2 is not in \[0, 2\)"),
    (30, 2, -1, r"pipeline stage -1 is not in \[0, 2\)"),
    (30, 0, 0, "a pipeline group of 0 stages"),
    (4, 5, 0, "a pipeline group of 5 stages cannot split a model of 4 layers"),
])
def test_bad_stage_indexes_are_refused(layers: int, size: int, stage: int, msg: str) -> None:
    with pytest.raises(InvalidArgument, match=msg):
        stage_layers(layers, size, stage)


def single(engine: Engine, ids: list[int], imported: Sequence[Any] = ()) -> tuple[int, list[bytes]]:
    """The single instance's first token and new objects (full blocks, then the tail)."""
    res = engine.prefill(ids, list(imported), GREEDY)
    objs = [bytes(b) for _, b in res.new_blocks]
    if res.tail_block is not None:
        objs.append(bytes(res.tail_block))
    return res.first_token, objs


# (stages, prompt tokens, pipeline chunk): each length with 2 and 3 stages, each chunk size
# with both (not the whole cross product: the long cases cost seconds each in CI)
# Long cases: several chunks and a partial last block (520 = 2 x 256 + 8; 400 = 6 x 64 + 16).
CASES = [(2, 40, 64), (3, 40, 64), (2, 4 * 64, 64), (3, 4 * 64, 256), (2, 520, 256),
         (3, 400, 64)]


@pytest.mark.parametrize(("size", "n", "chunk"), CASES)
def test_a_group_computes_the_single_instance_bits(
        engine: Engine, n: int, chunk: int, size: int) -> None:
    ids = prompt_tokens(engine, n, variant=n + chunk)
    token, objs = single(engine, ids)
    board = Board()
    done = run_group(make_group(engine, size, board), work_for(engine, f"g{n}", ids), chunk)
    assert done.first_token == token
    put = board.put
    assert put is not None and not put.aborted
    assert put.committed == objs
    # a finished request's tail is skipped; none here (max_tokens 20)
    assert list(put.skipped) == [] and done.stored_blocks == n // 64
    assert done.tail_key == (f"tail/g{n}" if n % 64 else "")
    assert (done.cached_tokens, done.computed_tokens) == (0, n)
    # each stage streamed exactly its own layers: the leader also the headers, last
    step = [(len(v) - HEADER_SIZE) // engine.model.num_layers for v in put.views]
    stages = make_group(engine, size, Board())
    for st, ranges in zip(stages, [put.ranges] + [w.ranges for w in board.writers],
                          strict=True):
        for i in range(len(put.views)):
            mine = sorted((s, e) for j, s, e in ranges if j == i and s >= HEADER_SIZE)
            assert mine[0][0] == HEADER_SIZE + st.lo * step[i]
            assert mine[-1][1] == HEADER_SIZE + st.hi * step[i] and len(mine) == st.hi - st.lo
    assert [r for r in put.ranges if r[1] == 0] == [(i, 0, HEADER_SIZE) for i in
                                                     range(len(put.views))]


def test_a_request_finished_at_its_first_token_stores_no_tail(engine: Engine) -> None:
    ids = prompt_tokens(engine, 150, variant=2)
    board = Board()
    done = run_group(make_group(engine, 2, board), work_for(engine, "f", ids, max_tokens=1), 64)
    assert done.finished and done.finish_reason == "length" and done.tail_key == ""
    assert board.put is not None and list(board.put.skipped) == [2]
    assert done.stored_blocks == 2


def test_a_stage_that_could_not_write_fails_the_prompt_retriably(engine: Engine) -> None:
    ids = prompt_tokens(engine, 150, variant=3)
    board = Board()
    board.fail_writes = {1}
    stages = make_group(engine, 3, board)
    with pytest.raises(EngineFailed, match=r"could not store their layers of KV objects \[1\]"):
        run_group(stages, work_for(engine, "w", ids), 64)
    assert board.put is not None and board.put.aborted and not board.put.committed
    # the prompt is gone everywhere it ended; a new one starts cleanly on every stage
    with pytest.raises(InvalidArgument, match="has no prompt"):
        stages[0].forward(0, 64, None)
    board.fail_writes = set()
    assert run_group(stages, work_for(engine, "w2", ids), 64).first_token == single(engine, ids)[0]


def test_layers_that_cannot_be_read_back_fail_the_prompt(engine: Engine) -> None:
    ids = prompt_tokens(engine, 100, variant=4)
    board = Board()
    board.fail_fill = True
    with pytest.raises(EngineFailed, match="reading the other stages' KV layers back"):
        run_group(make_group(engine, 2, board), work_for(engine, "r", ids), 64)
    assert board.put is not None and board.put.aborted and not board.put.committed


def test_objects_the_store_refused_fail_the_prompt_but_existing_ones_do_not(
        engine: Engine) -> None:
    ids = prompt_tokens(engine, 130, variant=5)  # 2 blocks + a tail
    board = Board()
    board.results = [ObjectExists("stored by another prefill"), None, None]
    done = run_group(make_group(engine, 2, board), work_for(engine, "e", ids), 64)
    assert done.stored_blocks == 1 and done.tail_key == "tail/e"
    board.results = [None, StreamFailed("lease expired"), None]
    with pytest.raises(EngineFailed, match="storing 1 of 3 new KV objects failed"):
        run_group(make_group(engine, 2, board), work_for(engine, "e2", ids), 64)


def test_bad_calls_get_clear_errors(engine: Engine) -> None:
    ids = prompt_tokens(engine, 200, variant=6)
    board = Board()
    s0, s1 = make_group(engine, 2, board)
    with pytest.raises(InvalidArgument, match="has no prompt"):
        s1.forward(0, 64, None)
    for st in (s0, s1):
        assert st.begin("b", ids, []) == 0
    with pytest.raises(InvalidArgument, match="open_put is the leader's; this is stage 1"):
        s1.open_put(work_for(engine, "b", ids), 0)
    with pytest.raises(InvalidArgument, match="not open_writer"):
        s0.open_writer(0, b"mem-plan")
    with pytest.raises(InvalidArgument, match="holds the KV of 0 leading blocks only"):
        s0.open_put(work_for(engine, "b", ids), 1)
    with pytest.raises(InvalidArgument, match="the work has 199 tokens, the prompt 200"):
        s0.open_put(work_for(engine, "b", ids[:-1]), 0)
    plan = s0.open_put(work_for(engine, "b", ids), 0)
    with pytest.raises(InvalidArgument, match="no KV plan for the new blocks from block 0"):
        s1.open_writer(0, b"")
    s1.open_writer(0, plan)
    with pytest.raises(InvalidArgument, match="takes no hidden states"):
        s0.forward(0, 64, torch.zeros(64, s0.hidden_size, dtype=s0.dtype))
    h = s0.forward(0, 64, None)
    with pytest.raises(InvalidArgument, match="computes from position 64 next"):
        s0.forward(0, 64, None)
    with pytest.raises(InvalidArgument, match="must end at a multiple of the compute chunk"):
        s0.forward(64, 100, None)
    with pytest.raises(InvalidArgument, match="needs the previous stage's hidden states"):
        s1.forward(0, 64, None)
    with pytest.raises(InvalidArgument, match=r"hidden states must be \[64, 576\] torch.float32, "
                       r"got \[32, 576\] torch.float32"):
        s1.forward(0, 64, h[:32])
    with pytest.raises(InvalidArgument, match=r"got \[64, 576\] torch.float16"):
        s1.forward(0, 64, h.half())
    with pytest.raises(InvalidArgument, match="of 64 tokens are 147456 bytes"):
        s1.hidden_from_bytes(bytes(100), 64)
    with pytest.raises(InvalidArgument, match="not a block multiple"):
        s1.last_token_pass(h[-1:])
    with pytest.raises(InvalidArgument, match="computed positions up to 64 of 200"):
        s0.complete(work_for(engine, "b", ids), h[-1:], [(15, 30)], [])
    s1.forward(0, 64, h)  # the good calls still work after the refused ones
    out = s1.forward(64, 200, s0.forward(64, 200, None))
    work = work_for(engine, "b", ids)
    with pytest.raises(InvalidArgument, match=r"layer ranges \[\(10, 30\)\] and \[0, 15\) "
                       "do not tile"):
        s0.complete(work, out[-1:], [(10, 30)], [])
    with pytest.raises(InvalidArgument, match="layer ranges end at layer 20"):
        s0.complete(work, out[-1:], [(15, 20)], [])
    with pytest.raises(InvalidArgument, match=r"last hidden state must be \[1, 576\]"):
        s0.complete(work, out, [(15, 30)], [])
    assert board.put is not None and board.put.aborted  # a failed complete drops the prompt
    with pytest.raises(InvalidArgument, match="has no prompt"):
        s0.complete(work, out[-1:], [(15, 30)], [])
    s1.abort()
    s1.abort()  # idempotent
    assert board.writers[0].aborted
    with pytest.raises(InvalidArgument, match=r"pipeline stage 2 is not in \[0, 2\)"):
        EmbeddedStage(engine, NO_STORE, 2, 2)


# -- against a real store ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[StoreCluster]:
    with store_cluster(nodes=2, dram_size="128MiB") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def clients(store: StoreCluster) -> Iterator[list[StoreClient]]:
    """One client a stage (each stage is its own process in a group)."""
    made = [store.client() for _ in range(3)]
    yield made
    for c in made:
        c.close()


def segments(client: StoreClient) -> tuple[str, str]:
    home, write = (s.name for s in sorted(client.stats().segments, key=lambda s: s.node_id))
    return home, write


def store_group(engine: Engine, size: int, clients: list[StoreClient]) -> list[EmbeddedStage]:
    return [EmbeddedStage(engine, clients[s], s, size) for s in range(size)]


def test_a_group_stores_the_blocks_a_single_instance_would(
        engine: Engine, clients: list[StoreClient]) -> None:
    client = clients[0]
    home, write = segments(client)
    ids = prompt_tokens(engine, 5 * 64 + 20, variant=11)
    token, objs = single(engine, ids)
    work = work_for(engine, "sg", ids, tenant="sg", home_segment=home, write_segment=write)
    done = run_group(store_group(engine, 2, clients), work, 128)
    assert (done.first_token, done.stored_blocks, done.tail_key) == (token, 5, "tail/sg")
    keys = [*work.plan.keys, done.tail_key]
    assert [bytes(client.get(k)) for k in keys] == objs
    # the leader wrote its half of the layers and the headers: blocks twice, the tail once
    half = [HEADER_SIZE + (len(o) - HEADER_SIZE) // 2 for o in objs]
    assert done.kv_bytes == 2 * sum(half[:5]) + half[5]
    got = client._call("GetReplicas", spb.GetReplicasRequest(keys=keys)).objects
    assert [sorted(r.segment for r in o.replicas) for o in got] == \
        [sorted([home, write])] * 5 + [[write]]
    # the group's prefix is reused whole by a single instance
    again = engine.prefill(ids, [client.get(k) for k in work.plan.keys[:4]], GREEDY)
    assert (again.first_token, again.rejected_blocks, again.cached_tokens) == (token, 0, 4 * 64)


@pytest.mark.parametrize(("n", "reuse", "size", "chunk"), [
    (520, 3, 3, 256),     # 3 blocks from the store, the rest computed (2 chunks)
    (4 * 64, 4, 2, 64),   # a full hit: only the one-token pass runs, through every stage
])
def test_a_group_reuses_a_single_instances_blocks(
        engine: Engine, clients: list[StoreClient], n: int, reuse: int, size: int,
        chunk: int) -> None:
    client = clients[0]
    ids = prompt_tokens(engine, n, variant=12 + n)
    cold = engine.prefill(ids, [], GREEDY)
    work = work_for(engine, f"r{n}", ids, reuse, tenant=f"r{n}")
    keys = work.plan.keys
    client.batch_put(keys[:reuse], [b for _, b in cold.new_blocks[:reuse]])
    token, objs = single(engine, ids, [client.get(k) for k in keys[:reuse]])
    done = run_group(store_group(engine, size, clients), work, chunk, keys[:reuse])
    assert done.first_token == token == cold.first_token
    assert (done.cached_tokens, done.imported_blocks) == (min(reuse * 64, n - 1), reuse)
    new = [*keys[reuse:], *([done.tail_key] if n % 64 else [])]
    assert [bytes(client.get(k)) for k in new] == objs


def test_the_group_computes_from_the_shortest_verified_prefix(
        engine: Engine, clients: list[StoreClient]) -> None:
    ids = prompt_tokens(engine, 300, variant=13)
    keys = engine.block_keys(ids, "v")
    cold = engine.prefill(ids, [], GREEDY)
    clients[0].batch_put(keys[:3], [b for _, b in cold.new_blocks[:3]])
    s0, s1 = store_group(engine, 2, clients)
    assert s0.begin("v", ids, keys[:4]) == 3  # the 4th is not stored: the read ends there
    assert s1.begin("v", ids, keys[:3]) == 3
    assert s0.recompute_from([3, 2]) == 2
    s0.abort()
    s1.abort()


def test_an_object_a_stage_could_not_write_is_never_committed(
        engine: Engine, clients: list[StoreClient]) -> None:
    client = clients[0]
    home, write = segments(client)
    ids = prompt_tokens(engine, 2 * 64 + 5, variant=14)
    work = work_for(engine, "nc", ids, tenant="nc", home_segment=home, write_segment=write)
    with pytest.raises(EngineFailed, match=r"KV objects \[1\] of 3"):
        run_group(store_group(engine, 2, clients), work, 64, fail=[1])
    # nothing committed, not even the objects every stage wrote
    assert client.exists([*work.plan.keys, "tail/nc"]) == [False, False, False]
