"""`specmoe serve --max-batch`: concurrent requests decoded together, each as it would be alone.

In-process on the embedded target at 25% (experts are read, so the union matters) and 100% (lone
requests run the one-sync device pass between the batches):
- queue level: requests submitted together are batched (newcomers join, short ones leave first);
  each one's streamed text, finish_reason and completion_tokens equal what the same request gets
  alone (greedy; stock mlx-lm's BatchGenerator and single-sequence decoding agree on this model,
  bench/results/batch_stock_drift.txt), a stop string cuts one of them with its held-back text;
- a cancelled member (what a client disconnect sets) ends alone, the others finish unchanged;
- a request running alone when others arrive hands over to their batch, its text unchanged;
- over HTTP: concurrent chat requests (one streaming with a stop string) equal their runs alone,
  /health shows more than one request running at once, the stats report batch sizes and unique <
  summed expert lookups, and the lifetime counters still add up (every host sync of a batch is in
  some request's record);
- each member samples with its own settings: a hot request leaves the greedy ones unchanged;
- planted: tokens routed to the wrong request's stream are caught by the same comparison;
- the prompt-cache pool: two conversations batched over HTTP, then one's follow-up reuses its batched turn's KV
  (the stats' reused prompt tokens) and equals a fresh stock run; planted, the batch's caches not kept: no reuse.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from runtime.checkpoints import embedded_pair
from runtime.serve import Backend, GenerationQueue, SamplingDefaults, ServerState, build_app
from runtime.serve.batch_run import BatchRun
from runtime.serve.server import context_limit, vocab_size
from runtime.serve.validation import CompletionRequest

PROMPTS = ["Enter the king, with his lords. The king speaks:", "What says the queen?",
           "Once upon a time", "The sky is blue because"]
MAX_TOKENS = [14, 6, 10, 12]  # different lengths: members leave at different steps


@pytest.fixture(scope="module", params=["25%", "100%"])
def engine(request):
    """25%: experts are read, the union matters; 100%: lone requests run the one-sync device pass, which
    the batches between them must not disturb (nor it them)."""
    from runtime import load

    with load(embedded_pair().target, budget=request.param) as e:
        yield e


@pytest.fixture(scope="module")
def backend(engine):
    return Backend(engine)


def _request(prompt: str, max_tokens: int, stop: list[str] | None = None) -> CompletionRequest:
    return CompletionRequest(kind="text", model=None, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                             stop=list(stop or []), stream=True)


def _run(queue: GenerationQueue, backend, requests: list, cancel: dict | None = None) -> list[dict]:
    """Submit all requests at once; each one's text events, final event. `cancel` {index: after n text events}."""
    async def main():
        jobs = [queue.submit(backend.encode(r), r) for r in requests]

        async def consume(i, job):
            texts = []
            while True:
                e = await asyncio.wait_for(job.events.get(), timeout=120)
                if e.kind == "text":
                    texts.append(e.text)
                    if cancel and i in cancel and len(texts) >= cancel[i]:
                        job.cancel.set()
                    continue
                return {"texts": texts, "text": "".join(texts), "kind": e.kind, "finish": e.finish_reason,
                        "tokens": e.completion_tokens, "error": e.error}

        return await asyncio.gather(*(consume(i, j) for i, j in enumerate(jobs)))

    return asyncio.run(main())


def _alone(queue, backend, requests) -> list[dict]:
    return [_run(queue, backend, [r])[0] for r in requests]


@pytest.fixture(scope="module")
def alone(backend):
    q = GenerationQueue(backend, max_batch=4)
    try:
        steps = backend.batch_stats()["steps"]
        out = _alone(q, backend, [_request(p, m) for p, m in zip(PROMPTS, MAX_TOKENS)])
        assert backend.batch_stats()["steps"] == steps  # nobody waited: each ran on the one-request path
        return out
    finally:
        q.close()


def _batched(backend, requests, cancel=None):
    """The requests submitted together behind a short lead request: the lead finds nobody waiting and runs
    alone (or joins them), so every request under test is decoded in a batch."""
    q = GenerationQueue(backend, max_batch=4)
    syncs0, counted0 = backend.host_syncs(), backend.stats()["host_syncs"]["total"]
    try:
        before = backend.batch_stats()
        out = _run(q, backend, [_request("Hello", 2)] + requests,
                   {i + 1: n for i, n in (cancel or {}).items()})[1:]
    finally:
        q.close()  # the worker is done with the batch once it has stopped
    # every host sync of the batch is in some request's record (each step's shared among its members)
    assert backend.stats()["host_syncs"]["total"] - counted0 == backend.host_syncs() - syncs0 > 0
    return out, before, backend.batch_stats(), q.status()


