"""The server's pure parts without a server: stop strings on streamed text, request validation, SSE,
the body reader's bounds, the queue's limit and request timeout."""

from __future__ import annotations

import asyncio
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
    ({"messages": [{"role": "user"}], "seed": 2**70}, "'seed' must be in [0, 18446744073709551615]"),
    ({"messages": [{"role": "user"}], "temperature": 1e308}, "'temperature' must be in [0, 100]"),
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


class _SlowBackend:
    """Yields a token every `step_s` seconds until closed (a generation that would run on)."""

    def __init__(self, step_s: float = 0.02):
        self.step_s = step_s

    def stream(self, ids, request):
        import time
        from types import SimpleNamespace

        while True:
            time.sleep(self.step_s)
            yield SimpleNamespace(text="x", finish_reason=None, cached_tokens=None)


def _events(job, loop):
    out = []
    while True:
        event = loop.run_until_complete(asyncio.wait_for(job.events.get(), 10))
        out.append(event)
        if event.kind != "text":
            return out


def test_queue_refuses_past_max_queue_and_ends_a_run_at_request_timeout():
    from runtime.serve import CompletionRequest, GenerationQueue, QueueFull

    loop = asyncio.new_event_loop()
    q = GenerationQueue(_SlowBackend(), max_queue=2, request_timeout_s=0.3)
    try:
        async def submit():
            return q.submit([1], CompletionRequest(kind="text", model=None, prompt="x", max_tokens=10**6))

        first, second = loop.run_until_complete(submit()), loop.run_until_complete(submit())
        with pytest.raises(QueueFull) as info:
            loop.run_until_complete(submit())
        assert info.value.retry_after_s >= 1 and "--max-queue" in str(info.value)
        for job in (first, second):
            done = _events(job, loop)[-1]
            assert done.kind == "done" and done.finish_reason == "length" and done.completion_tokens > 1
        status = q.status()
        assert status["timed_out"] == 2 and status["refused"] == 1 and q.pending == 0
        loop.run_until_complete(submit())  # room again once those ended
    finally:
        q.close()
        loop.close()


class _Request:
    def __init__(self, chunks, length=None, delay_s=0.0):
        self.headers = {} if length is None else {"content-length": str(length)}
        self.chunks, self.delay_s, self.read = chunks, delay_s, 0

    async def stream(self):
        for c in self.chunks:
            await asyncio.sleep(self.delay_s)
            self.read += 1
            yield c


def test_read_body_caps_size_before_and_while_reading_and_bounds_time():
    from runtime.serve import RequestLimits, read_body

    limits = RequestLimits(max_body_bytes=10, body_timeout_s=0.2)
    declared = _Request([b"x" * 100], length=100)
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(declared, limits))
    assert info.value.status == 413 and declared.read == 0  # refused from Content-Length, nothing read
    chunked = _Request([b"x" * 6] * 100)
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(chunked, limits))
    assert info.value.status == 413 and chunked.read == 2  # stopped at the chunk that passed the cap
    with pytest.raises(RequestError) as info:
        asyncio.run(read_body(_Request([b"{"] * 5, delay_s=0.1), limits))
    assert info.value.status == 408 and "--body-timeout" in info.value.message
    assert asyncio.run(read_body(_Request([b"{}"], length=2), limits)) == b"{}"
    with pytest.raises(ValueError, match="--max-queue 0"):
        RequestLimits(max_queue=0)


def test_deep_nesting_huge_integers_and_nan_are_400_not_500():
    for raw, needle in [(b"[" * 100000 + b"]" * 100000, "nests too deeply"), (b'{"a": ' + b"9" * 5000 + b"}", "too many digits"),
                        (b'{"temperature": NaN}', "NaN"), (b'{"x": -Infinity}', "-Infinity")]:
        with pytest.raises(RequestError, match=needle):
            parse_json(raw)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for name, value in [("seed", 2**64), ("seed", -1), ("top_k", 10**9), ("temperature", 101), ("stop", ["x" * 257])]:
        with pytest.raises(RequestError) as info:
            parse_completion({**body, name: value}, "chat", vocab_size=4096)
        assert info.value.param == name and info.value.status == 400
    assert parse_completion({**body, "seed": 2**64 - 1, "top_k": 4095}, "chat", vocab_size=4096).seed == 2**64 - 1
