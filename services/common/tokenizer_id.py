"""The identity of a tokenizer: what it does, not which files it came from.

The Conductor tokenises every prompt and the workers compute KV for exactly those ids, so the
two must use the same tokenizer: a Conductor with another one sends ids the workers' model reads
as other words, and every answer is wrong while the HTTP status is 200. Workers put this
fingerprint in their load reports; the Conductor compares it with its own and is not ready
while they differ (`conductor.http.api.Frontend.not_ready`).

It hashes the tokenizer's behaviour: for a fast tokenizer its whole pipeline as the `tokenizers`
library serialises it (normaliser, pre-tokeniser, model with vocabulary and merges, post-
processor, decoder, added tokens), without the truncation and padding state that encoding calls
change; for a slow one its vocabulary. The chat template and the special tokens join either.
Two processes loading the same files with the same library versions get the same value;
formatting or file layout (a directory holding only the tokenizer files) does not change it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hex digest (16 bytes) naming what `tokenizer` (a transformers tokenizer) does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        pipeline.pop("truncation", None)
        pipeline.pop("padding", None)
    else:
        pipeline = sorted(tokenizer.get_vocab().items())
    doc = {
        "pipeline": pipeline,
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        "special": {name: str(getattr(tokenizer, name, None) or "") for name in _SPECIAL},
    }
    h = hashlib.blake2b(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(),
                        digest_size=16, person=b"mooncake-tokzr")
    return h.hexdigest()
