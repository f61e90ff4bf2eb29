"""The numbers a run reports, one shape for plain and speculative decoding (Python API and `--json`).

`RunStats` is what every `stream_generate` response carries: the run so far, split into two phases
measured the same way for every decoder, as mlx-lm splits prompt and generation time:

- prefill: from the call to the first emitted token (the prompt's forwards, a warm start's reads,
  and with a drafter the first verify round, which emits the first token);
- decode: from the first emitted token to the latest one (`tokens` = emitted tokens - 1).

Each phase counts the expert cache's lookups (hits, demand misses), the reads prefetches made,
every byte read from disk (demand + prefetch) and the host syncs of the target's forwards, as
deltas of the engine's running totals (`Totals`, what `Engine.totals()` returns). The top-level
rates (`tokens_per_s`, `hit_rate`, `host_syncs_per_token`, ...) are the decode phase's: prefill
never enters them; the top-level counts (`bytes_read`, `misses`) are the whole call's. `speculative` holds the drafter's part (None when decoding plainly).

Invariants: phases never overlap and their sums are the call's totals; a rate with nothing under
it is 0.0 (a hit rate with no lookups is 1.0); every field is JSON-ready through `to_json()`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import mlx.core as mx

__all__ = ["Totals", "PhaseStats", "SpeculativeStats", "RunStats", "RunMeter"]


@dataclass(frozen=True)
class Totals:
    """Running totals of an engine since it was loaded (`Engine.totals()`); counts only grow."""

    hits: int  # expert lookups found resident (per MoE call: its distinct experts)
    misses: int  # lookups that read the expert from disk on demand
    evictions: int  # experts evicted to make room
    prefetch_reads: int  # experts read ahead of use because a forecast named them (the drafter's, with a drafter)
    prefetch_used: int  # of those, experts a call then used
    prefetch_wasted: int  # prefetched experts evicted unused, or cancelled before their read
    bytes_read: int  # bytes read from disk: demand and prefetch reads
    load_wait_ms: float  # time forwards waited for demand reads
    host_syncs: int  # host syncs (CPU<->GPU crossings) the target's forwards made
    usable_slots: int  # expert slots usable now, over all MoE layers (a level, not a count)

    @classmethod
    def of(cls, om) -> "Totals":
        """The totals of an OffloadedModel (runtime.decode) now."""
        c = om.counters()
        return cls(hits=int(c["hits"]), misses=int(c["misses"]), evictions=int(c["evictions"]),
                   prefetch_reads=int(c["prefetch_loaded"]), prefetch_used=int(c["prefetch_hits"]),
                   prefetch_wasted=int(c["prefetch_wasted"] + c["prefetch_cancelled"]),
                   bytes_read=int(c["bytes_read"]), load_wait_ms=float(c["load_wait_ms"]),
                   host_syncs=int(om.cache.host_syncs), usable_slots=int(om.cache.total_usable_slots()))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PhaseStats:
    """One phase of a run (prefill or decode)."""

    tokens: int  # prefill: prompt tokens processed (a prompt cache's reused ones excluded); decode: tokens after the first
    seconds: float  # wall time of the phase
    tokens_per_s: float  # tokens / seconds
    hit_rate: float  # lookups found resident / all lookups (1.0 when there were none)
    misses: int  # experts read on demand
    prefetch_reads: int  # experts read because a forecast named them
    bytes_read: int  # bytes read from disk, demand + prefetch
    host_syncs: int  # host syncs of the target's forwards

    @classmethod
    def between(cls, a: Totals, b: Totals, tokens: int, seconds: float) -> "PhaseStats":
        hits, misses = b.hits - a.hits, b.misses - a.misses
        return cls(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds if tokens and seconds > 0 else 0.0,
                   hit_rate=hits / (hits + misses) if hits + misses else 1.0, misses=misses,
                   prefetch_reads=b.prefetch_reads - a.prefetch_reads, bytes_read=b.bytes_read - a.bytes_read,
                   host_syncs=b.host_syncs - a.host_syncs)

    def per_token(self, value: float) -> float:
        return value / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class SpeculativeStats:
    """The drafter's part of a speculative run (the whole call so far)."""

    rounds: int  # verify passes
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens the target accepted
    plain_rounds: int  # rounds with no draft (adaptive K fell back to plain decoding)
    tokens_per_verify: float  # tokens emitted per verify pass
    mean_k: float  # draft tokens proposed per round
    cutoff: int  # MoE layers whose forecast experts are prefetched (the MoE layer count: all; 0: none)
    forecast_recall: float  # experts verify used that the forecast had named, over the prefetched layers

    @classmethod
    def of(cls, spec, n_emitted: int) -> "SpeculativeStats":
        """From a runtime.decode.SpecStats while it runs (its token count is booked when the stream ends)."""
        layers = spec.prefetch_layers or None
        return cls(rounds=spec.n_rounds, drafted=spec.n_drafted, accepted=spec.n_accepted,
                   plain_rounds=spec.n_plain_rounds, tokens_per_verify=n_emitted / spec.n_rounds if spec.n_rounds else 0.0,
                   mean_k=spec.mean_k,
                   cutoff=len(spec.prefetch_layers), forecast_recall=spec.recall(layers) if layers else 0.0)


