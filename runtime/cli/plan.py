"""`specmoe plan`: will a MoE model fit on a given Mac, and how fast would it decode (projections).

`register(app)` adds the `plan` command to the project's typer app. `build_plan(...)` computes one
results dict; the rich tables and `--json PATH` are both rendered from it, so they cannot disagree.

Invariants: every speed shown is labelled a projection; bad input (unknown Mac, unknown preset,
unreadable config.json, malformed --budget, out-of-range numbers) prints one line on stderr naming
what was wrong and what was expected, exits with code 2, shows no traceback and writes no file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from runtime.cache import parse_budget
from runtime.plan import mac_profile
from runtime.plan import load_model_config, model_costs
from runtime.plan import (
    DEFAULT_SYNC_MS_PER_LAYER,
    CostConstants,
    SpecAssumptions,
    hit_rate_prior_exponent,
    hit_rates,
    plan_memory,
    project,
    projection_json,
    required_hit_rate,
)

__all__ = ["register", "build_plan"]
_PROJECTION_NOTE = "every speed in this plan is a PROJECTION of the planner's cost model, not a measurement"


def _gb(n_bytes: float) -> float:
    return round(n_bytes / 1e9, 3)


def build_plan(
    *,
    model_ref: str,
    mac_name: str,
    budget_text: str = "auto",
    bits: int = 4,
    group_size: int = 64,
    top_k: int | None = None,
    context_tokens: int = 4096,
    ssd_gb: int | None = None,
    wired_limit_mb: int | None = None,
    headroom_gb: float | None = None,
    hit_rate: float | None = None,
    page_cache: bool = False,
    target_tok_s: float = 10.0,
    draft_len: int = 3,
    acceptance: float = 0.75,
    drafter_gb: float = 0.3,
    overlap_scale: float = 1.0,
    prefetch_recall: float = 0.5,
    sync_ms_per_layer: float = DEFAULT_SYNC_MS_PER_LAYER,
) -> dict[str, Any]:
    """All planner results for one question, as JSON-ready data. Raises ValueError on bad input."""
    name, config, config_source = load_model_config(model_ref)
    model = model_costs(config, bits=bits, group_size=group_size, top_k=top_k, name=name)
    mac = mac_profile(mac_name, ssd_capacity_gb=ssd_gb, wired_limit_mb=wired_limit_mb)
    budget = parse_budget(budget_text)
    if headroom_gb is not None and headroom_gb < 0:
        raise ValueError(f"--headroom-gb must be >= 0, got {headroom_gb!r}")
    spec = SpecAssumptions(draft_len, acceptance, int(drafter_gb * 1e9), overlap_scale)
    constants = CostConstants(sync_ms_per_layer=sync_ms_per_layer)
    if not 0 <= prefetch_recall <= 1:
        raise ValueError(f"--prefetch-recall must be in [0, 1], got {prefetch_recall!r}")
    memory = plan_memory(
        model, mac, budget, context_tokens,
        headroom_bytes=None if headroom_gb is None else int(headroom_gb * 1e9),
        drafter_bytes=spec.drafter_bytes, page_cache=page_cache,
    )
    hits = hit_rates(memory, hit_rate)
    results: dict[str, Any] = {
        "kind": "specmoe-plan",
        "note": _PROJECTION_NOTE,
        "model": {
            "name": model.name, "config_source": config_source, "model_type": model.model_type,
            "bits": model.bits, "group_size": model.group_size, "n_moe_layers": model.n_moe_layers,
            "n_experts": model.n_experts, "top_k": model.top_k,
            "expert_mb": round(model.expert_bytes / 1e6, 3), "experts_gb": _gb(model.expert_total_bytes),
            "resident_gb": _gb(model.resident_bytes), "kv_kb_per_token": round(model.kv_bytes_per_token / 1e3, 2),
            "experts_read_per_token": model.experts_read_per_token,
            "expert_mb_per_token_all_miss": round(model.expert_bytes_per_token / 1e6, 1),
        },
        "mac": {
            "name": mac.name, "label": mac.label, "ram_gb": _gb(mac.ram_bytes),
            "gpu_working_set_gb": _gb(mac.gpu_working_set_bytes), "mem_bandwidth_gbps": mac.mem_bandwidth_gbps,
            "gpu_tflops": mac.gpu_tflops, "ssd_read_gbps": mac.ssd_read_gbps,
            "page_cache_read_gbps": mac.page_cache_read_gbps, "sources": mac.sources,
        },
        "memory": {
            "context_tokens": memory.context_tokens, "working_set_gb": _gb(memory.working_set_bytes),
            "resident_gb": _gb(memory.resident_bytes), "kv_gb": _gb(memory.kv_bytes),
            "drafter_gb": _gb(memory.drafter_bytes), "headroom_gb": _gb(memory.headroom_bytes),
            "cache_gb": _gb(memory.cache_bytes), "cache_fraction": round(memory.cache_fraction, 4),
            "min_cache_gb": _gb(memory.min_cache_bytes), "page_cache_gb": _gb(memory.page_cache_bytes),
            "free_gb": _gb(memory.free_bytes), "fits": memory.fits, "advice": list(memory.advice),
        },
        "hit_rates": {"cache": round(hits.cache, 4), "page_cache": round(hits.page_cache, 4),
                      "ssd": round(hits.ssd, 4), "source": hits.source},
        "speculation": {"draft_len": spec.draft_len, "acceptance_rate": spec.acceptance_rate,
                        "drafter_gb": _gb(spec.drafter_bytes), "unique_expert_scale": spec.unique_expert_scale},
        "prefetch_recall": prefetch_recall,
        "sync_ms_per_layer": constants.sync_ms_per_layer,
        "target_tok_s": target_tok_s,
        "projections": [],
        "required_hit_rate": {},
    }
    if not memory.fits:
        return results
    variants = (("baseline", None, 0.0), ("prefetch", None, prefetch_recall),
                ("speculative", spec, 0.0), ("speculative + prefetch", spec, prefetch_recall))
    for label, variant_spec, recall in variants:
        projection = project(model, mac, hits, constants, context_tokens=context_tokens,
                             spec=variant_spec, prefetch_recall=recall, label=label)
        results["projections"].append(projection_json(projection))
    for label, variant_spec, recall in (variants[0], variants[3]):
        needed = required_hit_rate(target_tok_s, model, mac, constants, context_tokens=context_tokens,
                                   spec=variant_spec, prefetch_recall=recall)
        results["required_hit_rate"][label] = None if needed is None else round(needed, 4)
    return results


def _render(results: dict[str, Any], console: Console) -> None:
    model, mac, memory = results["model"], results["mac"], results["memory"]
    console.print(f"[bold]{model['name']}[/] ({model['bits']}-bit, group {model['group_size']}) on "
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
    title = f"Projected decode speed (sync {results['sync_ms_per_layer']:.2f} ms/layer); ms columns: one forward"
    table = Table(title=title)
    for column in ("variant", "tok/s (projected)", "ms/token", "forward", "dense ms", "experts ms", "I/O ms",
                   "hidden ms", "sync ms"):
        table.add_column(column, justify="right" if column != "variant" else "left")
    for projection in results["projections"]:
        step = projection["step"]
        forward = "1 token" if step["n_tokens"] == 1 else f"verify {step['n_tokens']}"
        table.add_row(projection["label"], f"{projection['tok_per_s']:.2f}", f"{projection['ms_per_token']:.1f}",
                      forward,
                      f"{step['dense_ms']:.1f}", f"{step['expert_compute_ms']:.1f}",
                      f"{step['page_cache_ms'] + step['ssd_ms']:.1f}", f"{step['hidden_io_ms']:.1f}",
                      f"{step['sync_ms']:.1f}")
    console.print(table)
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
    console.print(f"[dim]{_PROJECTION_NOTE}; hit-rate prior h = c^{hit_rate_prior_exponent():.3f}; "
                  f"prefetch assumes recall {results['prefetch_recall']:.2f} and no memory contention[/]")


def _write_json(path: Path, results: dict[str, Any]) -> None:
    # Write beside the target and rename, so a failure never leaves a partial file.
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ValueError(f"--json {str(path)!r}: directory {str(directory)!r} does not exist")
    handle, temp_name = tempfile.mkstemp(dir=directory, prefix=".plan-", suffix=".json")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def _opt(flag: str, help_text: str) -> Any:
    return typer.Option(flag, help=help_text)


def plan_command(
    model: Annotated[str, _opt("--model", "Preset (e.g. qwen3.5-35b-a3b) or path to a config.json.")],
    mac: Annotated[str, _opt("--mac", "Mac as CHIP-RAMgb: m4-16gb, m1pro-16gb, m3max-48gb.")],
    budget: Annotated[str, _opt("--budget", "Expert cache: 6GB, 40% (of expert bytes) or auto.")] = "auto",
    bits: Annotated[int, _opt("--bits", "Weight bits (mlx affine); 16 = unquantized.")] = 4,
    group_size: Annotated[int, _opt("--group-size", "Quantization group size.")] = 64,
    top_k: Annotated[Optional[int], _opt("--top-k", "Experts per token (default: the model's).")] = None,
    context: Annotated[int, _opt("--context", "Context length in tokens for the KV bytes.")] = 4096,
    ssd_gb: Annotated[Optional[int], _opt("--ssd-gb", "Internal SSD size in GB (256 GB reads slower).")] = None,
    wired_limit_mb: Annotated[Optional[int], _opt("--wired-limit-mb", "As `sysctl iogpu.wired_limit_mb`.")] = None,
    headroom_gb: Annotated[Optional[float], _opt("--headroom-gb", "Headroom (default: runtime rule).")] = None,
    hit_rate: Annotated[Optional[float], _opt("--hit-rate", "Expert-cache hit rate (default: prior).")] = None,
    page_cache: Annotated[bool, _opt("--page-cache/--no-page-cache", "Leftover RAM as a page-cache tier.")] = False,
    target_tok_s: Annotated[float, _opt("--target-tok-s", "Speed to solve the needed hit rate for.")] = 10.0,
    draft_len: Annotated[int, _opt("--draft-len", "Drafted tokens per speculative round (K).")] = 3,
    acceptance: Annotated[float, _opt("--acceptance", "Per-token draft acceptance rate.")] = 0.75,
    drafter_gb: Annotated[float, _opt("--drafter-gb", "Drafter weights in GB.")] = 0.3,
    overlap_scale: Annotated[float, _opt("--overlap-scale", "Measured/uniform unique experts.")] = 1.0,
    prefetch_recall: Annotated[float, _opt("--prefetch-recall", "Share of misses prefetched.")] = 0.5,
    sync_ms_per_layer: Annotated[
        float, _opt("--sync-ms-per-layer", "Per-layer overhead (default: fitted).")
    ] = DEFAULT_SYNC_MS_PER_LAYER,
    json_path: Annotated[Optional[Path], _opt("--json", "Also write the results as JSON to PATH.")] = None,
) -> None:
    """Will MODEL fit on MAC, and how fast would it decode? (memory breakdown + projected tok/s)"""
    try:
        results = build_plan(
            model_ref=model, mac_name=mac, budget_text=budget, bits=bits, group_size=group_size, top_k=top_k,
            context_tokens=context, ssd_gb=ssd_gb, wired_limit_mb=wired_limit_mb, headroom_gb=headroom_gb,
            hit_rate=hit_rate, page_cache=page_cache, target_tok_s=target_tok_s, draft_len=draft_len,
            acceptance=acceptance, drafter_gb=drafter_gb, overlap_scale=overlap_scale,
            prefetch_recall=prefetch_recall, sync_ms_per_layer=sync_ms_per_layer,
        )
        if json_path is not None:
            _write_json(json_path, results)
    except (ValueError, OSError) as error:
        typer.echo(f"specmoe plan: error: {error}", err=True)
        # SystemExit, not typer.Exit: click in standalone_mode=False *returns* an Exit's code,
        # which a caller may drop; SystemExit reaches every caller as exit code 2.
        raise SystemExit(2) from None
    _render(results, Console())


def register(app: typer.Typer) -> None:
    """Add the `plan` command to the project's typer app."""
    app.command("plan")(plan_command)
