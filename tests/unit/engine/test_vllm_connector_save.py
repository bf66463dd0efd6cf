"""The KV connector's worker side against a real store: layer-wise saves store exactly the bytes
of a whole-block save, and what is saved loads back into other vLLM blocks.

vLLM's paged KV is stood in for by tensors of its CPU layout (vLLM itself runs in
tests/e2e/test_vllm.py); the connector, the store (master and node processes on loopback) and
the streaming put are real. The hooks are called as vLLM's attention wrapper calls them: one
`save_kv_layer` per layer in model order, then `wait_for_save`.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from types import SimpleNamespace as NS

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

with warnings.catch_warnings():  # vLLM's imports warn about torch deprecations
    warnings.simplefilter("ignore")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from mooncake_k8s.common.blocks import BlockLayout, encode_block
    from mooncake_k8s.engine.vllm.connector import MooncakeK8sConnector, MooncakeMeta, _Load
    from mooncake_k8s.engine.vllm.kvlayout import PagedKV
    from mooncake_k8s.engine.vllm.layersave import SaveGroup

from mooncake_k8s.store.client import StoreClient
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.store.testing import StoreCluster, store_cluster

L, B, H, BS, D = 4, 12, 2, 4, 8
FP = "ab" * 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreCluster]:
    """Node n0 on this host (segment "n0-dram-0") and, in this process, node "far" that says
    it is on another host ("far-dram-0"): reads from it count as remote."""
    with store_cluster(nodes=1) as c:
        far = StorageNode(NodeConfig(master=c.master_address, node_id="far", token=c.token,
                                     dram_size=32 << 20, host_id="another-host",
                                     prefault=False))
        far.start()
        try:
            assert far.wait_registered(20)
            yield c
        finally:
            far.stop()


@pytest.fixture
def store(cluster: StoreCluster) -> Iterator[StoreClient]:
    with cluster.client() as s:
        yield s


def _caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(B, H, BS, 2 * D, generator=g).to(torch.bfloat16) for n in NAMES}


def _worker(cluster: StoreCluster, monkeypatch: pytest.MonkeyPatch, caches: dict[str, torch.Tensor],
            stream: bool | None = None) -> MooncakeK8sConnector:
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", cluster.token)
    extra: dict[str, object] = {"master": cluster.master_address, "fingerprint": FP}
    if stream is not None:
        extra["stream_saves"] = stream
    cfg = NS(kv_transfer_config=NS(kv_connector_extra_config=extra, is_kv_producer=True),
             cache_config=NS(block_size=BS, cache_dtype="auto"),
             model_config=NS(dtype=torch.bfloat16))
    c = MooncakeK8sConnector(cfg, KVConnectorRole.WORKER, None)
    c.register_kv_caches(caches)
    return c


def _whole_blocks(caches: dict[str, torch.Tensor], block_ids: list[int]) -> list[bytes]:
    """What the connector stored before layer-wise saves: every layer gathered, then encoded."""
    paged = PagedKV.from_caches(caches)
    out = torch.empty(len(block_ids), *paged.block_shape(), dtype=paged.dtype)
    paged.gather(block_ids, out)
    layout = BlockLayout(bytes.fromhex(FP), "bfloat16", L, H, D)
    return [encode_block(layout, BS, out[i].view(torch.uint8).numpy())
            for i in range(len(block_ids))]


def _keys(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:02d}".encode().hex().ljust(32, "0")[:32] for i in range(n)]


def _step(c: MooncakeK8sConnector, meta: MooncakeMeta, hooked: list[str]) -> None:
    """One forward pass as vLLM drives the connector."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    for name in hooked:
        c.wait_for_layer_load(name)
        c.save_kv_layer(name, torch.empty(0), object())
    c.wait_for_save()
    c.clear_connector_metadata()


@pytest.mark.parametrize("stream", [True, False])
def test_layerwise_save_stores_the_bytes_of_a_whole_block_save(
        cluster: StoreCluster, store: StoreClient, monkeypatch: pytest.MonkeyPatch,
        stream: bool) -> None:
    caches = _caches(1)
    c = _worker(cluster, monkeypatch, caches, stream)
    tag = "s" if stream else "p"
    a, b = _keys(tag + "a", 3), _keys(tag + "b", 2)
    meta = MooncakeMeta(saves=[SaveGroup(a, [3, 7, 0]), SaveGroup(b, [11, 5])])
    _step(c, meta, NAMES)
    assert c._stats["layers_hooked"] == L and c._stats["layers_late"] == 0
    assert c._stats["saved"] == 5 and c._stats["save_failed"] == 0
    assert c._stats["streamed"] == (5 if stream else 0)
    want = _whole_blocks(caches, [3, 7, 0, 11, 5])
    assert [bytes(store.get(k)) for k in a + b] == want
    c.shutdown()


