"""The agent pieces of the server without a server: the reply splitter on mlx-lm's markers and
parsers, the OpenAI and Anthropic reply shapes built from it, and the Anthropic request mapping.

Replies are cut into chunks at random places (hypothesis): streaming must give what the whole text
gives, as mlx-lm's TextStateMachine promises for markers split across tokens.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.serve.anthropic_reply import MessageReply
from runtime.serve.anthropic_shapes import error_body, parse_messages
from runtime.serve.openai_reply import ChatReply
from runtime.serve.reply_split import ReplySplitter
from runtime.serve.sse import ResponseFormat
from runtime.serve.validation import RequestError, parse_completion
from tests.agent_checkpoint import agent_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {}}}]
REPLY = ('<think>\nweighing it\n</think>\n\nLet me check.<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
         '\n</tool_call>')


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load

    return load(agent_checkpoint(tmp_path_factory.mktemp("agent")))


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def summary(segments) -> list:
    """Adjacent text of one kind merged; tool calls as (name, arguments)."""
    out = []
    for s in segments:
        if s.kind == "tool_call":
            out.append(("tool_call", s.call.name, s.call.arguments))
        elif out and out[-1][0] == s.kind:
            out[-1] = (s.kind, out[-1][1] + s.text)
        else:
            out.append((s.kind, s.text))
    return out


def test_the_splitter_separates_thinking_text_and_tool_calls(tokenizer):
    s = ReplySplitter(tokenizer, [1], TOOLS)
    got = summary(s.feed(REPLY) + s.finish())
    assert got == [("reasoning", "\nweighing it\n"), ("text", "Let me check."),
                   ("tool_call", "get_weather", {"city": "Paris"}), ("tool_call", "get_weather", {"city": "Rome"})]
    assert s.n_tool_calls == 2


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_streamed_in_any_chunks_the_split_is_the_same(tokenizer, cuts):
    whole = ReplySplitter(tokenizer, [1], TOOLS)
    expected = summary(whole.feed(REPLY) + whole.finish())
    s = ReplySplitter(tokenizer, [1], TOOLS)
    segments = [seg for c in chunks_of(REPLY, cuts) for seg in s.feed(c)] + s.finish()
    assert summary(segments) == expected


def test_text_without_markers_comes_back_unchanged_and_a_cut_call_stays_text(tokenizer):
    plain = "  The king speaks: <tool and </think-less words\n"
    s = ReplySplitter(tokenizer, [1], TOOLS)
    assert "".join(x.text for x in s.feed(plain) + s.finish()) == plain
    s = ReplySplitter(tokenizer, [1], TOOLS)
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert summary(s.feed(cut) + s.finish()) == [("text", cut)] and s.n_tool_calls == 0


def test_a_prompt_that_opens_a_thinking_block_starts_the_reply_in_it(tokenizer):
    ids = list(tokenizer.encode("hello <think>", add_special_tokens=False))
    s = ReplySplitter(tokenizer, ids, None)
    assert summary(s.feed("pondering</think>answer") + s.finish()) == [("reasoning", "pondering"), ("text", "answer")]


def test_openai_streamed_deltas_add_up_to_the_whole_message(tokenizer):
    request = SimpleNamespace(kind="chat", tools=TOOLS)
    whole = ChatReply.for_request(ResponseFormat("chat", "m"), tokenizer, request, [1])
    message = whole.complete(REPLY, "stop", {})["choices"][0]
    streamed = ChatReply.for_request(ResponseFormat("chat", "m"), tokenizer, request, [1])
    chunks = [c for piece in chunks_of(REPLY, [5, 17, 40, 41, 90]) for c in streamed.chunks(piece)]
    chunks += streamed.final_chunks("stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert message["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == message["message"]["content"] == "Let me check."
    assert "".join(d.get("reasoning", "") for d in deltas) == message["message"]["reasoning"]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert [tc["function"] for tc in calls] == [tc["function"] for tc in message["message"]["tool_calls"]]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}


def test_anthropic_events_accumulate_to_the_whole_message(tokenizer):
    anthropic = pytest.importorskip("anthropic")
    from anthropic.lib.streaming._messages import accumulate_event

    done = SimpleNamespace(finish_reason="stop", stop_sequence=None, prompt_tokens=20, completion_tokens=30,
                           cached_tokens=4)
    message = MessageReply("m", ReplySplitter(tokenizer, [1], TOOLS), 20).message(REPLY, done)
    reply = MessageReply("m", ReplySplitter(tokenizer, [1], TOOLS), 20)
    events = reply.start() + [e for piece in chunks_of(REPLY, [3, 30, 31, 77]) for e in reply.feed(piece)]
    events += reply.finish(done)
    snapshot = None
    for raw in events:
        name, data = raw.split("\n")[0][len("event: "):], json.loads(raw.split("\n")[1][len("data: "):])
        assert data["type"] == name
        if name != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs={})
    streamed = snapshot.to_dict()
    assert isinstance(anthropic.types.Message.model_validate(message), anthropic.types.Message)
    for m in (message, streamed):
        for block in m["content"]:
            block.pop("id", None)
    assert streamed["content"] == message["content"]
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert message["stop_reason"] == streamed["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 16, "output_tokens": 30, "cache_read_input_tokens": 4,
                                "cache_creation_input_tokens": 0}


def test_an_anthropic_conversation_maps_to_the_chat_templates_shape():
    body = {"model": "claude-x", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "top_k": 5, "tools": [{"name": "get_weather", "input_schema": {}}],
            "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"},
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                  {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "Sunny"}]},
                                             {"type": "text", "text": "Thanks"}]}]}
    req = parse_messages(body)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert req.messages[2]["reasoning_content"] == "hm" and req.messages[3]["content"] == "Sunny"
    assert (req.max_tokens, req.top_k, req.stop, req.tool_choice) == (9, 5, ["END"], "required")
    assert req.template_kwargs == {"enable_thinking": False} and req.tools[0]["function"]["name"] == "get_weather"
    assert error_body(RequestError("x", status=429))["error"]["type"] == "rate_limit_error"


def test_an_openai_tool_turn_keeps_its_calls_for_the_template():
    body = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}], "tools": TOOLS}
    req = parse_completion(body, "chat")
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert req.messages[2]["tool_call_id"] == "c1" and req.tools == TOOLS and req.tool_choice == "auto"


def test_a_waiting_stream_sends_pings_until_the_reply_comes(tokenizer, monkeypatch):
    import asyncio

    from runtime.serve import anthropic_routes
    from runtime.serve.queue import JobEvent

    monkeypatch.setattr(anthropic_routes, "PING_S", 0.01)

    async def run() -> list[str]:
        job = SimpleNamespace(events=asyncio.Queue(), cancel=SimpleNamespace(set=lambda: None))
        reply = MessageReply("m", ReplySplitter(tokenizer, [1], None), 5)
        names = []
        async for e in anthropic_routes._stream(job, reply):
            names.append(e.split("\n")[0][len("event: "):])
            if names.count("ping") == 4:  # a slow prefill: nothing came for three ping intervals; now a token
                job.events.put_nowait(JobEvent("text", text="Hi"))
                job.events.put_nowait(JobEvent("done", finish_reason="stop", prompt_tokens=5, completion_tokens=1))
        return names

    names = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert names == ["message_start", "ping", "ping", "ping", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
