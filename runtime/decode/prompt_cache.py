"""PromptCache: a conversation's KV cache and recurrent state, reused so a new turn prefills only itself.

The object holds mlx-lm's per-layer caches and the token ids they have processed (`tokens`,
in order; len(tokens) is every cache's position). For the next prompt, `reuse(ids)` rolls the
caches back to the longest prefix of `ids` they can return to and says how many tokens need no
prefill:
- caches that can be trimmed (KVCache) go back to any position;
- caches that cannot (GatedDeltaNet's ArraysCache, a full rotating window) go back only to a
  snapshot: `prefill()` takes one at the end of each prompt (its last token not yet fed, as
  mlx-lm's generate_step leaves it) and `extend()` one after the decoded tokens, keeping the
  newest `max_snapshots`;
- nothing usable: a fresh cache.
`prefill(model, ids)` then feeds the rest of the prompt but its last token in chunks of
`step` tokens (mlx-lm's generate_step chunking, so a fresh prompt computes exactly what
generate_step computes), snapshots, and returns the last token for the decode loop. After
decoding, `extend(generated)` records the tokens the decode loop fed (generate_step feeds every
token it yields before yielding it).

`save(path)` / `PromptCache.load(path)` write and read the caches with mlx-lm's
save_prompt_cache / load_prompt_cache (as `mlx_lm.cache_prompt`), with the tokens and the
model's config digest in the metadata; loading for another model is refused.

Invariants: len(tokens) equals the caches' position after every public call; a rolled-back
cache equals one that never saw the dropped tokens (trim, or a snapshot of untrimmable state
taken at that position); reuse never returns all of `ids` (the last token always runs, so
its logits exist).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx.utils import tree_map

from runtime.decode.kv_only import kv_only

PREFILL_STEP = 2048  # mlx-lm generate_step's prefill_step_size


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _copy_state(cache) -> list:
    """States of the caches that cannot be trimmed (containers copied, arrays shared); None for the rest."""
    return [None if c.is_trimmable() else tree_map(lambda x: x, c.state) for c in cache]


class PromptCache:
    def __init__(self, model, *, max_snapshots: int = 4, step: int = PREFILL_STEP, digest: str | None = None):
        self.model = model  # the mlx-lm model (or a wrapper with make_cache/layers) the caches belong to
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []  # processed tokens; len == every cache's position
        self.max_snapshots = max_snapshots
        self.step = step
        self.digest = digest  # the model's config digest (save/load check)
        self._snapshots: list[tuple[int, list]] = []  # (position, untrimmable states) at prompt ends
        self.reused = 0  # tokens of the last prompt that needed no prefill
        self.prefilled = 0  # tokens of the last prompt fed by prefill() (its last token excluded)

    @property
    def trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.cache)

    def reuse(self, ids: list[int]) -> int:
        """Roll back to the longest reusable prefix of `ids` (at most len(ids) - 1); returns its length."""
        n = min(common_prefix(self.tokens, ids), len(ids) - 1)
        if n == len(self.tokens):
            return n
        if not self.trimmable:  # only back to a snapshot
            fits = [(p, snap) for p, snap in self._snapshots if p <= n]
            if not fits:
                n = 0
            else:
                n, snap = fits[-1]
                for c, st in zip(self.cache, snap):
                    if st is not None:
                        c.state = tree_map(lambda x: x, st)  # a copy: caches mutate their containers in place
        if n == 0:
            self.reset()
            return 0
        for c in self.cache:
            if c.is_trimmable():
                c.trim(len(self.tokens) - n)
        self.tokens = self.tokens[:n]
        self._snapshots = [(p, snap) for p, snap in self._snapshots if p <= n]
        return n

    def snapshot(self) -> None:
        """Remember the untrimmable state at the current position (no-op when every cache can be trimmed)."""
        if self.trimmable or (self._snapshots and self._snapshots[-1][0] == len(self.tokens)):
            return
        self._snapshots = (self._snapshots + [(len(self.tokens), _copy_state(self.cache))])[-self.max_snapshots:]

    def reset(self) -> None:
        self.cache = make_prompt_cache(self.model)
        self.tokens, self._snapshots = [], []

    def prefill(self, model, ids: list[int], on_chunk=None, step: int | None = None, kv_options: dict | None = None,
                om=None) -> int:
        """Reuse what the caches hold, feed the rest of `ids` but the last token, snapshot; returns the last token.
        `model` is what runs the forward (e.g. the offloaded model); on_chunk(done, total) as mlx-lm's progress;
        `step` overrides the chunk; `kv_options` (kv_bits, ...) quantize the KV after each chunk as generate_step does;
        `om` (the OffloadedModel behind `model`): its last layer's experts are skipped in chunks (runtime/decode/kv_only.py)."""
        if not ids:
            raise ValueError("the prompt is empty after tokenization; expected at least one token")
        self.reused = self.reuse(ids)
        head = ids[self.reused : -1]
        total, step = len(head), step or self.step
        quantize = None
        if kv_options and kv_options.get("kv_bits"):
            from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

            def quantize():  # as generate_step after each prefill chunk (its defaults)
                maybe_quantize_kv_cache(self.cache, quantized_kv_start=DEFAULT_QUANTIZED_KV_START, kv_group_size=64,
                                        kv_bits=kv_options["kv_bits"])
        if on_chunk:
            on_chunk(0, total)
        for i in range(0, total, step):
            chunk = head[i : i + step]
            with kv_only(om):
                model(mx.array(chunk)[None], cache=self.cache)
            if quantize:
                quantize()
            mx.eval([c.state for c in self.cache])
            self.tokens.extend(chunk)
            if on_chunk:
                on_chunk(i + len(chunk), total)
        self.prefilled = total
        self.snapshot()
        return ids[-1]

    def extend(self, tokens: list[int]) -> None:
        """Record tokens the decode loop fed through the caches (and snapshot there)."""
        self.tokens.extend(int(t) for t in tokens)
        self.snapshot()

    # -- files ---------------------------------------------------------------------------
    def save(self, path: str | Path, prompt: list[int] | None = None) -> None:
        """Write the caches, their tokens and (optionally) the full prompt they were made for."""
        meta = {"specmoe_tokens": json.dumps(self.tokens), "specmoe_prompt": json.dumps(prompt or self.tokens),
                "specmoe_digest": self.digest or ""}
        save_prompt_cache(str(path), self.cache, meta)

    @classmethod
    def load(cls, path: str | Path, model, *, digest: str | None = None, **kw) -> tuple["PromptCache", list[int]]:
        """A PromptCache from `path` and the full prompt it was saved for; refuses another model's file."""
        path = Path(path)
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            tokens, prompt = json.loads(meta["specmoe_tokens"]), json.loads(meta["specmoe_prompt"])
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"--prompt-cache {path}: not a prompt cache written by specmoe ({e})") from None
        if digest and meta.get("specmoe_digest") and meta["specmoe_digest"] != digest:
            raise ValueError(f"--prompt-cache {path}: made for another model (config digest "
                             f"{meta['specmoe_digest']}, this model {digest})")
        pc = cls(model, digest=digest, **kw)
        if len(cache) != len(pc.cache) or any(type(a) is not type(b) for a, b in zip(cache, pc.cache)):
            raise ValueError(f"--prompt-cache {path}: its caches do not match this model's layers")
        pc.cache, pc.tokens = cache, tokens
        pc.snapshot()
        return pc, prompt
