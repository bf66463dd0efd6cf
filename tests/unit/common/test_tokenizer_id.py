"""`common.tokenizer_id`: one value per tokenizer behaviour, whatever the files or their use.

The Conductor compares its tokenizer's fingerprint with the workers' (issue 18): it must be equal
for the same tokenizer however it was stored and used (a tokenizer-only copy, encoding calls that
set truncation and padding), and differ when the ids or the chat template would differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mooncake_k8s.common.tokenizer_id import tokenizer_fingerprint

_TEXT = ["the quick brown fox jumps over the lazy dog", "a cluster serves one model",
         "prefill and decode agree on every token id"] * 10


def _trained(path: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_TEXT, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # Weights beside it: what a tokenizer-only copy leaves out.
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def _load(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained(tmp_path_factory.mktemp("tok"), 100)


def test_same_tokenizer_same_fingerprint_however_stored_or_used(model: Path,
                                                                tmp_path: Path) -> None:
    fp = tokenizer_fingerprint(_load(model))
    assert len(fp) == 32 and fp == tokenizer_fingerprint(_load(model))
    copy = tmp_path / "tokenizer-only"
    copy.mkdir()
    for f in model.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, copy / f.name)
    assert tokenizer_fingerprint(_load(copy)) == fp
    used = _load(model)
    used(["some text", "more"], truncation=True, max_length=4, padding="max_length")
    assert used.backend_tokenizer.truncation is not None  # the call left its state behind
    assert tokenizer_fingerprint(used) == fp


def test_other_ids_or_template_other_fingerprint(model: Path, tmp_path: Path) -> None:
    fp = tokenizer_fingerprint(_load(model))
    other = _load(_trained(tmp_path / "other", 80))
    assert len(other) != len(_load(model))  # a smaller vocabulary: other ids
    assert tokenizer_fingerprint(other) != fp
    templated = _load(model)
    templated.chat_template = "{{ messages[0]['content'] }}"
    assert tokenizer_fingerprint(templated) != fp
