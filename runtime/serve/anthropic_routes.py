"""The Anthropic Messages API routes of `specmoe serve`, beside the OpenAI ones (runtime.serve.app).

    POST /v1/messages               a message, or its server-sent events (runtime.serve.anthropic_reply)
    POST /v1/messages/count_tokens  {"input_tokens": N}: the prompt the chat template renders

A request's body is read under the server's limits, then checked (runtime.serve.anthropic_shapes),
rendered by the model's chat template with its tools, length-checked, its max_tokens clamped to
the context left, and queued, all as an OpenAI chat request (ServerState.prepare); the reply's text is split
into thinking, text and tool_use blocks (runtime.serve.reply_split). An agent that asks for a
Claude model by name (`claude-...`) is answered by the served model, so agents work with only
their base URL and key changed; other names must be the served model's, as on the OpenAI routes.

Invariants: every client error is a 4xx in the API's error shape {"type": "error", "error":
{"type", "message"}}; a client that disconnects cancels its job; a stream that waits (prefill,
a queued request) sends a ping at least every PING_S seconds.
"""

from __future__ import annotations

import asyncio

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.serve.anthropic_reply import MessageReply, sse_event
from runtime.serve.anthropic_shapes import error_body, parse_messages
from runtime.serve.limits import read_body
from runtime.serve.queue import QueueFull
from runtime.serve.reply_split import ReplySplitter
from runtime.serve.validation import RequestError, parse_json

__all__ = ["anthropic_routes", "PING_S"]

PING_S = 10.0  # a waiting stream sends a ping this often (proxies and clients time out silent streams)


def anthropic_routes(state, next_event) -> list[Route]:
    """Routes for `state` (a runtime.serve.app.ServerState: its body limits, its off-loop prepare, its queue);
    `next_event(job, request)` is the app's reader of a job's events (None: the client went away)."""

    def error(e: RequestError, headers: dict | None = None) -> JSONResponse:
        if e.status in (408, 413):  # the body was left unread: close the connection rather than read the rest
            headers = {**(headers or {}), "Connection": "close"}
        return JSONResponse(error_body(e), status_code=e.status, headers=headers)

    def parse(body: dict, count_only: bool = False):
        req = parse_messages(body, state.defaults, count_only=count_only, vocab_size=state.vocab_size)
        if not req.model.startswith("claude-"):
            state.check_model(req.model)
        return req

    async def count_tokens(request: Request):
        def count(raw: bytes) -> int:
            req = parse(parse_json(raw), count_only=True)
            try:
                return len(state.backend.encode(req))
            except Exception as e:  # e.g. a chat template that rejects this sequence of roles
                raise RequestError(f"could not apply the model's chat template to these messages: {str(e)[:200]}",
                                   param="messages") from None

        try:
            n = await anyio.to_thread.run_sync(count, await read_body(request, state.limits))
        except RequestError as e:
            return error(e)
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": n})

    async def messages(request: Request):
        try:
            raw = await read_body(request, state.limits)
            req, ids = await state.prepare_off_loop(raw, "chat", parse)
            del raw
            reply = MessageReply(req.model, ReplySplitter(state.backend.tokenizer, ids, req.tools), len(ids))
            job = state.queue.submit(ids, req)
        except RequestError as e:
            return error(e)
        except QueueFull as e:
            return error(RequestError(str(e), status=429), {"Retry-After": str(e.retry_after_s)})
        except ClientDisconnect:
            return Response(status_code=499)
        if req.stream:
            return StreamingResponse(_stream(job, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text = []
        try:
            while True:
                event = await next_event(job, request)
                if event is None:  # nobody is listening any more
                    return Response(status_code=499)
                if event.kind == "text":
                    text.append(event.text)
                elif event.kind == "error":
                    return JSONResponse(error_body(RequestError(event.error, status=500)), status_code=500)
                else:
                    return JSONResponse(reply.message("".join(text), event))
        finally:
            job.cancel.set()  # no-op once done; stops the job if this handler was cancelled

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


async def _stream(job, reply: MessageReply):
    try:
        for e in reply.start():
            yield e
        while True:  # disconnects arrive as cancellation here
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=PING_S)
            except asyncio.TimeoutError:
                yield sse_event("ping", {})
                continue
            if event.kind == "text":
                for e in reply.feed(event.text):
                    yield e
            elif event.kind == "error":
                yield sse_event("error", {"error": {"type": "api_error", "message": event.error}})
                break
            else:
                for e in reply.finish(event):
                    yield e
                break
    finally:
        job.cancel.set()
