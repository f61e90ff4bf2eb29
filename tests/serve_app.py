"""The live `specmoe serve` app in-process: the embedded target, a real Backend and GenerationQueue,
the Starlette app under starlette's TestClient (requests cross the ASGI stack, Guard included).

`app_client(engine, **overrides)` builds a ServerState (overrides: policy, limits, max_prompt_tokens,
context_tokens, defaults) and yields a TestClient addressed as http://127.0.0.1:8080, the queue
closed afterwards; the engine is shared (module fixtures load it once).
"""

from __future__ import annotations

from contextlib import contextmanager

from starlette.testclient import TestClient

from runtime.serve import Backend, GenerationQueue, SamplingDefaults, ServerState, build_app
from runtime.serve.limits import RequestLimits
from runtime.serve.security import AccessPolicy
from runtime.serve.server import context_limit, vocab_size

BASE = "http://127.0.0.1:8080"


@contextmanager
def app_client(engine, *, backend=None, policy: AccessPolicy | None = None, limits: RequestLimits | None = None,
               max_prompt_tokens: int = 64, context_tokens: int | None = None,
               defaults: SamplingDefaults = SamplingDefaults(max_tokens=4)):
    backend = backend or Backend(engine)
    limits = limits or RequestLimits()
    cfg = engine.model.config
    queue = GenerationQueue(backend, max_queue=limits.max_queue, request_timeout_s=limits.request_timeout_s)
    state = ServerState(backend, queue, "tiny-target", frozenset(), defaults, max_prompt_tokens,
                        context_tokens=context_tokens or context_limit(cfg), vocab_size=vocab_size(cfg),
                        policy=policy or AccessPolicy(), limits=limits)
    try:
        with TestClient(build_app(state), base_url=BASE, raise_server_exceptions=False) as client:
            client.state = state
            yield client
    finally:
        queue.close()


def chat_body(content: str = "What says the queen?", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **fields}