@dataclass(frozen=True)
class RunStats:
    """The run so far: top-level rates decode-only, top-level counts the whole call's (module docstring)."""

    prompt_tokens: int  # tokens in the prompt
    generation_tokens: int  # tokens emitted so far
    acceptance: float | None  # accepted / drafted tokens (speculative), None when plain
    peak_memory_gb: float  # MLX allocator peak since the call started, GB
    prefill: PhaseStats  # the call up to the first emitted token
    decode: PhaseStats  # from the first emitted token on
    speculative: SpeculativeStats | None = None  # the drafter's part; None when plain

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens/s: tokens after the first / time since the first."""
        return self.decode.tokens_per_s

    generation_tps = tokens_per_s  # mlx-lm's name

    @property
    def prompt_tps(self) -> float:
        """Prefill tokens/s (mlx-lm's name)."""
        return self.prefill.tokens_per_s

    @property
    def hit_rate(self) -> float:
        return self.decode.hit_rate

    @property
    def misses_per_token(self) -> float:
        return self.decode.per_token(self.decode.misses)

    @property
    def prefetch_reads_per_token(self) -> float:
        return self.decode.per_token(self.decode.prefetch_reads)

    @property
    def mb_read_per_token(self) -> float:
        return self.decode.per_token(self.decode.bytes_read / 1e6)

    @property
    def host_syncs_per_token(self) -> float:
        """1.0 is stock mlx-lm's: one read-back of the sampled token per decode step."""
        return self.decode.per_token(self.decode.host_syncs)

    @property
    def bytes_read(self) -> int:
        """The whole call's bytes read: prefill + decode, demand + prefetch."""
        return self.prefill.bytes_read + self.decode.bytes_read

    @property
    def misses(self) -> int:
        """The whole call's demand reads: prefill + decode."""
        return self.prefill.misses + self.decode.misses

    RATES = ("tokens_per_s", "generation_tps", "prompt_tps", "hit_rate", "misses_per_token",
             "prefetch_reads_per_token", "mb_read_per_token", "host_syncs_per_token", "bytes_read", "misses")

    def to_json(self) -> dict:
        """Every field and rate: the `stats` object of `specmoe generate --json` (docs/json.md)."""
        return {**{k: getattr(self, k) for k in self.RATES}, **asdict(self)}

    def line(self) -> str:
        return (f"{self.tokens_per_s:.1f} tok/s | hit rate {self.hit_rate:.1%} | "
                f"{self.misses_per_token:.2f} misses/token | {self.mb_read_per_token:.3f} MB read/token | "
                f"{self.host_syncs_per_token:.2f} host syncs/token | prompt {self.prompt_tokens} tok "
                f"({self.prompt_tps:.0f} tok/s), generated {self.generation_tokens} tok")


class RunMeter:
    """Builds each response's RunStats from the engine's totals: start(), then one stats() per token."""

    def __init__(self, om, n_prompt: int, prompt_cache=None):
        self.om = om  # runtime.decode.OffloadedModel
        self.n_prompt = n_prompt  # tokens in the prompt
        self.prompt_cache = prompt_cache  # a runtime.decode.PromptCache: its reused tokens are not prefilled
        self.n_prefilled = n_prompt  # prompt tokens this call processed (known at the first token)
        self.t0 = self.t_first = 0.0
        self.c0 = self.c_first = None

    def start(self) -> "RunMeter":
        mx.reset_peak_memory()
        self.c0, self.t0 = Totals.of(self.om), time.perf_counter()
        return self

    def stats(self, n_emitted: int, spec=None) -> RunStats:
        """Stats after the `n_emitted`-th token; `spec` is the decoder's live SpecStats (None: plain).
        Call it as soon as the token arrives, before asking for the next."""
        now, c = time.perf_counter(), Totals.of(self.om)
        if self.c_first is None:
            self.c_first, self.t_first = c, now
            self.n_prefilled = self.n_prompt - (self.prompt_cache.reused if self.prompt_cache is not None else 0)
        acceptance = None if spec is None else (spec.n_accepted / spec.n_drafted if spec.n_drafted else 0.0)
        return RunStats(
            prompt_tokens=self.n_prompt, generation_tokens=n_emitted, acceptance=acceptance,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            prefill=PhaseStats.between(self.c0, self.c_first, self.n_prefilled, self.t_first - self.t0),
            decode=PhaseStats.between(self.c_first, c, n_emitted - 1, now - self.t_first),
            speculative=None if spec is None else SpeculativeStats.of(spec, n_emitted))
