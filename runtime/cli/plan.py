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

from runtime.cache import parse_budget
from runtime.cli.errors import error_line
from runtime.cli.options import BUDGET_HELP, DEFAULT_BUDGET, DEFAULT_NUM_DRAFT
from runtime.cli.plan_render import PROJECTION_NOTE, render_plan
from runtime.plan import mac_profile
from runtime.plan import config_quantization, load_model_config, model_costs
from runtime.plan import (
    DEFAULT_SYNC_MS_PER_LAYER,
    CostConstants,
    SpecAssumptions,
    hit_rates,
    plan_memory,
    project,
    projection_json,
    required_hit_rate,
)
from runtime.plan import specmoe_engine
from runtime.plan import PREFILL_ASSUMPTIONS, max_context_tokens, prefill_time

__all__ = ["register", "build_plan", "measured_from_doctor"]
_PROJECTION_NOTE = PROJECTION_NOTE


def measured_from_doctor(path: Path) -> dict[str, Any]:
    """The planner inputs a `specmoe doctor --json` report measured: sync prices, syncs and repairs per
    token, acceptance and forecast recall (keys missing from the report are left out)."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--from-doctor {str(path)!r} is not a readable doctor JSON report: {error}") from None
    if not isinstance(report, dict) or report.get("kind") != "specmoe-doctor":
        raise ValueError(f"--from-doctor {str(path)!r}: expected the JSON written by `specmoe doctor --json`")
    inputs = report.get("planner_inputs") or {}
    return {key: value for key, value in inputs.items() if value is not None}


def _gb(n_bytes: float) -> float:
    return round(n_bytes / 1e9, 3)


def resolve_quantization(config: dict, bits: int | None, group_size: int | None,
                         mode: str | None) -> tuple[int, int, str]:
    """(bits, group size, mode): the flags where given, else the config.json's own `quantization`
    (an mlx-lm checkpoint), else 4-bit affine group 64. A --bits or --group-size without --quant-mode
    means affine: the flags describe an affine model."""
    own = config_quantization(config) if bits is None and group_size is None and mode is None else None
    if own is not None:
        return own
    return (4 if bits is None else bits), (64 if group_size is None else group_size), (mode or "affine")


def build_plan(
    *,
    model_ref: str,
    mac_name: str,
    budget_text: str = "auto",
    bits: int | None = None,
    group_size: int | None = None,
    quant_mode: str | None = None,
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
    cost_model: str = "v2",
    fast_synch: bool = False,
    repairs_per_token: float | None = None,
    syncs_per_token: float | None = None,
    measured: dict[str, Any] | None = None,
    prompt_tokens: int = 1000,
    one_sync: str = "auto",
) -> dict[str, Any]:
    """All planner results for one question, as JSON-ready data. Raises ValueError on bad input.

    `cost_model` "v2" prices host syncs, command buffers, layer time and repairs from the engine's
    counts (runtime/plan/engine_costs.py); "v1" is the single fitted per-layer constant. `measured`
    (from `measured_from_doctor`) replaces assumed inputs with what `specmoe doctor` measured; `one_sync`
    prices the engine's `one_sync` mode (runtime.api.load's; the default, auto, is what a plan is for)."""
    if cost_model not in ("v1", "v2"):
        raise ValueError(f"--cost-model must be v1 or v2, got {cost_model!r}")
    measured = dict(measured or {})
    assumed: list[str] = []
    if syncs_per_token is not None and repairs_per_token is None:
        raise ValueError("--syncs-per-token needs --repairs-per-token too (measured syncs include the repairs' own)")
    name, config, config_source = load_model_config(model_ref)
    bits, group_size, quant_mode = resolve_quantization(config, bits, group_size, quant_mode)
    model = model_costs(config, bits=bits, group_size=group_size, top_k=top_k, name=name, mode=quant_mode)
    mac = mac_profile(mac_name, ssd_capacity_gb=ssd_gb, wired_limit_mb=wired_limit_mb)
    budget = parse_budget(budget_text)
    if headroom_gb is not None and headroom_gb < 0:
        raise ValueError(f"--headroom-gb must be >= 0, got {headroom_gb!r}")
    acceptance = float(measured.get("acceptance_rate", acceptance))
    prefetch_recall = float(measured.get("forecast_recall", prefetch_recall))
    spec = SpecAssumptions(draft_len, acceptance, int(drafter_gb * 1e9), overlap_scale)
    engine = None
    if cost_model == "v2":
        engine = specmoe_engine(fast_synch=fast_synch, repairs_per_token=repairs_per_token, one_sync=one_sync)
        sync_key = "fast_synch_sync_us" if fast_synch else "default_sync_us"
        engine = engine.with_measured(sync_us=measured.get(sync_key), repairs_per_token=measured.get("repairs_per_token"),
                                      syncs_per_token=syncs_per_token, syncs_per_layer=measured.get("syncs_per_layer"))
        if syncs_per_token is not None or "syncs_per_layer" in measured:
            source = "--syncs-per-token" if syncs_per_token is not None else "doctor's embedded-pair runs"
            assumed.append(f"host syncs per forward: {engine.syncs_per_forward:g} + {engine.syncs_per_layer:.3g} per "
                           f"MoE layer, measured ({source})")
        assumed += list(engine.assumed)
        assumed.append("speculation: drafter depth half the target's, each layer at the target's layer time")
    constants = CostConstants(sync_ms_per_layer=sync_ms_per_layer, engine=engine)
    if measured.get("backend") == "cpu":
        assumed.append("the doctor report is from MLX's CPU backend: its sync price and counts are not a Mac's")
    for key, what in (("acceptance_rate", "acceptance"), ("forecast_recall", "prefetch recall"),
                      ("repairs_per_token", "repairs per forward")):
        if key in measured:
            assumed.append(f"{what} {measured[key]} measured by `specmoe doctor` on the embedded tiny pair, "
                           "not on this model")
    if "acceptance_rate" not in measured:
        assumed.append(f"acceptance {acceptance:.2f} per drafted token (--acceptance; not measured for this model)")
    if "forecast_recall" not in measured:
        assumed.append(f"prefetch recall {prefetch_recall:.2f} (--prefetch-recall; not measured for this model)")
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
            "bits": model.bits, "group_size": model.group_size, "quant_mode": model.quant_mode, "n_moe_layers": model.n_moe_layers,
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
        "cost_model": cost_model,
        "sync_ms_per_layer": constants.sync_ms_per_layer,
        "engine": None if engine is None else {
            "name": engine.name, "sync_us": engine.sync_us, "syncs_per_forward": engine.syncs_per_forward,
            "syncs_per_layer": engine.syncs_per_layer, "command_buffers_per_layer": engine.command_buffers_per_layer,
            "command_buffer_us": engine.command_buffer_us, "layer_us": engine.layer_us,
            "repairs_per_token": engine.repairs_per_token, "fast_synch": fast_synch,
            "partial_syncs_per_layer": engine.partial_syncs_per_layer, "routed_windows": engine.routed_windows},
        "measured_inputs": measured,
        "assumed": assumed,
        "target_tok_s": target_tok_s,
        "projections": [],
        "required_hit_rate": {},
    }
    if not memory.fits:
        return results
    if engine is not None:
        step_ms = project(model, mac, hits, constants, context_tokens=context_tokens).ms_per_token
        prefill = prefill_time(model, mac, prompt_tokens, min(1.0, memory.cache_fraction), step_ms,
                               layer_us=engine.layer_us, sync_us=engine.sync_us)
        results["prefill"] = {"prompt_tokens": prompt_tokens, "ttft_s": round(prefill.ttft_ms / 1000, 2),
                              "read_gb": _gb(prefill.read_bytes), "io_s": round(prefill.io_ms / 1000, 2),
                              "compute_s": round(prefill.compute_ms / 1000, 2),
                              "unique_experts_per_layer": round(prefill.unique_experts_per_layer, 1),
                              "kind": "projection"}
        results["max_context_tokens"] = max_context_tokens(
            model, mac, headroom_bytes=memory.headroom_bytes, drafter_bytes=memory.drafter_bytes)
        assumed += list(PREFILL_ASSUMPTIONS)
    variants = (("baseline", None, 0.0), ("prefetch", None, prefetch_recall),
                ("speculative", spec, 0.0), ("speculative + prefetch", spec, prefetch_recall))
    for label, variant_spec, recall in variants:
        projection = project(model, mac, hits, constants, context_tokens=context_tokens,
                             spec=variant_spec, prefetch_recall=recall, label=label)
        results["projections"].append(projection_json(projection))
    for label, variant_spec, recall in (variants[0], variants[3]):
        needed = required_hit_rate(target_tok_s, model, mac, constants, context_tokens=context_tokens,
                                   spec=variant_spec, prefetch_recall=recall, full_budget=hits.full_budget)
        results["required_hit_rate"][label] = None if needed is None else round(needed, 4)
    return results


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


def _opt(*flags_and_help: str) -> Any:
    *flags, help_text = flags_and_help
    return typer.Option(*flags, help=help_text)


def plan_command(
    model: Annotated[str, _opt("--model", "-m", "Preset (e.g. qwen3.5-35b-a3b) or path to a config.json.")],
    mac: Annotated[str, _opt("--mac", "Mac as CHIP-RAMgb: m4-16gb, m1pro-16gb, m3max-48gb.")],
    budget: Annotated[str, _opt("--budget", "-b", BUDGET_HELP)] = DEFAULT_BUDGET,
    bits: Annotated[
        Optional[int], _opt("--bits", "Weight bits (mlx affine); 16 = unquantized. Default: the config's, else 4.")
    ] = None,
    group_size: Annotated[
        Optional[int], _opt("--group-size", "Quantization group size. Default: the config's, else 64.")
    ] = None,
    quant_mode: Annotated[
        Optional[str], _opt("--quant-mode", "affine, mxfp4, nvfp4 or mxfp8 (e.g. gpt-oss ships MXFP4 experts). "
                            "Default: the config's, else affine.")
    ] = None,
    top_k: Annotated[Optional[int], _opt("--experts-per-tok", "Experts per token (default: the model's).")] = None,
    context: Annotated[int, _opt("--context", "Context length in tokens for the KV bytes.")] = 4096,
    ssd_gb: Annotated[Optional[int], _opt("--ssd-gb", "Internal SSD size in GB (256 GB reads slower).")] = None,
    wired_limit_mb: Annotated[Optional[int], _opt("--wired-limit-mb", "As `sysctl iogpu.wired_limit_mb`.")] = None,
    headroom_gb: Annotated[Optional[float], _opt("--headroom-gb", "Headroom (default: runtime rule).")] = None,
    hit_rate: Annotated[Optional[float], _opt("--hit-rate", "Expert-cache hit rate (default: prior).")] = None,
    page_cache: Annotated[bool, _opt("--page-cache/--no-page-cache", "Leftover RAM as a page-cache tier.")] = False,
    target_tok_s: Annotated[float, _opt("--target-tok-s", "Speed to solve the needed hit rate for.")] = 10.0,
    draft_len: Annotated[int, _opt("--num-draft", "-k", "Drafted tokens per speculative round (K).")] = DEFAULT_NUM_DRAFT,
    acceptance: Annotated[float, _opt("--acceptance", "Per-token draft acceptance rate.")] = 0.75,
    drafter_gb: Annotated[float, _opt("--drafter-gb", "Drafter weights in GB.")] = 0.3,
    overlap_scale: Annotated[float, _opt("--overlap-scale", "Measured/uniform unique experts.")] = 1.0,
    prefetch_recall: Annotated[float, _opt("--prefetch-recall", "Share of misses prefetched.")] = 0.5,
    sync_ms_per_layer: Annotated[
        float, _opt("--sync-ms-per-layer", "v1 only: per-layer overhead (default: fitted).")
    ] = DEFAULT_SYNC_MS_PER_LAYER,
    cost_model: Annotated[str, _opt("--cost-model", "v2 (syncs, buffers, repairs from the code) or v1.")] = "v2",
    fast_synch: Annotated[bool, _opt("--fast-synch/--no-fast-synch", "Price syncs with MLX_METAL_FAST_SYNCH.")] = False,
    repairs_per_token: Annotated[
        Optional[float], _opt("--repairs-per-token", "Measured repairs per forward (default: expected).")
    ] = None,
    syncs_per_token: Annotated[
        Optional[float], _opt("--syncs-per-token", "Measured host syncs per token (default: the code's count).")
    ] = None,
    from_doctor: Annotated[
        Optional[Path], _opt("--from-doctor", "Use what `specmoe doctor --json` measured on the Mac.")
    ] = None,
    prompt_tokens: Annotated[int, _opt("--prompt-tokens", "Prompt length for the time to first token.")] = 1000,
    json_path: Annotated[Optional[Path], _opt("--json", "Also write the results as JSON to this path.")] = None,
) -> None:
    """Will MODEL fit on MAC, and how fast would it decode? (memory breakdown + projected tok/s)"""
    try:
        results = build_plan(
            model_ref=model, mac_name=mac, budget_text=budget, bits=bits, group_size=group_size,
            quant_mode=quant_mode, top_k=top_k,
            context_tokens=context, ssd_gb=ssd_gb, wired_limit_mb=wired_limit_mb, headroom_gb=headroom_gb,
            hit_rate=hit_rate, page_cache=page_cache, target_tok_s=target_tok_s, draft_len=draft_len,
            acceptance=acceptance, drafter_gb=drafter_gb, overlap_scale=overlap_scale,
            prefetch_recall=prefetch_recall, sync_ms_per_layer=sync_ms_per_layer, cost_model=cost_model,
            fast_synch=fast_synch, repairs_per_token=repairs_per_token, prompt_tokens=prompt_tokens,
            syncs_per_token=syncs_per_token,
            measured=measured_from_doctor(from_doctor) if from_doctor is not None else None,
        )
        if json_path is not None:
            _write_json(json_path, results)
    except (ValueError, OSError) as error:
        typer.echo(error_line(error), err=True)
        # SystemExit, not typer.Exit: click in standalone_mode=False *returns* an Exit's code,
        # which a caller may drop; SystemExit reaches every caller as exit code 2.
        raise SystemExit(2) from None
    render_plan(results, Console())


def register(app: typer.Typer) -> None:
    """Add the `plan` command to the project's typer app."""
    app.command("plan")(plan_command)
