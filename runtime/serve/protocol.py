"""uvicorn's h11 HTTP protocol with a deadline on a request's line and headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a client that opens a
connection and sends its request line and headers a byte at a time is never timed out: each byte
re-arms nothing, and the connection (a file descriptor) stays open. `headers_within(seconds)`
returns an h11 protocol class that closes a connection whose request has not reached the end of
its headers `seconds` after the connection opened or the previous response ended. Once the
headers are in, the app's own body deadline (runtime.serve.limits.read_body) takes over.

uvicorn's `limit_concurrency` answers 503 only once a request's headers are in, so connections that
never send them still hold descriptors until the deadline. A connection opened while
`limit_concurrency` are already open is answered 503 at once and closed, so the descriptors a flood
can hold stay near that limit (macOS allows a process 256 by default).

Invariants: a connection waiting for headers lives at most `seconds` (plus the event loop's
timer slack); a request whose headers arrived in time is never cut by this deadline; at most
`limit_concurrency` connections stay open.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["headers_within"]

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
         b"content-length: 27\r\n\r\nExceeded concurrency limit.")


def headers_within(seconds: float) -> type:
    class BoundedH11Protocol(H11Protocol):
        header_timeout_s = seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
                transport.write(_BUSY)  # over --max-connections: answered and closed before anything is read
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived: the app's deadlines apply from here
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # waiting for the next request's headers

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._expire)

        def _disarm(self) -> None:
            handle = getattr(self, "_header_deadline", None)
            if handle is not None:
                handle.cancel()
                self._header_deadline = None

        def _expire(self) -> None:
            self._header_deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
