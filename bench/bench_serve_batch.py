"""`specmoe serve --max-batch`: concurrent HTTP clients against a real server, batched vs one at a time.

Method: two `specmoe serve` processes on the embedded target at --budget (default 25%), one with
--max-batch 1 (one request at a time) and one with --max-batch B (default 4), both loaded before any
timing and never running at once. Each round sends --clients concurrent /v1/completions requests (one
thread each, different calibration prompts, greedy, --max-tokens each, ignore no EOS: the embedded
target emits no EOS in that span) to one server and times the round from the first send to the last
answer; the rounds alternate between the two servers, --repeats each. Reported: aggregate tokens/s (all
completion tokens over the round's wall time, prefill and HTTP included), the per-request latency
(median over the round's requests), the ratio batch/one-at-a-time per repeat pair, medians with
(min-max) spreads; the batched server's sequences per step and unique vs summed expert lookups per step
(its /v1/specmoe/stats); and whether every request's text was the same on both servers (greedy).
The first request of a round usually finds nobody waiting and starts alone (runtime/serve/queue.py); when
the others wait it hands over to a batch with them (the server's queue.handed_over counts it). Prints a table and ends with one JSON line
(bench/run_all.sh writes it to bench/results/ with the date and load average).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Enter the king, with his lords. The king speaks:", "What says the queen?", "Once upon a time there was",
           "The sky is blue because", "First Citizen: Before we proceed any further, hear me speak.",
           "All: Speak, speak.", "You are all resolved rather to die than to famish?", "We know't, we know't."]


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@contextmanager
def _server(model: str, budget: str, max_batch: int, log_dir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(log_dir / f"serve_b{max_batch}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli.app", "serve", "-m", model, "--budget", budget,
                             "--max-batch", str(max_batch), "--port", str(port), "--max-prompt-tokens", "256"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve --max-batch {max_batch} exited: {(log_dir / log.name).read_text()}")
            try:
                _get(base + "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"serve --max-batch {max_batch} did not start") from None
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _round(base: str, clients: int, max_tokens: int) -> dict:
    results = [None] * clients

    def one(i):
        t0 = time.perf_counter()
        r = _post(base + "/v1/completions", {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                             "temperature": 0})
        results[i] = (r["choices"][0]["text"], r["usage"]["completion_tokens"], time.perf_counter() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[1] for r in results)
    return {"aggregate_tps": tokens / wall, "tokens": tokens, "wall_s": wall,
            "latency_s": statistics.median(r[2] for r in results), "texts": [r[0] for r in results]}


def _fmt(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded target)")
    ap.add_argument("--budget", default="25%", help="expert cache budget of both servers")
    ap.add_argument("--max-batch", type=int, default=4, help="the batched server's --max-batch")
    ap.add_argument("--clients", type=int, default=4, help="concurrent requests per round")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=7, help="rounds per server, interleaved")
    args = ap.parse_args()
    if args.model is None:
        from runtime.checkpoints import embedded_pair

        args.model = str(embedded_pair().target)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        one = stack.enter_context(_server(args.model, args.budget, 1, Path(tmp)))
        batched = stack.enter_context(_server(args.model, args.budget, args.max_batch, Path(tmp)))
        _round(one, args.clients, 4), _round(batched, args.clients, 4)  # warm both (first-touch costs)
        rows = {"one": [], "batch": []}
        for i in range(args.repeats):
            order = [("one", one), ("batch", batched)] if i % 2 == 0 else [("batch", batched), ("one", one)]
            for name, base in order:
                rows[name].append(_round(base, args.clients, args.max_tokens))
        stats = _get(batched + "/v1/specmoe/stats")["batching"]
        handed_over = _get(batched + "/health")["queue"]["handed_over"]
        health_one = _get(one + "/health")["queue"]
    same = all(a["texts"] == b["texts"] for a, b in zip(rows["one"], rows["batch"]))
    ratio = [b["aggregate_tps"] / a["aggregate_tps"] for a, b in zip(rows["one"], rows["batch"])]
    lat = [b["latency_s"] / a["latency_s"] for a, b in zip(rows["one"], rows["batch"])]
    print(f"specmoe serve on the embedded target, budget {args.budget}: {args.clients} concurrent /v1/completions "
          f"requests x {args.max_tokens} greedy tokens, {args.repeats} interleaved rounds per server, median (min-max)")
    print(f"{'server':<16} {'aggregate tok/s':>20} {'median latency s':>20}")
    for name, label in (("one", "--max-batch 1"), ("batch", f"--max-batch {args.max_batch}")):
        print(f"{label:<16} {_fmt([r['aggregate_tps'] for r in rows[name]]):>20} "
              f"{_fmt([r['latency_s'] for r in rows[name]], 2):>20}")
    print(f"batch / one at a time: aggregate {_fmt(ratio, 2)}, median latency {_fmt(lat, 2)}")
    print(f"batched server: {stats['steps']} decode steps, {stats['mean_sequences']:.2f} sequences per step "
          f"(max {stats['max_seen']}, histogram {stats['histogram']}), unique/summed expert lookups per step "
          f"{stats['unique_per_step']:.1f} / {stats['summed_per_step']:.1f}; requests handed over from alone to a "
          f"batch: {handed_over}")
    print(f"same text on both servers, every request: {same} (one-at-a-time server mode: {health_one['mode']})")
    print(json.dumps({"bench": "serve_batch", "budget": args.budget, "clients": args.clients,
                      "max_batch": args.max_batch, "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "same_text": same, "handed_over": handed_over, "ratio": ratio, "latency_ratio": lat, "batching": stats,
                      "rounds": {k: [{x: r[x] for x in ("aggregate_tps", "tokens", "wall_s", "latency_s")} for r in v]
                                 for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
