"""The profiling workload (`specmoe profile --model`): every prompt through the paged model.

Each prompt is one sequence of the telemetry. With max_tokens == 0 the prompt is only read
(teacher-forced routing on real text, the fixture the routing notes recommend); otherwise the
model generates, plainly or speculatively (with a drafter). The analysis of what it recorded is
runtime.observe's (`trace_of`, `analyse`).

Invariants: every prompt ends its telemetry round; speculative totals are summed over prompts
and are empty for plain or prefill-only runs.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from runtime.decode import generate_tokens, run_speculative

__all__ = ["run_workload"]


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
            generate_tokens(om.model, ids, max_tokens=max_tokens, om=om)
        else:
            _, stats, _ = run_speculative(om, draft, ids, max_tokens=max_tokens, num_draft=num_draft,
                                          predictor=predictor, cutoff=None)
            for k in spec_totals:
                spec_totals[k] += getattr(stats, k)
        om.end_round()
        if progress:
            progress(1)
    return spec_totals if draft is not None and max_tokens else {}
