"""The doctor's report as pasteable text (markdown tables), rendered from the results dict only.

Invariant: every figure printed is in the dict (`--json` writes the same dict); projections are
labelled as such; every skipped check is listed with its reason.
"""

from __future__ import annotations

__all__ = ["render_report"]


def _gb(n: int | None) -> str:
    return "?" if not n else f"{n / 1e9:.1f} GB"


def _error(value) -> str | None:
    return value.get("error") if isinstance(value, dict) else None


def render_report(r: dict) -> str:
    lines = [f"## specmoe doctor (v{r['doctor_version']}{', quick' if r['quick'] else ''}, {r['elapsed_s']} s)", ""]
    m, mlx = r.get("machine") or {}, r.get("mlx") or {}
    if _error(m):
        lines.append(f"machine: {m['error']}")
    else:
        wired = f", wired limit {m['wired_limit_mb']} MB" if m.get("wired_limit_mb") else ""
        lines.append(f"- machine: {m.get('chip') or '?'} ({m.get('cpu_cores')} CPUs), {_gb(m.get('ram_bytes'))} RAM, "
                     f"GPU working set {_gb(m.get('gpu_working_set_bytes')) if m.get('gpu_working_set_bytes') else 'n/a'}"
                     f"{wired}; {m.get('os')}")
        # ssd_model is the drive's product name; "model" alone would read as the LLM
        disk = m.get("ssd_model") or "name unknown (the drive did not report one)"
        lines.append(f"- disk: {disk}, {_gb(m.get('ssd_size_bytes'))}")
    lines.append(f"- MLX {mlx.get('mlx_version')} ({mlx.get('backend')} backend), mlx-lm {mlx.get('mlx_lm_version')}")
    sc = r.get("selfcheck") or {}
    lines.append(f"- selfcheck: {sc.get('status', sc.get('error'))} (kernel: {sc.get('kernel', '-')})")
    sync = r.get("host_sync") or {}
    if _error(sync):
        lines.append(f"- host sync: {sync['error']}")
    else:
        d, f = sync.get("default", {}), sync.get("fast_synch", {})
        pays = sync.get("fast_synch_pays")
        metal = (r.get("mlx") or {}).get("backend") == "metal"
        verdict = ("pays" if pays else "does not pay" if pays is False
                   else "CPU backend: the variable changes nothing, the difference is noise" if not metal
                   else "not measured")
        lines.append(f"- host sync: {d.get('sync_us', d.get('error'))} us with MLX_METAL_FAST_SYNCH=0 "
                     f"({'default fence' if metal else 'CPU stream'}), {f.get('sync_us', f.get('error'))} us with "
                     f"=1 ({verdict})")
    ssd = r.get("ssd") or {}
    if _error(ssd):
        lines.append(f"- SSD: {ssd['error']}")
    else:
        depth = ssd.get("depths", {})
        lines.append(f"- cold SSD reads of {ssd.get('record_bytes', 0) / 1e6:.2f} MB ({ssd.get('cache_bypass')}, fresh "
                     f"{ssd.get('file_bytes', 0) / 1e6:.0f} MB file): QD1 {depth.get('1', {}).get('gbps')} GB/s "
                     f"({depth.get('1', {}).get('ms_per_read')} ms/read), QD4 {depth.get('4', {}).get('gbps')} GB/s; "
                     f"hot page cache {ssd.get('hot_gbps')} GB/s")
    rates = r.get("rates") or {}
    if rates and not _error(rates):
        lines.append(f"- memory copy {rates['mem_copy_gbps']} GB/s, float32 matmul {rates['matmul_gflops']} GFLOP/s")
    decode = r.get("decode")
    if isinstance(decode, list) and decode:
        projected = {(p["budget"], p["mode"]): p["projected_tok_s"]
                     for p in (r.get("projection") or {}).get("rows", [])}
        lines += ["", "Decoding on the embedded pair (greedy; hit rate includes the prompt; vs stock: over stock "
                  "mlx-lm running the same target resident, one pair per budget, noisy):", "",
                  "| budget | mode | tok/s | vs stock | projected tok/s | hit rate | host syncs/token | "
                  "repairs/token | acceptance | recall | tokens = first run | tokens = stock |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in decode:
            if "error" in row:
                lines.append(f"| {row['budget']} | {row['mode']} | error: {row['error']} | | | | | | | | | |")
                continue
            match = row.get("tokens_match_stock")
            lines.append(
                f"| {row['budget']} | {row['mode']} | {row['tokens_per_s']:.1f} | {row.get('vs_stock', '-')} | "
                f"{projected.get((row['budget'], row['mode']), '-')} | {row['hit_rate']:.2f} | "
                f"{row['syncs_per_token']:.2f} | {row['repairs_per_token']:.3f} | {row.get('acceptance', '-')} | "
                f"{row.get('forecast_recall', '-')} | {'yes' if row['tokens_match_first_run'] else 'NO'} | "
                f"{'-' if match is None else 'yes' if match else 'NO'} |")
        stock_error = next((row["stock_error"] for row in decode if "stock_error" in row), None)
        if stock_error:
            lines.append(f"\nstock mlx-lm could not run the target: {stock_error}")
        how = {row.get("sync_counts") for row in decode if "sync_counts" in row}
        lines.append(f"\nhost syncs and repairs: {', '.join(sorted(how))}; projected = the planner (cost model v2) fed "
                     "these measurements, a projection")
    elif _error(decode):
        lines.append(f"- decode: {decode['error']}")
    projection = r.get("projection") or {}
    if projection.get("implied_layer_us") is not None:
        lines.append(f"per-layer time implied by the plain runs: {projection['implied_layer_us']} us "
                     f"(the planner's Mac-fitted value is used above)")
    inputs = r.get("planner_inputs") or {}
    lines.append("planner inputs (`specmoe plan --from-doctor`): "
                 + ", ".join(f"{k} {v}" for k, v in inputs.items() if k != "note"))
    settings = r.get("mac_settings") or []
    if settings:
        lines += ["", "Mac settings the engine applies here (switch: SPECMOE_MAC_SETTINGS):"]
        lines += [f"- {s['name']}: {'apply ' + s['action'] if s['apply'] else 'not applied'} ({s['reason']})"
                  for s in settings]
    if r.get("skipped"):
        lines += ["", "Skipped:"] + [f"- {reason}" for reason in r["skipped"]]
    timings = r.get("timings_s") or {}
    lines.append("\ntimings (s): " + ", ".join(f"{k} {v}" for k, v in timings.items()))
    return "\n".join(lines)
