"""Turning a profiling workload's telemetry into a report: its prompts, its routing trace, the analysis.

The workload itself decodes, so it runs above the decoder (runtime/tune/profile_run.py); this
module only reads what telemetry recorded. Invariant: analysing a trace never changes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.observe.analysis import layer_report
from runtime.observe.routing_math import saturation_threshold
from runtime.observe.trace import RoutingTrace


def read_prompts(path: Path) -> list[str]:
    try:
        prompts = [l.strip() for l in Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]
    except FileNotFoundError:
        raise ValueError(f"--prompts {path}: file not found") from None
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {path}: not UTF-8 text; expected one prompt per line") from None
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts (expected one prompt per line)")
    return prompts


def trace_of(om) -> RoutingTrace:
    return RoutingTrace(om.model_id(), om.telemetry.trace_sequences())


def analyse(trace: RoutingTrace, window: int) -> dict:
    """Per-layer statistics plus a summary averaged over layers."""
    n, k = trace.n_experts, trace.top_k
    layers = {}
    for i, layer in enumerate(trace.moe_layers):
        seqs = [s for s in trace.layer(i) if len(s)]
        if seqs:
            layers[layer] = layer_report(seqs, n, windows=range(1, max(9, window + 1)), rng=np.random.default_rng(i))
    def avg(f):
        vals = [f(r) for r in layers.values()]
        return float(np.nanmean(vals)) if vals else float("nan")
    summary = {
        "tokens": trace.n_tokens, "sequences": len(trace.sequences), "n_experts": n, "top_k": k,
        "overlap": {d: avg(lambda r, d=d: r["overlap"][d]) for d in range(1, 9)},
        "overlap_shuffled": {d: avg(lambda r, d=d: r["overlap_shuffled"][d]) for d in range(1, 9)},
        "overlap_independent": avg(lambda r: r["overlap_independent"]),
        "overlap_uniform": k / n,
        "unique": {t: avg(lambda r, t=t: r["unique"][t]) for t in range(1, 9)},
        "unique_independent": {t: avg(lambda r, t=t: r["unique_independent"][t]) for t in range(1, 9)},
        "unique_uniform": {t: avg(lambda r, t=t: r["unique_uniform"][t]) for t in range(1, 9)},
        "saturation_threshold_tokens": saturation_threshold(k, n, 0.95),
        "window": window,
    }
    return {"model": trace.model, "summary": summary, "layers": layers}
