"""`specmoe sweep cutoff`, `specmoe sweep cache`, `specmoe tune`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from runtime.cli import options as opt
from runtime.observe import console, err_console, progress_bar, write_json

sweep_app = typer.Typer(help="Measure a grid of settings: prefetch cutoff (with a model) or cache policies (from a trace).",
                        no_args_is_help=True, rich_markup_mode=None)

_PROMPTS_HELP = "Text file of prompts, one per line."
_IO_HELP = "buffered (page cache) or direct (O_DIRECT/F_NOCACHE)."


def _measure_table(rows, title: str) -> Table:
    t = Table(title=title)
    for col in ["cutoff L", "predictor", "K", "policy", "tok/s", "min-max (passes)", "misses/tok", "prefetch used MB",
                "wasted MB", "recall", "accept"]:
        t.add_column(col, justify="right")
    for m in rows:
        s = m.setting
        spread = f"{m.tokens_per_s_min:.2f}-{m.tokens_per_s_max:.2f} ({m.n_passes})" if m.n_passes > 1 else "- (1)"
        t.add_row(str(s.cutoff), s.predictor, str(s.num_draft), s.policy, f"{m.tokens_per_s:.2f}", spread,
                  f"{m.misses_per_token:.2f}",
                  f"{m.prefetch_used_mb:.2f}", f"{m.prefetch_wasted_mb:.2f}", f"{m.recall:.2f}", f"{m.acceptance:.0%}")
    return t


def _run_grid(runner, settings, passes: dict, bar, task, repeats: int = 1) -> list:
    """Measure `settings` not measured yet, `repeats` interleaved passes (a fresh order each pass);
    returns every setting's median measurement with its min-max over passes."""
    import random

    from runtime.tune import median_measurement

    new = [s for s in settings if s not in passes]
    for r in range(repeats):
        for s in random.Random(r).sample(new, len(new)):
            bar.update(task, description=f"pass {r + 1}/{repeats}: L={s.cutoff} {s.predictor} K={s.num_draft} {s.policy}")
            passes.setdefault(s, []).append(runner.measure(s)[0])
            bar.advance(task)
    return [median_measurement(ms) for ms in passes.values()]


def _finish(measured, title, json_path, extra=None, interrupted=False):
    console.print(_measure_table(measured, title + (" (interrupted: partial)" if interrupted else "")))
    if json_path:
        from dataclasses import asdict

        write_json(json_path, {"measured": [asdict(m) for m in measured], "interrupted": interrupted, **(extra or {})})


@sweep_app.command("cutoff")
def sweep_cutoff(
    model: Path = opt.model_option(),
    draft: Path = opt.draft_option(required=True, help="Drafter (path or hub id)."),
    prompts: Path = typer.Option(..., "--prompts", help=_PROMPTS_HELP),
    budget: str = opt.budget_option(),
    max_tokens: int = opt.measure_tokens_option(),
    num_draft: int = opt.num_draft_option(opt.DEFAULT_NUM_DRAFT, "Tokens the drafter proposes per round (K)."),
    predictor: str = typer.Option("spmoe", "--predictor", help="Expert forecaster: none, previous, popularity, spmoe, oracle."),
    policy: str = typer.Option("dlfu", "--policy", help="Cache eviction policy: dlfu (decayed LFU, the default), lfu or lru."),
    io_mode: str = typer.Option("buffered", "--io-mode", help=_IO_HELP),
    json_path: Path = opt.json_option(),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of tok/s against the cutoff (error bars: min-max of passes)."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Interleaved passes per cutoff (their min-max is the noise)."),
):
    """tok/s, misses, prefetch MB and recall for cutoffs L = 0 (off) .. all MoE layers; coarse grid, then refined.
    A cutoff is chosen over a simpler one only when it is faster outside the noise of the passes."""
    if num_draft < 1:
        raise ValueError(f"--num-draft {num_draft}; expected K >= 1")
    from runtime.observe import read_prompts
    from runtime.tune import SettingRunner, Workload
    from runtime.tune import Setting, choose, cutoff_grid, refine

    if plot:
        from runtime.observe import pyplot

        pyplot()
    runner = SettingRunner(Workload(model, draft, budget, read_prompts(prompts), max_tokens, io_mode))
    n = runner.n_moe_layers
    measured: list = []
    passes: dict = {}
    title = (f"cutoff sweep: {model.name}, drafter {draft.name}, budget {budget}, K={num_draft}, {predictor}, "
             f"{repeats} pass(es)")
    try:
        with progress_bar(console=err_console) as bar:
            coarse = [Setting(c, predictor, num_draft, policy) for c in cutoff_grid(n, n)]
            task = bar.add_task("sweep", total=len(coarse) * repeats)
            measured = _run_grid(runner, coarse, passes, bar, task, repeats)
            best = choose(measured).setting.cutoff
            fine = [Setting(c, predictor, num_draft, policy) for c in refine(best, {m.setting.cutoff for m in measured}, n)]
            bar.update(task, total=(len(coarse) + len(fine)) * repeats)
            measured = _run_grid(runner, fine, passes, bar, task, repeats)
    except KeyboardInterrupt:
        from runtime.tune import median_measurement

        measured = [median_measurement(ms) for ms in passes.values()]
        if measured:
            _finish(sorted(measured, key=lambda m: m.setting.cutoff), title, json_path, interrupted=True)
        raise
    measured.sort(key=lambda m: m.setting.cutoff)
    c = choose(measured)
    _finish(measured, title, json_path, {"chosen_cutoff": c.setting.cutoff, "reason": c.reason})
    console.print(f"chosen L = {c.setting.cutoff}: {c.reason}", highlight=False)
    if plot:
        from runtime.tune import plot_cutoff

        plot_cutoff([{"cutoff": m.setting.cutoff, "tokens_per_s": m.tokens_per_s,
                      "tokens_per_s_min": m.tokens_per_s_min or m.tokens_per_s,
                      "tokens_per_s_max": m.tokens_per_s_max or m.tokens_per_s} for m in measured], c.setting.cutoff,
                    title, plot)
        err_console.print(f"wrote {plot}")


