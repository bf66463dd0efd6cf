"""Incremental detokenisation and stop strings for one sequence.

Decoding token by token is wrong for byte-level BPE (a character may span tokens, so one token
alone decodes to U+FFFD) and for SentencePiece (a token's leading space depends on what comes
before). We keep two offsets into the token list, as vLLM does: text is decoded over a short
window that starts a few tokens back, and a token's text is released only once the window
decodes to more than it did before and does not end in a partial character.

Stop strings: generated text is searched as it grows; the matched stop string and everything
after it is dropped. A suffix that could still become a stop string is withheld until the next
tokens decide it, so a client never sees text that is later taken back.

The state is a pure function of (prompt tail, generated tokens, stop strings), so the decode
process rebuilds exactly the prefill process's state by replaying the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Prompt tokens kept as left context so the first generated token decodes with the right
#: leading space (SentencePiece) or byte merge.
CONTEXT_TOKENS = 5


class TextStream:
    """Turns a sequence's generated token ids into text deltas, honouring stop strings."""

    def __init__(self, tokenizer: Any | None, prompt_ids: Sequence[int], stop: Sequence[str]):
        self._tok = tokenizer
        self._ids = [int(t) for t in prompt_ids[-CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        """Generated text so far (after truncation at a stop string)."""
        self._emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        tok: Any = self._tok
        return str(tok.decode(ids, skip_special_tokens=True))

    def _advance(self, final: bool) -> str:
        """Newly decodable text; with `final`, also a trailing partial character."""
        window = self._ids[self._prefix :]
        full = self._decode(window)
        before = self._decode(self._ids[self._prefix : self._read])
        if len(full) > len(before) and (final or not full.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(before) :]
        return ""

    def _held(self) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _append(self, new: str) -> str:
        if new:
            start = max(0, len(self.text) - self._max_stop + 1)
            self.text += new
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held())

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text it releases. Check `stopped` after."""
        if self._tok is None or self.stopped:
            return ""
        self._ids.append(int(token_id))
        return self._append(self._advance(final=False))

    def flush(self) -> str:
        """Generation ended for another reason (EOS, length): release everything withheld."""
        if self._tok is None or self.stopped:
            return ""
        out = self._append(self._advance(final=True))
        if self.stopped:
            return out
        return out + self._emit(len(self.text))
