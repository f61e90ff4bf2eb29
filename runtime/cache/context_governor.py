"""ContextGovernor: as the KV cache grows, the expert cache gives back slots to stay under the memory limit.

The budget planned at load assumed a context; a conversation can outgrow it. Before each prefill
chunk and every few decoded tokens the decoder reports the KV/state bytes it holds and the context
it is about to reach; the governor turns MemoryLimit.expert_room into usable slots per layer
(one slot in every layer costs the sum of the layers' expert bytes) and requests them from the
ExpertCache, which applies them between calls and hands the freed slots' pages back to the OS
where it can. When the KV shrinks (a new conversation), slots come back, up to the planned budget. A batch of sequences
(runtime/decode/batch.py) reports its batch KV caches' bytes, every member's, the same way (observe_held): slots
give way as the batch grows and come back as members leave.

The accounting is open loop (what the parts should take); with `measure` (the process's peak RSS since
the previous update, set when a limit is in force) it is also closed: at each update whatever the
process held beyond the parts (allocator pools, load transients, a chunk's transient arrays, thread
stacks) is added to the baseline -- which only grows -- so memory the accounting missed is taken from
the expert cache instead of going over the cap.

Invariants: usable slots stay within [top-k, planned slots]; a request never exceeds what the RAM
MemoryGovernor currently allows (its `ceiling`); the baseline never shrinks; tokens are unchanged by
any resize.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.cache.memory_limit import MemoryLimit, activation_bytes


@dataclass
class ContextGovernorStats:
    n_updates: int = 0  # KV reports received
    n_shrinks: int = 0  # requests that lowered the usable slots
    n_grows: int = 0  # requests that raised them
    usable: int = 0  # usable slots per layer last requested
    kv_bytes: int = 0  # last KV report (what the next forwards will hold)
    kv_held_bytes: int = 0  # of that, held at the report
    unaccounted_bytes: int = 0  # the most the measured process held beyond the accounted parts (added to the baseline)


class ContextGovernor:
    def __init__(self, cache, limit: MemoryLimit, config: dict, step: int, memory_governor=None, kv_per_token: int = 0,
                 measure=None):
        self.cache = cache  # ExpertCache
        self.limit = limit
        self.config = config
        self.step = step  # tokens per forward the activations are sized for (the prefill chunk; 1 when decoding)
        self.memory_governor = memory_governor  # the RAM governor, whose current level also caps the slots
        self.kv_per_token = kv_per_token  # KV bytes one more token adds (attention layers)
        self.measure = measure  # () -> bytes the process holds now (RSS), or None: open-loop accounting only
        self.layers = cache.layers()
        self.row_bytes = sum(cache.layouts[l].expert_bytes for l in self.layers)  # one slot in every layer
        self.max_slots = min(cache.n_slots(l) for l in self.layers)
        self.stats = ContextGovernorStats(usable=self.max_slots)

    def chunk_for(self, prompt_tokens: int, context: int) -> int:
        """The prefill chunk for a prompt of `prompt_tokens` reaching `context`: the whole prompt unless its
        activations would take more than their share of the limit (MemoryLimit.prefill_step)."""
        kv = context * self.kv_per_token
        return self.limit.prefill_step(self.config, context, kv, default=max(16, prompt_tokens))

    def slots_for(self, kv_bytes: int, context: int, chunk: int | None = None) -> int:
        room = self.limit.expert_room(self.config, kv_bytes, context, chunk or self.step)
        return max(self.cache.min_usable, min(self.max_slots, room // self.row_bytes))

    def observe(self, caches, tokens_now: int, tokens_next: int, chunk: int | None = None) -> int:
        """Before growing mlx-lm `caches` from `tokens_now` to `tokens_next` tokens in forwards of `chunk`
        tokens: what they hold now plus the growth (and one 256-token allocation step of KVCache)."""
        held = sum(c.nbytes for c in caches)
        return self.observe_held(held, max(0, tokens_next - tokens_now) + 256, tokens_next, chunk)

    def observe_held(self, held_bytes: int, growth_tokens: int, context: int, chunk: int | None = None) -> int:
        """Caches of any shape (one sequence's, or a batch's: every member's KV) holding `held_bytes` now, about to
        grow by `growth_tokens` token rows in all (new tokens and allocation steps of every sequence), the longest
        reaching `context` tokens in forwards of `chunk` tokens."""
        return self.update(held_bytes + growth_tokens * self.kv_per_token, context, chunk, held_bytes)

    def accounted_bytes(self, kv_bytes: int) -> int:
        """What the parts should hold now: baseline, weights, drafter, `kv_bytes` and the slots in use."""
        m = self.limit
        held = sum(n * self.cache.layouts[l].expert_bytes for l, n in self.cache.usable_now().items())
        return m.baseline_bytes + m.resident_bytes + m.drafter_bytes + kv_bytes + held

    def _close_the_loop(self, kv_held: int, context: int, chunk: int) -> None:
        """Measured memory beyond the accounted parts (and the activations' share) joins the baseline, which only
        grows by what is new: the baseline already holds what earlier updates found."""
        from dataclasses import replace

        act = activation_bytes(self.config, min(chunk, max(1, context)), context)  # the share expert_room leaves
        extra = self.measure() - self.accounted_bytes(kv_held) - act
        if extra > 0:
            self.limit = replace(self.limit, baseline_bytes=self.limit.baseline_bytes + extra)
            self.stats.unaccounted_bytes += extra

    def update(self, kv_bytes: int, context: int, chunk: int | None = None, kv_held: int | None = None) -> int:
        """The KV/state bytes about to be held at `context` tokens (`kv_held`: held now, default the same);
        returns the usable slots requested."""
        s = self.stats
        s.n_updates += 1
        s.kv_bytes = kv_bytes
        s.kv_held_bytes = kv_bytes if kv_held is None else kv_held
        if self.measure is not None:
            self._close_the_loop(s.kv_held_bytes, context, chunk or self.step)
        n = self.slots_for(kv_bytes, context, chunk)
        if self.memory_governor is not None:
            self.memory_governor.ceiling = n  # its later grows stop here
            n = min(self.memory_governor.usable_for(self.memory_governor.stats.level).values())
        if n != s.usable:
            s.n_shrinks += n < s.usable
            s.n_grows += n > s.usable
            s.usable = n
            self.cache.request_usable_slots(n)
        return n
