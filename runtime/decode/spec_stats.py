"""SpecStats: what a speculative run did, round by round totals (docs/json.md documents every field).

Invariants: counts only grow during a run; n_tokens, decode_s and counters are final once the
decoder's stream is exhausted or closed; per_layer scores only rounds that made a forecast.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from runtime.decode.forecast_score import ForecastScore
from runtime.decode.prefill import PrefillStats
from runtime.decode.window_reads import WindowReads


@dataclass
class SpecStats:
    n_rounds: int = 0  # rounds: verify passes, plain rounds (K = 0, a token each) and greedy probes (a token each)
    n_drafted: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens accepted
    n_tokens: int = 0  # tokens emitted
    n_reruns: int = 0  # rounds whose rewind re-ran accepted tokens (untrimmable state)
    n_plain_rounds: int = 0  # rounds with K = 0 (adaptive K fell back to plain decoding: acceptance was low)
    n_probes: int = 0  # greedy probes after a stretch of plain rounds: one drafted token, no verify window
    draft_s: float = 0.0  # time in draft + forecast + queueing prefetch
    verify_s: float = 0.0  # time in target forwards: verify windows, plain rounds, probes (including demand loads)
    rewind_s: float = 0.0  # time restoring state and re-running accepted tokens
    one_sync_tries: int = 0  # verify forwards run as device passes (runtime/decode/device_pass.py)
    one_sync_fallbacks: int = 0  # of those, verifies that needed more than one host sync (repairs, split layers)
    host_syncs: int = 0  # host syncs of verify forwards (1 per round when the forecast covered the window)
    repairs: int = 0  # verify recomputations after absent experts
    routed_rounds: int = 0  # verifies routed: some MoE layers synced their codes before their experts (no recompute)
    settle_ms: float = 0.0  # time waiting, before verify, for the round's prefetches still in flight
    decode_s: float = 0.0  # wall time of all rounds
    prefetch_bytes_queued: int = 0  # bytes of prefetch reads queued
    window_reads: WindowReads = field(default_factory=WindowReads)  # verify reads by the window tokens that needed them
    per_layer: dict[int, ForecastScore] = field(default_factory=dict)  # forecast quality per MoE layer
    prefetch_layers: list[int] = field(default_factory=list)  # the MoE layers forecasts were prefetched for
    counters: dict[str, float] = field(default_factory=dict)  # cache/loader counter deltas over the rounds; levels (usable_slots, returns_memory) at the end
    prefill: PrefillStats | None = None  # the prompt (all tokens but the last): tokens/s, reads, bytes

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def n_verifies(self) -> int:
        """Rounds that ran a verify window (the rest were plain rounds and probes, decoded as plain decoding)."""
        return self.n_rounds - self.n_plain_rounds - self.n_probes

    @property
    def mean_k(self) -> float:
        """Draft tokens proposed per round (num_draft unless adaptive K lowered it)."""
        return self.n_drafted / self.n_rounds if self.n_rounds else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.n_tokens / self.n_rounds if self.n_rounds else 0.0

    def recall(self, layers=None) -> float:
        scores = [s for l, s in self.per_layer.items() if layers is None or l in layers]
        actual = sum(s.actual for s in scores)
        return sum(s.hits for s in scores) / actual if actual else 0.0

    def precision(self, layers=None) -> float:
        scores = [s for l, s in self.per_layer.items() if layers is None or l in layers]
        forecast = sum(s.forecast for s in scores)
        return sum(s.hits for s in scores) / forecast if forecast else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["per_layer"] = {l: {**asdict(s), "recall": s.recall, "precision": s.precision} for l, s in self.per_layer.items()}
        d.update(n_verifies=self.n_verifies, acceptance=self.acceptance, tokens_per_verify=self.tokens_per_verify, mean_k=self.mean_k,
                 recall=self.recall(), precision=self.precision(), window_reads=self.window_reads.to_json())
        return d
