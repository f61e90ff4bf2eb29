"""The planner's projection for this machine and the embedded model, beside what doctor measured.

The planner (cost model v2) is fed what doctor measured here: memory copy bandwidth, cold SSD and
hot page-cache reads, a float32 matmul rate as the compute rate, the host-sync price, each run's
hit rate and syncs and repairs per token. The one constant it cannot measure here is the fitted
per-layer time (from published Mac runs); doctor therefore also reports the per-layer time the
plain runs IMPLY (their measured ms/token minus every other projected term, over the MoE layers),
which is the figure a Mac's doctor output lets the planner refit.

Invariants: every projected figure is labelled a projection; the assumptions are listed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

__all__ = ["machine_rates", "project_rows"]


def machine_rates(quick: bool) -> dict:
    """Memory copy GB/s (numpy, read + written) and float32 matmul GFLOP/s (MLX default device)."""
    import mlx.core as mx
    import numpy as np

    nbytes = (64 if quick else 256) << 20
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(3 if quick else 5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    n = 512 if quick else 1024
    a = mx.random.normal((n, n))
    mx.eval(a)
    mx.eval(a @ a)
    t0 = time.perf_counter()
    reps = 4
    for _ in range(reps):
        mx.eval(a @ a)
    gflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
    return {"mem_copy_gbps": round(2 * nbytes / best / 1e9, 2), "matmul_gflops": round(gflops, 2)}


def project_rows(decode: list[dict], rates: dict, ssd: dict, sync_us: float, ram_bytes: int) -> dict:
    """Projected tok/s for each measured decode row, and the per-layer time the plain rows imply."""
    from runtime.checkpoints import embedded_pair
    from runtime.plan import CostConstants, HitRates, SpecAssumptions, config_quantization, forward_time
    from runtime.plan import measured_profile, model_costs
    from runtime.plan import project, specmoe_engine

    pair = embedded_pair()
    config = json.loads((Path(pair.target) / "config.json").read_text())
    bits, group_size, mode = config_quantization(config) or (4, 64, "affine")
    model = model_costs(config, bits=bits, group_size=group_size, mode=mode, name="embedded target")
    depth4 = ssd.get("depths", {}).get("4", {}).get("gbps") or 1.0
    mac = measured_profile("this machine", ram_bytes=ram_bytes, mem_bandwidth_gbps=rates["mem_copy_gbps"],
                           ssd_read_gbps=depth4, page_cache_read_gbps=ssd.get("hot_gbps") or depth4,
                           gpu_tflops=rates["matmul_gflops"] / 1000)
    rows, implied = [], []
    for row in decode:
        if "error" in row:
            continue
        # The embedded pair's files are hot: its misses are served by the page cache.
        hits = HitRates(row["hit_rate"], 1.0 - row["hit_rate"], "measured")
        repairs = row["repairs_per_token"]
        engine = specmoe_engine(repairs_per_token=repairs).with_measured(
            sync_us=sync_us, syncs_per_token=row["syncs_per_token"], repairs_per_token=repairs)
        constants = CostConstants(engine=engine)
        spec = None
        if row["mode"] == "speculative":
            spec = SpecAssumptions(draft_len=3, acceptance_rate=min(0.999, row["acceptance"]),
                                   drafter_bytes=_drafter_bytes(pair.default_drafter))
        projection = project(model, mac, hits, constants, context_tokens=64, spec=spec,
                             prefetch_recall=row.get("forecast_recall", 0.0) if spec else 0.0)
        rows.append({"budget": row["budget"], "mode": row["mode"], "measured_tok_s": row["tokens_per_s"],
                     "projected_tok_s": round(projection.tok_per_s, 2), "kind": "projection"})
        if spec is None and row["tokens_per_s"] > 0:
            step = forward_time(model, mac, hits, constants, context_tokens=64)
            # layer time enters once per forward and half again per repair (its re-run)
            weight = model.n_moe_layers * (1 + engine.repair_fraction * step.repairs)
            other_ms = step.total_ms - weight * engine.layer_us / 1000
            implied.append(max(0.0, (1000.0 / row["tokens_per_s"] - other_ms) / weight * 1000))
    return {"model": {"name": "embedded target", "n_moe_layers": model.n_moe_layers,
                      "expert_bytes": model.expert_bytes, "resident_bytes": model.resident_bytes},
            "profile": {"mem_bandwidth_gbps": mac.mem_bandwidth_gbps, "ssd_read_gbps": mac.ssd_read_gbps,
                        "page_cache_read_gbps": mac.page_cache_read_gbps, "compute_gflops": rates["matmul_gflops"]},
            "rows": rows,
            "implied_layer_us": round(sorted(implied)[len(implied) // 2], 1) if implied else None,
            "assumed": ["per-layer time: fitted to published Mac runs (does not transfer to the CPU backend)",
                        "compute rate: a float32 matmul, not the quantized kernels decode runs",
                        "misses served by the page cache (the embedded files are hot)"]}


def _drafter_bytes(path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
