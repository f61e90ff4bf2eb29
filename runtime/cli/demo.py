"""`specmoe demo`: the embedded trained pair, three ways, side by side.

Runs the shipped target under a budget holding ~40% of its experts: plain
offloaded decoding, speculative decoding without prefetch, and speculative
decoding with spmoe prefetch. All three are greedy, so their text must be
identical; the table shows what each cost. The three run `--repeats` times,
interleaved in a fresh order each pass; tok/s is the median with its min-max (the
noise), and "vs plain" the ratio of the medians with the range the two spreads allow.
A variant is called faster or slower than plain only when its spread and plain's do
not overlap; otherwise the verdict is "within noise", so it cannot contradict the
numbers beside it.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from runtime.cli import options as opt
from runtime.observe import console, err_console, write_json

DEMO_PROMPT = "Enter the king, with his lords. The king speaks:"


def prefetched_bytes(om) -> int:
    """Bytes of the prefetch reads that have landed in `om`'s cache since it was loaded (every layer)."""
    return sum(s.prefetch_loaded * om.cache.layouts[l].expert_bytes for l, s in om.cache.stats().items())


def _row(name, tokens_per_s, tel_summary, n_tokens, prefetch_bytes=0, acceptance=None, tpv=None):
    """A variant's row. MB read per token counts the demand reads (telemetry, after the prompt) and the prefetch
    reads (the cache's counters: only decoding prefetches), so a forecaster's reads are not hidden."""
    s, n = tel_summary, max(1, n_tokens)
    return {"variant": name, "tokens_per_s": tokens_per_s, "hit_rate": s["hit_rate"],
            "misses_per_token": s["misses"] / n, "mb_read_per_token": (s["bytes_read"] + prefetch_bytes) / 1e6 / n,
            "prefetch_mb_per_token": prefetch_bytes / 1e6 / n,
            "unique_per_layer_per_verify": s["unique_per_layer_per_verify"],
            "pairs_per_layer_per_verify": s["pairs_per_layer_per_verify"], "acceptance": acceptance, "tokens_per_verify": tpv}


def verdict(tokens_per_s: list[float], plain_tokens_per_s: list[float]) -> str:
    """"faster"/"slower" than plain only outside the noise: every pass of the variant beats (or trails) every
    pass of plain, i.e. the min-max spreads do not overlap; otherwise "within noise". One pass has no spread."""
    if min(len(tokens_per_s), len(plain_tokens_per_s)) < 2:
        return "no spread (1 pass)"
    if min(tokens_per_s) > max(plain_tokens_per_s):
        return "faster"
    if max(tokens_per_s) < min(plain_tokens_per_s):
        return "slower"
    return "within noise"


def run_demo(target: Path, draft: Path, prompt: str, max_tokens: int, budget: str, num_draft: int, io_mode: str,
             repeats: int = 3) -> dict:
    import random
    import statistics

    variants = [("plain", None), ("spec, no prefetch", "none"), ("spec + spmoe prefetch", "spmoe")]
    passes = [run_variants(target, draft, prompt, max_tokens, budget, num_draft, io_mode,
                           random.Random(r).sample(variants, len(variants))) for r in range(repeats)]
    plain = [p["rows"]["plain"]["tokens_per_s"] for p in passes]
    rows = []
    for name, _ in variants:
        row = dict(passes[-1]["rows"][name])
        tps = [p["rows"][name]["tokens_per_s"] for p in passes]
        # "vs plain" is the ratio of the medians shown beside it, bracketed by the ratios the two spreads allow
        # (slowest over fastest plain .. fastest over slowest plain), so the verdict and the numbers agree.
        row.update(tokens_per_s=statistics.median(tps), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
                   tokens_per_s_passes=tps, vs_plain=statistics.median(tps) / statistics.median(plain),
                   vs_plain_min=min(tps) / max(plain), vs_plain_max=max(tps) / min(plain),
                   verdict="-" if name == "plain" else verdict(tps, plain))
        rows.append(row)
    tokens_by = {name: p["tokens"][name] for p in passes for name in p["tokens"]}
    identical = len({tuple(t) for p in passes for t in p["tokens"].values()}) == 1
    first = passes[0]
    return {"prompt": prompt, "budget": budget, "cache_fraction": first["cache_fraction"], "rows": rows,
            "repeats": repeats, "text": first["texts"]["plain"], "identical_outputs": identical,
            "tokens": tokens_by["plain"]}


