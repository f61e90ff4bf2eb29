"""offloaded_generate_step: mlx-lm's generate_step for an OffloadedModel, one host sync per token.

Same prefill (chunks of `prefill_step_size`, all prompt tokens but the last, through the synced
path), same step (logits of the last position, log-softmax, sampler), same tokens; each decode
step is a DevicePass forward: the lookups happen on the device and the host syncs once, when the
token is read back, unless an expert was absent (then the pass repairs from the first layer that
missed). Pipelining as mlx-lm's: forward n+1 is built on token n's lazy output and queued
(mx.async_eval) before token n's sync (runtime/decode/next_forward.py), and the host bookkeeping of token n (recency, stats, observer, telemetry)
runs while forward n+1 computes.

Invariant: the yielded tokens equal generate_step's on the resident model (greedy); a forward
is queued only after the token it consumes was accepted; when the generator stops early (closed,
an error) a queued forward is finished (repaired if need be: a kept prompt cache stays right) and
its hold released; with after_last off, a generation that reaches max_tokens builds one forward per
token it yields and none after the last (whose KV nobody keeps).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from runtime.decode.device_pass import DevicePass
from runtime.decode.kv_only import kv_only


def offloaded_generate_step(om, prompt: mx.array, *, max_tokens: int, sampler: Callable,
                            device_pass: DevicePass | None = None, prompt_cache: list | None = None,
                            prefill_step_size: int = 2048, prompt_progress_callback: Callable | None = None,
                            kv_bits: int | None = None, kv_group_size: int = 64,
                            quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
                            after_prefill: Callable[[], None] | None = None,
                            after_last: bool = True) -> Iterator[tuple[int, mx.array]]:
    """generate_step's arguments that apply here (prompt_cache, prefill_step_size, prompt_progress_callback,
    kv_bits, kv_group_size, quantized_kv_start), plus the DevicePass to use and a call after the prefill.
    `after_last`: also run the forward that feeds the last token (as generate_step: its KV for a kept cache, its
    routing for a trace). Off, the generation ends with its last token: that forward is never built, so nothing
    waits for it (a whole token's compute, which the last token's delivery and the decode time would include)."""
    model = om.model
    dp = device_pass or DevicePass(om)
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    quantize = functools.partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                                 kv_group_size=kv_group_size, kv_bits=kv_bits)
    progress = prompt_progress_callback or (lambda *_: None)

    def quantizes_next(caches) -> bool:  # the next forward's build would convert a cache (maybe_quantize_kv_cache)
        return kv_bits is not None and any(hasattr(c, "to_quantized") and c.offset + 1 >= quantized_kv_start
                                           for c in caches)

    def step(tokens: mx.array) -> Callable:
        def forward():
            logits = model(tokens[None], cache=cache)[:, -1, :]
            quantize(cache)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs), logprobs.squeeze(0)
        return forward

    y, total, done = prompt, prompt.size, 0
    progress(done, total)
    while y.size > 1:
        n = min(prefill_step_size, y.size - 1)
        with kv_only(om):  # logits unread: the last layer's experts are not routed, read or run (stock skips them too)
            model(y[:n][None], cache=cache)
        quantize(cache)
        mx.eval([c.state for c in cache])
        done += n
        progress(done, total)
        y = y[n:]
        mx.clear_cache()
    if after_prefill is not None:
        after_prefill()
    dp.launch(step(y), cache, y.size)
    try:
        token, logprobs = dp.finish()
        progress(total, total)
        n = 0
        while n < max_tokens:
            # Queued before this token's bookkeeping and yield; with after_last (as generate_step) also after
            # the last token (its KV for a kept cache, its routing completes the sequence's trace).
            if not dp.pending and (after_last or n + 1 < max_tokens):  # else: built early on this token's
                dp.launch(step(token), cache, 1)  # lazy output (and this token stood), or not wanted
            dp.flush(defer=n > 0)  # the first forward's record is booked before its token is counted
            yield token.item(), logprobs
            n += 1
            if n % 256 == 0:
                mx.clear_cache()
            # As generate_step: the forward after this one is queued before this one's sync
            # (runtime/decode/next_forward.py) -- but not the build that quantizes the KV (--kv-bits): were
            # it dropped, this forward's repair would read quantized keys stock read unquantized.
            if (n + 1 < max_tokens or after_last and n < max_tokens) and not quantizes_next(cache):
                dp.launch_next(lambda out: step(out[0]))
            if not dp.pending:
                break  # the last token, and no forward after it (after_last off)
            token, logprobs = dp.finish()
    finally:
        dp.settle()  # stopped early (eos, close, an error): the queued forward is finished, its KV right
        dp.flush()
