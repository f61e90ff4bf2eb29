"""Request bodies of the OpenAI-compatible routes, checked the way `mlx_lm.server` checks them.

Fields (as mlx_lm.server accepts them): `model`, `messages` (chat) or `prompt` (completions),
`max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `top_k`, `min_p`, `stop`,
`seed`, `stream`, `stream_options.include_usage`. Missing fields take the server's defaults
(`specmoe serve --max-tokens/--temp/--top-p/--top-k/--min-p`). A chat's `tools`, `tool_choice`,
`chat_template_kwargs` and the tool turns of its `messages` are checked by runtime.serve.tool_fields.

Every number is bounded: `max_tokens` >= 1 (clamped later to the context left after the prompt),
`temperature` in [0, 100], `top_p`/`min_p` in [0, 1], `top_k` in [0, vocabulary size - 1], `seed` in
[0, 2**64 - 1] (what mx.random.seed takes); NaN and infinities are refused. `stop` holds at most 4
strings of at most 256 characters.

Invariants: every bad body raises `RequestError` with an HTTP 4xx status and a message naming
the field and what was expected; nothing here touches the model; a request that passes is
fully typed (`CompletionRequest`), so the generation queue never sees an unchecked value.
The checks are plain functions of the parsed body, so another API's routes can reuse them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

__all__ = ["RequestError", "CompletionRequest", "SamplingDefaults", "parse_json", "parse_completion"]

_ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
MAX_TEMPERATURE = 100
MAX_STOPS, MAX_STOP_CHARS = 4, 256


class RequestError(Exception):
    """A client error: HTTP `status`, OpenAI-style `type` and the offending `param`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SamplingDefaults:
    """Server-wide defaults for fields a request leaves out (mlx_lm.server's --temp etc.)."""

    max_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@dataclass
class CompletionRequest:
    kind: str  # "chat" or "text"
    model: str | None  # as the client named it; None if left out
    messages: list[dict] = field(default_factory=list)  # chat: [{"role", "content": str}]
    prompt: str = ""  # text completions
    max_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    tools: list[dict] | None = None  # chat: the tools the chat template shows (runtime.serve.tool_fields)
    tool_choice: str = "auto"  # chat: "auto", "none", "required" or a function name
    template_kwargs: dict = field(default_factory=dict)  # chat: chat_template_kwargs, e.g. enable_thinking


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or RequestError naming what is wrong with it."""
    if not raw.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({str(e)[:200]})") from None
    except ValueError:  # an integer past Python's digit limit (4300)
        raise RequestError("the request body holds a number with too many digits; expected JSON numbers of "
                           "ordinary size") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply; expected a JSON object of plain fields") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body is a JSON {type(body).__name__}; expected a JSON object")
    return body


def _no_constant(name: str):
    raise RequestError(f"the request body contains {name}; JSON numbers must be finite")


def _number(body: dict, name: str, default, *, integer: bool = False, lo=None, hi=None):
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind}, got {_short(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise RequestError(f"'{name}' must be {bounds}, got {_short(value)}", param=name)
    return value


def _short(value, limit: int = 80) -> str:
    """A value as JSON for an error message, cut to `limit` characters (a huge number or string stays short)."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # ints past Python's digit limit, deep nesting
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is served (mlx_lm.server: text models)
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"'messages[{i}].content' parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                   "this server serves text only", param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"'messages[{i}].content' must be a string or a list of text parts", param=f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is required: a list of {\"role\", \"content\"} objects", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"'messages[{i}]' must be an object with 'role' and 'content'", param=f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"'messages[{i}].role' is {_short(role)}; expected one of {', '.join(_ROLES)}",
                               param=f"messages[{i}].role")
        out.append({"role": role, "content": _content(m, i)})
    return out


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise RequestError(f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings of at "
                           f"most {MAX_STOP_CHARS} characters", param="stop")
    return stop


def parse_completion(body: dict, kind: str, defaults: SamplingDefaults = SamplingDefaults(),
                     vocab_size: int | None = None) -> CompletionRequest:
    """Check a /v1/chat/completions (kind "chat") or /v1/completions ("text") body; `top_k` may not
    reach `vocab_size` (the model's vocabulary, when known)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {_short(stream)}", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be true or false", param="stream_options.include_usage")
    n = body.get("n", 1)
    if isinstance(n, bool) or n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {_short(n)}", param="n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    request = CompletionRequest(
        kind=kind, model=model,
        max_tokens=_number(body, name, defaults.max_tokens, integer=True, lo=1),
        temperature=float(_number(body, "temperature", defaults.temperature, lo=0, hi=MAX_TEMPERATURE)),
        top_p=float(_number(body, "top_p", defaults.top_p, lo=0, hi=1)),
        top_k=_number(body, "top_k", defaults.top_k, integer=True, lo=0,  # mlx-lm: 0 (off) or below the vocabulary
                      hi=None if vocab_size is None else vocab_size - 1),
        min_p=float(_number(body, "min_p", defaults.min_p, lo=0, hi=1)),
        stop=_stop(body), seed=_number(body, "seed", None, integer=True, lo=0, hi=MAX_SEED), stream=stream,
        include_usage=include_usage,
    )
    if kind == "chat":
        request.messages = _messages(body)
        from runtime.serve.tool_fields import apply_tool_fields  # it imports RequestError from here

        apply_tool_fields(request, body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' is required: a non-empty string", param="prompt")
        request.prompt = prompt
    return request
