"""What this machine's MLX backend charges per op, and whether host work can overlap its compute.

The decode targets compare specmoe with stock mlx-lm on a model whose token is a few hundred tiny ops: what
an op costs, and whether Python can run beside the compute, set how far the engine's own host work and extra
lookup ops can be hidden. Five measurements, each repeated, the variants interleaved:

1. op chain: one eval of N chained small ops (a 1 x D matmul, a max, an add) -> microseconds per op.
2. Python beside eval: that eval while a pure-Python thread spins, over the eval alone. Above 1 means eval
   needs more than the one core such a thread leaves free (on this CPU backend the evaluating thread and
   the worker both stay busy: any host work run beside the compute slows it).
3. extra ops in a decode: stock decode of the synthetic 8-layer checkpoint (bench_decode.py's) with E
   extra tiny ops per MoE layer (a lookup through a 64-entry identity table, as a device lookup does)
   against none, paired per trial -> microseconds per extra op inside a real forward.
4. queueing from a helper thread: the variant queues each token with mx.async_eval from a helper thread
   (on a stream any thread may use) while the main thread builds the next forward; tokens must equal the
   plain loop's. Paired per trial: plain loop's time over the variant's (above 1: the variant is faster).
5. what mx.async_eval leaves in flight: a graph is built and queued; how long async_eval takes to return, and
   how long an eval right after it still waits (work not done when async_eval returned). Then the same with P
   ms of pure Python placed between the two: the milliseconds of it hidden = (queue + wait alone) + P - (queue +
   P + wait), per pair. Above 0: Python after async_eval runs while MLX's worker computes (the backend is not
   synchronous), so host work placed there overlaps. Two graphs: a one-token stock forward (hundreds of short
   ops: the queueing call itself keeps pace with the worker, so little is left when it returns) and a chain of
   long matmuls (few ops: async_eval returns at once).

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_decode import PROMPTS  # noqa: E402  (the decode bench's prompts: the same workload)
from runtime.checkpoints import make_tiny  # noqa: E402


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def op_chain(n_ops: int, width: int, repeats: int, spin: bool) -> list[float]:
    """Milliseconds per eval of a chain of n_ops small ops, with a Python thread spinning beside it or not."""
    a = mx.ones((1, width))
    w = mx.ones((width, width)) * 1e-3
    mx.eval(a, w)
    stop = threading.Event()

    def spin_until_stopped():
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin_until_stopped, daemon=True) if spin else None
    if spinner is not None:
        spinner.start()
    try:
        times = []
        for _ in range(repeats):
            x = a
            for _ in range(n_ops // 3):
                x = mx.maximum(x @ w, 0.5) + 1e-3
            t0 = time.perf_counter()
            mx.eval(x)
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()


class _ExtraOps(nn.Module):
    """Stock SwitchGLU behind `n` lookups of its expert ids through an identity table (the ids are unchanged)."""

    def __init__(self, inner, n: int, n_experts: int):
        super().__init__()
        self.inner, self.n = inner, n
        object.__setattr__(self, "_table", mx.arange(n_experts, dtype=mx.uint32))

    def __call__(self, x, indices):
        for _ in range(self.n):
            indices = self._table[indices]
        return self.inner(x, indices)


class _Decoder:
    """mlx-lm's decode loop on a stock model (build n+1, queue it, read n), plain or queued from a helper thread."""

    def __init__(self, model, tokenizer, tokens: int):
        self.model, self.tokenizer, self.tokens = model, tokenizer, tokens
        self.pool = ThreadPoolExecutor(1)

    def run(self, prompt: str, helper: bool) -> tuple[float, list[int]]:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        ids = mx.array(self.tokenizer.encode(prompt))
        self.model(ids[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])

        def step(y):
            return mx.argmax(self.model(y[None], cache=cache)[:, -1, :], axis=-1)

        y = step(ids[-1:])
        mx.eval(y)
        out = []
        t0 = time.perf_counter()
        if helper:
            queued = self.pool.submit(mx.async_eval, y)
            for _ in range(self.tokens):
                nxt = step(y)  # built while the helper thread queues (and the device computes) token n
                queued.result()
                queued = self.pool.submit(mx.async_eval, nxt)
                out.append(y)
                y = nxt
            queued.result()
            out = [int(t.item()) for t in out]
        else:
            for _ in range(self.tokens):
                nxt = step(y)
                mx.async_eval(nxt)
                out.append(int(y.item()))
                y = nxt
        mx.eval(y)
        return (time.perf_counter() - t0) / self.tokens * 1e3, out


