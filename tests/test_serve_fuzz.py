"""Property-based attacks on the live app (in-process, the embedded target, the whole ASGI stack):
no body a client sends gets a 5xx, every field error is a 4xx naming the field, and after each batch
the server answers /health, its memory and file descriptors have not grown without bound, and the
next valid request still gives the right text. The live-process attacks (slow bodies, disconnects,
file descriptors of a real uvicorn) are in tests/test_serve_attacks.py; longer runs: bench/fuzz_serve.py.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.serve.limits import RequestLimits
from runtime.serve.validation import MAX_SEED
from tests.serve_app import app_client, chat_body
from tests.serve_fuzz_bodies import bodies, json_values

ROUTES = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture(scope="module")
def client(engine):
    # a small context keeps a fuzzed valid request (max_tokens clamped to what the prompt leaves) short
    with app_client(engine, context_tokens=96, limits=RequestLimits(max_body_bytes=256 * 1024, request_timeout_s=5)) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client):
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    return r.json()["choices"][0]["message"]["content"]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def _still_healthy(client, reference, rss0: int, fds0: int) -> None:
    t0 = time.monotonic()
    assert client.get("/health").status_code == 200
    assert time.monotonic() - t0 < 10  # a liveness bound, not a speed claim: the loop is not blocked
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference
    assert psutil.Process().memory_info().rss - rss0 < 400e6
    assert _fds() <= fds0 + 8


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_bodies_never_get_a_5xx_and_the_server_keeps_serving(client, reference, route):
    rss0, fds0 = psutil.Process().memory_info().rss, _fds()
    statuses: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(raw=bodies())
    def attack(raw):
        r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (raw[:200], r.text[:300])
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"], r.text

    attack()
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
    _still_healthy(client, reference, rss0, fds0)


FIELD_CASES = [("seed", 2**70), ("seed", -1), ("seed", 1.5), ("top_k", 10**9), ("top_k", 1e9), ("top_k", -3),
               ("temperature", 1e308), ("temperature", -0.1), ("top_p", 1.5), ("min_p", -1), ("max_tokens", 0),
               ("max_tokens", -(2**70)), ("max_tokens", "9"), ("n", 2), ("stop", ["x" * 300]), ("stop", ["a"] * 5),
               ("stream", 1), ("model", 3)]


@pytest.mark.parametrize("name, value", FIELD_CASES)
def test_each_bad_field_is_a_4xx_naming_it(client, name, value):
    r = client.post("/v1/chat/completions", json=chat_body(**{name: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert f"'{name}'" in r.json()["error"]["message"]


def test_edge_values_that_are_allowed_are_served(client, engine):
    vocab = engine.model.config["vocab_size"]
    assert client.post("/v1/chat/completions", json=chat_body(top_k=vocab)).json()["error"]["param"] == "top_k"
    for fields in ({"seed": MAX_SEED, "temperature": 0.7}, {"top_k": vocab - 1, "temperature": 1.0, "seed": 0},
                   {"max_tokens": 10**30}, {"top_p": 0, "min_p": 1, "temperature": 1.0, "seed": 3}):
        r = client.post("/v1/chat/completions", json=chat_body(**fields))
        assert r.status_code == 200, (fields, r.text)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(name=st.sampled_from(["seed", "top_k", "temperature", "top_p", "min_p", "max_tokens", "n"]),
       value=json_values)
def test_any_value_of_a_numeric_field_is_200_or_a_400_naming_it(client, name, value):
    r = client.post("/v1/chat/completions", content=json.dumps({**chat_body(max_tokens=2), name: value}))
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == name, r.text


def test_max_tokens_is_clamped_to_the_context_the_prompt_leaves(engine):
    with app_client(engine, context_tokens=40) as c:
        r = c.post("/v1/chat/completions", json=chat_body(max_tokens=10**9))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 40  # not 10**9: the context's end
        assert r.json()["choices"][0]["finish_reason"] == "length"
        full = c.post("/v1/chat/completions", json=chat_body(content="the king " * 20))
        assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"


class _EndlessBackend:
    """Encodes anything to three ids and generates a token every 20 ms until told to stop."""

    tokenizer = None

    def encode(self, request):
        return [1, 2, 3]

    def stream(self, ids, request):
        from types import SimpleNamespace

        while True:
            time.sleep(0.02)
            yield SimpleNamespace(text="x", finish_reason=None, cached_tokens=None)

    def stats(self):
        return {}


def test_a_full_queue_answers_429_with_retry_after_and_a_long_run_ends_at_the_timeout(engine):
    import threading

    limits = RequestLimits(max_queue=1, request_timeout_s=1.0)
    with app_client(engine, backend=_EndlessBackend(), limits=limits) as c:
        first = {}
        t = threading.Thread(target=lambda: first.update(r=c.post("/v1/chat/completions", json=chat_body(max_tokens=10**6))))
        t.start()
        deadline = time.monotonic() + 10
        while not c.get("/health").json()["queue"]["busy"] and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert int(r.headers["retry-after"]) >= 1
        t.join(timeout=30)
        answer = first["r"].json()
        assert answer["choices"][0]["finish_reason"] == "length" and 10 < answer["usage"]["completion_tokens"] < 10**6
        status = c.get("/health").json()["queue"]
        assert status["refused"] == 1 and status["timed_out"] == 1


class _SlowEncode(_EndlessBackend):
    """encode() blocks until the test opens the gate (at most 10 s): a stand-in for tokenizing a huge prompt."""

    def __init__(self, wait_s: float):
        import threading

        self.entered, self.gate, self.released, self.wait_s = threading.Event(), threading.Event(), None, wait_s

    def encode(self, request):
        self.entered.set()
        self.released = self.gate.wait(self.wait_s)  # True: opened by the test while this still ran
        return [1, 2, 3]


def _health_during_tokenization(engine, wait_s: float) -> bool:
    import threading

    backend = _SlowEncode(wait_s)
    with app_client(engine, backend=backend, limits=RequestLimits(request_timeout_s=0.1)) as c:
        t = threading.Thread(target=lambda: c.post("/v1/chat/completions", json=chat_body()))
        t.start()
        assert backend.entered.wait(10)
        assert c.get("/health").status_code == 200
        backend.gate.set()
        t.join(timeout=30)
    return backend.released


def test_tokenizing_runs_off_the_event_loop(engine, monkeypatch):
    """While one request is being tokenized, /health answers: the test opens the tokenizer's gate only after
    /health answered. Planted: parsing and tokenizing on the event loop, /health waits out the gate first."""
    from runtime.serve.app import ServerState

    assert _health_during_tokenization(engine, wait_s=10) is True

    async def on_the_loop(self, raw, kind, *args):
        return self.prepare(raw, kind, *args)

    monkeypatch.setattr(ServerState, "prepare_off_loop", on_the_loop)
    assert _health_during_tokenization(engine, wait_s=1) is False