def test_layers_the_hooks_skip_are_staged_at_wait_for_save(
        cluster: StoreCluster, store: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    caches = _caches(2)
    c = _worker(cluster, monkeypatch, caches)
    keys = _keys("late", 2)
    # vLLM skips the hooks in a step without attention metadata; two layers are named here,
    # one of them twice and one unknown name: neither stages anything again.
    _step(c, MooncakeMeta(saves=[SaveGroup(keys, [2, 9])]),
          [NAMES[1], NAMES[1], "model.layers.99.mlp", NAMES[3]])
    assert c._stats["layers_hooked"] == 2 and c._stats["layers_late"] == L - 2
    assert [bytes(store.get(k)) for k in keys] == _whole_blocks(caches, [2, 9])
    c.shutdown()


def test_a_layer_is_stored_as_it_was_when_its_hook_ran(
        cluster: StoreCluster, store: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy out of vLLM's cache happens in the layer's hook, not after the forward pass."""
    caches = _caches(3)
    before = {n: t.clone() for n, t in caches.items()}
    c = _worker(cluster, monkeypatch, caches)
    keys = _keys("hook", 1)
    c.bind_connector_metadata(MooncakeMeta(saves=[SaveGroup(keys, [4])]))
    c.start_load_kv(None)
    for name in NAMES:
        c.save_kv_layer(name, caches[name], object())
        caches[name][4].fill_(0)  # vLLM would not; shows when the layer was read
    c.wait_for_save()
    assert bytes(store.get(keys[0])) == _whole_blocks(before, [4])[0]
    c.shutdown()


def test_saved_blocks_load_into_other_vllm_blocks(
        cluster: StoreCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _caches(4)
    saver = _worker(cluster, monkeypatch, src)
    keys = _keys("load", 3)
    _step(saver, MooncakeMeta(saves=[SaveGroup(keys, [1, 6, 8])]), NAMES)
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    loader = _worker(cluster, monkeypatch, dst)
    missing = _keys("none", 1)
    _step(loader, MooncakeMeta(loads=[_Load([*keys, *missing], [10, 2, 3, 0])]), NAMES)
    for n in NAMES:
        assert torch.equal(dst[n][[10, 2, 3]], src[n][[1, 6, 8]])
    assert loader._stats["loaded"] == 3 and loader._stats["missing"] == 1
    assert loader.get_block_ids_with_load_errors() == {0}  # vLLM recomputes that block
    saver.shutdown()
    loader.shutdown()


def _replicas(store: StoreClient, key: str) -> list[str]:
    got = store._lookup([key], use_cache=False)[0]
    return sorted(loc.segment.name for loc in got.replicas) if got else []


@pytest.mark.parametrize("stream", [True, False])
def test_new_blocks_get_a_replica_on_each_planned_segment(
        cluster: StoreCluster, store: StoreClient, monkeypatch: pytest.MonkeyPatch,
        stream: bool) -> None:
    caches = _caches(5)
    c = _worker(cluster, monkeypatch, caches, stream)
    keys = _keys("two" + "sp"[stream], 2)
    _step(c, MooncakeMeta(saves=[SaveGroup(keys, [1, 2], ("n0-dram-0", "far-dram-0"))]),
          NAMES)
    assert c._stats["saved"] == 2 and c._stats["streamed"] == (2 if stream else 0)
    for k, want in zip(keys, _whole_blocks(caches, [1, 2]), strict=True):
        assert _replicas(store, k) == ["far-dram-0", "n0-dram-0"]
        assert bytes(store.get(k)) == want
    c.shutdown()


def test_blocks_read_from_another_host_are_kept_where_the_plan_says(
        cluster: StoreCluster, store: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _caches(6)
    saver = _worker(cluster, monkeypatch, src)
    keys = _keys("keep", 2)
    _step(saver, MooncakeMeta(saves=[SaveGroup(keys, [3, 4], ("far-dram-0",))]), NAMES)
    assert [_replicas(store, k) for k in keys] == [["far-dram-0"]] * 2
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    loader = _worker(cluster, monkeypatch, dst)
    _step(loader, MooncakeMeta(loads=[_Load(keys, [7, 8], keep_on="n0-dram-0")]), NAMES)
    assert loader._stats["loaded"] == 2
    assert [_replicas(store, k) for k in keys] == [["far-dram-0", "n0-dram-0"]] * 2
    for n in NAMES:
        assert torch.equal(dst[n][[7, 8]], src[n][[3, 4]])
    saver.shutdown()
    loader.shutdown()


def test_a_step_that_never_reached_wait_for_save_is_dropped_not_committed(
        cluster: StoreCluster, store: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    caches = _caches(7)
    c = _worker(cluster, monkeypatch, caches)
    lost, kept = _keys("lost", 1), _keys("kept", 1)
    c.bind_connector_metadata(MooncakeMeta(saves=[SaveGroup(lost, [2])]))
    c.save_kv_layer(NAMES[0], caches[NAMES[0]], object())  # the forward pass failed here
    _step(c, MooncakeMeta(saves=[SaveGroup(kept, [3])]), NAMES)
    assert store.exists(lost + kept) == [False, True]
    assert bytes(store.get(kept[0])) == _whole_blocks(caches, [3])[0]
    c.shutdown()
