"""BatchDecoder: several sequences decoded together over an OffloadedModel, through mlx-lm's BatchGenerator.

Shapes: B = sequences in the generation batch, L = MoE layers, k = experts per token.

mlx-lm's `BatchGenerator` carries the sequences: its batch KV caches (left-padded prompts, per-sequence
offsets), continuous batching (sequences join between steps, leave when they finish or are removed),
prompt processing of newcomers in chunks of `prefill_step_size`, samplers and stop sequences. It drives
the paged model (`om.model`) as it would the resident one, through a thin forwarding view (`_PagedView`)
that only names each forward:
- a decode step is one forward of B tokens (B, 1). Each MoE layer routes the B tokens; below a full budget it
  reads the union of their experts back once (one host sync per MoE layer, runtime/cache/cached_switch.py),
  reads each absent expert of that union once, and runs all B tokens on the cache's slots; the slots stay
  pinned until the output is evaluated (the module evaluates its pending output before its next call). A
  union larger than the layer's usable slots goes expert-major (runtime/cache/expert_major.py): still one
  read per unique expert. A layer whose experts all sit in the slots numbered like them (a full budget) runs
  on the router's ids with no read-back (runtime/decode/batch_pass.py: held from before the build until
  evaluated; mlx-lm builds step n+1 before it reads step n's tokens, so such a step is booked -- routing,
  counters -- one step later): a step then makes one host sync, mlx-lm's token read-back.
- a newcomer's prompt chunk (B', n) runs expert-major where it has experts to read; its logits are never
  read (mlx-lm evaluates the caches only), so the last decoder layer's experts are skipped as in plain
  prefill (runtime/decode/kv_only.py). The forward of a newcomer's last prompt token, which samples its
  first token, is a full forward.

Invariants: the tokens equal those of mlx-lm's BatchGenerator on the resident model given the same
prompts, settings and schedule of inserts, removals and steps (greedy; same arithmetic: the modules'
outputs are stock's bit for bit, tests/test_batch_generate.py); `BatchStepStats.unique_experts` of a
step is the sum over MoE layers of the size of the union of its B tokens' experts, `summed_experts`
the sum over layers and tokens of each token's own experts (what B one-at-a-time steps would look up);
nothing is left pinned or held after close(); BatchStepStats.host_syncs counts a step's routing read-backs and
mlx-lm's token read-back (1 on ids).

Under --memory-limit the batch's KV caches are reported to the context governor (runtime/decode/batch_memory.py),
so expert slots give way as the batch grows and come back as members leave.

Not here: the table lookups with repair of the single-sequence device pass (below a full budget a step syncs
once per MoE layer), lookahead prefetch, speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from mlx_lm.generate import BatchGenerator

from runtime.decode.batch_memory import BatchMemory
from runtime.decode.batch_pass import BatchPass
from runtime.decode.kv_only import kv_only
from runtime.decode.warm import warm_start


@dataclass
class BatchStepStats:
    n_sequences: int  # B: sequences decoded by this step (tokens in the forward)
    unique_experts: int  # sum over MoE layers of |union of the B tokens' experts| (each looked up, read if absent, once)
    summed_experts: int  # sum over MoE layers and tokens of each token's own distinct experts (B one-at-a-time steps)
    reads: int  # experts read from disk during the step (demand misses)
    bytes_read: int  # bytes the loader read during the step
    host_syncs: int = 1  # host syncs of the step: its layers' routing read-backs (none on ids) + mlx-lm's token read-back


@dataclass
class BatchTotals:
    steps: int = 0  # decode steps (forwards of the generation batch)
    tokens: int = 0  # tokens those steps decoded (sum of their B)
    unique_experts: int = 0  # sum of BatchStepStats.unique_experts
    summed_experts: int = 0  # sum of BatchStepStats.summed_experts
    reads: int = 0  # experts read by decode steps
    bytes_read: int = 0  # bytes read by decode steps
    host_syncs: int = 0  # host syncs of the decode steps (routing read-backs and token read-backs)
    prefill_reads: int = 0  # experts read by prompt chunks and first-token forwards

    def add(self, step: BatchStepStats) -> None:
        self.steps += 1
        self.tokens += step.n_sequences
        self.unique_experts += step.unique_experts
        self.summed_experts += step.summed_experts
        self.reads += step.reads
        self.bytes_read += step.bytes_read
        self.host_syncs += step.host_syncs

    @property
    def unique_share(self) -> float:
        """unique / summed expert lookups over the decode steps (1.0: no sharing; 1/B: all shared)."""
        return self.unique_experts / self.summed_experts if self.summed_experts else 1.0


def _batch_cache(gen: BatchGenerator, batch: str):
    """The KV cache list of the generator's generation or prompt batch (mlx-lm 0.32's private attributes, read
    only): a forward is named by the cache it is given. Absent (another mlx-lm), None: every forward runs plain."""
    return getattr(getattr(gen, batch, None), "prompt_cache", None)


def _reads(om) -> tuple[int, int]:
    """(demand misses, bytes read) since load: the two counters a step reports."""
    return sum(s.misses for s in om.cache.stats().values()), om.loader.stats.bytes_read


def _distinct_per_row(ids: np.ndarray) -> int:
    """Sum over the rows of (N, k) ids of each row's distinct ids."""
    ordered = np.sort(ids, axis=1)
    return ids.shape[0] + int(np.count_nonzero(np.diff(ordered, axis=1)))


