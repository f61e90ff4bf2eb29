"""Measuring settings for sweeps and the tuner: real runs, same prompts, fresh caches.

Each (setting, prompt) run starts from an empty expert cache (a fresh
OffloadedModel), so no setting inherits another's warm cache; the drafter is
loaded once. tok/s is the median over prompts of decode throughput.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from runtime.decode import load_drafter
from runtime.decode import OffloadConfig, OffloadedModel
from runtime.decode import run_speculative
from runtime.tune.tuner import Measurement, Setting


@dataclass
class Workload:
    model: Path  # target checkpoint or store
    draft: Path  # drafter directory
    budget: str  # --budget
    prompts: list[str]  # one sequence each
    max_tokens: int  # tokens generated per prompt
    io_mode: str = "buffered"  # loader I/O mode
    threads: int = 4  # loader threads
    inject: str = ""  # storage fault/latency injection (storage/faults.py), e.g. "slow:ms=1": EMULATED read latency


class SettingRunner:
    def __init__(self, work: Workload):
        self.work = work
        probe = OffloadedModel.load(work.model, OffloadConfig(budget=work.budget))
        try:
            self.draft_model, self.draft_config = load_drafter(work.draft, probe)
            self.n_moe_layers = len(probe.moe_layers)
            self.top_k = probe.top_k
            self.expert_bytes = probe.store.layout(probe.moe_layers[0]).expert_bytes
            self.slots_per_layer = min(probe.plan.slots.values())
            self.model_id = probe.model_id()
        finally:
            probe.close()

    def measure(self, s: Setting) -> tuple[Measurement, dict]:
        """Run every prompt with setting `s`; returns the measurement and raw timing facts."""
        w = self.work
        tps, misses, tokens, used, wasted, recall, acc = [], 0, 0, 0, 0, [], []
        facts = {"draft_ms_per_round": [], "load_ms_per_expert": [], "verify_ms_per_round": []}
        for prompt in w.prompts:
            om = OffloadedModel.load(w.model, OffloadConfig(budget=w.budget, policy=s.policy, io_mode=w.io_mode,
                                                            threads=w.threads, inject=w.inject))
            try:
                ids = list(om.tokenizer.encode(prompt))
                _, st, layers = run_speculative(om, w.draft, ids, max_tokens=w.max_tokens, num_draft=s.num_draft,
                                                predictor=s.predictor, cutoff=s.cutoff, draft_model=self.draft_model,
                                                draft_config=self.draft_config)
                tps.append(st.n_tokens / st.decode_s if st.decode_s else 0.0)
                c = st.counters
                misses += c["misses"]
                tokens += st.n_tokens
                used += c["prefetch_hits"]
                wasted += c["prefetch_wasted"] + c["prefetch_cancelled"]
                recall.append(st.recall(layers) if layers else 0.0)
                acc.append(st.acceptance)
                facts["draft_ms_per_round"].append(st.draft_s * 1e3 / max(1, st.n_rounds))
                facts["verify_ms_per_round"].append(st.verify_s * 1e3 / max(1, st.n_rounds))
                ls = om.loader.stats
                if ls.n_requests:
                    facts["load_ms_per_expert"].append(ls.read_ms / ls.n_requests)
            finally:
                om.close()
        mb = self.expert_bytes / 1e6
        m = Measurement(s, statistics.median(tps), misses / max(1, tokens), used * mb, wasted * mb,
                        statistics.mean(recall), statistics.mean(acc))
        return m, {k: statistics.median(v) if v else 0.0 for k, v in facts.items()}
