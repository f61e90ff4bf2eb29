"""specmoe with every expert resident against stock mlx-lm: CPU per decoded token and per MoE layer call.

Physics: at a 100% budget the default decode is a device pass (runtime/decode/plain.py): the router's ids are the
slots (runtime/cache/cached_switch.py), the expert module is the family's own class over the cache's slabs
(runtime/cache/slab_switch.py), so the arithmetic is stock's and only host work (graph building, one packed
read-back, bookkeeping) is added. On MLX's CPU backend a token's time is the quantized matmuls: the expert
projections (gather_qmm, MXFP4 on gpt-oss) and the affine 4-bit attention, router and head. Process CPU time
(time.process_time: every thread, MLX's worker included) per token is robust to other load on the machine.

Rows:
- "decode": each repeat runs stock, specmoe 100% and specmoe 100% with the forward after the last token built and
  waited for (the behaviour before `after_last`, runtime/decode/offloaded_step.py) in separate fresh processes
  (order alternating), each loading only its own model, generating a few warm-up tokens, then decoding --tokens
  greedy tokens of the same prompt through its streaming API (the time a response arrives); CPU per token over
  tokens 3..N (the prefill and the first steps excluded), and over tokens 3..N-1 ("before the last token": the
  steady state). Ratios are per repeat, against that repeat's stock run. Tokens must be equal.
- "layer": in one process, the stock expert module of each MoE layer and the slab module specmoe runs in its place
  (same weights: read from the checkpoint into the cache), called on the same hidden state and the same random
  routing (one token, top-k), median CPU per call; plus the slabs' dtypes against the checkpoint's.
Prints a table, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "The quick brown fox jumps over the lazy dog and then"
AFTER_LAST = "specmoe-after-last"
KINDS = ("stock", "specmoe", AFTER_LAST)


def _child_decode(model: str, which: str, n_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    if which == "stock":
        from mlx_lm import load as mlx_load

        m, tok = mlx_load(model)
        ids = list(tok.encode(PROMPT))

        def gen(k):
            return (int(t) for t, _ in generate_step(mx.array(ids), m, max_tokens=k, sampler=make_sampler(0.0)))
    else:
        import runtime

        if which == AFTER_LAST:  # the earlier behaviour: the forward after the last token built and waited for
            import runtime.decode.plain as plain

            real = plain.offloaded_generate_step
            plain.offloaded_generate_step = lambda *a, **kw: real(*a, **{**kw, "after_last": True})
        eng = runtime.load(model, budget="100%", memory_limit=None, telemetry=False, memory_governor=False)
        ids = list(eng.tokenizer.encode(PROMPT))

        def gen(k):
            return (r.token for r in runtime.stream_generate(eng, ids, max_tokens=k))
    list(gen(3))  # warm: every expert read (specmoe), allocator buffers
    tokens, stamps = [], []
    for t in gen(n_tokens):
        tokens.append(t)
        stamps.append(time.process_time())
    steps = len(stamps) - 3
    return {"which": which, "cpu_ms_per_token": (stamps[-1] - stamps[2]) / steps * 1e3,
            "cpu_ms_before_last": (stamps[-2] - stamps[2]) / (steps - 1) * 1e3, "tokens": tokens}


def _child_layer(model: str, calls: int, seed: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    import runtime

    stock, _ = mlx_load(model)
    eng = runtime.load(model, budget="100%", memory_limit=None, telemetry=False, memory_governor=False)
    om = eng.model
    list(runtime.stream_generate(eng, [1, 2, 3], max_tokens=2))  # every expert read into its slot
    dtypes = {}  # tensor -> (stock's dtype, the slab's): the checkpoint as mlx-lm loads it, against the cache
    rng = random.Random(seed)
    rows = []
    for layer in om.moe_layers:
        path = om.store.layout(layer).prefix  # e.g. model.layers.0.mlp.experts
        node_s, node_o = stock, om.model
        for p in path.split("."):
            node_s = node_s[int(p)] if p.isdigit() else getattr(node_s, p)
            node_o = node_o[int(p)] if p.isdigit() else getattr(node_o, p)
        n_exp, k = om.store.layout(layer).n_experts, om.top_k
        for name, slab in om.cache.slabs[layer].items():
            proj, part = name.split(".")
            dtypes[f"{path}.{name}"] = (str(node_s[proj][part].dtype), str(slab.dtype))
        x = mx.random.normal((1, 1, om.config["hidden_size"]), key=mx.random.key(layer))
        mx.eval(x)
        times = {"stock": [], "slab": []}
        for _ in range(calls):
            inds = mx.array([[rng.sample(range(n_exp), k)]], mx.uint32)
            mx.eval(inds)
            outs = {}
            for name, mod in (("stock", node_s), ("slab", node_o.switch)):
                t0 = time.process_time()
                outs[name] = mod(x, inds)
                mx.eval(outs[name])
                times[name].append(time.process_time() - t0)
            if not mx.array_equal(outs["stock"], outs["slab"]).item():
                raise SystemExit(f"layer {layer}: the slab module's output differs from stock's")
        rows.append({"layer": layer, "stock_ms": statistics.median(times["stock"]) * 1e3,
                     "slab_ms": statistics.median(times["slab"]) * 1e3})
    return {"rows": rows, "dtypes": dtypes}


def _spawn(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an mlx-lm checkpoint dir (e.g. a reduced-depth gpt-oss-20b preset)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens decoded per run (CPU over tokens 3..N)")
    ap.add_argument("--repeats", type=int, default=3, help="stock/specmoe process pairs, order alternating")
    ap.add_argument("--layer-calls", type=int, default=24, help="calls per MoE layer in the layer rows (0: skip)")
    ap.add_argument("--out", help="also write the table and JSON here")
    ap.add_argument("--note", default="", help="a condition to record in the header")
    ap.add_argument("--child", choices=[*KINDS, "layer"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child in KINDS:
        print(json.dumps(_child_decode(args.model, args.child, args.tokens)))
        return
    if args.child == "layer":
        print(json.dumps(_child_layer(args.model, args.layer_calls, 0)))
        return
    if args.tokens < 5:
        ap.error(f"--tokens {args.tokens}: expected >= 5 (CPU is measured over tokens 3..N and 3..N-1)")
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there; expected an mlx-lm checkpoint directory")
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    runs = {k: [] for k in KINDS}
    before_last = {k: [] for k in KINDS}
    tokens = {}
    for r in range(args.repeats):
        for which in (KINDS if r % 2 == 0 else KINDS[::-1]):
            res = _spawn(["--child", which, "--model", args.model, "--tokens", str(args.tokens)])
            runs[which].append(res["cpu_ms_per_token"])
            before_last[which].append(res["cpu_ms_before_last"])
            tokens.setdefault(which, res["tokens"])
            if res["tokens"] != tokens[which]:
                raise SystemExit(f"{which}: tokens changed between repeats")
    layer = _spawn(["--child", "layer", "--model", args.model, "--layer-calls", str(args.layer_calls)]) \
        if args.layer_calls else {"rows": [], "dtypes": {}}
    load1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    equal = all(tokens[k] == tokens["stock"] for k in KINDS)
    cmd = "python bench/bench_resident_layer.py " + " ".join(sys.argv[1:])
    lines = [f"# {cmd} | {started} | load average before {load0}, after {load1} | at nice 19"
             + (f" | {args.note}" if args.note else "")]
    lines.append(f"{'row':<28}{'stock ms':>10}{'specmoe ms':>12}{'ratio':>8}   repeats")
    ratios = {}
    for label, series, kind in (("decode CPU/token", runs, "specmoe"),
                                ("  before the last token", before_last, "specmoe"),
                                ("  forward after last (old)", runs, AFTER_LAST),
                                ("  old, before the last token", before_last, AFTER_LAST)):
        rs = [o / s for s, o in zip(series["stock"], series[kind])]
        ratios[f"{label.strip()}"] = rs
        lines.append(f"{label:<28}{statistics.median(series['stock']):>10.1f}{statistics.median(series[kind]):>12.1f}"
                     f"{statistics.median(rs):>8.3f}   ratios [{min(rs):.3f}-{max(rs):.3f}] n={len(rs)}")
    lines.append(f"# tokens equal stock's in every run: {'yes' if equal else 'NO'}")
    for row in layer["rows"]:
        lines.append(f"{'layer ' + str(row['layer']) + ' experts CPU/call':<28}{row['stock_ms']:>10.2f}"
                     f"{row['slab_ms']:>12.2f}{row['slab_ms'] / row['stock_ms']:>8.3f}   median of {args.layer_calls}")
    off = {n: d for n, d in layer["dtypes"].items() if d[0] != d[1]}
    if layer["dtypes"]:
        lines.append(f"# slab dtypes equal the checkpoint's: {'yes' if not off else 'NO: ' + str(off)}"
                     f" ({len(layer['dtypes'])} tensors)")
    result = {"model": args.model, "tokens": args.tokens, "cpu_ms_per_token": runs, "cpu_ms_before_last": before_last,
              "ratios": ratios, "tokens_equal": equal, "layer": layer["rows"],
              "dtypes_differ": off, "load_average": {"before": load0, "after": load1}}
    lines.append(json.dumps(result))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