class _PagedView:
    """What BatchGenerator is given as its model: om.model's attributes, and a call that names the forward.

    decode (the generation batch's step): the routing of each MoE layer is counted; prompt chunk (the prompt
    batch's cache, logits unread): the last layer's experts are skipped; anything else (a newcomer's first
    token): a plain forward."""

    def __init__(self, decoder: "BatchDecoder"):
        object.__setattr__(self, "_decoder", decoder)

    def __getattr__(self, name):
        return getattr(self._decoder.om.model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        return self._decoder._forward(inputs, cache, **kwargs)


class BatchDecoder:
    """Sequences that join, decode together one token per step, and leave; over one OffloadedModel.

    `insert` queues prompts (they join at the next steps), `next` runs one step and returns mlx-lm's
    GenerationBatch.Response list (uid, token, logprobs, finish_reason, ...), `remove` drops sequences
    (a cancelled request), `close` releases what the modules hold. Settings are BatchGenerator's; `on_ids`
    False keeps every step on the per-layer synced path (for measuring the two)."""

    def __init__(self, om, *, max_tokens: int = 128, stop_tokens=None, sampler: Callable | None = None,
                 completion_batch_size: int = 32, prefill_batch_size: int = 8, prefill_step_size: int = 2048,
                 warm: str | None = None, on_step: Callable[[BatchStepStats], None] | None = None,
                 on_ids: bool = True):
        if completion_batch_size < 1:
            raise ValueError(f"completion_batch_size {completion_batch_size}; expected >= 1")
        self.om = om
        self.on_step = on_step  # called with each decode step's BatchStepStats
        self.totals = BatchTotals()
        self.last_step: BatchStepStats | None = None
        self._routes: list[np.ndarray] | None = None  # the decode forward's (B, k) ids per MoE layer while it builds
        self._pass = BatchPass(om) if on_ids else None  # all-resident layers run on their ids (batch_pass.py)
        self._unbooked: list[BatchStepStats] = []  # steps built on ids, booked when retired (oldest first)
        self._memory = BatchMemory(om.context_governor, prefill_step_size)  # --memory-limit: the batch's KV counted
        warm_start(om, warm)  # a full budget reads every expert (overlapping the first prompts), as plain decoding
        self.generator = BatchGenerator(_PagedView(self), max_tokens=max_tokens, stop_tokens=stop_tokens,
                                        sampler=sampler, completion_batch_size=completion_batch_size,
                                        prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size)

    # -- the forwards BatchGenerator builds ------------------------------------------------
    def _forward(self, inputs, cache, **kwargs):
        om, gen = self.om, self.generator
        if cache is _batch_cache(gen, "_generation_batch"):
            return self._decode_forward(inputs, cache, **kwargs)
        c0 = _reads(om)[0]
        try:
            if cache is _batch_cache(gen, "_prompt_batch"):  # a prompt chunk: mlx-lm evaluates the caches only
                om.label_round("batch prefill")
                with kv_only(om):
                    return om.model(inputs, cache=cache, **kwargs)
            om.label_round("batch first token")
            return om.model(inputs, cache=cache, **kwargs)
        finally:
            self.totals.prefill_reads += _reads(om)[0] - c0

    def _decode_forward(self, inputs, cache, **kwargs):
        om = self.om
        om.label_round("batch decode")
        c0, syncs0 = _reads(om), om.cache.host_syncs
        if self._pass is not None:
            self._retire(keep_last=True)  # steps before the pending one were evaluated by mlx-lm's read-back
            out = self._pass.build(lambda: om.model(inputs, cache=cache, **kwargs))
            if out is not None:  # booked when retired: its routing comes back with its evaluation
                c1 = _reads(om)
                self._unbooked.append(BatchStepStats(int(inputs.shape[0]), 0, 0, int(c1[0] - c0[0]), int(c1[1] - c0[1]),
                                                     om.cache.host_syncs - syncs0 + 1))
                om.cache.host_syncs += 1  # mlx-lm reads the step's tokens back
                return out
        saved = {layer: m.observer for layer, m in om.modules.items()}
        self._routes = []
        try:
            for m in om.modules.values():
                m.observer = self._observe
            out = om.model(inputs, cache=cache, **kwargs)
        finally:
            for layer, m in om.modules.items():
                m.observer = saved[layer]
            routes, self._routes = self._routes, None
        if self._pass is not None and self._pass.pending:
            self._retire(keep_last=False)  # the per-layer syncs evaluated every earlier step
        c1 = _reads(om)
        om.cache.host_syncs += 1  # mlx-lm reads the step's tokens back
        self._book(BatchStepStats(int(inputs.shape[0]), 0, 0, int(c1[0] - c0[0]), int(c1[1] - c0[1]),
                                  om.cache.host_syncs - syncs0), routes)
        return out

    def _observe(self, layer: int, ids: np.ndarray) -> None:
        if self._routes is not None:
            self._routes.append(ids)

    def _book(self, step: BatchStepStats, routes: list[np.ndarray]) -> None:
        step.unique_experts = sum(np.unique(ids).size for ids in routes)
        step.summed_experts = sum(_distinct_per_row(ids) for ids in routes)
        self.totals.add(step)
        self.last_step = step
        if self.on_step is not None:
            self.on_step(step)

    def _retire(self, keep_last: bool) -> None:
        """Book the steps built on ids that the read-back evaluated (all pending ones without `keep_last`)."""
        for routes in self._pass.retire(keep_last):
            self._book(self._unbooked.pop(0), list(routes.values()))

    # -- the sequences ---------------------------------------------------------------------
    def insert(self, prompts: list[list[int]], max_tokens: list[int] | None = None, **kwargs) -> list[int]:
        """Queue prompts (token ids); they join the batch at the next steps. Returns their uids."""
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; expected at least one token")
        for i, m in enumerate(max_tokens or []):
            if m < 1:
                raise ValueError(f"max_tokens[{i}] = {m}; expected >= 1")
        uids = self.generator.insert([list(p) for p in prompts], max_tokens, **kwargs)
        self._memory.joined(uids, prompts, max_tokens or [self.generator.max_tokens] * len(prompts), kwargs.get("caches"))
        return uids

    def remove(self, uids: list[int], return_caches: bool = False) -> dict:
        """Drop sequences wherever they are (queued, in prompt processing, decoding); the others go on. With
        `return_caches`: {uid: (its per-sequence KV caches, the tokens they hold)}, extracted by mlx-lm."""
        caches = self.generator.remove(uids, return_prompt_caches=return_caches)
        self._memory.left(uids)
        return caches

    def next(self) -> list:
        """One step: the generation batch's tokens (mlx-lm's GenerationBatch.Response list), after running
        whatever prompt processing the BatchGenerator schedules; [] when nothing is left."""
        self._memory.observe(self.generator)
        responses = self.generator.next_generated()
        if self._pass is not None and self._pass.pending:
            self._retire(keep_last=True)
        self._memory.started([r.uid for r in responses])
        self._memory.left([r.uid for r in responses if r.finish_reason is not None])
        return responses

    @property
    def n_active(self) -> int:
        """Sequences decoding now (the generation batch's size)."""
        return len(getattr(self.generator, "_generation_batch", None) or ())

    def close(self) -> None:
        """Release the modules' pending outputs (their slots unpinned) and the generator's wired limit."""
        try:
            if self._pass is not None:
                self._retire(keep_last=False)  # a held step is evaluated before its layers are released
        finally:
            self.generator.close()
            for m in self.om.modules.values():
                m.release_pending()

    def __enter__(self) -> "BatchDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
