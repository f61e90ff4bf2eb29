"""PrefillMeter: what processing a prompt cost -- time, reads, bytes, and reads per routed expert.

The meter watches an OffloadedModel from the start of a prompt to its first generated token:
the cache counters (reads = misses, bytes read) before and after, and, through the modules'
observer hook (chained with any observer already set), the unique experts each MoE call
routed. The least any cache can read is each call's unique experts once, so
`reads_per_unique_expert` <= 1 means no expert was read twice within a call (expert-major
prefill, runtime/cache/expert_major.py); a token-by-token split shows up as more than 1.
It also turns MoE layer calls into a progress fraction for a PrefillProgress display.

Invariants: observing never changes what the model computes; stop() restores every module's
observer as it was; stats of a stock model (om None) carry time only.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class PrefillStats:
    n_tokens: int  # prompt tokens
    seconds: float  # time to the first generated token
    tokens_per_s: float  # prompt tokens / seconds
    reads: int = 0  # experts read from disk
    bytes_read: int = 0  # bytes of those reads
    unique_experts: int = 0  # sum over MoE calls of the call's distinct experts (the least that must be read)
    unique_bytes: int = 0  # bytes of those
    reads_per_unique_expert: float = 0.0  # reads / unique_experts (<= 1: nothing read twice in a call)
    reused_tokens: int = 0  # prompt tokens a PromptCache already held (not prefilled, not in n_tokens)
    chunk_tokens: int = 0  # prompt tokens per prefill forward (0: not recorded)

    def line(self) -> str:
        s = f"prefill {self.n_tokens} tok in {self.seconds:.2f} s ({self.tokens_per_s:.0f} tok/s)"
        if self.reused_tokens:
            s += f" after {self.reused_tokens} cached"
        if self.unique_experts:
            s += (f", {self.bytes_read / 1e6:.1f} MB read ({self.reads} reads, "
                  f"{self.reads_per_unique_expert:.2f} per routed expert)")
        return s

    def to_json(self) -> dict:
        return asdict(self)


class PrefillMeter:
    def __init__(self, om, n_tokens: int, progress=None):
        self.om = om  # OffloadedModel or None (stock)
        self.n_tokens = n_tokens
        self.progress = progress  # a PrefillProgress (or anything with update(fraction) and close())
        self.processed = 0  # prompt tokens of finished chunks (generate_step's progress callback)
        self._unique = 0
        self._unique_bytes = 0
        self._saved: dict = {}
        self._t0 = self._c0 = None
        self._layer_pos = {l: i for i, l in enumerate(om.moe_layers)} if om is not None else {}

    def start(self) -> "PrefillMeter":
        self._t0 = time.perf_counter()
        if self.om is not None:
            self._c0 = self.om.counters()
            for layer, m in self.om.modules.items():
                self._saved[layer] = m.observer
                m.observer = self._observer(m.observer)
        return self

    def _observer(self, previous):
        def observe(layer: int, ids: np.ndarray) -> None:
            n = len(np.unique(ids))
            self._unique += n
            self._unique_bytes += n * self.om.store.layout(layer).expert_bytes
            if self.progress is not None:
                done = self.processed + ids.shape[0] * (self._layer_pos[layer] + 1) / len(self._layer_pos)
                self.progress.update(min(done, self.n_tokens) / max(1, self.n_tokens))
            if previous is not None:
                previous(layer, ids)
        return observe

    def on_chunk(self, processed: int, total: int) -> None:
        """mlx-lm generate_step's prompt_progress_callback."""
        self.processed = processed
        if self.progress is not None:
            self.progress.update(processed / max(1, total))

    def stop(self) -> PrefillStats:
        seconds = time.perf_counter() - self._t0
        if self.progress is not None:
            self.progress.close()
        stats = PrefillStats(self.n_tokens, seconds, self.n_tokens / seconds if seconds > 0 else 0.0)
        if self.om is not None:
            for layer, obs in self._saved.items():
                self.om.modules[layer].observer = obs
            self._saved = {}
            c1 = self.om.counters()
            stats.reads = c1["misses"] - self._c0["misses"]
            stats.bytes_read = c1["bytes_read"] - self._c0["bytes_read"]
            stats.unique_experts, stats.unique_bytes = self._unique, self._unique_bytes
            stats.reads_per_unique_expert = stats.reads / self._unique if self._unique else 0.0
        return stats
