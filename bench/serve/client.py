"""One streamed OpenAI request, timed on the client side.

Every number the benchmark reports starts here, so the timing rules live in one place:

- TTFT: from just before the request is written to the first SSE chunk that carries a token
  (a chunk with a choice that has `text`, or a chat `delta.content`). The role-only first chat
  chunk of some servers and the final usage chunk (`choices: []`) are not tokens.
- ITL: the gaps between consecutive token chunks (vLLM's definition: one chunk may carry more
  than one token, and then the gap is per chunk, not per token).
- E2EL: from the send to the end of the stream (`data: [DONE]` or EOF).
- Output tokens: `usage.completion_tokens` when the server reports it (we always ask with
  `stream_options.include_usage`), else the number of token chunks.

A request never raises: anything that goes wrong (HTTP status, an SSE `error` event, a
timeout, a dropped connection) becomes `success=False` with a short message, and an HTTP 429
is flagged `rejected` so admission control shows up as its own count instead of as a crash.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ERROR_SNIPPET = 300  # characters of a server's error body kept per failed request


@dataclass(frozen=True)
class ApiConfig:
    """Where and how requests go; shared by every request of a run."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    timeout_s: float = 600.0
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass(frozen=True)
class RequestSpec:
    """What to send: a prompt (token ids for completions, text for chat) and its lengths."""

    prompt: list[int] | str
    prompt_len: int  # the intended prompt length in tokens (exact for token-id prompts)
    output_len: int
    arrival_s: float | None = None  # offset from the start of the run (trace replay), if any
    tag: str = ""  # free-form label: prefix group, trace row, reuse size, ...


@dataclass
class RequestOutput:
    """The client-side record of one request; times in seconds, `start` on perf_counter."""

    success: bool = False
    rejected: bool = False  # HTTP 429: refused by admission control
    status: int | None = None
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0  # usage.prompt_tokens when reported, else the spec's length
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    num_chunks: int = 0
    queue_wait: float = 0.0  # time spent waiting for a --max-concurrency slot
    tag: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "success": self.success, "rejected": self.rejected, "status": self.status,
            "error": self.error, "ttft_ms": self.ttft * 1e3, "e2el_ms": self.latency * 1e3,
            "itl_ms": [x * 1e3 for x in self.itl], "prompt_len": self.prompt_len,
            "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
            "queue_wait_ms": self.queue_wait * 1e3, "tag": self.tag,
        }


def build_body(cfg: ApiConfig, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body: greedy, exactly `output_len` tokens, usage in the stream."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, also ours: fixed output lengths
    if cfg.endpoint == "chat":
        text = spec.prompt if isinstance(spec.prompt, str) else " ".join(map(str, spec.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = spec.prompt
    return body


def _is_token_chunk(data: dict[str, Any]) -> bool:
    for choice in data.get("choices") or ():
        if "text" in choice and choice.get("text") is not None:
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") is not None or delta.get("reasoning_content") is not None:
            return True
    return False


def _error_message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        return str(err.get("message") or err)[:ERROR_SNIPPET]
    return str(data)[:ERROR_SNIPPET]


async def send(session: aiohttp.ClientSession, cfg: ApiConfig,
               spec: RequestSpec) -> RequestOutput:
    """Send one streamed request and time it; never raises (except on cancellation)."""
    out = RequestOutput(prompt_len=spec.prompt_len, tag=spec.tag)
    body = build_body(cfg, spec)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    usage: dict[str, Any] | None = None
    last_token_at = 0.0
    out.start = time.perf_counter()
    try:
        async with session.post(cfg.url, json=body, headers=cfg.headers(),
                                timeout=timeout) as resp:
            out.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    out.error = f"HTTP {resp.status}: {_error_message(json.loads(text))}"
                except ValueError:
                    out.error = f"HTTP {resp.status}: {text[:ERROR_SNIPPET]}"
                out.rejected = resp.status == 429
                return out
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line or not line.startswith(b"data:"):
                    continue  # blank separators, comments (": keep-alive"), "event:" lines
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    data = json.loads(payload)
                except ValueError:
                    snippet = payload[:ERROR_SNIPPET].decode(errors="replace")
                    out.error = f"bad SSE payload: {snippet}"
                    return out
                if not isinstance(data, dict):
                    continue
                if "error" in data:
                    out.error = f"stream error: {_error_message(data)}"
                    return out
                if data.get("usage"):
                    usage = data["usage"]
                if _is_token_chunk(data):
                    if out.num_chunks == 0:
                        out.ttft = now - out.start
                    else:
                        out.itl.append(now - last_token_at)
                    last_token_at = now
                    out.num_chunks += 1
            out.latency = time.perf_counter() - out.start
            if out.num_chunks == 0:
                out.error = "stream ended without a token"
                return out
            if not done:
                out.error = "stream ended without [DONE]"
                return out
    except TimeoutError:
        out.error = f"timeout after {cfg.timeout_s:.0f} s"
        return out
    except (aiohttp.ClientError, OSError, ValueError) as e:  # ValueError: an over-long line
        out.error = f"{type(e).__name__}: {str(e)[:ERROR_SNIPPET]}"
        return out
    out.success = True
    out.output_tokens = out.num_chunks
    if usage:
        out.output_tokens = int(usage.get("completion_tokens") or out.num_chunks)
        if usage.get("prompt_tokens"):
            out.prompt_len = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            out.cached_tokens = int(details["cached_tokens"])
    return out


async def get_json(session: aiohttp.ClientSession, url: str, api_key: str | None = None,
                   timeout_s: float = 10.0) -> Any:
    """GET a JSON document (model list); raises aiohttp errors for the caller to report."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(url, headers=headers,
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return await resp.json()


async def get_text(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> str | None:
    """GET a text document (Prometheus metrics); None when it is not there."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
