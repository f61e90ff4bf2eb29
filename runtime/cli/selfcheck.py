"""`specmoe selfcheck`: compare the dedup verify kernel, its reference and stock mlx-lm on live shapes.

Prints a pasteable report (device, versions, shapes, max errors, timings) for the
requested shape and a coverage table (groups over 8 rows, windows under 8 pairs,
float16, float32 activations with bf16 scales). Exit code: 0 PASS (the kernel ran
and matched everywhere), 1 FAIL (a comparison beyond its tolerance or a kernel that
failed to run), 3 SKIPPED (the kernel did not run -- no Metal device, or a --bits the
kernel cannot compute -- so only reference vs stock was checked; 2 is bad input).
"""

from __future__ import annotations

from pathlib import Path

import typer

from runtime.observe import console, err_console, write_json


def register(app: typer.Typer) -> None:
    @app.command()
    def selfcheck(
        tokens: int = typer.Option(4, "--window", min=1, help="Tokens in the verify window (K drafted + 1)."),
        top_k: int = typer.Option(8, "--experts-per-tok", min=1, help="Experts per token (config num_experts_per_tok)."),
        d_model: int = typer.Option(2048, "--d-model", min=1, help="Hidden size D (Qwen3-30B-A3B: 2048)."),
        hidden: int = typer.Option(768, "--hidden", min=1, help="Expert intermediate size H (Qwen3-30B-A3B: 768)."),
        slots: int = typer.Option(32, "--slots", min=1, help="Cache slots in the test slab."),
        bits: int = typer.Option(4, "--bits", help="Weight bits."),
        group_size: int = typer.Option(64, "--group-size", help="Quantization group size (32, 64, 128)."),
        dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16, or auto: bfloat16 with "
                                  "Metal, float32 without (CPU bfloat16 matmuls are slow)."),
        routing: str = typer.Option("skewed", "--routing", help="random, overlap (shared pool) or skewed (router-like)."),
        trials: int = typer.Option(5, "--trials", min=1, help="Timed runs per variant; the median is reported."),
        seed: int = typer.Option(0, "--seed", help="Seed for weights, activations and routing."),
        json_path: Path = typer.Option(None, "--json", help="Also write the report as JSON to this path."),
        coverage: bool = typer.Option(True, "--coverage/--no-coverage",
                                      help="Also check the coverage cases (small shapes; a few seconds)."),
    ):
        """Check the dedup verify kernel against its reference and stock mlx-lm; print a report."""
        import mlx.core as mx

        from metal.selfcheck import (SelfCheckConfig, format_coverage, format_report, overall_result, run_coverage,
                                     run_selfcheck)

        if dtype == "auto":
            dtype = "bfloat16" if mx.metal.is_available() else "float32"
        config = SelfCheckConfig(tokens=tokens, top_k=top_k, d_model=d_model, hidden=hidden, n_slots=slots, bits=bits,
                                 group_size=group_size, dtype=dtype, routing=routing, trials=trials, seed=seed)
        err_console.print(f"checking {tokens} x top-{top_k} at D={d_model}, H={hidden}, {bits}-bit ...")
        report = run_selfcheck(config)
        console.print(format_report(report), markup=False, highlight=False)
        cases = run_coverage(config) if coverage else {}
        if cases:
            console.print(format_coverage(cases), markup=False, highlight=False)
        result = overall_result([report, *cases.values()])
        console.print(f"overall              {result}", markup=False, highlight=False)
        if json_path:
            write_json(json_path, {**report.to_json(), "overall": result,
                                   "coverage": {name: r.to_json() for name, r in cases.items()}})
        if result != "PASS":
            raise typer.Exit(1 if result == "FAIL" else 3)
