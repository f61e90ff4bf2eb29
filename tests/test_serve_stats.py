"""The server's counters add up: lifetime totals are the sums of the per-request records, completion
tokens are what the responses reported, one-sync forwards never exceed forwards, and runs ended early
(stop string, --request-timeout) are counted as such. In-process on the embedded target.
"""

from __future__ import annotations


from runtime.serve import backend as backend_module
from runtime.serve.limits import RequestLimits
from tests.serve_app import app_client, chat_body


def _run_mix(client) -> tuple[list[dict], list[int]]:
    """Plain, streamed, stop-string and timed-out requests; (each one's last_request record, usage tokens)."""
    records, reported = [], []
    first = client.post("/v1/chat/completions", json=chat_body(max_tokens=9)).json()
    text = first["choices"][0]["message"]["content"]
    assert len(text) >= 3, text
    bodies = [chat_body(max_tokens=6), chat_body(content="Enter the king", max_tokens=9, stream=True,
                                                 stream_options={"include_usage": True}),
              chat_body(max_tokens=9, stop=[text[1:3]]), chat_body(content="And the queen?", max_tokens=5000)]
    reported.append(first["usage"]["completion_tokens"])
    records.append(client.get("/v1/specmoe/stats").json()["last_request"])
    for body in bodies:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            import json

            events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
            reported.append(events[-1]["usage"]["completion_tokens"])
        else:
            reported.append(r.json()["usage"]["completion_tokens"])
        records.append(client.get("/v1/specmoe/stats").json()["last_request"])
    return records, reported


def test_lifetime_counters_are_the_sums_of_the_requests(engine):
    with app_client(engine, limits=RequestLimits(request_timeout_s=2.0)) as client:
        records, reported = _run_mix(client)
        stats = client.get("/v1/specmoe/stats").json()
    assert [r["completion_tokens"] for r in records] == reported  # what each client was told
    assert stats["requests"]["completion_tokens"] == sum(reported)
    assert stats["requests"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    syncs = stats["host_syncs"]
    assert syncs["total"] == sum(r["host_syncs"] for r in records)
    finished = [r for r in records if r["forwards"] is not None]
    assert syncs["forwards"] == sum(r["forwards"] for r in finished)
    assert syncs["one_sync_forwards"] == sum(r["one_sync_forwards"] for r in finished)
    assert syncs["reported_tokens"] == sum(r["completion_tokens"] for r in finished)
    assert syncs["unreported_runs"] == len(records) - len(finished) >= 2  # the stop string and the timeout
    assert 0 <= syncs["one_sync_forwards"] <= syncs["forwards"]
    assert syncs["forwards"] >= syncs["reported_tokens"]  # plain decoding: at least one forward per token
    assert stats["queue"]["timed_out"] >= 1  # the 5000-token request (a slow machine may time out more)


def test_the_old_accounting_breaks_the_invariants(engine, monkeypatch):
    """Planted: forwards estimated as tokens - 1 while one-sync forwards count every device pass (and runs
    ended early adding tokens but no forwards) -- one_sync_forwards exceeds forwards."""
    def old(detail, n_tokens):
        if detail is None:
            return {"forwards": 0, "one_sync_forwards": 0}
        return {"forwards": max(0, n_tokens - 1),
                "one_sync_forwards": detail.one_sync_tries - detail.one_sync_fallbacks}

    monkeypatch.setattr(backend_module, "_forwards", old)
    with app_client(engine, limits=RequestLimits(request_timeout_s=2.0)) as client:
        _run_mix(client)
        syncs = client.get("/v1/specmoe/stats").json()["host_syncs"]
    assert syncs["one_sync_forwards"] > syncs["forwards"]
