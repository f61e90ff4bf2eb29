"""Rendering a `specmoe plan` result dict as rich tables (runtime/cli/plan.py builds the dict).

Invariant: everything printed comes from the dict, so the tables and `--json` cannot disagree; every
speed is labelled a projection and every assumed term is printed as "assumed: ...".
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from runtime.plan import hit_rate_prior_exponent

__all__ = ["render_plan", "PROJECTION_NOTE"]
PROJECTION_NOTE = "every speed in this plan is a PROJECTION of the planner's cost model, not a measurement"


def render_plan(results: dict[str, Any], console: Console) -> None:
    """Print a plan dict (from build_plan) as rich tables."""
    model, mac, memory = results["model"], results["mac"], results["memory"]
    console.print(f"[bold]{model['name']}[/] ({_quant(model)}) on "
                  f"[bold]{mac['label']}[/]")
    table = Table(title="Model", show_header=False)
    for key, value in (
        ("routed experts", f"{model['n_experts']} x {model['n_moe_layers']} MoE layers, top-{model['top_k']}"),
        ("bytes per expert", f"{model['expert_mb']:.3f} MB"),
        ("all experts", f"{model['experts_gb']:.2f} GB"),
        ("resident (non-expert)", f"{model['resident_gb']:.2f} GB"),
        ("KV per context token", f"{model['kv_kb_per_token']:.1f} KB"),
        ("expert reads per token", f"{model['experts_read_per_token']} "
                                   f"({model['expert_mb_per_token_all_miss']:.0f} MB if all miss)"),
    ):
        table.add_row(key, value)
    console.print(table)
    table = Table(title=f"Memory (GPU working set {memory['working_set_gb']:.2f} GB)")
    table.add_column("item")
    table.add_column("GB", justify="right")
    for key, label in (("resident_gb", "resident weights"),
                       ("kv_gb", f"KV + state at {memory['context_tokens']} tokens"),
                       ("drafter_gb", "drafter"), ("headroom_gb", "headroom"),
                       ("cache_gb", f"expert cache ({100 * memory['cache_fraction']:.0f}% of experts)"),
                       ("free_gb", "free in working set"), ("page_cache_gb", "OS page-cache tier")):
        if key == "free_gb":
            table.add_row("total used", f"{memory['working_set_gb'] - memory['free_gb']:.2f}", end_section=True)
        table.add_row(label, f"{memory[key]:.2f}")
    console.print(table)
    if memory["fits"]:
        console.print("[green]fits[/]")
    else:
        console.print("[red]does not fit[/]: " + "; ".join(memory["advice"]))
        return
    hits = results["hit_rates"]
    console.print(f"hit rate: cache {hits['cache']:.2f}, page cache {hits['page_cache']:.2f}, "
                  f"SSD {hits['ssd']:.2f} ({hits['source']})")
    _render_projections(results, console)
    prefill = results.get("prefill")
    if prefill:
        console.print(f"time to first token (projection, expert-major prefill): {prefill['ttft_s']:.1f} s for "
                      f"{prefill['prompt_tokens']} prompt tokens ({prefill['read_gb']:.2f} GB read once, "
                      f"{prefill['unique_experts_per_layer']:.0f} experts/layer); longest context that fits: "
                      f"{results['max_context_tokens']:,} tokens")
    spec = results["projections"][2]["spec"]
    setup = results["speculation"]
    console.print(
        f"speculation (projection): K={setup['draft_len']}, acceptance {setup['acceptance_rate']:.2f} -> "
        f"{spec['tokens_per_round']:.2f} tokens/round; draft/target {spec['draft_ratio']:.2f}, "
        f"T(K+1)/T(1) {spec['verify_ratio']:.2f} with {spec['unique_experts_per_layer']:.1f} unique experts/layer, "
        f"rollback {spec['rollback_ms']:.1f} ms; speedup {spec['speedup']:.2f}x")
    table = Table(title=f"Cache hit rate needed for {results['target_tok_s']:g} tok/s (projection)")
    table.add_column("variant")
    table.add_column("hit rate", justify="right")
    for label, needed in results["required_hit_rate"].items():
        table.add_row(label, "unreachable" if needed is None else f"{needed:.3f}")
    console.print(table)
    for line in results.get("assumed", []):
        console.print(f"[dim]assumed: {line}[/]")
    console.print(f"[dim]{PROJECTION_NOTE}; hit-rate prior h = c^{hit_rate_prior_exponent():.3f}; "
                  f"prefetch assumes recall {results['prefetch_recall']:.2f} and no memory contention[/]")


# Short variant names keep the projection tables within 80 columns; the legend spells them out.
SHORT_VARIANT = {"baseline": "base", "prefetch": "prefetch", "speculative": "spec",
                 "speculative + prefetch": "spec+pf"}
LEGEND = {"dense": "resident weights + KV", "experts": "routed experts' compute",
          "I/O": "page-cache and SSD reads", "hidden": "I/O hidden by prefetch (subtracted)",
          "fixed": "host syncs + command buffers + per-layer time", "sync": "the fitted per-layer constant",
          "repair": "re-runs after an absent expert"}


def _render_projections(results: dict[str, Any], console: Console) -> None:
    """Two narrow tables (speed, then one forward's ms by term) that fit an 80-column terminal or log."""
    v2 = results["cost_model"] == "v2"
    if v2:
        engine = results["engine"]
        model_note = f"v2: {engine['sync_us']:.0f} us per host sync, {engine['layer_us']:.0f} us per MoE layer"
    else:
        model_note = f"v1: sync {results['sync_ms_per_layer']:.2f} ms per layer"
    speed = Table(title=f"Projected decode speed ({model_note})")
    for column in ("variant", "tok/s", "ms/token", "forward") + (("syncs",) if v2 else ()):
        speed.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    terms = Table(title="ms per forward (projection)")
    for column in ("variant", "dense", "experts", "I/O", "hidden", "fixed" if v2 else "sync") + (
            ("repair",) if v2 else ()):
        terms.add_column(column, justify="left" if column == "variant" else "right", no_wrap=True)
    for projection in results["projections"]:
        step, label = projection["step"], projection["label"]
        forward = "1 token" if step["n_tokens"] == 1 else f"{step['n_tokens']} tokens"
        speed.add_row(label, f"{projection['tok_per_s']:.2f}", f"{projection['ms_per_token']:.1f}", forward,
                      *((f"{step['host_syncs']:.2f}",) if v2 else ()))
        terms.add_row(SHORT_VARIANT.get(label, label), f"{step['dense_ms']:.1f}", f"{step['expert_compute_ms']:.1f}",
                      f"{step['page_cache_ms'] + step['ssd_ms']:.1f}", f"{step['hidden_io_ms']:.1f}",
                      f"{step['sync_ms']:.1f}", *((f"{step['repair_ms']:.1f}",) if v2 else ()))
    console.print(speed)
    console.print(terms)
    named = [column.header for column in terms.columns[1:]]
    console.print("[dim]ms per forward: " + "; ".join(f"{name} = {LEGEND[name]}" for name in named)
                  + ". spec = speculative (one forward verifies K+1 tokens), pf = prefetch.[/]")


def _quant(model: dict) -> str:
    """'4-bit, group 64' for affine; 'mxfp4' for a microscaled mode (its bits and group are fixed)."""
    mode = model.get("quant_mode", "affine")
    return f"{model['bits']}-bit, group {model['group_size']}" if mode == "affine" else mode
