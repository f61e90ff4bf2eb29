"""Who may talk to `specmoe serve`: the Host it answers to, the browser origins it allows, its API key.

A pure ASGI middleware (`Guard`) checks every HTTP request before a route or a body is read:
1. Host: while bound to a loopback address, the `Host` header must name loopback (`localhost`,
   `127.0.0.1`, `[::1]`, with or without the port), else 403. A web page that re-points its own
   domain at 127.0.0.1 (DNS rebinding) sends its domain as Host and is refused.
2. Origin: a request carrying an `Origin` header (browsers send one on cross-origin fetches,
   and on every POST) is refused with 403 unless that origin was allowed with `--cors-origin`. No
   origin is allowed by default, so no CORS headers are ever sent and a preflight gets no
   `Access-Control-Allow-Origin`. Clients that are not browsers (curl, SDKs) send no Origin.
3. API key: with a key set, every route except `GET /health` and CORS preflights needs
   `Authorization: Bearer KEY` or `x-api-key: KEY` (the header the Anthropic SDK sends), else 401.

Invariants: refusals are JSON in the OpenAI error shape (runtime.serve.validation.RequestError), on
the Anthropic routes (/v1/messages...) in that API's shape;
the key is compared in constant time; nothing here reads the request body; `/health` never needs
the key, so a supervisor can probe the server, and it says nothing that needs one.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass

from runtime.serve.anthropic_shapes import error_body
from runtime.serve.validation import RequestError

__all__ = ["AccessPolicy", "Guard", "is_loopback", "PUBLIC_PATHS"]

PUBLIC_PATHS = frozenset({"/health"})  # answered without the API key (still Host- and Origin-checked)


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessPolicy:
    bind_host: str = "127.0.0.1"  # the address the server is bound to (--host)
    port: int = 8080  # the port it listens on (a Host header may carry it)
    cors_origins: tuple[str, ...] = ()  # origins browsers may call from (--cors-origin); "*" allows any
    api_key: str | None = None  # --api-key / SPECMOE_API_KEY; None: no key needed

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty; expected a non-empty token (or leave it out)")
        for origin in self.cors_origins:
            scheme, sep, rest = origin.partition("://")
            scheme_ok = scheme[:1].isalpha() and all(c.isalnum() or c in "+-." for c in scheme)  # also chrome-extension
            if origin != "*" and (not sep or not scheme_ok or not rest or "/" in rest):
                raise ValueError(f"--cors-origin {origin!r}; expected an origin as browsers send it, "
                                 "e.g. http://localhost:3000 (scheme and host, no path), or *")

    @property
    def checks_host(self) -> bool:
        """Only a loopback bind knows every name it may be reached by."""
        return is_loopback(self.bind_host)

    def host_allowed(self, host: str | None) -> bool:
        if not self.checks_host:
            return True
        if not host:
            return False
        name, port = _split_host(host)
        return name in ("localhost", "127.0.0.1", "::1") and port in (None, self.port)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin in self.cors_origins

    def key_matches(self, headers: dict[str, str]) -> bool:
        """A request's credentials: `Authorization: Bearer KEY` or `x-api-key: KEY`."""
        if self.api_key is None:
            return True
        expected = self.api_key.encode()
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        candidates = [token.strip()] if scheme.lower() == "bearer" else []
        if "x-api-key" in headers:
            candidates.append(headers["x-api-key"].strip())
        return any(hmac.compare_digest(c.encode(), expected) for c in candidates)


def _split_host(host: str) -> tuple[str, int | None]:
    """('127.0.0.1', 8080) from '127.0.0.1:8080', ('::1', None) from '[::1]'; a bad port -> (host, -1)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    else:
        name, sep, port = host.partition(":")
        port = port if sep else None
    if port is None:
        return name, None
    return name, int(port) if port.isdigit() and len(port) <= 5 else -1


class Guard:
    """ASGI middleware: refuses requests the AccessPolicy does not allow, before the app sees them."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.check(scope)
        if error is None:
            return await self.app(scope, receive, send)
        anthropic = scope["path"].startswith("/v1/messages")  # that API's own shape: {"type": "error", "error": ...}
        body = json.dumps(error_body(error) if anthropic else error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if error.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="specmoe"'))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def check(self, scope) -> RequestError | None:
        """The refusal for this request, or None to let it through."""
        headers = _headers(scope)
        p = self.policy
        if not p.host_allowed(headers.get("host")):
            return RequestError(f"Host {headers.get('host', '(none)')!r} is not served here; this server is bound to "
                                f"{p.bind_host} and answers only to localhost, 127.0.0.1 or [::1]",
                                status=403, type="permission_error", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not p.origin_allowed(origin):
            return RequestError(f"origin {origin!r} is not allowed; browsers may call this server only from origins "
                                "given with --cors-origin", status=403, type="permission_error",
                                code="origin_not_allowed")
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if scope["path"] in PUBLIC_PATHS or preflight or p.key_matches(headers):
            return None
        return RequestError("missing or wrong API key; send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                            status=401, type="authentication_error", code="invalid_api_key")


def _headers(scope) -> dict[str, str]:
    """The request's headers, lower-case names; for a repeated header the last value."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
