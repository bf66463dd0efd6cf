"""Model loading: the converted-model cache, fingerprints, local directories, random weights."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mooncake_k8s.common.blocks import decode_block
from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine import loading
from mooncake_k8s.engine.embedded import (
    BUILTIN_NAME,
    Engine,
    EngineConfig,
    ModelLoadError,
    load_engine,
)
from mooncake_k8s.engine.embedded.testing import GREEDY, all_blocks, decode_alone, prompt_tokens

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_second_load_reads_the_cache(engine: Engine) -> None:
    """The session engine converted (or found) the model; loading again must not convert."""
    t = time.perf_counter()
    path, sha = loading.ensure_builtin(progress=False)
    assert time.perf_counter() - t < 5, "a cached model must not be converted again"
    assert path.name == f"{BUILTIN_NAME}-{sha[:16]}"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "mooncake-source.json"):
        assert (path / name).is_file(), name
    meta = json.loads((path / "mooncake-source.json").read_text())
    assert meta["sha256"] == sha
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    assert engine.served_name == BUILTIN_NAME and len(engine.fingerprint) == 16


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOONCAKE_CACHE_DIR", str(tmp_path))
    assert loading.cache_root() == tmp_path
    monkeypatch.delenv("MOONCAKE_CACHE_DIR")
    assert loading.cache_root().name == "mooncake-k8s"


def test_publish_tolerates_losing_the_rename_race(tmp_path: Path) -> None:
    final = tmp_path / "model"
    a, b = tmp_path / ".tmp-a", tmp_path / ".tmp-b"
    for d, tag in ((a, "a"), (b, "b")):
        d.mkdir()
        (d / "config.json").write_text(tag)
    assert loading.publish(a, final) is True
    assert loading.publish(b, final) is False, "the second writer must keep the first copy"
    assert (final / "config.json").read_text() == "a" and b.exists()
    c = tmp_path / ".tmp-c"
    c.mkdir()
    (c / "config.json").write_text("c")
    junk = tmp_path / "junk"
    (junk / "sub").mkdir(parents=True)
    with pytest.raises(OSError):  # a non-model directory in the way is an error, not a cache
        loading.publish(c, junk)


def test_namespace_and_keys_are_salted_by_tenant(engine: Engine) -> None:
    ids = prompt_tokens(engine, 200)
    keys = engine.block_keys(ids)
    assert len(keys) == 3 and keys == engine.block_keys([*ids, 5, 6])[:3]
    assert engine.block_keys(ids, tenant="acme") != keys
    ns = engine.namespace("acme")
    assert (ns.model_fingerprint, ns.dtype, ns.block_tokens, ns.tenant_salt) == (
        engine.fingerprint.hex(), "float32", 64, "acme")


def _tiny_dir(tmp_path: Path, name: str = "tiny-llama") -> Path:
    src, _ = loading.ensure_builtin(progress=False)
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    return d


def test_random_weights_engine_runs_and_has_its_own_identity(
    engine: Engine, tmp_path: Path
) -> None:
    d = _tiny_dir(tmp_path)
    cfg = EngineConfig(model=str(d), random_weights=True, block_tokens=16, max_batch=4)
    tiny = load_engine(cfg, progress=False)
    assert tiny.fingerprint != engine.fingerprint and tiny.served_name == "tiny-llama-random"
    assert tiny.layout.layers == 2 and tiny.max_context == 1024
    again = load_engine(cfg, progress=False)
    assert again.fingerprint == tiny.fingerprint, "same config, same random identity"
    ids = prompt_tokens(tiny, 70)
    cold = tiny.prefill(ids, [], GREEDY)
    blocks = [b for _, b in cold.new_blocks]
    assert len(blocks) == 4 and cold.tail_block is not None
    hit = again.prefill(ids, blocks, GREEDY)  # another engine, same weights
    assert hit.first_token == cold.first_token and hit.tail_block == cold.tail_block
    a = decode_alone(tiny, "a", ids, all_blocks(cold), cold.first_token, GREEDY)
    b = decode_alone(again, "b", ids, all_blocks(hit, blocks), hit.first_token, GREEDY)
    assert a == b
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        tiny.prefill([49152], [], GREEDY)


def test_bfloat16_blocks_round_trip(tmp_path: Path) -> None:
    d = _tiny_dir(tmp_path)
    cfg = EngineConfig(model=str(d), random_weights=True, block_tokens=16, dtype="bfloat16")
    tiny = load_engine(cfg, progress=False)
    ids = prompt_tokens(tiny, 40)
    cold = tiny.prefill(ids, [], GREEDY)
    header, _ = decode_block(cold.new_blocks[0][1], tiny.layout)
    assert header.layout.dtype == "bfloat16" and tiny.namespace().dtype == "bfloat16"
    hit = tiny.prefill(ids, [b for _, b in cold.new_blocks], GREEDY)
    assert (hit.first_token, hit.tail_block) == (cold.first_token, cold.tail_block)


def test_local_model_directory(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = _tiny_dir(tmp_path, "my-model")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(d)  # type: ignore[no-untyped-call]
    eng = load_engine(EngineConfig(model=str(d)), progress=False)
    assert eng.served_name == "my-model"
    assert eng.fingerprint == loading.fingerprint_dir(d)
    assert eng.chat_tokens([{"role": "user", "content": "hi"}])
    torch.manual_seed(2)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(d)  # type: ignore[no-untyped-call]
    assert loading.fingerprint_dir(d) != eng.fingerprint, "new weights, new identity"


def test_bad_model_directories(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_engine(EngineConfig(model=str(tmp_path / "nope")), progress=False)
    with pytest.raises(InvalidArgument, match=r"has no config\.json"):
        load_engine(EngineConfig(model=str(tmp_path)), progress=False)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InvalidArgument, match="model_type 'gpt2' is not a Llama-family"):
        load_engine(EngineConfig(model=str(gpt2)), progress=False)
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_engine(EngineConfig(model=str(no_tok)), progress=False)


def test_fused_attention_formulation_matches_the_masked_one(tmp_path: Path) -> None:
    """The CUDA chunk path (lower-right causal bias, native GQA) computes what the CPU path
    does; run here on the CPU, where torch materialises the same bias."""
    d = _tiny_dir(tmp_path)
    tiny = load_engine(EngineConfig(model=str(d), random_weights=True, block_tokens=16))
    model = tiny.model
    ids = torch.tensor(prompt_tokens(tiny, 80))
    with torch.inference_mode():
        out = []
        for fused in (None, "gqa", "repeat"):
            model._fused = fused
            kv = model.new_kv(80)
            for s in range(0, 80, 32):  # chunks that start past 0 exercise the alignment
                h = model.prefill_chunk(ids[s : s + 32], s, kv)
            out.append((h, kv))
    assert model._fused == "repeat", "the fused path must not have fallen back"
    for h, kv in out[1:]:
        torch.testing.assert_close(h, out[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv, out[0][1], rtol=1e-4, atol=1e-4)


def test_staged_group_view_matches_per_block_slices() -> None:
    """The GPU import/export path moves groups of blocks through one staging tensor; its view
    of the cache must address exactly each block's token range."""
    from mooncake_k8s.common.blocks import BlockLayout
    from mooncake_k8s.engine.embedded.kvblocks import BlockCodec

    codec = BlockCodec(BlockLayout(b"f" * 16, "float32", 3, 2, 8), block_tokens=4)
    kv = torch.randn(3, 2, 2, 40, 8)
    groups = codec._token_groups(kv, 8, 5)  # blocks 2..6
    assert groups.shape == (5, 3, 2, 2, 4, 8)
    for j in range(5):
        assert torch.equal(groups[j], kv[:, :, :, 8 + 4 * j : 12 + 4 * j])
    stage = torch.randn(5, 3, 2, 2, 4, 8)
    codec._token_groups(kv, 8, 5).copy_(stage)
    for j in range(5):
        assert torch.equal(kv[:, :, :, 8 + 4 * j : 12 + 4 * j], stage[j])


def test_larger_prefill_chunks_recompute_a_partial_chunk_of_imports(tmp_path: Path) -> None:
    """With 32-token chunks over 16-token blocks, an import ending mid-chunk is cut back to
    the chunk boundary, so the computation (and its bits) match a cold run."""
    d = _tiny_dir(tmp_path)
    cfg = EngineConfig(model=str(d), random_weights=True, block_tokens=16,
                       prefill_chunk_tokens=32)
    tiny = load_engine(cfg, progress=False)
    ids = prompt_tokens(tiny, 90)
    cold = tiny.prefill(ids, [], GREEDY)
    blocks = [b for _, b in cold.new_blocks]
    assert len(blocks) == 5
    res = tiny.prefill(ids, blocks[:3], GREEDY)
    assert (res.cached_tokens, res.rejected_blocks) == (32, 0)
    assert res.new_blocks == cold.new_blocks[2:]
    assert (res.first_token, res.tail_block) == (cold.first_token, cold.tail_block)
    full = tiny.prefill(ids, blocks, GREEDY)
    assert full.cached_tokens == 64 and full.new_blocks == cold.new_blocks[4:]