def _spin(ms: float) -> None:
    """Pure Python for `ms` milliseconds (holds the GIL, as bookkeeping does)."""
    end = time.perf_counter() + ms * 1e-3
    n = 0
    while time.perf_counter() < end:
        n += 1


def forward_graph(model, tokenizer, prompt: str):
    """A builder of a one-token stock forward on a fresh cache (its prompt evaluated first): the lazy next token."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(tokenizer.encode(prompt))

    def build():
        cache = make_prompt_cache(model)
        mx.eval(model(ids[None, :-1], cache=cache), [c.state for c in cache])
        return mx.argmax(model(ids[None, -1:], cache=cache)[:, -1, :], axis=-1)
    return build


def matmul_graph(n: int, size: int):
    """A builder of a chain of n size x size matmuls: few ops, each long."""
    a = mx.random.normal((size, size)) * (1.0 / size)
    mx.eval(a)

    def build():
        x = a
        for _ in range(n):
            x = x @ a
        return x
    return build


def async_overlap(build, python_ms: float, spin_first: bool) -> tuple[float, float, float]:
    """(ms async_eval took to return, ms an eval right after it waited, ms of `python_ms` of Python placed between
    them that was hidden) for the graph build() returns, the two variants back to back."""
    runs = {}
    for spin in ((True, False) if spin_first else (False, True)):
        y = build()  # built, nothing queued yet
        t0 = time.perf_counter()
        mx.async_eval(y)
        t1 = time.perf_counter()
        if spin:
            _spin(python_ms)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        runs[spin] = (t1 - t0, t3 - t2)  # queueing, then the wait for what was still in flight
    queue, wait = runs[False]
    # hidden = (queue + wait) + P - (queue' + P + wait'): the Python's own P cancels out
    return queue * 1e3, wait * 1e3, (queue + wait - sum(runs[True])) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=360, help="ops in the chain of measurements 1 and 2")
    ap.add_argument("--width", type=int, default=256, help="width D of the chain's 1 x D activations")
    ap.add_argument("--chain-repeats", type=int, default=30, help="evals of the chain per variant and trial")
    ap.add_argument("--extra-ops", type=int, default=16, help="extra lookups per MoE layer in measurement 3")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per run in measurements 3 and 4")
    ap.add_argument("--trials", type=int, default=4, help="trials; each runs every prompt with every variant")
    ap.add_argument("--python-ms", type=float, default=5.0, help="Python placed after async_eval in measurement 5")
    ap.add_argument("--matmuls", type=int, default=20, help="256 x 256 matmuls in measurement 5's long-op chain")
    ap.add_argument("--out", type=Path, default=None, help="also write the table and JSON line to this file")
    args = ap.parse_args()
    for name in ("ops", "width", "chain_repeats", "extra_ops", "tokens", "trials"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    from mlx_lm import load

    # Every variant runs on one stream that any thread may use (measurement 4's helper queues on it).
    mx.set_default_stream(mx.new_thread_unsafe_stream(mx.cpu))
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=8, n_experts=64, top_k=4, hidden=256,
                         expert_hidden=256)
        model, tokenizer = load(str(path))
        layers = [l for l in model.model.layers if hasattr(l.mlp, "switch_mlp")]
        stock = [l.mlp.switch_mlp for l in layers]
        n_experts = model.args.num_experts

        def extra(n: int) -> None:
            for l, s in zip(layers, stock):
                l.mlp.switch_mlp = _ExtraOps(s, n, n_experts) if n else s

        dec = _Decoder(model, tokenizer, args.tokens)
        op_cost, beside, per_extra, helper_ratio, helper_ms, plain_ms = [], [], [], [], [], []
        queue_ms, wait_ms, hidden_ms = [], [], []
        big_queue_ms, big_wait_ms, big_hidden_ms = [], [], []
        big = matmul_graph(args.matmuls, 256)
        op_chain(args.ops, args.width, 3, False)  # warm both variants alike
        for v in (False, True):
            dec.run(PROMPTS[0], v)
        for trial in range(args.trials):
            order = (False, True) if trial % 2 == 0 else (True, False)  # neither variant always goes first
            res = {spin: statistics.median(op_chain(args.ops, args.width, args.chain_repeats, spin)) for spin in order}
            op_cost.append(res[False] * 1e3 / (args.ops // 3 * 3))
            beside.append(res[True] / res[False])
            for prompt in PROMPTS:
                t = {}
                for n in ((0, args.extra_ops) if trial % 2 == 0 else (args.extra_ops, 0)):
                    extra(n)
                    t[n] = dec.run(prompt, False)[0]
                extra(0)
                per_extra.append((t[args.extra_ops] - t[0]) * 1e3 / (args.extra_ops * len(layers)))
                r = {}
                for helper in order:
                    r[helper] = dec.run(prompt, helper)
                if r[True][1] != r[False][1]:
                    raise SystemExit("the helper-thread loop decoded other tokens than mlx-lm's loop: not comparable")
                for i in range(4):
                    q, w, h = async_overlap(forward_graph(model, tokenizer, prompt), args.python_ms,
                                            spin_first=(trial + i) % 2 == 1)
                    queue_ms.append(q)
                    wait_ms.append(w)
                    hidden_ms.append(h)
                q, w, h = async_overlap(big, args.python_ms, spin_first=trial % 2 == 1)
                big_queue_ms.append(q)
                big_wait_ms.append(w)
                big_hidden_ms.append(h)
                plain_ms.append(r[False][0])
                helper_ms.append(r[True][0])
                helper_ratio.append(r[False][0] / r[True][0])
    load_after = [round(x, 2) for x in os.getloadavg()]
    result = {"bench": "backend", "device": str(mx.default_device()), "mlx": mx.__version__, "ops": args.ops,
              "width": args.width, "extra_ops": args.extra_ops, "tokens": args.tokens, "trials": args.trials,
              "load_avg": [load_before, load_after],
              "us_per_op": _spread(op_cost), "python_beside_eval": _spread(beside),
              "us_per_extra_op_in_decode": _spread(per_extra),
              "helper_queue_vs_plain": _spread(helper_ratio),
              "async_eval_return_ms": _spread(queue_ms), "wait_after_async_eval_ms": _spread(wait_ms),
              "python_hidden_after_async_eval_ms": _spread(hidden_ms), "python_ms": args.python_ms,
              "matmul_chain_return_ms": _spread(big_queue_ms), "matmul_chain_wait_ms": _spread(big_wait_ms),
              "matmul_chain_python_hidden_ms": _spread(big_hidden_ms),
              "plain_ms_per_token": statistics.median(plain_ms), "helper_ms_per_token": statistics.median(helper_ms)}

    def row(label, s, unit, fmt="{:.2f}"):
        return f"{label:<58} {fmt.format(s['median']):>8} {unit:<9} [{fmt.format(s['min'])}-{fmt.format(s['max'])}] n={s['n']}"

    lines = [f"MLX {mx.__version__} on {result['device']}; synthetic qwen3_moe, 8 layers, 64 experts, top-4; "
             f"{args.trials} trials, variants interleaved; load average {' '.join(map(str, load_before))} before, "
             f"{' '.join(map(str, load_after))} after",
             f"{'measurement':<58} {'median':>8} {'unit':<9} [min-max]",
             row(f"1. one op of a {args.ops}-op chain (1 x {args.width})", result["us_per_op"], "us", "{:.1f}"),
             row("2. that eval with a Python thread spinning beside it", result["python_beside_eval"], "x alone"),
             row(f"3. an extra lookup op in a stock decode ({args.extra_ops} a MoE layer)",
                 result["us_per_extra_op_in_decode"], "us", "{:.1f}"),
             row("4. mlx-lm's loop over helper-thread queueing (time)", result["helper_queue_vs_plain"],
                 "x"),
             f"   (ms per token: plain {result['plain_ms_per_token']:.2f}, helper {result['helper_ms_per_token']:.2f};"
             " above 1 would mean the helper's overlap pays)",
             row("5a. mx.async_eval of a one-token forward: time to return", result["async_eval_return_ms"], "ms"),
             row("5b. an eval right after it: still waiting for", result["wait_after_async_eval_ms"], "ms"),
             row(f"5c. of {args.python_ms:g} ms of Python placed after async_eval, hidden",
                 result["python_hidden_after_async_eval_ms"], "ms"),
             row(f"5d. a chain of {args.matmuls} 256x256 matmuls: async_eval returns after",
                 result["matmul_chain_return_ms"], "ms"),
             row("5e. an eval right after it: still waiting for", result["matmul_chain_wait_ms"], "ms"),
             row(f"5f. of {args.python_ms:g} ms of Python placed after it, hidden", result["matmul_chain_python_hidden_ms"],
                 "ms")]
    text = "\n".join(lines) + "\n" + json.dumps(result) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
