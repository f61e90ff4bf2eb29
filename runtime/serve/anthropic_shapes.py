"""Anthropic Messages API requests (`POST /v1/messages`, `/v1/messages/count_tokens`) as chat requests.

A Messages body becomes the same `CompletionRequest` the OpenAI chat route builds, so one set
of checks, one chat template rendering and one generation queue serve both APIs:

    system (string or text blocks)        -> a leading {"role": "system"} message
    user text blocks                      -> {"role": "user", "content": text}
    user tool_result blocks               -> {"role": "tool", "tool_call_id", "content"}, before the
                                             user's text of that turn (as the API orders them)
    assistant text / tool_use / thinking  -> {"role": "assistant", "content", "tool_calls",
                                             "reasoning_content"}
    tools [{name, description, input_schema}] -> OpenAI function tools (what templates read)
    tool_choice auto / any / tool / none  -> auto / required / that tool / none
    thinking enabled / adaptive / disabled -> chat_template_kwargs enable_thinking true / true / false
                                             (left out: the template's default)
    stop_sequences, temperature, top_p, top_k (top-level or through a client's extra_body)

Invariants: `max_tokens` is required (as the API requires it; count_tokens takes none); every
block type other than text, tool_use, tool_result, thinking and redacted_thinking is refused,
naming the block; a tool_result must answer a tool_use of the assistant message right before
it; the last message is the user's (assistant prefill is refused, not misrendered); every error
is a RequestError with the Anthropic-style path of the offending field, and `error_body` gives
the API's error shape {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json

from runtime.serve.validation import CompletionRequest, RequestError, SamplingDefaults, parse_completion

__all__ = ["parse_messages", "error_body", "ERROR_TYPES", "MAX_STOP_SEQUENCES"]

MAX_STOP_SEQUENCES, MAX_STOP_CHARS = 16, 256
MAX_SYSTEM_BLOCKS = 64
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stream")  # checked by parse_completion


def error_body(e: RequestError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if 400 <= e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _text_blocks(value, param: str, what: str) -> str:
    """A string, or a list of text blocks joined (system prompts, tool results)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or len(value) > 1024:
        raise RequestError(f"'{param}' must be a string or a list of text blocks ({what})", param=param)
    texts = []
    for j, b in enumerate(value):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text" or not isinstance(b.get("text"), str):
            raise RequestError(f"'{param}[{j}]' is a {json.dumps(kind)[:40]} block; {what} take text blocks only "
                               "(this server serves text)", param=f"{param}[{j}]")
        texts.append(b["text"])
    return "\n".join(texts)


def _system(body: dict) -> list[dict]:
    system = body.get("system")
    if system is None:
        return []
    if isinstance(system, list) and len(system) > MAX_SYSTEM_BLOCKS:
        raise RequestError(f"'system' has over {MAX_SYSTEM_BLOCKS} blocks", param="system")
    text = _text_blocks(system, "system", "system prompts")
    return [{"role": "system", "content": text}] if text else []


def _user(m: dict, i: int, previous_calls: set[str]) -> list[dict]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, texts = [], []
    for j, b in enumerate(_blocks(content, i)):
        p, kind = f"messages[{i}].content[{j}]", b.get("type")
        if kind == "text":
            texts.append(_string(b, "text", p))
        elif kind == "tool_result":
            use_id = b.get("tool_use_id")
            if not isinstance(use_id, str) or use_id not in previous_calls:
                raise RequestError(f"'{p}' is a tool_result for tool_use_id {json.dumps(use_id)[:80]}, which the "
                                   f"previous message (messages[{i - 1}]) does not hold: each tool_result must "
                                   "answer a tool_use block of the assistant message right before it", param=p)
            is_error = b.get("is_error", False)
            if not isinstance(is_error, bool):
                raise RequestError(f"'{p}.is_error' must be true or false", param=f"{p}.is_error")
            text = "" if b.get("content") is None else _text_blocks(b["content"], f"{p}.content", "tool results")
            results.append({"role": "tool", "tool_call_id": use_id, "content": text})
        else:
            raise _unknown(kind, p, "user", ("text", "tool_result"))
    out = results
    if texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(m: dict, i: int) -> dict:
    content = m.get("content")
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls, thinking = [], [], []
    for j, b in enumerate(_blocks(content, i)):
        p, kind = f"messages[{i}].content[{j}]", b.get("type")
        if kind == "text":
            texts.append(_string(b, "text", p))
        elif kind == "thinking":
            thinking.append(_string(b, "thinking", p))
        elif kind == "redacted_thinking":
            continue  # an encrypted block another server made: nothing this model can read
        elif kind == "tool_use":
            use_id = _string(b, "id", p)
            if not 0 < len(use_id) <= 256:
                raise RequestError(f"'{p}.id' must be 1-256 characters", param=f"{p}.id")
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise RequestError(f"'{p}.input' must be a JSON object", param=f"{p}.input")
            calls.append({"id": use_id, "type": "function", "function": {"name": b.get("name"), "arguments": args}})
        else:
            raise _unknown(kind, p, "assistant", ("text", "tool_use", "thinking", "redacted_thinking"))
    out = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    return out


