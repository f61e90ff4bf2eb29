"""An 8K-token context under a memory cap: peak RSS and MLX peak within the cap, tokens equal to stock.

Physics: a long prompt's process holds the interpreter and libraries, the resident weights, the KV
cache (linear in the context), the prefill chunk's activations (on MLX's CPU backend attention
materialises chunk x context x heads scores) and, for specmoe, the expert cache. Under
`--memory-limit` the budget is planned for the context and the chunk shrinks only if its
activations would not fit (runtime/cache/memory_limit.py); the expert cache takes what is left.

Method: each variant runs in its own process (clean peaks); peak RSS is the kernel's high-water mark
(VmHWM; getrusage's ru_maxrss is kept across execve, so a child would report its parent's peak),
MLX peak mx.get_peak_memory(). First stock mlx-lm, fully resident, with mlx-lm's 2048-token
chunks, to see what the prompt costs unlimited; the cap is then --cap-share of stock's peak RSS
(or --cap). specmoe runs under the cap (budget 100%, --memory-limit CAP, planned for the prompt
plus the generated tokens, or for --planned-context tokens so that the expert cache must give slots
back as the KV grows past it; the chunk is the whole prompt unless its activations do not fit), and
stock runs again with specmoe's chunk size: the greedy tokens of the two must be equal (on Metal
the chunk size can change attention's rounding, so that is the fair reference; on this CPU
backend the chunk does not change the output). One run each (a long prefill on a shared 2-core machine takes minutes).
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _peak_rss() -> int:
    """This process's peak RSS. On Linux the kernel's VmHWM (kept across the governor's resets by
    process_peak_rss): getrusage's ru_maxrss survives execve, so a child started by a parent that had grown
    larger (building the checkpoint) would report the parent's peak."""
    from runtime.cache import process_peak_rss

    return process_peak_rss()


