"""`specmoe profile`: routing observability — unique experts per window, overlap vs baselines."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from runtime.cli import options as opt
from runtime.observe import console, err_console, progress_bar, write_json


def _tables(report: dict, telemetry_totals: dict | None, spec: dict) -> None:
    s = report["summary"]
    w = s["window"]
    t = Table(title=f"per layer: unique experts per {w}-token window, overlap at distance d (measured / independent / uniform)")
    for col in ["layer", f"unique/{w} tok", "indep", "uniform", "ov d1", "ov d2", "ov d3", "ov d4", "indep", "shuffle d1", "uniform"]:
        t.add_column(col, justify="right")
    if telemetry_totals:
        t.add_column("hit rate", justify="right")
        t.add_column("MB read", justify="right")
    for layer, r in sorted(report["layers"].items()):
        row = [str(layer), f"{r['unique'][w]:.2f}", f"{r['unique_independent'][w]:.2f}", f"{r['unique_uniform'][w]:.2f}",
               *(f"{r['overlap'][d]:.3f}" for d in (1, 2, 3, 4)), f"{r['overlap_independent']:.3f}",
               f"{r['overlap_shuffled'][1]:.3f}", f"{r['overlap_uniform']:.3f}"]
        if telemetry_totals:
            tot = telemetry_totals[layer]
            row += [f"{tot.hits / max(1, tot.hits + tot.misses):.1%}", f"{tot.bytes_read / 1e6:.2f}"]
        t.add_row(*row)
    console.print(t)
    overlaps = " ".join(f"{s['overlap'][d]:.3f}" for d in (1, 2, 3, 4))
    lines = [
        f"tokens {s['tokens']} in {s['sequences']} sequences; k={s['top_k']} of N={s['n_experts']} experts",
        f"overlap d=1..4: {overlaps} | independent {s['overlap_independent']:.3f} "
        f"(shuffle control {s['overlap_shuffled'][1]:.3f}) | uniform {s['overlap_uniform']:.3f}",
        f"unique experts per {w}-token window: {s['unique'][w]:.2f} measured | {s['unique_independent'][w]:.2f} independent | "
        f"{s['unique_uniform'][w]:.2f} uniform | saturation at {s['saturation_threshold_tokens']} tokens (tau 0.95)",
    ]
    if spec:
        lines.append(f"speculative: acceptance {spec['n_accepted'] / max(1, spec['n_drafted']):.0%}, "
                     f"{spec['n_tokens'] / max(1, spec['n_rounds']):.2f} tokens per verify")
    console.print("\n".join(lines), highlight=False)


def register(app: typer.Typer) -> None:
    @app.command()
    def profile(
        model: Path = opt.model_option(required=False, help="Model to run, path or hub id (omit with --trace FILE to "
                                                            "analyse a saved trace)."),
        prompts: Path = typer.Option(None, "--prompts", help="Text file, one prompt per line."),
        trace: Path = typer.Option(None, "--trace", help="With --model: save the routing trace here. Alone: analyse this trace."),
        draft: Path = opt.draft_option(help="Drafter: profile speculative decoding (verify windows)."),
        num_draft: int = opt.num_draft_option(opt.DEFAULT_NUM_DRAFT, "K; windows of K+1 tokens are reported."),
        predictor: str = typer.Option("spmoe", "--predictor", help="Forecaster when --draft is given."),
        max_tokens: int = typer.Option(0, "--decode-tokens", min=0,
                                       help="Tokens to generate after each prompt; 0 reads the prompts only "
                                            "(teacher-forced routing)."),
        budget: str = opt.budget_option(),
        json_path: Path = opt.json_option("Write the report as JSON."),
        plot: Path = typer.Option(None, "--plot", help="Write a PNG: overlap vs distance, unique experts vs window."),
    ):
        """Report unique experts per layer per window, overlap vs baselines, hit rates and bytes read."""
        from runtime.decode import OffloadConfig, OffloadedModel
        from runtime.observe import analyse, read_prompts, read_summary, trace_of
        from runtime.tune import run_workload
        from runtime.observe import RoutingTrace

        if num_draft < 1:
            raise ValueError(f"--num-draft {num_draft}; expected K >= 1")
        if plot is not None:
            from runtime.observe import pyplot

            pyplot()  # fail before the run, not after it
        if model is None:
            if trace is None:
                raise ValueError("specmoe profile needs --model M --prompts FILE, or --trace FILE to analyse a saved trace")
            report = analyse(RoutingTrace.load(trace), num_draft + 1)
            totals, spec = None, {}
        else:
            if prompts is None:
                raise ValueError("--prompts FILE is required with --model")
            texts = read_prompts(prompts)
            om = OffloadedModel.load(model, OffloadConfig(budget=budget, trace=True))
            try:
                c0 = om.counters()
                with progress_bar(console=err_console) as bar:
                    task = bar.add_task("profiling", total=len(texts))
                    spec = run_workload(om, texts, max_tokens=max_tokens, draft=draft, num_draft=num_draft,
                                        predictor=predictor, progress=lambda n: bar.advance(task, n))
                tr = trace_of(om)
                if trace is not None:
                    tr.save(trace)
                report = analyse(tr, num_draft + 1)
                totals = om.telemetry.totals
                report["telemetry"] = om.telemetry.summary()
                report["reads"] = read_summary(c0, om.counters(), tr.n_tokens)
            finally:
                om.close()
        if "reads" in report:  # before the tables: their last line is the same with or without a model
            r = report["reads"]
            console.print(f"reads per token: {r['demand_misses_per_token']:.2f} demand misses, "
                          f"{r['prefetch_reads_per_token']:.2f} prefetched (used {r['prefetch_used_per_token']:.2f}, "
                          f"wasted {r['prefetch_wasted_per_token']:.2f}), {r['mb_read_per_token']:.3f} MB", highlight=False)
        _tables(report, totals, spec)
        report["speculative"] = spec
        if json_path:
            write_json(json_path, report)
        if plot:
            from runtime.observe import plot_profile

            plot_profile(report, plot)
            err_console.print(f"wrote {plot}")
