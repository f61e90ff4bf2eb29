"""Attacks on a real `specmoe serve` process (uvicorn on 127.0.0.1): unterminated and slow bodies,
oversized and chunked bodies, disconnects mid-body, more connections than allowed, a generation
that would run on; a busy port; slow headers on uvicorn's protocol. After each batch: /health
answers, the file descriptors the server holds stay under --max-connections and are back where they were, RSS has not run away,
and the next valid request gives the right text.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import psutil
import pytest

from runtime.checkpoints import embedded_pair
from tests.conftest import run_cli
from tests.serve_process import free_port, get_json, open_fds, post_raw, serve_process

KEY = "attack-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 65536
BODY = json.dumps({"messages": [{"role": "user", "content": "What says the queen?"}], "max_tokens": 4,
                   "temperature": 0}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("attacks") / "serve.log"
    args = ["-m", str(embedded_pair().target), "--max-tokens", "4", "--max-prompt-tokens", "64", "--body-timeout", "1",
            "--max-body-bytes", str(CAP), "--max-connections", "24", "--request-timeout", "1.5"]
    with serve_process(args, log, env={"SPECMOE_API_KEY": KEY}) as (base, proc):
        yield base, proc.pid


@pytest.fixture(scope="module")
def reference(server):
    code, raw = post_raw(server[0] + "/v1/chat/completions", BODY, headers=AUTH)
    assert code == 200
    return json.loads(raw)["choices"][0]["message"]["content"]


def _connect(base: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=15)


def _head(length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{size}{extra}\r\n").encode()


def _answer(s: socket.socket) -> tuple[int, bytes]:
    """(status, everything until the server closes the connection or 15 s pass)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def _settled(base: str, pid: int, reference: str, fds0: int, rss0: int) -> None:
    """Within 15 s: /health answers 200 (a burst over --max-connections gets 503 while it lasts) and the
    server's descriptors are back to where they were; then a valid request gets the reference text."""
    deadline = time.monotonic() + 15
    while (get_json(base + "/health")[0] != 200 or open_fds(pid) > fds0 + 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_fds(pid) <= fds0 + 2, (open_fds(pid), fds0)
    t0 = time.monotonic()
    assert get_json(base + "/health")[0] == 200 and time.monotonic() - t0 < 10
    code, raw = post_raw(base + "/v1/chat/completions", BODY, headers=AUTH)
    assert code == 200 and json.loads(raw)["choices"][0]["message"]["content"] == reference
    assert psutil.Process(pid).memory_info().rss - rss0 < 300e6


def test_unterminated_bodies_get_408_and_their_connections_close(server, reference):
    base, pid = server
    fds0, rss0 = open_fds(pid), psutil.Process(pid).memory_info().rss
    for n, allowed in ((10, {408}), (100, {408, 503})):  # then more than --max-connections 24: 503 for some
        socks = []
        for _ in range(n):
            s = _connect(base)
            s.sendall(_head(1000) + b'{"messages": [')
            socks.append(s)
        time.sleep(0.3)
        assert open_fds(pid) <= fds0 + 24 + 4  # a flood holds at most --max-connections descriptors
        t0 = time.monotonic()
        statuses = []
        for s in socks:
            statuses.append(_answer(s)[0])
            s.close()
        assert set(statuses) <= allowed, statuses
        assert time.monotonic() - t0 < 12  # answered at --body-timeout (1 s), not held open
    _settled(base, pid, reference, fds0, rss0)


def test_oversized_bodies_get_413_before_or_while_they_arrive(server, reference):
    base, pid = server
    fds0, rss0 = open_fds(pid), psutil.Process(pid).memory_info().rss
    with _connect(base) as s:  # a declared length over the cap: refused without sending a byte of it
        s.sendall(_head(10**9))
        status, data = _answer(s)
        assert status == 413 and b"--max-body-bytes" in data
    with _connect(base) as s:  # chunked: refused once the count passes the cap
        s.sendall(_head(None))
        try:
            for _ in range(CAP // 4096 + 4):
                s.sendall(b"1000\r\n" + b" " * 4096 + b"\r\n")
        except OSError:  # the server may close while chunks are still being sent
            pass
        assert _answer(s)[0] == 413
    _settled(base, pid, reference, fds0, rss0)


def test_disconnects_mid_body_and_mid_answer_leak_nothing(server, reference):
    base, pid = server
    fds0, rss0 = open_fds(pid), psutil.Process(pid).memory_info().rss
    for i in range(20):
        s = _connect(base)
        s.sendall(_head(len(BODY)) + BODY[: i * len(BODY) // 20])
        s.close()
    for _ in range(5):  # the whole request, then gone before the answer
        s = _connect(base)
        s.sendall(_head(len(BODY)) + BODY)
        s.close()
    _settled(base, pid, reference, fds0, rss0)


def test_a_generation_past_request_timeout_ends_with_length(server):
    base, _ = server
    before = get_json(base + "/health")[1]["queue"]["timed_out"]
    body = json.dumps({"messages": [{"role": "user", "content": "Enter the king"}], "max_tokens": 100000,
                       "temperature": 0}).encode()
    code, raw = post_raw(base + "/v1/chat/completions", body, headers=AUTH)
    answer = json.loads(raw)
    assert code == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert 0 < answer["usage"]["completion_tokens"] < 2000  # the context (2048) would have allowed more
    assert get_json(base + "/health")[1]["queue"]["timed_out"] == before + 1


def test_the_key_from_the_environment_is_enforced(server):
    openai = pytest.importorskip("openai")
    base, _ = server
    wrong = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert right.models.list().data[0].id == str(embedded_pair().target)
    assert get_json(base + "/health")[0] == 200  # open without the key


def test_a_busy_port_fails_in_one_line_before_any_announcement():
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        t0 = time.monotonic()
        code, out, err = run_cli(["serve", "-m", str(embedded_pair().target), "--port", str(port)])
    assert code == 2 and f"--port {port}: cannot bind 127.0.0.1:{port}" in err and "Traceback" not in err
    assert "specmoe serve:" not in err + out and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 30  # the port is taken before the model loads


def _dribble(port: int) -> tuple[bytes | None, float]:
    """Send a request line a byte every 0.1 s for 2 s; (what came back, or None if still open; seconds)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\nHo")
        for _ in range(20):  # never completes its headers
            try:
                s.sendall(b"s")
            except OSError:
                break
            time.sleep(0.1)
        s.settimeout(0.5)
        try:
            data = s.recv(100)
        except socket.timeout:
            return None, time.monotonic() - t0
        except ConnectionResetError:
            data = b""
        return data, time.monotonic() - t0


def test_slow_headers_are_cut_off_by_the_protocol_deadline():
    """uvicorn with headers_within(0.5): a request line dribbled in is closed, 40 silent connections over
    limit_concurrency 10 are closed at once, and a prompt request is served. With uvicorn's stock h11 protocol
    (the contrast) the dribble is still connected after 2 s and the server holds all 40."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from runtime.serve.protocol import headers_within

    app = Starlette(routes=[Route("/", lambda r: PlainTextResponse("ok"))])
    for protocol, closes in ((headers_within(0.5), True), ("h11", False)):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", http=protocol,
                                               limit_concurrency=10))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                time.sleep(0.05)
            data, _ = _dribble(port)
            assert (data == b"") if closes else (data is None), (protocol, data)
            fds0 = open_fds(os.getpid())  # client and server sides both live in this process
            flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
            time.sleep(0.3)
            server_side = open_fds(os.getpid()) - fds0 - len(flood)  # connections the server still holds
            for c in flood:
                c.close()
            assert server_side <= 10 if closes else server_side >= 30, (protocol, server_side)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert _answer(s)[0] == 200
        finally:
            server.should_exit = True
            thread.join(timeout=10)
