"""BatchMemory: under --memory-limit, a batch's KV caches are counted, so expert slots give way as the batch grows.

The ContextGovernor (runtime/cache/context_governor.py) turns the KV a decoder reports into usable expert slots.
A batch reports what mlx-lm's BatchGenerator holds: every member's batch KV cache (left-padded rows included),
the prompt batch's caches and the caches of sequences still queued (`BatchGenerator.prompt_cache_nbytes`), plus
what the next steps will add: AHEAD tokens and one 256-token allocation step per member, and the prompt tokens
not prefilled yet. A report is made before a step whenever a member joined or left since the last one, and every
EVERY steps otherwise; a member that leaves lowers the next report, so slots come back.

Invariants: without a governor (no --memory-limit) nothing is reported; a report never counts less than the
caches hold now; only the decoder's thread calls it (between steps).
"""

from __future__ import annotations

AHEAD = 32  # decode steps a report covers (each adds one token per member)
EVERY = 16  # steps between reports when nobody joined or left
ALLOCATION_STEP = 256  # tokens a batch KV cache grows by at once, per member (mlx-lm's KVCache.step)


class BatchMemory:
    def __init__(self, governor, prefill_step: int):
        self.governor = governor  # the engine's ContextGovernor, or None (no --memory-limit)
        self.prefill_step = prefill_step  # mlx-lm's prompt chunk (tokens per prompt per chunk)
        self._reach: dict[int, int] = {}  # uid -> the context it reaches at most (cached + prompt + max_tokens)
        self._unfilled: dict[int, int] = {}  # uid -> prompt tokens not prefilled yet (until its first token)
        self._changed = True
        self._since = 0
        self.n_reports = 0  # reports made (for tests and stats)

    def joined(self, uids: list[int], prompts: list, max_tokens: list[int], caches=None) -> None:
        for i, (uid, prompt, limit) in enumerate(zip(uids, prompts, max_tokens)):
            cached = max((getattr(c, "offset", 0) or 0 for c in caches[i]), default=0) if caches and caches[i] else 0
            self._reach[uid] = int(cached) + len(prompt) + int(limit)
            self._unfilled[uid] = len(prompt)
        self._changed = True

    def left(self, uids: list[int]) -> None:
        for uid in uids:
            if self._reach.pop(uid, None) is not None:
                self._changed = True
            self._unfilled.pop(uid, None)

    def started(self, uids: list[int]) -> None:
        """These members produced a token: their prompts are in the caches now."""
        for uid in uids:
            self._unfilled.pop(uid, None)

    def observe(self, generator) -> int | None:
        """Report the batch's KV to the governor when due; returns the usable slots requested (None: no report)."""
        if self.governor is None or not self._reach:
            return None
        self._since += 1
        if not self._changed and self._since < EVERY:
            return None
        self._changed, self._since = False, 0
        members, unfilled = len(self._reach), sum(self._unfilled.values())
        growth = members * (AHEAD + ALLOCATION_STEP) + unfilled
        chunk = max(members, min(unfilled, self.prefill_step))
        self.n_reports += 1
        return self.governor.observe_held(int(generator.prompt_cache_nbytes), growth, max(self._reach.values()), chunk)
