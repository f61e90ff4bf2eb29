"""`specmoe serve` against the official `openai` client: same text as `specmoe generate`, streaming,
concurrency, a disconnect mid-stream, and clear 4xx errors. One live server on the embedded target.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from runtime.checkpoints import embedded_pair
from tests.conftest import run_cli
from tests.serve_process import get_json, post_raw, serve

openai = pytest.importorskip("openai")

PROMPTS = ["Enter the king, with his lords. The king speaks:", "What says the queen?"]
N = 10  # tokens per answer: short, the machine is shared


@pytest.fixture(scope="module")
def target():
    return embedded_pair().target


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve(["-m", str(target), "--max-prompt-tokens", "64", "--max-tokens", str(N)], log) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate_text(target, prompt: str, *extra: str) -> str:
    """What `specmoe generate` prints for `prompt`, greedy, N tokens."""
    code, out, err = run_cli(["generate", "-m", str(target), "-p", prompt, "-n", str(N), "--temp", "0", *extra])
    assert code == 0, err
    return out[:-1]  # generate ends the text with one newline


@pytest.fixture(scope="module")
def reference(target):
    return {p: generate_text(target, p) for p in PROMPTS}


def test_health_and_models_say_what_is_served(server, client, target):
    code, health = get_json(server + "/health")
    assert code == 200 and health["status"] == "ok"
    assert "one request at a time" in health["queue"]["mode"]
    assert [m.id for m in client.models.list().data] == [str(target)]


def test_no_cors_by_default(server):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    with pytest.raises(urllib.error.HTTPError) as info:  # a page's preflight is refused: no browser may call it
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 403 and "Access-Control-Allow-Origin" not in info.value.headers


def test_chat_non_streaming_and_streaming_equal_specmoe_generate(client, target, reference):
    prompt = PROMPTS[0]
    r = client.chat.completions.create(model=str(target), messages=[{"role": "user", "content": prompt}],
                                       max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == reference[prompt]
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model=str(target), messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=N, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference[prompt]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


def test_raw_sse_stream_ends_with_done(server):
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 3, "stream": True})
    code, raw = post_raw(server + "/v1/chat/completions", body.encode())
    events = [e for e in raw.decode().split("\n\n") if e]
    assert code == 200 and all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert {json.loads(e[6:])["object"] for e in events[:-1]} == {"chat.completion.chunk"}


def test_text_completions_equal_raw_prompt_generate(client, target):
    prompt = PROMPTS[1]
    expected = generate_text(target, prompt, "--raw-prompt")
    r = client.completions.create(model=str(target), prompt=prompt, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=str(target), prompt=prompt, max_tokens=N, temperature=0, stream=True) if c.choices)
    assert streamed == expected


def test_stop_strings_cut_the_text_and_finish_with_stop(client, reference):
    prompt = PROMPTS[0]
    full = reference[prompt]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    r = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def ask(seed: int) -> str:
        return client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=N, temperature=1.5,
            top_p=0.95, seed=seed, extra_body={"top_k": 50, "min_p": 0.01}).choices[0].message.content

    assert ask(7) == ask(7)
    assert len({ask(s) for s in (1, 2, 3)}) > 1  # sampling does happen


def test_a_conversation_reuses_its_prompt_cache_and_answers_as_a_fresh_run(client, target, reference):
    from runtime import load, stream_generate

    history = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": reference[PROMPTS[0]]},
               {"role": "user", "content": PROMPTS[1]}]
    with load(target) as engine:  # the answer from scratch, no prompt cache
        ids = list(engine.tokenizer.apply_chat_template(history, add_generation_prompt=True))
        fresh = "".join(r.text for r in stream_generate(engine, ids, N, temp=0.0))
    client.chat.completions.create(model="default_model", messages=history[:1], max_tokens=N, temperature=0)
    r = client.chat.completions.create(model="default_model", messages=history, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == fresh
    assert r.usage.prompt_tokens_details.cached_tokens > 10  # the first turn's prompt came from the cache
    assert r.usage.prompt_tokens == len(ids)


def test_concurrent_requests_are_all_answered_correctly(client, reference):
    jobs = [PROMPTS[i % 2] for i in range(6)]
    answers: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int, prompt: str) -> None:
        try:
            stream = i % 2 == 1
            r = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=N, temperature=0, stream=stream)
            answers[i] = ("".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream
                          else r.choices[0].message.content)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert answers == {i: reference[p] for i, p in enumerate(jobs)}


def _cancelled(server) -> int:
    return get_json(server + "/health")[1]["queue"]["cancelled"]


def test_disconnect_mid_stream_cancels_and_the_server_keeps_serving(server, client, reference):
    before = _cancelled(server)
    port = int(server.rsplit(":", 1)[1])
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 2000, "stream": True,
                       "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while seen.count(b"data: ") < 3:  # the role chunk and two content chunks
            seen += s.recv(4096)
        assert b"200 OK" in seen
    deadline = time.monotonic() + 60
    while _cancelled(server) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cancelled(server) == before + 1
    stats = get_json(server + "/v1/specmoe/stats")[1]
    assert stats["last_request"]["generation_tokens"] < 2000  # decoding stopped, it did not run to max_tokens
    r = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": PROMPTS[1]}],
                                       max_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference[PROMPTS[1]]


def test_disconnect_while_waiting_for_a_non_streaming_answer_cancels_it(server, client, reference):
    before = _cancelled(server)
    submitted = get_json(server + "/health")[1]["queue"]["submitted"]
    port = int(server.rsplit(":", 1)[1])
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 2000}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until *this* request is the one generating (not a previous one)
            queue = get_json(server + "/health")[1]["queue"]
            if queue["submitted"] > submitted and queue["busy"] and not queue["queued"]:
                break
            time.sleep(0.05)
    deadline = time.monotonic() + 60
    while _cancelled(server) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cancelled(server) == before + 1
    assert get_json(server + "/v1/specmoe/stats")[1]["last_request"]["generation_tokens"] < 2000
    r = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference[PROMPTS[0]]


@pytest.mark.parametrize("kwargs, status, needle", [
    (dict(model="gpt-4"), 404, "model 'gpt-4' is not served"),
    (dict(temperature=-1), 400, "'temperature' must be in [0, 100]"),
    (dict(top_p=2), 400, "'top_p' must be in [0, 1]"),
    (dict(max_tokens=0), 400, "'max_tokens' must be >= 1"),
    (dict(extra_body={"top_k": "many"}), 400, "'top_k' must be an integer"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "'messages[0].role'"),
    (dict(messages=[{"role": "user", "content": "the king " * 80}]), 400, "at most 64 (--max-prompt-tokens)"),
])
def test_bad_requests_get_clear_errors(client, kwargs, status, needle):
    args = dict(model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == status and needle in info.value.message, info.value.message


def test_malformed_bodies_and_routes_are_4xx_json(server, client, reference):
    for body, needle in [(b"{not json", "not valid JSON"), (b"[1, 2]", "expected a JSON object"), (b"", "empty"),
                         (b'{"max_tokens": 2}', "'messages' is required")]:
        code, raw = post_raw(server + "/v1/chat/completions", body)
        assert code == 400 and needle in json.loads(raw)["error"]["message"], raw
    code, raw = post_raw(server + "/v1/completions", b'{"prompt": 3}')
    assert code == 400 and "'prompt'" in json.loads(raw)["error"]["message"]
    code, err = get_json(server + "/v1/nothing")
    assert code == 404 and "no route /v1/nothing" in err["error"]["message"]
    r = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=N, temperature=0)
    assert r.choices[0].message.content == reference[PROMPTS[0]]  # still serving, still right


def test_stats_report_cache_io_and_memory(server):
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": N}).encode()
    assert post_raw(server + "/v1/chat/completions", body)[0] == 200
    code, stats = get_json(server + "/v1/specmoe/stats")
    assert code == 200
    assert 0 <= stats["expert_cache"]["hit_rate"] <= 1 and stats["io"]["bytes_read"] > 0
    assert stats["memory"]["rss_bytes"] > 0 and stats["requests"]["requests"] >= 1
    assert stats["host_syncs"]["per_token"] > 0
    assert stats["speculative"] is None


def test_speculative_server_gives_the_same_text_and_reports_acceptance(target, reference, tmp_path):
    drafter = embedded_pair().default_drafter
    with serve(["-m", str(target), "--draft", str(drafter), "--max-tokens", str(N)], tmp_path / "spec.log") as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        for stream in (False, True):
            r = c.chat.completions.create(model="default_model", messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=N, temperature=0, stream=stream)
            text = ("".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream
                    else r.choices[0].message.content)
            assert text == reference[PROMPTS[0]]
        r = c.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4, temperature=0.7, seed=3, extra_body={"top_k": 5, "min_p": 0.05})
        assert r.choices[0].finish_reason in ("stop", "length")  # mlx-lm's filters, kept by speculative sampling
        stats = get_json(base + "/v1/specmoe/stats")[1]
    spec = stats["speculative"]
    assert spec["drafter"] == drafter.name and spec["rounds"] > 0 and 0 <= spec["acceptance"] <= 1
    assert stats["host_syncs"]["per_token"] > 0
