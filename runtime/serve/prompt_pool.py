"""A few conversations' prompt caches, so each conversation re-prefills only its new turn.

`take(ids)` returns the cache (a runtime.decode.PromptCache) whose processed tokens share the
longest prefix with `ids`; with none sharing any, a fresh cache while there is room, else the
least recently used one, reset. The PromptCache itself rolls back to the shared prefix and
prefills the rest (runtime/decode/prompt_cache.py).

Invariants: at most `size` caches exist (each holds a conversation's KV, so this bounds memory);
only the generation worker (or the chat REPL's thread) calls `take`/`clear`; a cache handed
out is the most recently used.
"""

from __future__ import annotations

from runtime.decode import common_prefix

__all__ = ["PromptCachePool", "common_prefix"]


class PromptCachePool:
    def __init__(self, factory, size: int = 2):
        if size < 1:
            raise ValueError(f"--prompt-cache-size {size}; expected >= 1")
        self.factory, self.size = factory, size
        self.entries: list = []  # least recently used first

    def take(self, ids: list[int]):
        best, shared = None, 0
        for entry in self.entries:
            n = common_prefix(entry.tokens, ids)
            if n > shared:
                best, shared = entry, n
        if best is None:
            if len(self.entries) < self.size:
                best = self.factory()
            else:
                best = self.entries.pop(0)
                best.reset()
        else:
            self.entries.remove(best)
        self.entries.append(best)
        return best

    def clear(self) -> None:
        self.entries.clear()
