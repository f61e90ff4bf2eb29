"""Running a profiling workload and turning its telemetry into a report.

The workload: each prompt is one sequence. With max_tokens == 0 the prompt is
only read (teacher-forced routing on real text, the fixture the routing notes
recommend); otherwise the model generates, plainly or speculatively (--draft).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
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


def run_workload(om, prompts: list[str], *, max_tokens: int, draft=None, num_draft: int = 4, predictor: str = "spmoe",
                 chunk: int = 512, progress=None) -> dict:
    """Run every prompt; returns speculative stats summed over prompts (empty without --draft)."""
    tel = om.telemetry
    spec_totals = {"n_rounds": 0, "n_drafted": 0, "n_accepted": 0, "n_tokens": 0}
    for prompt in prompts:
        tel.new_sequence()
        ids = list(om.tokenizer.encode(prompt))
        if max_tokens == 0:
            cache = make_prompt_cache(om.model)
            for i in range(0, len(ids), chunk):
                om.label_round("prefill")
                mx.eval(om.model(mx.array(ids[i : i + chunk])[None], cache=cache))
        elif draft is None:
            from runtime.decode import generate_tokens  # decode reports to observe: import at use, no cycle

            generate_tokens(om.model, ids, max_tokens=max_tokens, om=om)
        else:
            from runtime.decode import run_speculative

            _, stats, _ = run_speculative(om, draft, ids, max_tokens=max_tokens, num_draft=num_draft,
                                          predictor=predictor, cutoff=None)
            for k in spec_totals:
                spec_totals[k] += getattr(stats, k)
        om.end_round()
        if progress:
            progress(1)
    return spec_totals if draft is not None and max_tokens else {}


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