def run_variants(target: Path, draft: Path, prompt: str, max_tokens: int, budget: str, num_draft: int, io_mode: str,
                 variants: list) -> dict:
    """One pass: each variant once, in the given order, each from a freshly loaded (empty) cache."""
    from runtime.api import load, stream_generate

    rows, texts, tokens_by = {}, {}, {}
    for name, predictor in variants:
        engine = load(target, budget, draft if predictor else None, num_draft=num_draft, predictor=predictor,
                      cutoff=None if predictor != "none" else 0, policy="lru", io_mode=io_mode)
        with engine:
            om = engine.model
            om.telemetry.new_sequence()
            before = prefetched_bytes(om)
            responses = list(stream_generate(engine, prompt, max_tokens))
            out, last = [r.token for r in responses], responses[-1]
            om.end_round()
            om.cache.settle_inflight()  # prefetches still in flight were read all the same
            fetched = prefetched_bytes(om) - before
            summary = om.telemetry.summary(exclude=("prefill",))
            if predictor is None:
                # Plain decoding has no verify windows: a decode step is a window of one token.
                summary["unique_per_layer_per_verify"] = summary["pairs_per_layer_per_verify"] = float(om.top_k)
                rows[name] = _row(name, last.detail.tokens_per_s, summary, len(out), fetched)
            else:
                st = last.detail
                rows[name] = _row(name, st.n_tokens / st.decode_s, summary, len(out), fetched, st.acceptance,
                                  st.tokens_per_verify)
            texts[name] = om.tokenizer.decode(out)
            tokens_by[name] = out
            plan = om.plan
    return {"rows": rows, "texts": texts, "tokens": tokens_by, "cache_fraction": plan.fraction}


SHORT = {"plain": "plain", "spec, no prefetch": "spec", "spec + spmoe prefetch": "spec+pf"}
LEGEND = ("spec = speculative decoding, no prefetch; spec+pf = with spmoe expert prefetch. MB/tok: demand + prefetch "
          "reads (pf: prefetch alone). unique /pairs: experts per layer per verify window (K+1 tokens; 1 for plain), "
          "unique vs routed pairs.")


def demo_tables(result: dict) -> list:
    """The result as two tables that fit 80 columns (speed, then reads and windows) and a legend line."""
    speed = Table(title=f"tok/s over {result['repeats']} interleaved passes; outputs identical: "
                        f"{'yes' if result['identical_outputs'] else 'NO'}")
    for col in ("variant", "tok/s", "min-max", "vs plain [min-max]", "verdict"):
        speed.add_column(col, justify="left" if col == "variant" else "right", no_wrap=True)
    reads = Table(title=f"cache holds {result['cache_fraction']:.0%} of the experts; after the prompt")
    for col in ("variant", "hit", "miss /tok", "MB/tok", "pf MB/tok", "unique /pairs", "accept", "tok /verify"):
        reads.add_column(col, justify="left" if col == "variant" else "right")
    for r in result["rows"]:
        name = SHORT.get(r["variant"], r["variant"])
        versus = ("1.00" if r["variant"] == "plain"
                  else f"{r['vs_plain']:.2f} [{r['vs_plain_min']:.2f}-{r['vs_plain_max']:.2f}]")
        speed.add_row(name, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}",
                      versus, r["verdict"])
        reads.add_row(name, f"{r['hit_rate']:.0%}", f"{r['misses_per_token']:.2f}", f"{r['mb_read_per_token']:.3f}",
                      f"{r['prefetch_mb_per_token']:.3f}",
                      f"{r['unique_per_layer_per_verify']:.1f}/{r['pairs_per_layer_per_verify']:.0f}",
                      "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                      "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}")
    return [speed, reads, Text(LEGEND, style="dim")]


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        prompt: str = opt.prompt_option(required=False, default=DEMO_PROMPT),
        max_tokens: int = opt.max_tokens_option("Tokens to generate in each run of each variant."),
        budget: str = opt.budget_option("Expert cache size (default: ~40% of the experts, so the demo pages).",
                                        opt.DEMO_BUDGET),
        num_draft: int = opt.num_draft_option(opt.DEFAULT_NUM_DRAFT, "Tokens the drafter proposes per round (K)."),
        io_mode: str = typer.Option("buffered", "--io-mode", help="buffered or direct (reads bypass the page cache)."),
        model: Path = opt.model_option(required=False, help="Target to demo instead of the embedded one "
                                                            "(path or hub id)."),
        draft: Path = opt.draft_option(help="Drafter to use instead of the embedded one (path or hub id)."),
        json_path: Path = opt.json_option(),
        repeats: int = typer.Option(3, "--repeats", min=1, help="Interleaved passes (their min-max is the noise)."),
    ):
        """Run the embedded trained MoE + drafter: plain vs speculative vs speculative with expert prefetch."""
        from runtime.checkpoints import embedded_pair

        prompt = opt.read_prompt(prompt)
        if num_draft < 1:
            raise ValueError(f"--num-draft {num_draft}; expected K >= 1")

        if model is None or draft is None:
            pair = embedded_pair()
            model, draft = model or pair.target, draft or pair.default_drafter
        err_console.print(f"target {model}\ndrafter {draft}\nbudget {budget}; greedy, {max_tokens} tokens", highlight=False)
        result = run_demo(model, draft, prompt, max_tokens, budget, num_draft, io_mode, repeats)
        console.print(f"[bold]{prompt}[/bold]{result['text']}", highlight=False)
        for table in demo_tables(result):
            console.print(table)
        if json_path:
            write_json(json_path, result)
        if not result["identical_outputs"]:
            raise RuntimeError("speculative output differed from plain greedy decoding: this is a bug, please report it")
