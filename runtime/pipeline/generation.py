"""Plain generation through the pipeline (rank 0): prefill, then one window per token.

Mirrors mlx-lm's generate_step (`plain_stream` yields the tokens; `generate_plain` collects them): the prompt but its last token is prefilled in chunks
of `prefill_step` tokens, then each step runs one token and samples from the
log-probabilities of the last position with mlx-lm's sampler. So greedy tokens equal
stock mlx-lm's in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from runtime.decode import WindowReads

PREFILL_STEP = 2048  # mlx-lm's generate_step default


@dataclass
class PipelineStats:
    n_ranks: int  # pipeline ranks
    n_prompt_tokens: int  # tokens in the prompt
    n_tokens: int  # tokens generated
    prefill_s: float  # plain: time to the first generated token; speculative: time of the prefill
    decode_s: float  # plain: time for the tokens after the first; speculative: time of all rounds
    tokens_per_s: float  # plain: tokens after the first / decode_s (as GenerationStats); speculative: tokens / decode_s (as SpecStats)
    n_windows: int = 0  # windows rank 0 sent through the chain (decode steps or verify rounds, plus prefill chunks)
    n_drafted: int = 0  # speculative: draft tokens proposed
    n_accepted: int = 0  # speculative: draft tokens accepted
    n_rounds: int = 0  # speculative: verify windows
    n_plain_rounds: int = 0  # speculative: rounds with K = 0 (adaptive K fell back to plain decoding)
    ranks: list = field(default_factory=list)  # per rank: layers, memory, cache counters, channel and compute time

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def window_reads(self) -> WindowReads | None:
        """Every rank's verify-window reads summed (each rank counts the same windows in its own layers), or None
        before the ranks reported (runtime/decode/window_reads.py)."""
        rows = [r["counters"]["window_reads"] for r in self.ranks if "window_reads" in r.get("counters", {})]
        return WindowReads.summed(rows) if rows else None

    def line(self) -> str:
        parts = [f"{self.tokens_per_s:.1f} tok/s over {self.n_ranks} ranks"]
        if self.n_rounds:
            parts.append(f"acceptance {self.acceptance:.0%}, {self.n_tokens / self.n_rounds:.2f} tokens/verify, "
                         f"mean K {self.n_drafted / self.n_rounds:.2f}")
            reads = self.window_reads
            if reads is not None and reads.total:
                parts.append(reads.line() + " (all ranks)")
        for r in self.ranks:
            c = r["counters"]
            hr = c["hits"] / max(1, c["hits"] + c["misses"])
            parts.append(f"rank {r['rank']} layers {r['layers'][0]}-{r['layers'][1]}: resident {r['resident_bytes'] / 1e6:.1f} MB "
                         f"+ cache {r['cache_bytes'] / 1e6:.1f} MB, hit rate {hr:.0%}, "
                         f"prefetch used {c['prefetch_hits']}, sent {r['channel']['bytes_sent'] / 1e3:.0f} KB"
                         + "".join(f", {v['host_syncs'] / v['windows']:.2f} host syncs/{kind}"
                                   for kind, v in c.get("host_syncs", {}).items() if kind in ("step", "verify") and v["windows"]))
        return " | ".join(parts)

    def to_json(self) -> dict:
        reads = self.window_reads
        return {**asdict(self), "acceptance": self.acceptance, "window_reads": reads.to_json() if reads else None}


def plain_stream(driver, prompt_ids: list[int], *, max_tokens: int, sampler=None, eos_ids=(), prefill_step: int = PREFILL_STEP,
                 stats: PipelineStats | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` tokens after `prompt_ids` (one window per token). The driver's caches
    may already hold a prefix of `prompt_ids` (serve: driver.reset(keep)); only the rest is fed.
    `stats` (optional) is filled in once the generator is exhausted or closed."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}; expected >= 1")
    if not prompt_ids:
        raise ValueError("the prompt is empty after tokenization; expected at least one token")
    sampler = sampler or make_sampler(temp=0.0)
    t0, w0 = time.perf_counter(), driver.timer.n_windows
    held = len(driver.tokens)
    if held >= len(prompt_ids) or driver.tokens != prompt_ids[:held]:
        raise ValueError(f"rank 0: the caches hold {held} tokens that are not a proper prefix of the prompt")
    driver.prefill(prompt_ids[held:-1], prefill_step)
    y, n, t_first = prompt_ids[-1], 0, None
    try:
        while n < max_tokens:
            logits = driver.window([y])[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            y = int(sampler(logprobs).item())
            if t_first is None:
                t_first = time.perf_counter()
            n += 1
            yield y
            if y in eos_ids:
                break
    finally:
        if stats is not None:
            t_end = time.perf_counter()
            t_first = t_first or t_end
            stats.n_ranks, stats.n_prompt_tokens, stats.n_tokens = driver.ch.size, len(prompt_ids), n
            stats.prefill_s, stats.decode_s = t_first - t0, t_end - t_first
            stats.tokens_per_s = (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0
            stats.n_windows = driver.timer.n_windows - w0


def generate_plain(driver, prompt_ids: list[int], *, max_tokens: int, temp: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, min_p: float = 0.0, eos_ids=(), on_token=None,
                   prefill_step: int = PREFILL_STEP) -> tuple[list[int], PipelineStats]:
    stats = PipelineStats(driver.ch.size, len(prompt_ids), 0, 0.0, 0.0, 0.0)
    tokens = []
    sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    for y in plain_stream(driver, prompt_ids, max_tokens=max_tokens, sampler=sampler, eos_ids=eos_ids,
                          prefill_step=prefill_step, stats=stats):
        tokens.append(y)
        if on_token:
            on_token(y)
    return tokens, stats
