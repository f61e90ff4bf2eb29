"""The server's pure parts without a server: stop strings on streamed text, request validation, SSE."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.serve import ResponseFormat, SamplingDefaults, StopMatcher, parse_completion, parse_json, sse
from runtime.serve.validation import RequestError

ALPHABET = "ab<|>\n "


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3))
def test_stop_matcher_releases_exactly_the_text_before_the_first_stop(pieces, stops):
    full = "".join(pieces)
    m = StopMatcher(stops)
    released = []
    for p in pieces:
        out = m.feed(p)
        released.append(out)
        assert not any(s in "".join(released) for s in stops)  # never sends a stop string
    released.append(m.flush())
    cuts = [full.find(s) for s in stops if s in full]
    assert "".join(released) == (full[: min(cuts)] if cuts else full)
    assert m.stopped == bool(cuts)


def test_stop_matcher_holds_back_only_a_possible_stop_prefix():
    m = StopMatcher(["<|end|>"])
    assert m.feed("Hello <|") == "Hello "
    assert m.feed("en") == ""
    assert m.feed("d") == "" and not m.stopped
    assert m.feed("x") == "<|endx"


def test_validation_defaults_and_aliases():
    d = SamplingDefaults(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1)
    r = parse_completion({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "chat", d)
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.min_p, r.stream) == (7, 0.5, 0.9, 3, 0.1, False)
    assert r.messages == [{"role": "user", "content": "hi"}]
    r = parse_completion({"prompt": ["x"], "max_completion_tokens": 4, "stop": "\n", "seed": 3, "stream": True,
                          "stream_options": {"include_usage": True}}, "text")
    assert (r.prompt, r.max_tokens, r.stop, r.seed, r.stream, r.include_usage) == ("x", 4, ["\n"], 3, True, True)


@pytest.mark.parametrize("body, needle", [
    ({"messages": [], "max_tokens": 1}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}], "max_tokens": True}, "'max_tokens' must be an integer"),
    ({"messages": [{"role": "user"}], "min_p": 1.5}, "'min_p' must be in [0, 1]"),
    ({"messages": [{"role": "user"}], "stream": "yes"}, "'stream' must be true or false"),
    ({"messages": [{"role": "user"}], "stop": ["a", ""]}, "'stop' must be"),
    ({"messages": [{"role": "user"}], "n": 2}, "'n' must be 1"),
    ({"messages": [{"role": "user"}], "seed": 1.5}, "'seed' must be an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text only"),
])
def test_validation_errors_name_the_field(body, needle):
    with pytest.raises(RequestError) as info:
        parse_completion(body, "chat")
    assert needle in info.value.message and info.value.status == 400
    assert info.value.body()["error"]["message"] == info.value.message


def test_json_errors():
    for raw, needle in [(b"", "empty"), (b"{", "not valid JSON"), (b"\xff", "not valid JSON"), (b"3", "JSON int")]:
        with pytest.raises(RequestError, match=needle):
            parse_json(raw)


def test_sse_chunks_have_openai_shapes():
    f = ResponseFormat("chat", "m")
    first = f.chunk(None, first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                            "content": ""}
    last = f.chunk(None, "length")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert last["id"] == first["id"] and f.id.startswith("chatcmpl-")
    event = sse(f.chunk("hi"))
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    assert json.loads(event[6:])["choices"][0]["delta"] == {"content": "hi"}
    assert ResponseFormat("text", "m").complete("x", "stop", {})["object"] == "text_completion"


class _FakeCache:
    def __init__(self):
        self.tokens, self.resets = [], 0

    def reset(self):
        self.tokens, self.resets = [], self.resets + 1


def test_prompt_cache_pool_picks_the_longest_shared_prefix_and_evicts_the_lru():
    from runtime.serve.prompt_pool import PromptCachePool

    pool = PromptCachePool(_FakeCache, size=2)
    a = pool.take([1, 2, 3])
    a.tokens = [1, 2, 3, 9]
    b = pool.take([5, 6])
    b.tokens = [5, 6, 7]
    assert b is not a and pool.take([1, 2, 3, 9, 4]) is a  # conversation A continues in A's cache
    assert pool.take([5, 6, 7, 8]) is b
    c = pool.take([42])  # a third conversation: the least recently used (A) is reset and reused
    assert c is a and a.resets == 1 and a.tokens == [] and len(pool.entries) == 2
    with pytest.raises(ValueError, match="--prompt-cache-size 0"):
        PromptCachePool(_FakeCache, size=0)
