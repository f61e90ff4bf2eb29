"""Plain (non-speculative) generation on an OffloadedModel, with the stats we report.

What the default (`one_sync="auto"`) runs, decided when the generation starts:
- the budget holds every expert of every MoE layer (usable slots >= experts): offloaded_generate_step, mlx-lm's
  generate_step (step n+1 queued with `async_eval` before token n is yielded) with each step a DevicePass forward --
  expert lookups on the device, one host sync per token as stock, repaired from the first layer that missed if the
  memory governor took an expert away meanwhile;
- otherwise: mlx-lm's own generate_step over the paged model, each MoE layer reading its routing back (one host sync
  per MoE layer and one for the token) and reading what is absent before its experts run.
Below a full budget the per-layer sync measured faster than the device pass with its route syncs and repairs, and
no slower than a plain greedy loop over the paged model (bench/results/decode_defaults.txt). `one_sync="on"`
(device passes at any budget: one sync per token plus one per repair) and "off" (the per-layer sync at any budget)
are kept for the comparison benches and the tests that drive repairs. `GenerationStats.decode_path` says which
ran, `host_syncs_per_token` what it cost. Before the prefill the cache is warmed (runtime/decode/warm.py). Prefill
and decode are reported separately because prefill misses say nothing about steady-state paging.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Generator

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from runtime.cache import DEFAULT_PREFILL_STEP
from runtime.decode.device_pass import DevicePass
from runtime.decode.offloaded_step import offloaded_generate_step
from runtime.decode.prefill import PrefillMeter, PrefillStats
from runtime.decode.warm import warm_start


@dataclass
class GenerationStats:
    n_prompt_tokens: int  # tokens in the prompt
    n_tokens: int  # tokens generated
    prefill_s: float  # time to the first generated token
    decode_s: float  # time for the remaining tokens
    tokens_per_s: float  # decode throughput (tokens after the first / decode_s)
    hit_rate: float  # decode: unique experts found resident / requested
    misses_per_token: float  # decode: experts read from disk per generated token
    mb_read_per_token: float  # decode: MB read from disk per generated token
    prefill_misses: int  # experts read during prefill
    bytes_read: int  # all bytes read (prefill + decode)
    load_wait_ms: float  # time the model waited for demand loads
    peak_memory_bytes: int  # MLX allocator peak during the run
    one_sync_tries: int = 0  # forwards run as device passes (runtime/decode/device_pass.py)
    one_sync_fallbacks: int = 0  # of those, forwards that needed more than one host sync (a repair)
    host_syncs_per_token: float = 0.0  # decode: host syncs per generated token, the token's own included (stock: 1.0)
    repairs_per_token: float = 0.0  # decode: recomputations after absent experts per generated token
    wasted_reads: int = 0  # experts read by repairs that the repaired forward did not use
    bookkeeping_us_per_layer_call: float = 0.0  # host bookkeeping per MoE layer call (off the critical path)
    prefill: PrefillStats | None = None  # the prompt: tokens/s, reads, bytes, reads per routed expert
    prefetch_reads_per_token: float = 0.0  # decode: experts read because a forecast named them (plain decoding queues none)
    prefetch_used_per_token: float = 0.0  # decode: of those, used by a call
    prefetch_wasted_per_token: float = 0.0  # decode: prefetched experts evicted unused
    early_forwards: int = 0  # forwards built before the previous one's sync (runtime/decode/next_forward.py)
    decode_path: str = ""  # "device pass" (one sync a token + repairs) or "per-layer sync" (one per MoE layer + 1)

    def line(self) -> str:
        return (f"{self.tokens_per_s:.1f} tok/s | hit rate {self.hit_rate:.1%} | "
                f"{self.misses_per_token:.2f} demand misses/token | {self.mb_read_per_token:.3f} MB read/token | "
                + (f"prefetch {self.prefetch_reads_per_token:.2f}/token (used {self.prefetch_used_per_token:.2f}, "
                   f"wasted {self.prefetch_wasted_per_token:.2f}) | " if self.prefetch_reads_per_token else "") +
                f"prompt {self.n_prompt_tokens} tok, generated {self.n_tokens} tok | "
                f"{self.host_syncs_per_token:.2f} host syncs/token, {self.repairs_per_token:.2f} repairs/token")

    def to_json(self) -> dict:
        return asdict(self)


def _counters(om, dp=None) -> dict:
    c = om.counters() if om is not None else {"hits": 0, "misses": 0, "bytes_read": 0, "load_wait_ms": 0.0,
                                              "prefetch_loaded": 0, "prefetch_hits": 0, "prefetch_wasted": 0}
    c["host_syncs"] = om.cache.host_syncs if om is not None else 0
    c["repairs"] = dp.stats.repairs if dp is not None else 0
    return c


def generate_tokens(model, prompt_ids: list[int], *, max_tokens: int, temp: float = 0.0, top_p: float = 1.0,
                    eos_ids=(), om=None, on_token: Callable[[int], None] | None = None,
                    one_sync: str = "auto", sampler=None, progress=None,
                    prompt_cache=None, kv_bits: int | None = None,
                    warm: str | None = None) -> tuple[list[int], GenerationStats]:
    """All of stream_tokens at once: (tokens, stats); on_token(token) is called as each arrives."""
    tokens: list[int] = []
    run = stream_tokens(model, prompt_ids, max_tokens=max_tokens, temp=temp, top_p=top_p, eos_ids=eos_ids, om=om,
                        one_sync=one_sync, sampler=sampler, progress=progress, prompt_cache=prompt_cache,
                        kv_bits=kv_bits, warm=warm)
    while True:
        try:
            token = next(run)
        except StopIteration as done:
            return tokens, done.value
        tokens.append(token)
        if on_token:
            on_token(token)


def stream_tokens(model, prompt_ids: list[int], *, max_tokens: int, temp: float = 0.0, top_p: float = 1.0,
                  eos_ids=(), om=None, one_sync: str = "auto", sampler=None,
                  progress=None, prompt_cache=None, kv_bits: int | None = None,
                  warm: str | None = None) -> Generator[int, None, GenerationStats]:
    """Yield up to `max_tokens` token ids after `prompt_ids`; the generator returns the run's stats.

    `om` (an OffloadedModel) supplies paging counters; its decode steps run as device passes (one host sync per
    token, repaired when an expert was absent) when one_sync is "on", or "auto" and the budget holds every expert;
    else through mlx-lm's generate_step on the per-layer synced path (the module docstring). Before the prefill the
    cache is warmed: every expert when the budget holds them all (`warm="off"`: not even then); decoding
    starts once those reads are in.
    `sampler` (mlx-lm's make_sampler) overrides temp/top_p. `progress` (a PrefillProgress) shows the
    prompt's processing; the stats' `prefill` says what it cost (runtime/decode/prefill.py).
    `prompt_cache` (a PromptCache) keeps the KV cache and state across calls: the prefix it already
    holds is not prefilled again, and it holds this prompt and the tokens yielded afterwards. `kv_bits`
    quantizes the KV cache as mlx-lm does (from its quantized_kv_start on); an OffloadedModel with a
    memory limit prefills the prompt in one chunk unless its activations need smaller ones (the chunk is
    mlx-lm's 2048 tokens without a limit) and gives expert slots back as the KV grows."""
    if one_sync not in ("auto", "on", "off"):
        raise ValueError(f"--one-sync {one_sync!r}; expected auto, on or off")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}; expected >= 1")
    if not prompt_ids:
        raise ValueError("the prompt is empty after tokenization; expected at least one token")
    sampler = sampler or make_sampler(temp=temp, top_p=top_p)
    kv_options = {"kv_bits": kv_bits} if kv_bits else {}
    forward = model  # prefill chunks run here (a prompt cache prefills itself)
    device = om is not None and (one_sync == "on" or one_sync == "auto" and holds_every_expert(om))
    dp = DevicePass(om) if device else None
    # The forward after the last token only matters to a kept cache (that token's KV) and to whoever records routing
    # (a trace, an observer); else it is not built (runtime/decode/offloaded_step.py: the last token does not wait).
    after_last = device and (prompt_cache is not None or (om.telemetry is not None and om.telemetry.tracing)
                             or any(m.observer is not None for m in om.modules.values()))
    mx.reset_peak_memory()
    c0 = _counters(om)
    t0 = time.perf_counter()
    if om is not None:
        warm_start(om, warm)  # reads overlap the prefill

    def decode(prompt: mx.array, cache, **prefill):
        if dp is None:
            return generate_step(prompt, model, max_tokens=max_tokens, sampler=sampler, prompt_cache=cache, **prefill,
                                 **kv_options)
        return offloaded_generate_step(om, prompt, max_tokens=max_tokens, sampler=sampler, device_pass=dp,
                                       prompt_cache=cache, after_prefill=om.cache.settle_inflight, after_last=after_last,
                                       **prefill, **kv_options)

    tokens, t_first, c1 = [], None, None
    reused = prompt_cache.reuse(prompt_ids) if prompt_cache is not None else 0
    meter, prefill = PrefillMeter(om, len(prompt_ids) - reused, progress).start(), None
    limit = om.context_governor if om is not None else None  # --memory-limit: slots give way as the KV grows
    step = DEFAULT_PREFILL_STEP  # mlx-lm's chunk, unless a memory limit sizes it to the prompt
    if limit is not None:
        step = limit.chunk_for(len(prompt_ids) - reused, len(prompt_ids) + max_tokens)
    kv = prompt_cache.cache if prompt_cache is not None else (make_prompt_cache(forward) if limit else None)
    on_chunk = meter.on_chunk
    if limit is not None:
        def on_chunk(done: int, total: int) -> None:
            meter.on_chunk(done, total)
            now = reused + done
            limit.observe(kv, now, min(now + step, len(prompt_ids)) + 1, chunk=step)
    ok, steps = False, None
    try:
        if prompt_cache is None:
            steps = decode(mx.array(prompt_ids), kv, prompt_progress_callback=on_chunk, prefill_step_size=step)
        else:  # the same chunks as generate_step's prefill, into the kept cache; then the last token
            last = prompt_cache.prefill(forward, prompt_ids, on_chunk=on_chunk, step=step, kv_options=kv_options, om=om)
            steps = decode(mx.array([last]), prompt_cache.cache)
        for token, _ in steps:
            token = int(token)
            if dp is None and om is not None:
                om.cache.host_syncs += 1  # generate_step read the token back (a device pass counts its own sync)
            if t_first is None:
                t_first, c1 = time.perf_counter(), _counters(om, dp)
                prefill = meter.stop()
                prefill.reused_tokens, prefill.chunk_tokens = reused, step
            tokens.append(token)
            if limit is not None and (len(tokens) == 1 or len(tokens) % 32 == 0):
                limit.observe(kv, len(prompt_ids) + len(tokens), len(prompt_ids) + len(tokens) + 32, chunk=1)
            # syncs and repairs up to this token (the step generate_step computes after the last one is not a decoded token)
            at_last = (om.cache.host_syncs, dp.stats.repairs if dp else 0) if om is not None else (0, 0)
            yield token
            if token in eos_ids:
                break
        ok = True
    except GeneratorExit:
        ok = True  # closed by the consumer after a token: generate_step fed every token it yielded
        raise
    finally:
        if dp is not None and steps is not None:
            steps.close()  # an early stop leaves the next forward queued: finish (repair) and book it
            dp.flush()
        elif om is not None and steps is not None:
            steps.close()
            for m in om.modules.values():  # the per-layer path's last calls: evaluated, their slots unpinned
                m.release_pending()
        if prefill is None:
            meter.stop()  # restores the modules' observers
        if prompt_cache is not None:
            if ok and t_first is not None:
                prompt_cache.extend([prompt_ids[-1]] + tokens)
            else:
                prompt_cache.reset()  # an error mid-way: what the caches hold is unknown
    t_end = time.perf_counter()
    c2 = _counters(om, dp)
    n_decode = max(0, len(tokens) - 1)
    hits, misses = c2["hits"] - c1["hits"], c2["misses"] - c1["misses"]
    return GenerationStats(
        n_prompt_tokens=len(prompt_ids),
        n_tokens=len(tokens),
        prefill_s=t_first - t0,
        decode_s=t_end - t_first,
        tokens_per_s=n_decode / (t_end - t_first) if n_decode and t_end > t_first else 0.0,
        hit_rate=hits / (hits + misses) if hits + misses else 1.0,
        misses_per_token=misses / n_decode if n_decode else 0.0,
        mb_read_per_token=(c2["bytes_read"] - c1["bytes_read"]) / 1e6 / n_decode if n_decode else 0.0,
        prefill_misses=c1["misses"] - c0["misses"],
        bytes_read=c2["bytes_read"] - c0["bytes_read"],
        load_wait_ms=c2["load_wait_ms"] - c0["load_wait_ms"],
        peak_memory_bytes=mx.get_peak_memory(),
        one_sync_tries=dp.stats.passes if dp else 0,
        one_sync_fallbacks=dp.stats.multi_sync if dp else 0,
        # A device pass counts its token's sync; the per-layer path reads the token back once more (generate_step)
        host_syncs_per_token=(at_last[0] - c1["host_syncs"]) / n_decode if n_decode else 0.0,
        repairs_per_token=(at_last[1] - c1["repairs"]) / n_decode if n_decode else 0.0,
        wasted_reads=dp.stats.wasted_reads if dp else 0,
        bookkeeping_us_per_layer_call=dp.stats.bookkeeping_s * 1e6 / max(1, dp.stats.layer_calls) if dp else 0.0,
        prefill=prefill,
        prefetch_reads_per_token=(c2["prefetch_loaded"] - c1["prefetch_loaded"]) / n_decode if n_decode else 0.0,
        prefetch_used_per_token=(c2["prefetch_hits"] - c1["prefetch_hits"]) / n_decode if n_decode else 0.0,
        prefetch_wasted_per_token=(c2["prefetch_wasted"] - c1["prefetch_wasted"]) / n_decode if n_decode else 0.0,
        early_forwards=dp.stats.next_built - dp.stats.next_dropped if dp else 0,
        decode_path="device pass" if dp else ("per-layer sync" if om is not None else ""),
    )


def holds_every_expert(om) -> bool:
    """Whether every MoE layer's usable slots can hold all of its experts (a full budget, the governor not shrinking)."""
    usable = om.cache.usable_now()
    return all(usable[l] >= om.cache.layouts[l].n_experts for l in om.moe_layers)


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of `prompt`, through the chat template when asked and available."""
    if chat and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    return list(tokenizer.encode(prompt))
