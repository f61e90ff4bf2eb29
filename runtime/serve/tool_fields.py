"""The agent fields of a chat request: tools, tool_choice, chat_template_kwargs, and the tool turns
of a conversation (an assistant's tool_calls, a tool's result), checked and put in the shape
Hugging Face chat templates read (mlx_lm.server passes the same objects to `apply_chat_template`).

Shapes (OpenAI's, which the templates expect):
    tools          [{"type": "function", "function": {"name", "description", "parameters"}}]
    assistant      {"role": "assistant", "content", "tool_calls": [{"id", "type": "function",
                    "function": {"name", "arguments": {...}}}]}   (arguments as a JSON object, as
                    mlx_lm.server turns the string the client sent into one)
    tool result    {"role": "tool", "tool_call_id", "content"}

tool_choice: "auto" (default), "none" (tools not shown to the template, replies not parsed),
"required" or one named function (only that function is shown). A choice narrows what the model
sees; it is not enforced by constraining the decoder.

Invariants: every field is bounded (counts, name lengths, JSON size) and a bad one raises
RequestError naming it; a tool result must answer a tool call of the assistant turn right before
it (by id when it gives one); template kwargs never override what the server itself passes
(tokenize, add_generation_prompt, tools, ...).
"""

from __future__ import annotations

import json
import re

from runtime.serve.validation import RequestError

__all__ = ["MAX_TOOLS", "MAX_TOOL_JSON", "apply_tool_fields", "openai_tools", "tool_choice", "template_kwargs", "message_extras",
           "check_tool_turns", "narrow_tools", "function_tool"]

MAX_TOOLS = 128  # as OpenAI's limit
MAX_TOOL_JSON = 64 * 1024  # characters of one tool definition or one call's arguments, as JSON
MAX_TOOL_CALLS = 128  # calls in one assistant turn
MAX_TEMPLATE_KWARGS = 16
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_RESERVED = frozenset({"tokenize", "add_generation_prompt", "tools", "documents", "conversation", "messages",
                       "return_dict", "return_tensors", "continue_final_message", "chat_template", "padding",
                       "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def apply_tool_fields(request, body: dict) -> None:
    """Set a checked chat request's `tools`, `tool_choice` and `template_kwargs` from an OpenAI body, and
    add each message's tool fields (its `messages` were checked one to one from body["messages"])."""
    for i, m in enumerate(body["messages"]):
        request.messages[i].update(message_extras(m, i))
    check_tool_turns(request.messages)
    tools = openai_tools(body)
    request.tool_choice = tool_choice(body, tools)
    request.tools = narrow_tools(tools, request.tool_choice)
    request.template_kwargs = template_kwargs(body.get("chat_template_kwargs"))


def _name(value, param: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise RequestError(f"'{param}' must be a name of 1-128 letters, digits, '_', '-', '.' or ':', got "
                           f"{json.dumps(value)[:80]}", param=param)
    return value


def _json_size(value, param: str) -> None:
    if len(json.dumps(value)) > MAX_TOOL_JSON:
        raise RequestError(f"'{param}' is over {MAX_TOOL_JSON} characters as JSON", param=param)


def function_tool(name: str, description, parameters, param: str) -> dict:
    """One tool as the chat templates read it, checked."""
    _name(name, f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"'{param}.description' must be a string", param=f"{param}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError(f"'{param}' parameters must be a JSON Schema object", param=param)
    fn = {"name": name, "description": description or "", "parameters": parameters}
    _json_size(fn, param)
    return {"type": "function", "function": fn}


def openai_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} function tools", param="tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                               "\"description\", \"parameters\"}}", param=f"tools[{i}]")
        out.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function"))
    return out or None


def tool_choice(body: dict, tools: list[dict] | None):
    """"auto", "none", "required" or a function name; RequestError for anything else."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(fn, dict) and choice.get("type", "function") == "function":
        return _chosen(fn.get("name"), tools, "tool_choice.function.name")
    raise RequestError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice")


def _chosen(name, tools: list[dict] | None, param: str) -> str:
    _name(name, param)
    if not any(t["function"]["name"] == name for t in tools or []):
        raise RequestError(f"'{param}' names {name!r}, which is not among the request's tools", param=param)
    return name


def narrow_tools(tools: list[dict] | None, choice: str) -> list[dict] | None:
    """The tools the template shows for this choice (None: none)."""
    if not tools or choice == "none":
        return None
    if choice in ("auto", "required", "any"):
        return tools
    return [t for t in tools if t["function"]["name"] == choice]


def template_kwargs(value, param: str = "chat_template_kwargs") -> dict:
    """Extra variables for the chat template (e.g. {"enable_thinking": false}), as mlx_lm.server takes them."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"'{param}' must be an object of at most {MAX_TEMPLATE_KWARGS} template variables",
                           param=param)
    for key, v in value.items():
        if not key.isidentifier() or key in _RESERVED:
            raise RequestError(f"'{param}.{key}' is not a template variable a request may set", param=param)
        if not (v is None or isinstance(v, (bool, int, float, str))) or (isinstance(v, str) and len(v) > 1024):
            raise RequestError(f"'{param}.{key}' must be a boolean, number or short string", param=f"{param}.{key}")
    return dict(value)


def _arguments(value, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(f"'{param}' is not valid JSON ({e})", param=param) from None
    if not isinstance(value, dict):
        raise RequestError(f"'{param}' must be a JSON object (or a string of one)", param=param)
    _json_size(value, param)
    return value


def message_extras(m: dict, i: int) -> dict:
    """The tool fields of one OpenAI chat message, in the template's shape ({} when it has none)."""
    role, out = m.get("role"), {}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
            raise RequestError(f"'messages[{i}].tool_calls' must be a list of at most {MAX_TOOL_CALLS} calls",
                               param=f"messages[{i}].tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            p = f"messages[{i}].tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict):
                raise RequestError(f"'{p}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                   "\"arguments\"}}", param=p)
            call_id = c.get("id")
            if call_id is not None and (not isinstance(call_id, str) or len(call_id) > 256):
                raise RequestError(f"'{p}.id' must be a string of at most 256 characters", param=f"{p}.id")
            out["tool_calls"].append({"id": call_id, "type": "function", "function": {
                "name": _name(fn.get("name"), f"{p}.function.name"),
                "arguments": _arguments(fn.get("arguments"), f"{p}.function.arguments")}})
    if role == "assistant":
        for key in ("reasoning_content", "reasoning"):
            if isinstance(m.get(key), str):
                out["reasoning_content"] = m[key]
                break
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and (not isinstance(call_id, str) or len(call_id) > 256):
            raise RequestError(f"'messages[{i}].tool_call_id' must be a string of at most 256 characters",
                               param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = _name(m["name"], f"messages[{i}].name")
    return out


def check_tool_turns(messages: list[dict], param: str = "messages", what: str = "a 'tool' message") -> None:
    """Every tool result answers a call of the assistant turn right before its run of results."""
    calls: list[dict] | None = None  # the calls of the last assistant turn, while results follow it
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or None
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if calls is None:
                raise RequestError(f"'{param}[{i}]' is {what} without the tool call it answers: it must follow "
                                   "an assistant turn with tool calls", param=f"{param}[{i}]")
            if call_id is not None and not any(c.get("id") == call_id for c in calls):
                raise RequestError(f"'{param}[{i}]' answers tool call {call_id!r}, which the assistant turn before "
                                   "it did not make", param=f"{param}[{i}]")
        else:
            calls = None
