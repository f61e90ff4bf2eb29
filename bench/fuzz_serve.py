"""Fuzz a live `specmoe serve` (the embedded model, uvicorn on 127.0.0.1) with what attackers and broken
clients send, and report how it held up.

Each request is drawn from a seeded mix: malformed JSON, wrong types, huge and negative numbers, NaN,
unicode (lone surrogates included), deep nesting, unknown fields, valid requests, bodies over the
size cap (declared and chunked), slow bodies that never finish, and clients that disconnect mid-body.
Slow bodies and request lines that never end go in parallel batches of up to 30 (under
--max-connections 32); a slow body holds its connection until --body-timeout answers 408, an
unfinished request line until the header deadline (10 s) closes it (status 0). A flood is 48 slow
bodies at once, over --max-connections: uvicorn answers 503 to those past the limit, reported apart
(a capacity answer, not a mishandled client error).

Then `--largest` prompts as large as the default body cap (2 MiB) go to a server with default limits:
each is tokenized (off the event loop) and refused as too long; the slowest /health meanwhile and the
RSS are reported.

Reported: requests tried, responses by status (0: the server closed without answering), 5xx count
outside floods (must be 0: every case here is a client's fault), the slowest /health
answer while under attack, the server's RSS growth (max over the run), its open file descriptors
before and after (after the connections settle), and whether the next valid request still answers
with the same text. Table first, the last line one JSON document.

    python -m bench.fuzz_serve --requests 2000          # writes bench/results/serve_fuzz.txt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAP = 262144  # --max-body-bytes of the fuzzed server
VALID = {"messages": [{"role": "user", "content": "What says the queen?"}], "max_tokens": 4, "temperature": 0}
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
          "stream", "stream_options", "n"]
NUMBERS = [0, -1, 1, 2**31, 2**63, 2**64 - 1, 2**64, 2**70, -2**70, 10**9, 1e9, 1e308, -1e308, 0.5, 5e-324]
TEXTS = ["", "hi", "\ud800", "\x00", "\u202e", "🙂" * 50, "<|im_end|>", "a" * 3000]


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(NUMBERS)
    if kind == 1:
        return rng.choice(TEXTS)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return rng.uniform(-1e6, 1e6)
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5:
        return {rng.choice(FIELDS + ["x"]): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return {"role": rng.choice(["user", "wizard", 3]), "content": _value(rng, depth + 1)}


def _body(rng: random.Random) -> tuple[str, bytes]:
    """(case name, body)."""
    case = rng.choice(["mutated", "mutated", "mutated", "valid", "garbage", "nested", "constants", "unicode",
                       "huge_int", "big_prompt"])
    if case == "valid":
        return case, json.dumps({**VALID, "messages": [{"role": "user", "content": rng.choice(TEXTS[1:7])}]}).encode()
    if case == "mutated":
        body = dict(VALID)
        for _ in range(rng.randrange(1, 4)):
            body[rng.choice(FIELDS)] = _value(rng)
        return case, json.dumps(body).encode()
    if case == "garbage":
        return case, bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if case == "nested":
        d = rng.choice([100, 10_000, 100_000])
        return case, b"[" * d + b"]" * d if rng.random() < 0.5 else b'{"a":' * d + b"1" + b"}" * d
    if case == "constants":
        return case, rng.choice([b'{"temperature": NaN, "messages": []}', b'{"seed": Infinity}', b"null", b"[]"])
    if case == "big_prompt":  # under the body cap, far over the prompt limit: tokenized off the loop, then 400
        return case, json.dumps({**VALID, "messages": [{"role": "user", "content": "the king " * 25000}]}).encode()
    if case == "unicode":
        return case, json.dumps(VALID).encode("utf-16")
    return case, b'{"max_tokens": ' + b"9" * rng.choice([100, 5000]) + b"}"


def _head(port: int, length: int | None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\n{size}\r\n").encode()


def _status(s: socket.socket) -> int:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        pass
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _send(port: int, mode: str, body: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            if mode == "normal":
                s.sendall(_head(port, len(body)) + body)
            elif mode == "oversized_declared":
                s.sendall(_head(port, CAP * 4))
            elif mode == "oversized_chunked":
                s.sendall(_head(port, None))
                for _ in range(CAP // 16384 + 2):
                    s.sendall(b"4000\r\n" + b" " * 16384 + b"\r\n")
            elif mode in ("slow", "flood"):
                s.sendall(_head(port, len(body) + 100) + body[: len(body) // 2])
            elif mode == "slow_headers":  # a request line that never ends: the header deadline closes it
                s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode())
            elif mode == "disconnect":
                s.sendall(_head(port, len(body)) + body[: len(body) // 2])
                return -1  # closed by us: no answer expected
        except OSError:
            pass  # the server refused mid-send (413): read its answer
        return _status(s)


def _get(port: int, path: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


def _valid_text(port: int) -> str:
    body = json.dumps(VALID).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(_head(port, len(body)) + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"]


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def largest_bodies(n: int) -> dict:
    """A server with the default limits sent `n` prompts as large as the default body cap accepts (far over
    the prompt limit): each is read, parsed and tokenized off the event loop, then refused with 400. Meanwhile
    /health is polled every 50 ms. Returns the statuses, seconds per request, the slowest /health and RSS."""
    import psutil

    from runtime.checkpoints import embedded_pair
    from runtime.serve import DEFAULT_MAX_BODY_BYTES
    from tests.serve_process import get_json, post_raw, serve_process

    text = "the king " * ((DEFAULT_MAX_BODY_BYTES - 200) // 9)
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_largest_{os.getpid()}.log"
    with serve_process(["-m", str(embedded_pair().target)], log) as (base, proc):
        p = psutil.Process(proc.pid)
        rss0 = rss_max = p.memory_info().rss
        worst, done = [0.0], threading.Event()

        def poll() -> None:
            nonlocal rss_max
            while not done.is_set():
                t0 = time.monotonic()
                get_json(base + "/health")
                worst[0] = max(worst[0], time.monotonic() - t0)
                rss_max = max(rss_max, p.memory_info().rss)
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        statuses, seconds = Counter(), []
        for _ in range(n):
            t0 = time.monotonic()
            statuses[post_raw(base + "/v1/chat/completions", body, timeout=300)[0]] += 1
            seconds.append(time.monotonic() - t0)
        done.set()
        poller.join()
        time.sleep(5)
        rss_after = p.memory_info().rss
    return {"n": n, "body_bytes": len(body), "statuses": {str(k): v for k, v in statuses.items()},
            "seconds": [round(x, 2) for x in seconds], "health_max_ms": round(worst[0] * 1000, 1),
            "rss_before_bytes": rss0, "rss_max_bytes": rss_max, "rss_after_bytes": rss_after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="requests to send")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_fuzz.txt"), help="report file")
    ap.add_argument("--largest", type=int, default=5,
                    help="then this many bodies of the default cap's size to a server with default limits (0: skip)")
    args = ap.parse_args()
    from runtime.checkpoints import embedded_pair
    from tests.serve_process import free_port, wait_for_health

    port, log = free_port(), Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_fuzz_{os.getpid()}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "runtime.cli.app", "serve", "-m", str(embedded_pair().target), "--port", str(port),
           "--max-tokens", "4", "--max-prompt-tokens", "256", "--max-body-bytes", str(CAP), "--body-timeout", "2",
           "--request-timeout", "1", "--max-connections", "32"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    rng, statuses, flood, cases = random.Random(args.seed), Counter(), Counter(), Counter()
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, log, 240, "specmoe serve")
        reference = _valid_text(port)
        time.sleep(0.5)
        fds0, rss0 = _fds(proc.pid), _rss(proc.pid)
        rss_max, health_max_s, t0, sent = rss0, 0.0, time.monotonic(), 0
        while sent < args.requests:
            mode = rng.choices(["normal", "oversized_declared", "oversized_chunked", "slow", "slow_headers",
                                "disconnect", "flood"], [85, 3, 3, 2, 0.4, 5, 0.2])[0]
            batch = {"slow": rng.randrange(5, 31), "slow_headers": rng.randrange(5, 31), "flood": 48}.get(mode, 1)
            jobs = []
            for _ in range(min(batch, args.requests - sent)):
                case, body = _body(rng)
                cases[f"{mode}:{case}" if mode == "normal" else mode] += 1
                jobs.append(body)
            results: list[int] = []
            threads = [threading.Thread(target=lambda b=b: results.append(_send(port, mode, b))) for b in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            (flood if mode == "flood" else statuses).update(r for r in results if r >= 0)
            sent += len(jobs)
            if sent % 25 < len(jobs) or sent >= args.requests:
                h0 = time.monotonic()
                assert _get(port, "/health")[0] == 200
                health_max_s = max(health_max_s, time.monotonic() - h0)
                rss_max = max(rss_max, _rss(proc.pid))
        wall_s = time.monotonic() - t0
        deadline = time.monotonic() + 20
        while _fds(proc.pid) > fds0 and time.monotonic() < deadline:
            time.sleep(0.25)
        fds1 = _fds(proc.pid)
        still_right = _valid_text(port) == reference
        stats = json.loads(_get(port, "/v1/specmoe/stats")[1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    big = largest_bodies(args.largest) if args.largest else None
    n5xx = sum(n for s, n in statuses.items() if s >= 500)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    lines = [f"# serve fuzz: {datetime.now(timezone.utc):%Y-%m-%dT%H:%MZ}, load average {load}, seed {args.seed}, "
             f"{os.cpu_count()} cores; server: {' '.join(cmd[3:])}",
             f"requests tried        {sent} in {wall_s:.1f} s",
             "responses by status  " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())),
             "floods (48 slow bodies at once, over --max-connections 32): "
             + (", ".join(f"{s}: {n}" for s, n in sorted(flood.items())) or "none drawn"),
             f"5xx                   {n5xx}",
             f"slowest /health       {health_max_s * 1000:.0f} ms (every 25 requests)",
             f"RSS                   {rss0 / 1e6:.0f} MB before, max growth {(rss_max - rss0) / 1e6:.1f} MB",
             f"file descriptors      {fds0} before, {fds1} after",
             f"next valid request    {'same text as before the run' if still_right else 'DIFFERENT TEXT'}",
             f"queue                 {stats['queue']}",
             "cases                 " + ", ".join(f"{k}: {n}" for k, n in sorted(cases.items()))]
    if big is not None:
        lines += [f"largest bodies        {big['n']} prompts of {big['body_bytes']} bytes to a server with default limits: "
                  f"statuses {big['statuses']}, {min(big['seconds']):.1f}-{max(big['seconds']):.1f} s each (read, "
                  f"parsed and tokenized off the event loop); slowest /health meanwhile {big['health_max_ms']:.0f} ms; "
                  f"RSS {big['rss_before_bytes'] / 1e6:.0f} MB before, {big['rss_max_bytes'] / 1e6:.0f} MB at most, "
                  f"{big['rss_after_bytes'] / 1e6:.0f} MB 5 s after"]
    summary = {"requests": sent, "statuses": {str(k): v for k, v in sorted(statuses.items())}, "n_5xx": n5xx,
               "flood_statuses": {str(k): v for k, v in sorted(flood.items())},
               "health_max_ms": round(health_max_s * 1000, 1), "rss_before_bytes": rss0,
               "rss_max_growth_bytes": rss_max - rss0, "fds_before": fds0, "fds_after": fds1,
               "next_request_correct": still_right, "load_average": load, "wall_s": round(wall_s, 1), "largest": big}
    text = "\n".join(lines) + "\n" + json.dumps(summary) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    sys.stdout.write(text)
    return 0 if n5xx == 0 and still_right and fds1 <= fds0 else 1


if __name__ == "__main__":
    sys.exit(main())
