"""The HTTP routes of `specmoe serve` (Starlette on uvicorn): OpenAI-compatible, as mlx_lm.server.

    POST /v1/chat/completions   chat.completion, or SSE chat.completion.chunk ... [DONE]
    POST /v1/completions        text_completion, or SSE text_completion ... [DONE]
    GET  /v1/models             the one model this server serves
    GET  /health                {"status": "ok", "queue": {...}}: requests run one at a time
    GET  /v1/specmoe/stats      hit rate, host syncs, bytes read, acceptance, memory

Invariants: every client error is a 4xx JSON body {"error": {"message", "type", "param", "code"}}
naming the problem (RequestError), and the server keeps serving; a request is tokenized and
length-checked before it is queued; a client that disconnects (streaming or not) cancels its job.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.serve.queue import GenerationQueue, Job
from runtime.serve.sse import SSE_DONE, ResponseFormat, sse, usage
from runtime.serve.validation import RequestError, SamplingDefaults, parse_completion, parse_json

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
    allowed_origins: tuple[str, ...] = ("*",)  # CORS, as mlx_lm.server --allowed-origins (browser chat UIs)

    def check_model(self, name: str | None) -> None:
        if name is None or name in ("default_model", self.model_id) or name in self.aliases:
            return
        raise RequestError(f"model {name!r} is not served here; this server serves {self.model_id!r} "
                           "(GET /v1/models)", status=404, param="model", code="model_not_found")


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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
            body = parse_json(await request.body())
            req = parse_completion(body, kind, state.defaults)
            state.check_model(req.model)
            try:
                ids = state.backend.encode(req)
            except Exception as e:  # e.g. a chat template that rejects this sequence of roles
                raise RequestError(f"could not apply the model's chat template to these messages: {e}",
                                   param="messages" if kind == "chat" else "prompt") from None
            if len(ids) > state.max_prompt_tokens:
                raise RequestError(f"the prompt is {len(ids)} tokens; this server takes at most "
                                   f"{state.max_prompt_tokens} (--max-prompt-tokens)",
                                   param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        except RequestError as e:
            return _error(e)
        fmt = ResponseFormat(kind, model=req.model or state.model_id)
        job = state.queue.submit(ids, req)
        if req.stream:
            return StreamingResponse(_stream(job, fmt, req.include_usage), media_type="text/event-stream",
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
                    return JSONResponse(fmt.complete("".join(text), event.finish_reason, u))
        finally:
            job.cancel.set()  # no-op once done; stops the job if this handler was cancelled

    async def _stream(job: Job, fmt: ResponseFormat, include_usage: bool):
        try:
            yield sse(fmt.chunk(None, first=True))
            while True:
                event = await _next_event(job, None)  # disconnects arrive as cancellation here
                if event.kind == "text":
                    yield sse(fmt.chunk(event.text))
                elif event.kind == "error":
                    yield sse({"error": {"message": event.error, "type": "server_error", "param": None, "code": None}})
                    break
                else:
                    yield sse(fmt.chunk(None, event.finish_reason))
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

    async def health(request: Request):
        return JSONResponse({"status": "ok", "queue": state.queue.status()})

    async def stats(request: Request):
        return JSONResponse({"model": state.model_id, "queue": state.queue.status(), **state.backend.stats()})

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", text, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/specmoe/stats", stats, methods=["GET"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["GET", "POST"],
                             allow_headers=["*"])]
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
