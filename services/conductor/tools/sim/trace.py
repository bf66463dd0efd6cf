"""Request traces in the Mooncake FAST'25 format: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``:
`hash_ids` name the prompt's blocks (512 tokens each in the published traces); equal ids at
equal positions mean an equal prefix, as our chained block keys do. A bad line is an error
that names the line, never a silent skip: a replay of a half-read trace is a wrong answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """The trace file is missing, empty or has a malformed line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]


def load(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """All requests (or the first `limit`), sorted by arrival, times relative to the first."""
    p = Path(path)
    try:
        f = p.open()
    except OSError as e:
        raise TraceError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from e
    out: list[TraceRequest] = []
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                d = json.loads(line)
                req = TraceRequest(float(d["timestamp"]), int(d["input_length"]),
                                   int(d["output_length"]),
                                   tuple(int(h) for h in d.get("hash_ids", ())))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{p}:{n}: not a trace record ({type(e).__name__}: {e}); "
                                 "expected timestamp, input_length, output_length, "
                                 "hash_ids") from None
            if req.input_tokens < 1 or req.output_tokens < 1 or req.arrival_ms < 0:
                raise TraceError(f"{p}:{n}: input_length and output_length must be >= 1 and "
                                 "timestamp >= 0")
            out.append(req)
    if not out:
        raise TraceError(f"trace {str(p)!r} has no requests")
    out.sort(key=lambda r: r.arrival_ms)
    t0 = out[0].arrival_ms
    if t0:
        out = [TraceRequest(r.arrival_ms - t0, r.input_tokens, r.output_tokens, r.blocks)
               for r in out]
    return out


def infer_block_tokens(reqs: list[TraceRequest]) -> int:
    """The block size a trace was cut with: the published traces use 512, and a request's
    block count is ceil(input / block), so the smallest power of two that fits all works."""
    for bt in (1 << e for e in range(13)):
        if all(len(r.blocks) == -(-r.input_tokens // bt) for r in reqs[:2000] if r.blocks):
            return bt
    raise TraceError("cannot infer the trace's block size; pass --block-tokens")