def test_batched_requests_equal_their_runs_alone_and_a_stop_string_cuts_one(backend, alone):
    stop = alone[0]["text"][5:8]
    assert len(stop) == 3 and stop not in alone[0]["text"][:7]
    requests = [_request(p, m, [stop] if i == 0 else None) for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    requests.append(_request(PROMPTS[1], MAX_TOKENS[1]))  # a fifth: waits for a place, joins mid-run
    out, before, after, status = _batched(backend, requests)
    assert after["steps"] > before["steps"] and after["max_seen"] >= 2  # they were decoded together
    assert after["unique_experts"] - before["unique_experts"] < after["summed_experts"] - before["summed_experts"]
    assert after["current"] == 0 and status["running"] == 0 and status["completed"] == len(requests) + 1
    first = out[0]
    assert first["kind"] == "done" and first["finish"] == "stop"
    assert first["text"] == alone[0]["text"][:alone[0]["text"].index(stop)]  # cut before the stop, held text kept
    for got, want in zip(out[1:], alone[1:] + [alone[1]]):
        assert (got["kind"], got["text"], got["finish"], got["tokens"]) == \
               (want["kind"], want["text"], want["finish"], want["tokens"])
    assert len(out[3]["texts"]) > 1  # streamed token by token, not in one piece


def test_a_cancelled_member_ends_alone_and_the_others_finish_unchanged(backend, alone):
    requests = [_request(p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    out, before, after, status = _batched(backend, requests, cancel={0: 2})
    assert out[0]["kind"] == "error" and out[0]["error"] == "cancelled"
    assert len(out[0]["texts"]) < MAX_TOKENS[0]  # it stopped early
    assert status["cancelled"] == 1 and status["completed"] == 4 and status["running"] == 0
    for got, want in zip(out[1:], alone[1:]):
        assert (got["text"], got["finish"], got["tokens"]) == (want["text"], want["finish"], want["tokens"])


def test_a_request_running_alone_hands_over_to_a_batch_when_others_arrive(backend, alone):
    """The first request runs alone; others arrive while it decodes: it goes on in their batch from its own
    prompt cache, and every text (its own across the hand-over included) equals the run alone."""
    q = GenerationQueue(backend, max_batch=4)
    try:
        lead = _request(PROMPTS[0], 40)
        (lead_alone,) = _alone(q, backend, [lead])
        rest = [_request(p, m) for p, m in zip(PROMPTS[1:], MAX_TOKENS[1:])]
        before, totals0 = backend.batch_stats(), backend.stats()["requests"]

        async def main():
            job = q.submit(backend.encode(lead), lead)
            first = await asyncio.wait_for(job.events.get(), timeout=120)  # it is decoding alone
            jobs = [q.submit(backend.encode(r), r) for r in rest]

            async def consume(j, texts):
                while (e := await asyncio.wait_for(j.events.get(), timeout=120)).kind == "text":
                    texts.append(e.text)
                return "".join(texts), e.kind, e.completion_tokens

            return await asyncio.gather(consume(job, [first.text]), *(consume(j, []) for j in jobs))

        out = asyncio.run(main())
    finally:
        q.close()
    assert q.status()["handed_over"] == 1
    after, totals = backend.batch_stats(), backend.stats()["requests"]
    assert out[0] == (lead_alone["text"], "done", lead_alone["tokens"])
    assert [o[0] for o in out[1:]] == [a["text"] for a in alone[1:]]
    assert after["steps"] > before["steps"] and after["max_seen"] >= 2
    assert totals["requests"] - totals0["requests"] == 4  # the hand-over is not a second request
    assert totals["completion_tokens"] - totals0["completion_tokens"] == sum(o[2] for o in out)


def test_each_member_samples_with_its_own_settings(backend, alone):
    """A hot request (temperature 1.5) in the batch leaves the greedy ones as they are alone."""
    requests = [_request(p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    requests[0].temperature = 1.5
    out, before, after, _ = _batched(backend, requests)
    assert after["max_seen"] >= 2
    assert out[0]["text"] != alone[0]["text"]  # it did sample (14 tokens at 1.5 all greedy: vanishingly unlikely)
    for got, want in zip(out[1:], alone[1:]):
        assert (got["text"], got["tokens"]) == (want["text"], want["tokens"])


def test_planted_tokens_routed_to_the_wrong_stream_are_caught(backend, alone, monkeypatch):
    def wrong(members, uid):  # the next member's stream gets the token
        uids = sorted(members)
        return members[uids[(uids.index(uid) + 1) % len(uids)]] if uid in members else None

    monkeypatch.setattr(BatchRun, "_member_of", staticmethod(wrong))
    requests = [_request(p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    out, *_ = _batched(backend, requests)
    assert [o["text"] for o in out] != [a["text"] for a in alone]


def test_http_concurrent_requests_batch_and_the_counters_add_up(engine, backend):
    from starlette.testclient import TestClient

    cfg = engine.model.config
    queue = GenerationQueue(backend, max_batch=4)
    state = ServerState(backend, queue, "tiny-target", frozenset(), SamplingDefaults(max_tokens=8), 64,
                        context_tokens=context_limit(cfg), vocab_size=vocab_size(cfg))
    bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": m, "temperature": 0}
              for p, m in zip(PROMPTS, MAX_TOKENS)]
    try:
        with TestClient(build_app(state), base_url="http://127.0.0.1:8080") as client:
            def content(r):
                if r.headers["content-type"].startswith("text/event-stream"):
                    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
                    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
                    return text, events[-1]["usage"]["completion_tokens"]
                return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]

            alone = [content(client.post("/v1/chat/completions", json=b)) for b in bodies]
            stop = alone[0][0][4:7]
            bodies[0] = {**bodies[0], "stream": True, "stream_options": {"include_usage": True}, "stop": [stop]}
            before = client.get("/v1/specmoe/stats").json()
            results, running, done = [None] * len(bodies), [], threading.Event()

            def post(i):
                results[i] = content(client.post("/v1/chat/completions", json=bodies[i]))

            def watch():
                while not done.is_set():
                    running.append(client.get("/health").json()["queue"]["running"])
                    time.sleep(0.02)

            threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
            watcher = threading.Thread(target=watch)
            watcher.start()
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            done.set()
            watcher.join()
            after = client.get("/v1/specmoe/stats").json()
            health = client.get("/health").json()
    finally:
        queue.close()
    assert max(running) > 1  # /health saw requests decoding together
    assert results[0][0] == alone[0][0][:alone[0][0].index(stop)]
    assert results[1:] == alone[1:]
    b = after["batching"]
    assert b["max_seen"] >= 2 and b["histogram"] and b["unique_experts"] < b["summed_experts"]
    assert health["queue"]["max_batch"] == 4 and "batched" in health["queue"]["mode"]
    assert health["batching"]["max_seen"] >= 2 and health["batching"]["mean_sequences"] > 1
    added = after["requests"]["completion_tokens"] - before["requests"]["completion_tokens"]
    assert added == sum(n for _, n in results)  # every request's tokens counted once
    assert after["requests"]["requests"] - before["requests"]["requests"] == len(bodies)
    syncs = after["host_syncs"]
    assert syncs["forwards"] >= syncs["reported_tokens"] and syncs["one_sync_forwards"] <= syncs["forwards"]


def _two_conversations_then_a_follow_up(engine, backend) -> tuple:
    """Two conversations posted at once over HTTP (the pool emptied first), then the second one's follow-up alone.
    Returns (batching stats before, after the two; prompt tokens the follow-up reused; its messages; its text)."""
    from starlette.testclient import TestClient

    cfg = engine.model.config
    queue = GenerationQueue(backend, max_batch=4)
    state = ServerState(backend, queue, "tiny-target", frozenset(), SamplingDefaults(max_tokens=8), 64,
                        context_tokens=context_limit(cfg), vocab_size=vocab_size(cfg))
    turns = [[{"role": "user", "content": "Speak of the sea, good sir."}],
             [{"role": "user", "content": "What news from the north?"}]]
    try:
        with TestClient(build_app(state), base_url="http://127.0.0.1:8080") as client:
            backend.reset_prompt_cache()
            before = client.get("/v1/specmoe/stats").json()
            replies = [None, None]

            def post(i):
                r = client.post("/v1/chat/completions", json={"messages": turns[i], "max_tokens": 10, "temperature": 0})
                replies[i] = r.json()["choices"][0]["message"]["content"]

            threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            batched = client.get("/v1/specmoe/stats").json()
            follow = turns[1] + [{"role": "assistant", "content": replies[1]},
                                 {"role": "user", "content": "And what of the king?"}]
            r = client.post("/v1/chat/completions", json={"messages": follow, "max_tokens": 10, "temperature": 0})
            after = client.get("/v1/specmoe/stats").json()
    finally:
        queue.close()
    reused = after["requests"]["cached_prompt_tokens"] - batched["requests"]["cached_prompt_tokens"]
    return (before["batching"], batched["batching"], reused, turns[1], follow,
            r.json()["choices"][0]["message"]["content"])


def test_http_a_batched_conversations_kv_serves_its_next_turn(engine, backend, monkeypatch):
    """Two conversations decoded together over HTTP; each one's KV goes to the prompt-cache pool when it ends (mlx-lm
    extracts it from the batch caches), so the follow-up turn of one of them, alone, prefills only its new part: the
    stats count its reused prompt tokens, and its text equals a fresh stock mlx-lm run of the whole follow-up.
    Planted: the batch's caches not kept; the follow-up reuses none of its first turn."""
    from mlx_lm import load as stock_load
    from mlx_lm import stream_generate as stock_stream

    b0, b1, reused, first_turn, follow, text = _two_conversations_then_a_follow_up(engine, backend)
    assert b1["steps"] > b0["steps"] and b1["max_seen"] >= 2  # the two were decoded together
    first = backend.encode_messages(first_turn)
    assert reused >= len(first)  # the follow-up started from the batched turn's KV
    model, tok = stock_load(str(embedded_pair().target))
    want = "".join(x.text for x in stock_stream(model, tok, backend.encode_messages(follow), max_tokens=10))
    assert text == want

    monkeypatch.setattr(BatchRun, "_keep", lambda self, cache, tokens: None)
    b0, b1, reused, _, _, text = _two_conversations_then_a_follow_up(engine, backend)
    assert b1["steps"] > b0["steps"] and reused < len(first) and text == want