@sweep_app.command("cache")
def sweep_cache(
    trace: Path = typer.Option(..., "--trace", help="Routing trace from `specmoe profile --trace`."),
    window: int = typer.Option(1, "--window", min=1, help="Tokens per call: 1 = plain decode, K+1 = verify windows."),
    sizes: str = typer.Option("10,20,30,40,50,60,70,80,90", "--sizes", help="Cache sizes, % of a layer's experts."),
    policies: str = typer.Option("lru,lfu,dlfu,forecast", "--policies",
                                 help="lru, lfu, dlfu (decayed LFU, the default), forecast (LRU + simulated forecast protection)."),
    forecast_recall: float = typer.Option(0.9, "--forecast-recall", min=0.0, max=1.0,
                                          help="forecast policy: share of the next window's experts it foresees."),
    json_path: Path = opt.json_option(),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of hit rate against cache size."),
):
    """Replay a trace through every cache policy and size, against Belady's MIN; equal vs miss-curve slot split."""
    from runtime.tune import cache_sweep

    if plot:
        from runtime.observe import pyplot

        pyplot()
    try:
        fractions = [float(x) / 100 for x in sizes.split(",")]
    except ValueError:
        raise ValueError(f"--sizes {sizes!r}: expected comma-separated percentages like 10,20,50") from None
    if not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"--sizes {sizes!r}: percentages must be in (0, 100]")
    names = [p.strip() for p in policies.split(",")]
    from runtime.cache import POLICIES

    known = sorted(POLICIES) + ["forecast"]
    bad = [p for p in names if p not in known]
    if bad:
        raise ValueError(f"--policies {bad[0]!r}; expected some of {', '.join(known)}")
    result = cache_sweep(trace, window=window, fractions=fractions, policies=names, forecast_recall=forecast_recall)
    t = Table(title=f"cache replay of {trace.name}: hit rate (MB read per token), window {window}")
    t.add_column("size", justify="right")
    t.add_column("slots", justify="right")
    ratios = all("default_vs_lru" in row for row in result["table"])
    cols = names + ["belady"] + ([f"{result['default']} misses / lru", f"{result['default']} / belady"] if ratios else []) + [
        "split: equal", "split: by miss curves"]
    for c in cols:
        t.add_column(c, justify="right")
    for row in result["table"]:
        cells = [f"{row['fraction']:.0%}", str(row["slots"])]
        for c in names + ["belady"]:
            r = row[c]
            cells.append(f"{r['hit_rate']:.1%} ({r['mb_per_token']:.3f})")
        if ratios:
            cells += [f"{row['default_vs_lru']:.2f}x", f"{row['default_vs_belady']:.2f}x"]
        cells += [f"{row['split_equal']:.1%}", f"{row['split_allocated']:.1%}"]
        t.add_row(*cells)
    console.print(t)
    if json_path:
        write_json(json_path, result)
    if plot:
        from runtime.tune import plot_cache

        rows = [{"policy": c, "fraction": row["fraction"], "hit_rate": row[c]["hit_rate"]} for row in result["table"]
                for c in names + ["belady"]]
        plot_cache(rows, plot, f"{trace.name}: hit rate vs cache size (window {window})")
        err_console.print(f"wrote {plot}")


def register(app: typer.Typer) -> None:
    app.add_typer(sweep_app, name="sweep")

    @app.command()
    def tune(
        model: Path = opt.model_option(),
        draft: Path = opt.draft_option(required=True, help="Drafter to tune for (path or hub id)."),
        prompts: Path = typer.Option(..., "--prompts", help=_PROMPTS_HELP),
        budget: str = opt.budget_option(),
        max_tokens: int = opt.measure_tokens_option(),
        io_mode: str = typer.Option("buffered", "--io-mode", help=_IO_HELP),
        json_path: Path = opt.json_option("Also write every measurement and the choice as JSON to this path."),
        inject: str = typer.Option(None, "--inject", hidden=True,
                                   help="Debug: inject disk latency/faults in every run (spec: storage/faults.py)."),
    ):
        """Pick cutoff, predictor, K and cache policy by measurement; write tuning.json
        next to the model."""
        from runtime.tune import run_tune

        run_tune(model, draft, prompts, budget=budget, max_tokens=max_tokens, io_mode=io_mode, threads=opt.DEFAULT_THREADS,
                 json_path=json_path, table=_measure_table, inject=inject or "")
