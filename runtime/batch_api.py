"""`batch_generate(engine, prompts, ...)`: several prompts decoded together, in mlx-lm's shape.

    from runtime import load, batch_generate
    engine = load("~/models/q3.specmoe", budget="25%")
    r = batch_generate(engine, ["Hello", "Why is the sky blue?"], max_tokens=64)
    print(r.texts, r.stats.generation_tps, r.experts.unique_experts, r.experts.summed_experts)

As mlx-lm's `batch_generate(model, tokenizer, prompts, ...)`: the prompts (strings, tokenized as
given, or token ids) go into one batch (runtime/decode/batch.py: mlx-lm's BatchGenerator over the
paged model, each step reading the union of the batch's experts once); generation stops per prompt at
an end-of-sequence token (not included in the text) or at its `max_tokens`; the response lists the texts
in prompt order, mlx-lm's BatchStats, and optionally the token ids and the log-probabilities of the
sampled tokens. `experts` (BatchTotals) adds what batching saved: unique expert lookups per decode step
against the sum over sequences, and the reads.

Invariants: greedy tokens equal mlx-lm's `batch_generate` on the resident model for the same prompts
and settings (tests/test_batch_generate.py); batched and single-sequence numerics may differ in the
last bits, as in mlx-lm itself (bench/results/batch_stock_drift.txt). An engine loaded with a drafter
is refused: speculative decoding runs one sequence at a time (`stream_generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.sample_utils import make_sampler

from runtime.api import Engine
from runtime.decode import BatchDecoder, BatchTotals


@dataclass
class BatchResponse:
    texts: list[str]  # the generated text of each prompt, in prompt order
    stats: object  # mlx-lm's BatchStats: prompt and generation tokens, tokens/s, peak memory
    experts: BatchTotals  # decode steps' unique vs summed expert lookups, reads, bytes
    token_ids: list[list[int]] | None = None  # the generated ids per prompt (return_token_ids=True)
    logprobs: list[list[float]] | None = None  # log-probability of each sampled token (return_logprobs=True)
    finish_reasons: list[str] | None = None  # "stop" (end of sequence) or "length" per prompt


def batch_generate(engine: Engine, prompts: list[str] | list[list[int]], max_tokens: int | list[int] = 128, *,
                   temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                   return_token_ids: bool = False, return_logprobs: bool = False,
                   completion_batch_size: int = 32, prefill_batch_size: int = 8, prefill_step_size: int = 2048,
                   warm: str | None = None) -> BatchResponse:
    """Generate for every prompt at once; `max_tokens` per prompt or one for all. The batch sizes and the
    prefill step are mlx-lm's BatchGenerator settings (sequences decoding together, prompts processed
    together, prompt tokens per chunk); `warm` as stream_generate's."""
    if engine.draft is not None:
        raise ValueError("batch_generate with a drafter: batched decoding is plain (speculative decoding runs one "
                         "sequence at a time with stream_generate); load without draft")
    if not prompts:
        raise ValueError("prompts is empty; expected at least one prompt")
    tokenizer = engine.tokenizer
    ids = [_encode(tokenizer, p) for p in prompts]
    limits = [max_tokens] * len(ids) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(ids):
        raise ValueError(f"max_tokens has {len(limits)} entries for {len(ids)} prompts; expected one per prompt")
    sampler = make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    decoder = BatchDecoder(engine.model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], sampler=sampler,
                           completion_batch_size=completion_batch_size, prefill_batch_size=prefill_batch_size,
                           prefill_step_size=prefill_step_size, warm=warm)
    try:
        uids = decoder.insert(ids, limits)
        tokens = {u: [] for u in uids}
        logprobs = {u: [] for u in uids}
        finish = {}
        with decoder.generator.stats() as stats:
            while responses := decoder.next():
                for r in responses:
                    if r.finish_reason is not None:
                        finish[r.uid] = r.finish_reason
                    if r.finish_reason != "stop":
                        tokens[r.uid].append(r.token)
                        if return_logprobs:
                            logprobs[r.uid].append(r.logprobs[r.token].item())
    finally:
        decoder.close()
    return BatchResponse(
        texts=[tokenizer.decode(tokens[u]) for u in uids], stats=stats, experts=decoder.totals,
        token_ids=[tokens[u] for u in uids] if return_token_ids else None,
        logprobs=[logprobs[u] for u in uids] if return_logprobs else None,
        finish_reasons=[finish.get(u, "length") for u in uids])


def _encode(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):  # as stream_generate: no second BOS when the prompt already starts with one
        bos = getattr(tokenizer, "bos_token", None)
        ids = list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("a prompt is empty after tokenization; expected at least one token")
    return ids
