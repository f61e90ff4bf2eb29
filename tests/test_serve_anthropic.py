"""`POST /v1/messages` against the official `anthropic` client, on one live steered server.

The server runs the embedded target with a Qwen3-style tokenizer (tests/agent_checkpoint.py) and
an API key. Plain replies must equal `specmoe generate`; tool calls and thinking are produced by
steering the real sampler to emit their text (tests/steered_server.py), then parsed by the
server; the prompts the chat template rendered are read back from the server's prompt log.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.agent_checkpoint import agent_checkpoint
from tests.conftest import run_cli
from tests.steered_server import steered_serve

anthropic = pytest.importorskip("anthropic")

N = 10
KEY = "local-test-key"
PROMPT = "Enter the king, with his lords. The king speaks:"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return agent_checkpoint(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with steered_serve(model, tmp_path_factory.mktemp("serve"), "--max-tokens", str(N), "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model):
    from mlx_lm.tokenizer_utils import load

    return load(model)


def forced(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]


def rendered(server, tokenizer) -> str:
    return tokenizer.decode(server.prompts()[-1])


def ask(client, messages, **kw):
    return client.messages.create(model="claude-sonnet-4-5", max_tokens=kw.pop("max_tokens", N),
                                  messages=messages, extra_body={"temperature": 0}, **kw)


def test_text_equals_specmoe_generate_streaming_or_not(client, server, model):
    code, out, err = run_cli(["generate", "-m", str(model), "-p", PROMPT, "-n", str(N), "--temp", "0"])
    assert code == 0, err
    expected = out[:-1]
    r = ask(client, [{"role": "user", "content": PROMPT}])
    assert r.type == "message" and r.role == "assistant" and r.model == "claude-sonnet-4-5"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == expected
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == N
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(server.prompts()[-1])
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=N, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": PROMPT}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    count = client.messages.count_tokens(model="claude-sonnet-4-5", messages=[{"role": "user", "content": PROMPT}])
    assert count.input_tokens == len(server.prompts()[-1])


def test_stop_sequences_end_with_stop_sequence(client):
    full = ask(client, [{"role": "user", "content": PROMPT}]).content[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = ask(client, [{"role": "user", "content": PROMPT}], stop_sequences=[stop])
    assert r.content[0].text == full[: full.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop


def test_a_two_turn_tool_loop(client, server, tokenizer):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    server.force(forced(tokenizer, CALL))
    r = ask(client, question, tools=[WEATHER], max_tokens=60)
    assert r.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    prompt = rendered(server, tokenizer)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the tools went through the template
    use = r.content[0]
    follow = question + [{"role": "assistant", "content": r.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "Sunny, 24 C"}]}]
    r2 = ask(client, follow, tools=[WEATHER])
    assert r2.content and r2.content[0].type == "text" and r2.stop_reason in ("end_turn", "max_tokens")
    prompt = rendered(server, tokenizer)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nSunny, 24 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt


def test_a_streamed_tool_call_is_a_tool_use_block(client, server, tokenizer):
    server.force(forced(tokenizer, "Let me look." + CALL))
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=60, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == "Let me look." and final.content[1].input == {"city": "Paris"}
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "input_json_delta" in deltas


def test_thinking_is_a_thinking_block_and_can_be_turned_off(client, server, tokenizer):
    server.force(forced(tokenizer, "<think>\nThe king is speaking.\n</think>\n\nHe says hello."))
    r = ask(client, [{"role": "user", "content": PROMPT}], max_tokens=40)
    assert [b.type for b in r.content] == ["thinking", "text"] and r.stop_reason == "end_turn"
    assert r.content[0].thinking.strip() == "The king is speaking." and r.content[1].text == "He says hello."
    assert not rendered(server, tokenizer).endswith("</think>\n\n")
    server.force(forced(tokenizer, "<think>\nSo.\n</think>\n\nHello."))
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=40,
                                messages=[{"role": "user", "content": PROMPT}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Hello."
    ask(client, [{"role": "user", "content": PROMPT}], thinking={"type": "disabled"})
    assert rendered(server, tokenizer).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def raw_post(server, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"x-api-key": key} if key else {})}
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body, needle", [
    ({"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    ({"model": "claude-x", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
     "tool_result"),
    ({"model": "claude-x", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "hologram", "text": "hi"}]}]}, "unknown block type"),
    ({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "runs no tools itself"),
    ({"model": "claude-x", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "sometimes"}}, "'thinking'"),
])
def test_bad_requests_get_400_in_the_anthropic_error_shape(server, body, needle):
    code, err = raw_post(server, "/v1/messages", body)
    assert code == 400, err
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


def test_the_client_sees_errors_as_its_own_exceptions(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="some-other-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
