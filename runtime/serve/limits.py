"""The bounds of one request: its body's size and reading time, and the server's queue and run time.

`read_body` reads a request body under `RequestLimits`: a `Content-Length` over the cap is refused
(413) before a byte of the body is read; a body without one (chunked) is counted as it streams and
refused as soon as it passes the cap; a body still incomplete after `body_timeout_s` is refused
with 408. Either way the connection is closed after the error (uvicorn does that for a body left
unread), so a slow or endless body costs one error, not a held connection.

Invariants: no more than `max_body_bytes` (plus one network chunk) is ever held for one request;
reading never blocks the event loop; every refusal is a RequestError (4xx JSON).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from runtime.serve.validation import RequestError

__all__ = ["RequestLimits", "read_body", "DEFAULT_MAX_BODY_BYTES"]

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # ~500K tokens of English as JSON: more than any served context


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-body-bytes: larger bodies get 413
    body_timeout_s: float = 30.0  # --body-timeout: a body not complete by then gets 408
    max_queue: int = 16  # --max-queue: requests waiting or running; more get 429 with Retry-After
    request_timeout_s: float | None = None  # --request-timeout: a generation running longer ends (finish "length")
    max_connections: int = 64  # --max-connections: uvicorn's limit_concurrency (503 beyond it)
    header_timeout_s: float = 10.0  # a connection whose request line and headers take longer is closed

    def __post_init__(self):
        for name in ("max_body_bytes", "max_queue", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}; expected >= 1")
        for name in ("body_timeout_s", "header_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"--{flag} {value}; expected seconds > 0")


async def read_body(request, limits: RequestLimits) -> bytes:
    """The whole body of a Starlette `request`, or RequestError 413 (too large) / 408 (too slow)."""
    cap = limits.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise RequestError(f"Content-Length {length[:40]!r} is not a number of bytes")
        if int(length) > cap:
            raise _too_large(int(length), cap)
    chunks, size = [], 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise _too_large(size, cap, streamed=True)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout=limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body was not complete after {limits.body_timeout_s:g} s "
                           f"({size} bytes arrived; --body-timeout)", status=408, code="request_timeout") from None
    return b"".join(chunks)


def _too_large(size: int, cap: int, streamed: bool = False) -> RequestError:
    what = f"more than {cap} bytes arrived" if streamed else f"the request body is {size} bytes"
    return RequestError(f"{what}; this server takes bodies up to {cap} bytes (--max-body-bytes)", status=413,
                        code="request_too_large")
