"""The Conductor's HTTP front door: OpenAI-compatible API, health, readiness and metrics.

Request path, top-down: this module parses and validates (protocol), tokenises, then hands a
`Generation` to the pipeline, which asks the scheduler for a (prefill, decode) pair and runs it.
A streaming response's headers are sent only when the first token exists, so anything that
fails before then (bad input, no capacity, every attempt failed) is a plain HTTP error with
the right status, not a 200 with an error buried in the stream.

Bodies are read and decoded under `bodies.EdgeLimits` before anything else looks at them. A
client that goes away cancels its request: aiohttp cancels the handler (handler_cancellation),
or a write to the closed stream fails, and either way the pipeline's generators are closed at
once, which cancels the gRPC calls, so the decode worker drops the sequence and its KV. That
is an ordinary event, logged at INFO, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mooncake_k8s.common import tracing
from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.common.tenants import read_api_keys
from mooncake_k8s.conductor.http.bodies import EdgeLimits, decode_json, read_body
from mooncake_k8s.conductor.http.errors import ANSWERED, api_error
from mooncake_k8s.conductor.http.listener import HeaderDeadlines
from mooncake_k8s.conductor.http.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Endpoint,
    _Common,
    parse,
)
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched.admission import PRIORITIES
from mooncake_k8s.conductor.serving.instances import Instance
from mooncake_k8s.conductor.serving.pipeline import Delta, Generation, Outcome, Pipeline

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


def load_api_keys(path: str) -> dict[str, str]:
    """`KEY [TENANT] [dram=SIZE] [ssd=SIZE]` per line ('#' comments; `common.tenants`): each
    key's tenant, which salts that key's KV blocks. (The quotas are the store master's.)"""
    return read_api_keys(path).tenants


class Frontend:
    """Everything behind the HTTP routes; `Conductor` wires it to pools and the tokenizer."""

    def __init__(self, pipeline: Pipeline, metrics: ConductorMetrics,
                 api_keys: dict[str, str] | None, served_model: str | None,
                 use_prefix_cache: bool = True, limits: EdgeLimits | None = None) -> None:
        self.pipeline = pipeline
        self.limits = limits or EdgeLimits()
        self.metrics = metrics
        self.api_keys = api_keys
        self.served_model = served_model
        self.use_prefix_cache = use_prefix_cache
        self.tokenizer: Any = None
        self.tokenizer_error: str | None = None
        self.tokenizer_fingerprint = ""
        self.tokenizer_source = ""
        """Where the tokenizer came from (a model directory, or the built-in model's name)."""
        self.draining = False
        """Set on SIGTERM: /readyz says 503 while in-flight requests finish."""
        self.max_token_bytes: int | None = None
        """The most bytes of text one token covers (`max_token_bytes`), None = unknown."""
        self.index_not_ready: Callable[[], str | None] = lambda: None
        """Why the KV index is not ready yet (the store's snapshot is loading), or None."""

    # -- model facts come from the workers' load reports ------------------------------------

    def model_name(self) -> str | None:
        if self.served_model:
            return self.served_model
        for inst in self.pipeline.prefills.usable():
            assert inst.report is not None
            return inst.report.model
        return None

    def max_context(self) -> int:
        ctx = [i.report.max_context for i in self.pipeline.prefills.usable() if i.report]
        return min(ctx) if ctx else 0

    def not_ready(self) -> str | None:
        if self.draining:
            return "shutting down: finishing in-flight requests"
        if self.tokenizer_error:
            return f"tokenizer failed to load: {self.tokenizer_error}"
        if self.tokenizer is None:
            return "loading the tokenizer"
        for pool in (self.pipeline.prefills, self.pipeline.decodes):
            if not pool.usable():
                return self.tokenizer_mismatch(pool.role) or f"no {pool.role} instance is ready"
        return self.index_not_ready()

    def tokenizer_mismatch(self, role: str) -> str | None:
        """Why no instance of `role` is routed to, when the reason is their tokenizer."""
        pool = self.pipeline.prefills if role == "prefill" else self.pipeline.decodes
        bad = pool.mismatched()
        if not bad or bad[0].report is None:
            return None
        r = bad[0].report
        return (f"tokenizer mismatch: the Conductor's tokenizer ({self.tokenizer_source}, "
                f"fingerprint {self.tokenizer_fingerprint[:16]}) is not the one {role} "
                f"instance {r.instance_id} serves (model {r.model!r}, fingerprint "
                f"{r.tokenizer_fingerprint[:16]}); {len(bad)} {role} instance(s) differ. Give "
                "the Conductor the workers' model (--model / MOONCAKE_MODEL)")

    def conditions(self) -> list[dict[str, str]]:
        """/readyz's JSON form: machine-readable reasons (Kubernetes condition shape)."""
        reason = self.not_ready()
        ready = {"type": "Ready", "status": "False" if reason else "True",
                 "reason": "NotReady" if reason else "Ready", "message": reason or ""}
        bad = [m for m in map(self.tokenizer_mismatch, ("prefill", "decode")) if m]
        if self.tokenizer is None:
            tok = {"status": "Unknown", "reason": "TokenizerLoading",
                   "message": self.tokenizer_error or "loading the tokenizer"}
        elif bad:
            tok = {"status": "False", "reason": "TokenizerMismatch", "message": bad[0]}
        else:
            tok = {"status": "True", "reason": "TokenizerMatches",
                   "message": f"{self.tokenizer_source} ({self.tokenizer_fingerprint[:16]})"}
        return [ready, {"type": "TokenizerMatchesWorkers", **tok}]

    # -- routes ----------------------------------------------------------------------------

    def routes(self, with_metrics: bool = True) -> list[web.RouteDef]:
        return [
            *self.ops_routes(with_metrics),
            web.get("/v1/models", self.models),
            web.get("/v1/instances", self.instances),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
        ]

    def ops_routes(self, with_metrics: bool = True) -> list[web.RouteDef]:
        """Health, readiness and (optionally) metrics: what the metrics port serves."""
        ops = [web.get("/healthz", self.healthz), web.get("/readyz", self.readyz)]
        return [*ops, web.get("/metrics", self.metrics_handler)] if with_metrics else ops

    async def healthz(self, _r: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        reason = self.not_ready()
        if "application/json" in request.headers.get("Accept", ""):
            return web.json_response({"ready": reason is None, "reason": reason,
                                      "conditions": self.conditions()},
                                     status=503 if reason else 200)
        if reason:
            return web.Response(status=503, text=f"not ready: {reason}\n")
        return web.Response(text="ready\n")

    async def metrics_handler(self, _r: web.Request) -> web.Response:
        self.metrics.observe_pools(self.pipeline.prefills.instances.values(),
                                   self.pipeline.decodes.instances.values())
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        self.authenticate(request)
        name = self.model_name()
        data = [] if name is None else [{
            "id": name, "object": "model", "created": 0, "owned_by": "mooncake-k8s",
            "max_model_len": self.max_context(),
        }]
        return web.json_response({"object": "list", "data": data})

    async def instances(self, request: web.Request) -> web.Response:
        """The instances behind this Conductor as it sees them (prefill groups included:
        stages and incomplete groups are listed, never routed to). Ids, not addresses: an
        API key holder learns the topology, not where to reach the workers."""
        self.authenticate(request)
        return web.json_response({role: [_listing(i) for i in pool.instances.values()]
                                  for role, pool in (("prefill", self.pipeline.prefills),
                                                     ("decode", self.pipeline.decodes))})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    # -- the shared generation path --------------------------------------------------------

    def authenticate(self, request: web.Request) -> str:
        """The caller's tenant; 401 unless the bearer key is known (when keys are set)."""
        if self.api_keys is None:
            return ""
        header = request.headers.get("Authorization", "")
        presented = header[7:] if header.startswith("Bearer ") else ""
        for key, tenant in self.api_keys.items():
            # aiohttp keeps undecodable header bytes as surrogates: encode them back, not fail
            if hmac.compare_digest(key.encode(), presented.encode("utf-8", "surrogateescape")):
                return tenant
        raise ApiError(401, "Incorrect API key provided" if presented else
                       "Missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")

    async def _generate(self, request: web.Request, kind: Endpoint) -> web.StreamResponse:
        endpoint = kind.path
        try:
            tenant = self.authenticate(request)
            priority = request.headers.get("X-Mooncake-Priority", "interactive").lower()
            if priority not in PRIORITIES:
                raise ApiError(400, f"X-Mooncake-Priority must be one of {', '.join(PRIORITIES)}"
                                    f", not {priority!r}", param="X-Mooncake-Priority")
            group = _group_size(request)
            raw = await read_body(request, self.limits)
            body = decode_json(raw, self.limits.max_json_depth)
            req: _Common = parse(kind.body, body)
            with tracing.span("conductor.request", endpoint=endpoint):
                gen, max_tokens = await self._prepare(req, kind, tenant)
                gen.priority = priority
                gen.prefill_group_size = group
                return await self._respond(request, req, kind, gen, max_tokens, endpoint)
        except ANSWERED as exc:
            e = api_error(exc)
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return web.json_response(e.body(), status=e.status, headers=e.headers)

    async def _prepare(self, req: _Common, kind: Endpoint,
                       tenant: str) -> tuple[Generation, int]:
        name = self.model_name()
        if name is None or self.tokenizer is None or self.draining:
            raise ApiError(503, f"not ready: {self.not_ready()}", type_="server_error")
        if req.model != name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves "
                                f"'{name}'", param="model", code="model_not_found")
        if isinstance(req, ChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            # Chat templates may trim each message: count only what trimming keeps.
            self._check_text_fits([m["content"].strip() for m in messages], "messages")
            tokens = await asyncio.to_thread(self._chat_tokens, messages)
            limit = req.max_completion_tokens or req.max_tokens
        else:
            assert isinstance(req, CompletionRequest)
            prompt = req.prompt_input()
            if isinstance(prompt, str):
                self._check_text_fits([prompt], "prompt")
                tokens = await asyncio.to_thread(self.tokenizer.encode, prompt)
            else:
                vocab = len(self.tokenizer)
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise ApiError(400, f"token id {bad[0]} is outside the vocabulary "
                                        f"[0, {vocab})", param="prompt")
                tokens = prompt
            limit = req.max_tokens
        ctx = self.max_context()
        if len(tokens) >= ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the "
                                f"prompt has {len(tokens)}", param=kind.prompt_param,
                           code="context_length_exceeded")
        max_tokens = limit if limit is not None else min(DEFAULT_MAX_TOKENS, ctx - len(tokens))
        if len(tokens) + max_tokens > ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, "
                                f"you requested {len(tokens) + max_tokens} tokens "
                                f"({len(tokens)} in the prompt, {max_tokens} in the completion)",
                           param="max_tokens", code="context_length_exceeded")
        sampling = pb.Sampling(temperature=req.temperature, top_p=req.top_p,
                               max_tokens=max_tokens, stop=req.stops(),
                               has_seed=req.seed is not None, seed=req.seed or 0,
                               ignore_eos=req.ignore_eos)
        rid = uuid.uuid4().hex
        return Generation(rid, tokens, tenant, sampling, self.use_prefix_cache), max_tokens

    def _check_text_fits(self, texts: list[str], param: str) -> None:
        """Refuse text that cannot fit the context before paying to tokenise it: 4 MiB of
        prompt costs ~3.4 s of CPU and ~0.6 GB of memory to tokenise on the dev VM, while no
        prompt of more than context x max_token_bytes bytes can fit."""
        ctx = self.max_context()
        per_token = self.max_token_bytes
        if not ctx or not per_token:
            return
        size = sum(len(t.encode()) for t in texts)
        at_least = -(-size // per_token)
        if at_least >= ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the "
                                f"prompt has at least {at_least} ({size} bytes of text)",
                           param=param, code="context_length_exceeded")

    def _chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

    async def _respond(self, request: web.Request, req: _Common, kind: Endpoint, gen: Generation,
                       max_tokens: int, endpoint: str) -> web.StreamResponse:
        out = Outcome()
        self.metrics.inflight.inc()
        try:
            if req.stream:
                resp = await self._stream(request, req, kind, gen, out)
                if resp is None:  # the client went away mid-stream
                    self._hung_up(request, gen, out, endpoint)
                    return web.Response(status=499)  # never sent: the connection is gone
            else:
                text = []
                async with contextlib.aclosing(self.pipeline.run(gen, out)) as events:
                    async for d in events:
                        text.append(d.text)
                resp = web.json_response(self._full_body(req, kind, gen, out, "".join(text)))
                resp.headers.update(self._route_headers(out))
                # Decode failover moved the request this many times (a stream's headers are
                # sent before any resume could happen, so only whole responses carry it).
                resp.headers["X-Mooncake-Resumes"] = str(out.resumes)
            self._observe(out, endpoint, "200")
            return resp
        except asyncio.CancelledError:
            self._hung_up(request, gen, out, endpoint)
            raise
        finally:
            self.metrics.inflight.dec()

    def _hung_up(self, request: web.Request, gen: Generation, out: Outcome,
                 endpoint: str) -> None:
        self.metrics.requests.labels(endpoint, "client_closed").inc()
        transport = request.transport
        why = ("the client closed the connection" if transport is None or transport.is_closing()
               else "the server is stopping")
        log.info(f"request cancelled: {why}",
                 extra={"request_id": gen.request_id, "endpoint": endpoint,
                        "completion_tokens": out.completion_tokens})

    def _observe(self, out: Outcome, endpoint: str, status: str) -> None:
        now = time.monotonic()
        m = self.metrics
        m.requests.labels(endpoint, status).inc()
        m.prompt_tokens.inc(out.prompt_tokens)
        m.cached_tokens.inc(out.cached_tokens)
        m.completion_tokens.inc(out.completion_tokens)
        if out.attempts > 1:
            m.retries.inc()
        m.e2e.observe(now - out.started_at)
        if out.first_token_at is not None:
            m.ttft.observe(out.first_token_at - out.started_at)
            if out.completion_tokens > 1:
                m.tpot.observe((now - out.first_token_at) / (out.completion_tokens - 1))

    @staticmethod
    def _route_headers(out: Outcome) -> dict[str, str]:
        return {"X-Mooncake-Prefill": out.prefill, "X-Mooncake-Decode": out.decode,
                "X-Mooncake-Prefill-Stages": str(out.prefill_stages),
                "X-Mooncake-Cached-Tokens": str(out.cached_tokens)}

    @staticmethod
    def _usage(out: Outcome) -> dict[str, Any]:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    def _full_body(self, req: _Common, kind: Endpoint, gen: Generation, out: Outcome,
                   text: str) -> dict[str, Any]:
        created = int(time.time())
        if kind is Endpoint.CHAT:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "finish_reason": out.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": out.finish_reason,
                      "logprobs": None}
        return {"id": f"{kind.id_prefix}-{gen.request_id}", "object": kind.object,
                "created": created,
                "model": req.model, "choices": [choice], "usage": self._usage(out)}

    async def _stream(self, request: web.Request, req: _Common, kind: Endpoint,
                      gen: Generation, out: Outcome) -> web.StreamResponse | None:
        """The SSE response, or None when a write failed because the client went away."""
        created = int(time.time())
        chat = kind is Endpoint.CHAT
        obj = kind.chunk_object
        rid = f"{kind.id_prefix}-{gen.request_id}"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(d: Delta | None, first: bool) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if d is not None:
                    delta["content"] = d.text
                choice: dict[str, Any] = {"index": 0, "delta": delta,
                                          "finish_reason": d.finish_reason if d else None,
                                          "logprobs": None}
            else:
                choice = {"index": 0, "text": d.text if d else "",
                          "finish_reason": d.finish_reason if d else None, "logprobs": None}
            body = {"id": rid, "object": obj, "created": created, "model": req.model,
                    "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return body

        resp: web.StreamResponse | None = None
        try:
            async with contextlib.aclosing(self.pipeline.run(gen, out)) as events:
                async for d in events:
                    if resp is None:
                        resp = web.StreamResponse(headers={
                            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                            **self._route_headers(out)})
                        await resp.prepare(request)
                        await _sse(resp, chunk(d, True))
                    else:
                        await _sse(resp, chunk(d, False))
        except ANSWERED as exc:
            if resp is None:
                raise
            e = api_error(exc)
            try:
                await _sse(resp, e.body())  # the OpenAI clients raise on an "error" event
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionError:
                return None
            self._observe(out, "stream", str(e.status))
            return resp
        except ConnectionError:  # leaving the `async with` closed the pipeline: calls cancelled
            return None
        assert resp is not None
        try:
            if include_usage:
                await _sse(resp, {"id": rid, "object": obj, "created": created,
                                  "model": req.model, "choices": [], "usage": self._usage(out)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            return None
        return resp


_GROUP_HEADER = "X-Mooncake-Prefill-Group-Size"


def _group_size(request: web.Request) -> int:
    """`X-Mooncake-Prefill-Group-Size: G`: prefill on a target of G stages only (1: a single
    instance, G >= 2: a prefill group of G); absent: any target. For measuring each kind
    (`mooncake calibrate`) and comparing them; a 503 says when none of that size is ready."""
    raw = request.headers.get(_GROUP_HEADER)
    if raw is None:
        return 0
    try:
        size = int(raw.strip())
    except ValueError:
        size = 0
    if not 1 <= size <= 64:
        raise ApiError(400, f"{_GROUP_HEADER} must be an integer from 1 to 64, not {raw!r}",
                       param=_GROUP_HEADER)
    return size


def _listing(inst: Instance) -> dict[str, Any]:
    """One instance in `GET /v1/instances`."""
    r = inst.report
    # The failure's status only: its details may name internal addresses (the logs have them).
    out: dict[str, Any] = {"instance_id": inst.instance_id, "state": inst.state,
                           "revision": r.revision if r else "",
                           "error": inst.last_error.split(":", 1)[0]}
    if inst.group_size > 1 and r is not None:
        out["group"] = {"name": r.pipeline_group, "stage": r.pipeline_stage,
                        "size": inst.group_size, "whole": r.pipeline_whole,
                        "broken": inst.group_broken}
    return out


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of input text one token of `tokenizer` can stand for, so that a text of
    n bytes has at least n / max_token_bytes tokens. None when the tokenizer normalises text
    first (NFC and the like can shrink it, and the bound would not hold) or is not a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = tokenizer.get_vocab()
    # A lone byte of a multi-byte character decodes to U+FFFD (3 bytes): an overestimate,
    # which only weakens the bound.
    return max((len(tokenizer.convert_tokens_to_string([t]).encode()) for t in vocab),
               default=0) or None


async def _sse(resp: web.StreamResponse, body: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Anything unexpected becomes an OpenAI-style 500; the server keeps running."""
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except web.HTTPException as e:
        if e.status >= 400:
            err = ApiError(e.status, e.reason or "error")
            return web.json_response(err.body(), status=e.status)
        raise
    except ANSWERED as exc:
        answer = api_error(exc)
        return web.json_response(answer.body(), status=answer.status, headers=answer.headers)
    except ConnectionError as e:
        if request.transport is not None and not request.transport.is_closing():
            log.exception("unhandled error", extra={"path": request.path})
            err = ApiError(500, "internal server error", type_="server_error")
            return web.json_response(err.body(), status=500)
        # The client left (e.g. while sending its body): nobody to answer, nothing went wrong.
        log.info("the client closed the connection", extra={"path": request.path,
                                                            "error": str(e)})
        return web.Response(status=499)  # never sent: the connection is gone
    except Exception:
        log.exception("unhandled error", extra={"path": request.path})
        err = ApiError(500, "internal server error", type_="server_error")
        return web.json_response(err.body(), status=500)


def make_app(frontend: Frontend, deadlines: HeaderDeadlines | None = None,
             with_metrics: bool = True) -> web.Application:
    """The application; with `deadlines`, serve it with `deadlines.serve` (see `listener`).
    `with_metrics` False leaves /metrics to the metrics port (`make_ops_app`)."""
    middlewares: list[Any] = [_errors]
    if deadlines is not None:
        middlewares.insert(0, deadlines.middleware)
    app = web.Application(middlewares=middlewares,
                          client_max_size=frontend.limits.max_body_bytes)
    app.add_routes(frontend.routes(with_metrics))
    return app


def make_ops_app(frontend: Frontend) -> web.Application:
    """/metrics, /healthz and /readyz for the metrics port: no API key, no request bodies."""
    app = web.Application(middlewares=[_errors], client_max_size=1024)
    app.add_routes(frontend.ops_routes())
    return app
