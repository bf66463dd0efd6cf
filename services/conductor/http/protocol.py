"""The OpenAI request bodies we accept, validated with pydantic, and the error format.

Unknown fields are ignored as OpenAI does, but fields we would silently get wrong (n > 1,
logprobs, tools, echo, ...) are refused with a 400 that names them: an honest "unsupported"
beats a response that quietly differs from what was asked.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 4
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Every integer field is bounded to what its wire type carries (`Sampling.seed` is int64, the
token budgets fit int32), so an out-of-range value is a 400 naming the field here, never a
ValueError from protobuf later (a 500)."""


class ApiError(Exception):
    """An error for the client, in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers
        """Extra response headers (a 429's `Retry-After`)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    user: str | None = None
    ignore_eos: bool = False
    """Extension (as in vLLM): generate exactly max_tokens; benchmarks need fixed lengths."""

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def stops(self) -> list[str]:
        return self.stop if isinstance(self.stop, list) else []

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, "n > 1 is not supported; send separate requests", param="n")
        for name in ("logprobs", "top_logprobs", "tools", "tool_choice", "functions",
                     "response_format", "echo", "best_of", "suffix", "logit_bias"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, 0, 1) or (name in ("tools", "functions") and value):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        top_k = (self.model_extra or {}).get("top_k")
        if top_k not in (None, 0, -1):
            # vLLM's extension; 0 and -1 mean "off". Anything else would be silently ignored.
            raise ApiError(400, "'top_k' is not supported by this server (only 0 or -1, off)",
                           param="top_k")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, "only text content parts are supported",
                               param="messages.content")
            parts.append(p["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "prompt is empty", param="prompt")
            return p
        if not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        if all(isinstance(t, int) for t in p):
            return [int(t) for t in p]  # type: ignore[arg-type]
        if len(p) == 1:
            one = p[0]
            return one if isinstance(one, str) else [int(t) for t in one]  # type: ignore[union-attr]
        raise ApiError(400, "batched prompts are not supported; send one prompt per request",
                       param="prompt")


class Endpoint(Enum):
    """The two generation endpoints. What the edge does differently for each is a property
    here, so the handlers dispatch on this value (`Frontend._generate` and the methods it
    calls), never on a string."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"

    @property
    def path(self) -> str:
        """The route, also the `endpoint` label of the request metrics."""
        return self.value

    @property
    def body(self) -> type[_Common]:
        """The request body it accepts."""
        return ChatRequest if self is Endpoint.CHAT else CompletionRequest

    @property
    def prompt_param(self) -> str:
        """The body field an error about the prompt names."""
        return "messages" if self is Endpoint.CHAT else "prompt"

    @property
    def object(self) -> str:
        """The `object` of a whole response."""
        return "chat.completion" if self is Endpoint.CHAT else "text_completion"

    @property
    def chunk_object(self) -> str:
        """The `object` of a streamed chunk."""
        return "chat.completion.chunk" if self is Endpoint.CHAT else "text_completion"

    @property
    def id_prefix(self) -> str:
        """A response id is this, a dash and the request id."""
        return "chatcmpl" if self is Endpoint.CHAT else "cmpl"


def parse(model: type[_Common], body: Any) -> Any:
    """Validate a JSON body, turning pydantic's report into one specific 400."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{loc}: {err['msg']}" if loc else err["msg"],
                       param=loc or None) from None
    req.check_supported()
    return req