def _blocks(content, i: int) -> list[dict]:
    if not isinstance(content, list) or not content or not all(isinstance(b, dict) for b in content):
        raise RequestError(f"'messages[{i}].content' must be a string or a non-empty list of content blocks",
                           param=f"messages[{i}].content")
    return content


def _string(block: dict, key: str, p: str) -> str:
    if not isinstance(block.get(key), str):
        raise RequestError(f"'{p}.{key}' must be a string", param=f"{p}.{key}")
    return block[key]


def _unknown(kind, p: str, role: str, known: tuple[str, ...]) -> RequestError:
    served = "this server serves text only" if kind in ("image", "document", "search_result") else "unknown block type"
    return RequestError(f"'{p}' is a {json.dumps(kind)[:40]} block ({served}); {role} messages here take "
                        f"{', '.join(known)} blocks", param=p)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a non-empty list of {\"role\", \"content\"} objects",
                           param="messages")
    out: list[dict] = _system(body)
    previous_calls: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(m, i, previous_calls)
            previous_calls = set()
        elif role == "assistant":
            out.append(_assistant(m, i))
            previous_calls = {c["id"] for c in out[-1].get("tool_calls", [])}
        else:
            raise RequestError(f"'messages[{i}].role' is {json.dumps(role)[:40]}; expected \"user\" or \"assistant\"",
                               param=f"messages[{i}].role")
    if messages[-1].get("role") != "user":
        raise RequestError("the last message must be the user's: continuing an assistant message (prefill) is not "
                           "served", param=f"messages[{len(messages) - 1}]")
    return out


def _tools(body: dict) -> tuple[list[dict] | None, object]:
    """The tools in OpenAI's function shape and the OpenAI tool_choice, for parse_completion to check."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("'tools' must be a list of {\"name\", \"description\", \"input_schema\"}", param="tools")
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else None
                raise RequestError(f"'tools[{i}]' is a {json.dumps(kind)[:60]} tool; this server runs no tools itself: "
                                   "give client tools as {\"name\", \"description\", \"input_schema\"}",
                                   param=f"tools[{i}]")
            converted.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                               "parameters": t.get("input_schema")}})
        tools = converted
    choice = body.get("tool_choice")
    if choice is None:
        return tools, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise RequestError("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                           "{\"type\": \"tool\", \"name\": ...}", param="tool_choice")
    return tools, mapped


def _thinking(body: dict) -> dict:
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise RequestError("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} "
                           "or {\"type\": \"disabled\"}", param="thinking")
    budget = thinking.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise RequestError("'thinking.budget_tokens' must be a positive integer", param="thinking.budget_tokens")
    return {"enable_thinking": kind != "disabled"}


def _stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise RequestError(f"'stop_sequences' must be a list of up to {MAX_STOP_SEQUENCES} non-empty strings of at "
                           f"most {MAX_STOP_CHARS} characters", param="stop_sequences")
    return stops


def _metadata(body: dict) -> None:
    metadata = body.get("metadata")
    if metadata is None:
        return
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(metadata, dict) or (user is not None and (not isinstance(user, str) or len(user) > 256)):
        raise RequestError("'metadata' must be an object like {\"user_id\": \"...\"} (at most 256 characters)",
                           param="metadata")


def parse_messages(body: dict, defaults: SamplingDefaults = SamplingDefaults(), *, count_only: bool = False,
                   **checks) -> CompletionRequest:
    """A /v1/messages body (count_only: a /v1/messages/count_tokens body) as a checked chat request.
    `checks` go to parse_completion (e.g. vocab_size)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required: the name of the model to use (GET /v1/models)", param="model")
    if count_only:
        max_tokens = 1
    else:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise RequestError("'max_tokens' is required: the most tokens to generate (an integer >= 1)",
                               param="max_tokens")
    _metadata(body)
    tools, choice = _tools(body)
    chat = {"model": model, "messages": _messages(body), "max_tokens": max_tokens,
            **{k: body[k] for k in _PASSED if k in body}}
    if tools is not None:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    kwargs = _thinking(body)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    request = parse_completion(chat, "chat", defaults, **checks)
    request.stop = _stop_sequences(body)
    return request