def _prompt(tokenizer, n: int) -> list[int]:
    from importlib.resources import files

    ids = tokenizer.encode((files("runtime") / "data" / "calibration.txt").read_text())
    return (ids * (n // len(ids) + 1))[:n]


def role_stock(model: Path, n_prompt: int, n_gen: int, step: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    m, tok = load(str(model))
    ids = _prompt(tok, n_prompt)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = [int(t) for t, _ in generate_step(mx.array(ids), m, max_tokens=n_gen, prefill_step_size=step)]
    return {"tokens": out, "seconds": time.perf_counter() - t0, "peak_rss": _peak_rss(),
            "mlx_peak": mx.get_peak_memory(), "step": step}


def role_specmoe(model: Path, n_prompt: int, n_gen: int, cap: int, planned: int) -> dict:
    import mlx.core as mx

    from runtime import load
    from runtime.decode import generate_tokens

    engine = load(model, budget="100%", memory_limit=f"{cap}B", context_tokens=planned or n_prompt + n_gen,
                  memory_governor=False)
    planned_slots = min(engine.model.plan.slots.values())
    om = engine.model
    ids = _prompt(om.tokenizer, n_prompt)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out, stats = generate_tokens(om.model, ids, max_tokens=n_gen, om=om)
    gov = om.context_governor.stats
    result = {"tokens": out, "seconds": time.perf_counter() - t0, "peak_rss": _peak_rss(),
              "mlx_peak": mx.get_peak_memory(), "step": stats.prefill.chunk_tokens, "slots": min(om.plan.slots.values()),
              "n_experts": om.store.layout(om.moe_layers[0]).n_experts, "cache_bytes": om.plan.budget_bytes,
              "expert_bytes_total": om.store.expert_bytes_total, "baseline": om.memory_limit.baseline_bytes,
              "usable_at_end": gov.usable, "governor_shrinks": gov.n_shrinks, "planned_slots": planned_slots,
              "planned_context": planned or n_prompt + n_gen, "unaccounted_bytes": gov.unaccounted_bytes,
              "prefill_reads_per_unique": stats.prefill.reads_per_unique_expert}
    engine.close()
    return result


def _run(role: str, *args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{role} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint dir (default: a qwen3_moe, 4 MoE layers x 64 experts, top-4, hidden 128)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--cap", type=int, default=None, help="memory cap in bytes (default: --cap-share of stock's peak RSS)")
    ap.add_argument("--cap-share", type=float, default=0.85)
    ap.add_argument("--planned-context", type=int, default=0,
                    help="context the budget is planned for at load (default: the prompt + generated); smaller: "
                         "the expert cache must give slots back as the KV outgrows it")
    ap.add_argument("--n-experts", type=int, default=64, help="experts per layer of the default model")
    ap.add_argument("--no-unlimited", action="store_true", help="with --cap: skip the unlimited stock run")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "stock":
        m, n, g, step = args.args
        print(json.dumps(role_stock(Path(m), int(n), int(g), int(step))))
        return
    if args.role == "specmoe":
        m, n, g, cap, planned = args.args
        print(json.dumps(role_specmoe(Path(m), int(n), int(g), int(cap), int(planned))))
        return

    from runtime.checkpoints import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_tiny(Path(tmp) / "m", "qwen3_moe", seed=0, layers=4, n_experts=args.n_experts, top_k=4,
                                        hidden=128, expert_hidden=128)
        free = None if args.cap and args.no_unlimited else _run("stock", model, args.tokens, args.generate, 2048)
        cap = args.cap or int(args.cap_share * free["peak_rss"])
        ours = _run("specmoe", model, args.tokens, args.generate, cap, args.planned_context)
        ref = _run("stock", model, args.tokens, args.generate, ours["step"])

    equal = ours["tokens"] == ref["tokens"]
    gb = 1e6
    print(f"model: {args.model or f'qwen3_moe 4 layers x {args.n_experts} experts, top-4, hidden 128'} "
          f"({ours['expert_bytes_total'] / gb:.1f} MB of experts); prompt {args.tokens} tokens + {args.generate} generated; "
          f"cap {cap / gb:.0f} MB ({'--cap' if args.cap else f'{args.cap_share:.0%} of unlimited stock peak RSS'}); one run each")
    print(f"{'variant':<30}{'chunk':>7}{'peak RSS MB':>13}{'MLX peak MB':>13}{'within cap':>12}{'seconds':>9}")
    rows = [("stock, unlimited", free), ("specmoe under the cap", ours), ("stock, specmoe's chunk", ref)]
    rows = [(name, r) for name, r in rows if r is not None]
    for name, r in rows:
        within = r["peak_rss"] <= cap and r["mlx_peak"] <= cap
        print(f"{name:<30}{r['step']:>7}{r['peak_rss'] / gb:>13.1f}{r['mlx_peak'] / gb:>13.1f}{'yes' if within else 'no':>12}"
              f"{r['seconds']:>9.1f}")
    print(f"specmoe: budget planned for a {ours['planned_context']}-token context: expert cache {ours['cache_bytes'] / gb:.1f} MB "
          f"= {ours['slots']}/{ours['n_experts']} slots per layer; usable at the end {ours['usable_at_end']} "
          f"({ours['governor_shrinks']} give-backs as the KV grew; {ours['unaccounted_bytes'] / gb:.1f} MB measured beyond "
          f"the accounting, taken from the cache); process before loading "
          f"{ours['baseline'] / gb:.0f} MB; prefill reads per routed expert {ours['prefill_reads_per_unique']:.2f}")
    print(f"greedy tokens equal to stock with the same chunk: {equal}")
    print(json.dumps({"bench": "long_context", "prompt_tokens": args.tokens, "cap_bytes": cap, "tokens_equal": equal,
                      "specmoe_within_cap": ours["peak_rss"] <= cap and ours["mlx_peak"] <= cap,
                      "runs": {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in rows}}))


if __name__ == "__main__":
    main()
