"""runtime.serve: an OpenAI-compatible HTTP server (`specmoe serve`), in mlx_lm.server's shape.

Owns: request validation (`validation`), who may call (`security`: Host, Origin, API key), the
bounds of a request (`limits`: body size and time, queue, run time), uvicorn's protocol with a
header deadline (`protocol`), the generation queue (`queue`) and its batches of concurrent requests
(`batch_run`, --max-batch), stop strings
(`stops`), OpenAI response objects and SSE framing (`sse`), the Starlette routes (`app`), the
engine adapter shared with `specmoe chat` (`backend`), a chat conversation (`chat_session`),
server start-up (`server`); for agents, the Anthropic Messages API (`anthropic_shapes` requests,
`anthropic_reply` messages and events, `anthropic_routes`), tool fields (`tool_fields`), and a
reply split into thinking, text and tool calls with mlx-lm's parsers (`reply_split`, shaped for
OpenAI by `openai_reply`).

Invariants kept at this boundary: HTTP is parsed by Starlette/uvicorn, never by hand; client
errors are 4xx JSON naming the problem and the server keeps serving; the model is used by one
thread, one request at a time or one batch of them; a disconnected client's generation is cancelled.
"""

from runtime.serve.app import ServerState, build_app
from runtime.serve.backend import Backend, Piece
from runtime.serve.chat_session import ChatSession
from runtime.serve.limits import DEFAULT_MAX_BODY_BYTES, RequestLimits, read_body
from runtime.serve.queue import GenerationQueue, Job, JobEvent, QueueFull
from runtime.serve.security import AccessPolicy, Guard, is_loopback
from runtime.serve.server import ServeConfig, bind, context_limit, run_server, serve_backend
from runtime.serve.sse import SSE_DONE, ResponseFormat, sse, usage
from runtime.serve.stops import StopMatcher
from runtime.serve.validation import CompletionRequest, RequestError, SamplingDefaults, parse_completion, parse_json

__all__ = [
    "ServerState", "build_app", "Backend", "Piece", "ChatSession", "GenerationQueue", "Job", "JobEvent", "QueueFull",
    "DEFAULT_MAX_BODY_BYTES", "RequestLimits", "read_body", "AccessPolicy", "Guard", "is_loopback", "ServeConfig", "bind", "context_limit",
    "run_server", "serve_backend", "SSE_DONE", "ResponseFormat", "sse", "usage", "StopMatcher", "CompletionRequest", "RequestError",
    "SamplingDefaults", "parse_completion", "parse_json",
]
