"""Tool calls and reasoning on the OpenAI chat route, against the official `openai` client, on one
live steered server (tests/steered_server.py) running a Qwen3-style tokenizer (tests/agent_checkpoint.py).

The model's output is steered through the real sampler to a tool call's or a thinking block's
text; the server must parse it with mlx-lm's parser into `tool_calls` (streamed as deltas) and
`reasoning`, and render the next turn's tool result through the chat template.
"""

from __future__ import annotations

import json

import pytest

from tests.agent_checkpoint import agent_checkpoint
from tests.serve_process import post_raw
from tests.steered_server import steered_serve

openai = pytest.importorskip("openai")

N = 10
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return agent_checkpoint(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with steered_serve(model, tmp_path_factory.mktemp("serve"), "--max-tokens", str(N)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model):
    from mlx_lm.tokenizer_utils import load

    return load(model)


def forced(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]


def chat(client, messages, **kw):
    return client.chat.completions.create(model="default_model", messages=messages, temperature=0,
                                          max_tokens=kw.pop("max_tokens", N), **kw)


def test_a_two_turn_tool_loop(client, server, tokenizer):
    server.force(forced(tokenizer, CALL))
    r = chat(client, QUESTION, tools=TOOLS, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tools>" in tokenizer.decode(server.prompts()[-1])
    follow = QUESTION + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    r2 = chat(client, follow, tools=TOOLS)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.content
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nSunny, 24 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in tokenizer.decode(server.prompts()[-1])


def test_tool_calls_stream_as_deltas(client, server, tokenizer):
    server.force(forced(tokenizer, "Checking." + CALL))
    chunks = list(chat(client, QUESTION, tools=TOOLS, max_tokens=60, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_without_tools_or_with_tool_choice_none_the_text_is_not_parsed(client, server, tokenizer):
    server.force(forced(tokenizer, CALL))
    r = chat(client, QUESTION, tools=TOOLS, tool_choice="none", max_tokens=60)
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert "<tools>" not in tokenizer.decode(server.prompts()[-1])  # "none": the template is not shown the tools


def test_reasoning_is_separated_and_thinking_can_be_turned_off(client, server, tokenizer):
    server.force(forced(tokenizer, "<think>\nA greeting.\n</think>\n\nHello there."))
    message = chat(client, QUESTION, max_tokens=40).choices[0].message
    extra = message.model_extra
    assert message.content == "Hello there." and extra["reasoning"].strip() == "A greeting."
    assert extra["reasoning_content"] == extra["reasoning"]
    server.force(forced(tokenizer, "<think>\nA greeting.\n</think>\n\nHello there."))
    chunks = list(chat(client, QUESTION, max_tokens=40, stream=True))
    deltas = [c.choices[0].delta.model_extra or {} for c in chunks if c.choices]
    assert "".join(d.get("reasoning", "") for d in deltas).strip() == "A greeting."
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."
    chat(client, QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert tokenizer.decode(server.prompts()[-1]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("body, needle", [
    ({"messages": QUESTION + [{"role": "tool", "tool_call_id": "x", "content": "y"}]}, "without the tool call"),
    ({"messages": QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "y"}]}, "did not make"),
    ({"messages": QUESTION + [
        {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "not valid JSON"),
    ({"messages": QUESTION, "tools": [{"type": "retrieval"}]}, "'tools[0]'"),
    ({"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the request's tools"),
    ({"messages": QUESTION, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
])
def test_bad_tool_requests_get_400_in_the_openai_error_shape(server, body, needle):
    code, raw = post_raw(server.base + "/v1/chat/completions", json.dumps(body).encode())
    err = json.loads(raw)
    assert code == 400, err
    assert err["error"]["type"] == "invalid_request_error" and needle in err["error"]["message"]
