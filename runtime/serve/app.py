"""The HTTP routes of `specmoe serve` (Starlette on uvicorn): OpenAI-compatible, as mlx_lm.server.

    POST /v1/chat/completions   chat.completion, or SSE chat.completion.chunk ... [DONE]
    POST /v1/completions        text_completion, or SSE text_completion ... [DONE]
    GET  /v1/models             the one model this server serves
    GET  /health                {"status": "ok", "queue": {...}, "batching": {...}}: requests running, batch sizes
    GET  /v1/specmoe/stats      hit rate, host syncs, bytes read, acceptance, memory
    POST /v1/messages, /v1/messages/count_tokens   the Anthropic Messages API (runtime.serve.anthropic_routes)

Chat replies carry the model's thinking as `reasoning`/`reasoning_content` and its tool calls as
`tool_calls` (runtime.serve.openai_reply), split off with mlx-lm's markers and tool parsers.

Every request first passes runtime.serve.security.Guard (Host, Origin, API key); a completion's
body is read under runtime.serve.limits (size cap, deadline), then parsed, validated and tokenized
on a worker thread (one at a time, never on the event loop), its `max_tokens` clamped to the
context left after the prompt, and queued (429 with Retry-After when --max-queue requests wait).

Invariants: every client error is a 4xx JSON body {"error": {"message", "type", "param", "code"}}
naming the problem (RequestError), and the server keeps serving; a request is tokenized and
length-checked before it is queued; a client that disconnects (streaming or not) cancels its job;
/health and /v1/specmoe/stats name no filesystem path (stats adds them for `?paths=1` only when
an API key is set, so only a caller holding it sees them).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.serve.anthropic_routes import anthropic_routes
from runtime.serve.limits import RequestLimits, read_body
from runtime.serve.openai_reply import ChatReply
from runtime.serve.queue import GenerationQueue, Job, QueueFull
from runtime.serve.security import AccessPolicy, Guard
from runtime.serve.sse import SSE_DONE, ResponseFormat, sse, usage
from runtime.serve.validation import CompletionRequest, RequestError, SamplingDefaults, parse_completion, parse_json

__all__ = ["ServerState", "build_app"]

log = logging.getLogger(__name__)
_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class ServerState:
    backend: object  # runtime.serve.backend.Backend
    queue: GenerationQueue
    model_id: str  # what /v1/models lists and responses name
    aliases: frozenset[str]  # other names a request may use for the model (path, directory name)
    defaults: SamplingDefaults
    max_prompt_tokens: int  # longer prompts are refused with 400 context_length_exceeded
    context_tokens: int = 32768  # the model's context: max_tokens is clamped to what the prompt leaves of it
    vocab_size: int | None = None  # top_k may not exceed it
    policy: AccessPolicy = field(default_factory=AccessPolicy)  # Host, CORS origins, API key
    limits: RequestLimits = field(default_factory=RequestLimits)  # body size and time, queue, run time
    _tokenizing: object = None  # anyio.CapacityLimiter(1), made on the event loop: one request parsed at a time

    def check_model(self, name: str | None) -> None:
        if name is None or name in ("default_model", self.model_id) or name in self.aliases:
            return
        raise RequestError(f"model {name!r} is not served here; this server serves {self.model_id!r} "
                           "(GET /v1/models)", status=404, param="model", code="model_not_found")


    def prepare(self, raw: bytes, kind: str, parse=None) -> tuple[CompletionRequest, list[int]]:
        """Parse, check and tokenize one body (runs on a worker thread); max_tokens clamped to the context.
        `parse(body)` (model checked) replaces the OpenAI parsing: the Anthropic routes pass theirs."""
        if parse is not None:
            req = parse(parse_json(raw))
        else:
            req = parse_completion(parse_json(raw), kind, self.defaults, self.vocab_size)
            self.check_model(req.model)
        param = "messages" if kind == "chat" else "prompt"
        try:
            ids = self.backend.encode(req)
        except Exception as e:  # e.g. a chat template that rejects this sequence of roles, unencodable text
            what = "apply the model's chat template to these messages" if kind == "chat" else "tokenize this prompt"
            raise RequestError(f"could not {what}: {str(e)[:200]}", param=param) from None
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(f"the prompt is {len(ids)} tokens; this server takes at most "
                               f"{self.max_prompt_tokens} (--max-prompt-tokens)", param=param,
                               code="context_length_exceeded")
        left = self.context_tokens - len(ids)
        if left < 1:
            raise RequestError(f"the prompt is {len(ids)} tokens and fills the model's context of "
                               f"{self.context_tokens}; nothing is left to generate", param=param,
                               code="context_length_exceeded")
        req.max_tokens = min(req.max_tokens, left)
        return req, ids

    async def prepare_off_loop(self, raw: bytes, kind: str, parse=None) -> tuple[CompletionRequest, list[int]]:
        if self._tokenizing is None:
            self._tokenizing = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(self.prepare, raw, kind, parse, limiter=self._tokenizing)


def _error(e: RequestError, headers: dict | None = None) -> JSONResponse:
    if e.status in (408, 413):  # the body was left unread: close the connection rather than read the rest
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return _error(RequestError(what.get(exc.status_code, str(exc.detail)), status=exc.status_code))


async def _next_event(job: Job, request: Request | None):
    """The job's next event, or None (and the job cancelled) if a non-streaming client disconnected.

    The client is checked at least every _POLL_S seconds, also while events keep arriving: a fast
    generation puts a text event per token, and checking only when none came would never notice."""
    loop = asyncio.get_running_loop()
    while True:
        if request is not None and loop.time() - job.checked_at >= _POLL_S:
            job.checked_at = loop.time()
            if await request.is_disconnected():
                job.cancel.set()
                return None
        try:
            return await asyncio.wait_for(job.events.get(), timeout=_POLL_S)
        except asyncio.TimeoutError:
            continue


def build_app(state: ServerState) -> Starlette:
    async def completions(request: Request, kind: str):
        try:
            raw = await read_body(request, state.limits)
            req, ids = await state.prepare_off_loop(raw, kind)
            del raw
            job = state.queue.submit(ids, req)
        except RequestError as e:
            return _error(e)
        except QueueFull as e:
            return _error(RequestError(str(e), status=429, type="rate_limit_error", code="queue_full"),
                          {"Retry-After": str(e.retry_after_s)})
        except ClientDisconnect:
            return Response(status_code=499)
        fmt = ResponseFormat(kind, model=req.model or state.model_id)
        reply = ChatReply.for_request(fmt, state.backend.tokenizer, req, ids)  # reasoning and tool calls split off
        if req.stream:
            return StreamingResponse(_stream(job, reply, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text = []
        try:
            while True:
                event = await _next_event(job, request)
                if event is None:  # nobody is listening any more
                    return Response(status_code=499)
                if event.kind == "text":
                    text.append(event.text)
                elif event.kind == "error":
                    return JSONResponse({"error": {"message": event.error, "type": "server_error", "param": None,
                                                   "code": None}}, status_code=500)
                else:
                    u = usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                    return JSONResponse(reply.complete("".join(text), event.finish_reason, u))
        finally:
            job.cancel.set()  # no-op once done; stops the job if this handler was cancelled

    async def _stream(job: Job, reply: ChatReply, include_usage: bool):
        fmt = reply.fmt
        try:
            yield sse(fmt.chunk(None, first=True))
            while True:
                event = await _next_event(job, None)  # disconnects arrive as cancellation here
                if event.kind == "text":
                    for chunk in reply.chunks(event.text):
                        yield sse(chunk)
                elif event.kind == "error":
                    yield sse({"error": {"message": event.error, "type": "server_error", "param": None, "code": None}})
                    break
                else:
                    for chunk in reply.final_chunks(event.finish_reason):
                        yield sse(chunk)
                    if include_usage:
                        yield sse(fmt.usage_chunk(usage(event.prompt_tokens, event.completion_tokens,
                                                        event.cached_tokens)))
                    break
            yield SSE_DONE
        finally:
            job.cancel.set()

    async def chat(request: Request):
        return await completions(request, "chat")

    async def text(request: Request):
        return await completions(request, "text")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_id, "object": "model", "created": 0, "owned_by": "specmoe"}]})

    batch_stats = getattr(state.backend, "batch_stats", None)

    async def health(request: Request):
        body = {"status": "ok", "queue": state.queue.status()}
        if batch_stats is not None:  # batch sizes and unique vs summed expert lookups (runtime.serve.backend)
            body["batching"] = batch_stats()
        return JSONResponse(body)

    takes_paths = "paths" in inspect.signature(state.backend.stats).parameters

    async def stats(request: Request):
        # The Guard has checked the key when one is set; without a key nobody is asked, so paths are never shown.
        paths = request.query_params.get("paths") == "1" and state.policy.api_key is not None and takes_paths
        name = state.model_id if paths or not Path(state.model_id).exists() else Path(state.model_id).name
        return JSONResponse({"model": name, "queue": state.queue.status(),
                             **(state.backend.stats(paths=True) if paths else state.backend.stats())})

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", text, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/specmoe/stats", stats, methods=["GET"]),
        *anthropic_routes(state, _next_event),  # POST /v1/messages, /v1/messages/count_tokens
    ]
    middleware = [Middleware(Guard, policy=state.policy)]  # outermost: Host, Origin and key before anything else
    if state.policy.cors_origins:  # only origins named with --cors-origin get CORS headers (preflights included)
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.policy.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"]))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
