"""What the server and the chat REPL generate with: one loaded engine, its tokenizer and its stats.

`encode` turns a request into prompt ids with mlx-lm's conventions (the tokenizer's chat template
with the generation prompt; without a template, mlx_lm.server's plain role transcript);
`stream` yields runtime.api responses; `stats` is what GET /v1/specmoe/stats reports (host syncs are counted when the decode loop
reports them, else estimated from the forward and one-sync counters; MLX has no sync counter).

Invariants: only the generation worker (or the REPL's one thread) calls `stream`; a chat request
with one user message encodes to exactly the ids `specmoe generate -p TEXT` uses, so greedy
output is the same text; the stats are cumulative since the server started.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from runtime.serve.prompt_pool import PromptCachePool

__all__ = ["Backend", "Piece"]


@dataclass(frozen=True)
class Piece:
    """One emitted token as the server and the REPL see it."""

    text: str  # decoded text segment (may be empty)
    token: int
    finish_reason: str | None  # "stop", "length" or None
    stats: object  # runtime.api RunStats: the run so far
    cached_tokens: int | None  # prompt tokens taken from the prompt cache (None: no prompt cache)


class Backend:
    def __init__(self, engine, *, one_sync: str = "auto", chat_template_args: dict | None = None,
                 prompt_cache_size: int = 2):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.one_sync = one_sync
        self.chat_template_args = dict(chat_template_args or {})
        self.started = time.time()
        self._lock = threading.Lock()
        self._totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0,
                        "decode_s": 0.0}
        self._syncs = {"forwards": 0, "one_sync_forwards": 0, "counted": 0, "estimated": 0, "tokens": 0}
        self._spec = {"drafted": 0, "accepted": 0, "rounds": 0}
        self._last = None  # RunStats of the last finished request
        self.pool = _prompt_pool(engine, prompt_cache_size)  # None: speculative (no prompt cache yet)

    # -- prompts -----------------------------------------------------------------------------
    def encode_messages(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template(messages, add_generation_prompt=True, **self.chat_template_args))
        from mlx_lm.server import convert_chat

        return list(tok.encode(convert_chat(messages)))

    def encode_text(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))

    def encode(self, request) -> list[int]:
        return self.encode_messages(request.messages) if request.kind == "chat" else self.encode_text(request.prompt)

    # -- generation --------------------------------------------------------------------------
    def reset_prompt_cache(self) -> None:
        if self.pool is not None:
            self.pool.clear()

    def stream(self, ids: list[int], request):
        """Pieces for `ids` under the request's sampling settings (runtime.api.stream_generate), the
        conversation's KV taken from the prompt cache pool when decoding plainly."""
        from runtime.api import stream_generate

        t0 = time.perf_counter()
        last, cached = None, None
        extra = {}
        if self.pool is not None:
            extra["prompt_cache"] = cache = self.pool.take(ids)
        try:
            for last in stream_generate(self.engine, ids, request.max_tokens, temp=request.temperature,
                                        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
                                        seed=request.seed, one_sync=self.one_sync, **extra):
                if extra and cached is None:
                    cached = cache.reused  # set by the prefill, before the first token
                yield Piece(last.text, last.token, last.finish_reason, last.stats, cached)
        finally:
            with self._lock:
                t = self._totals
                t["requests"] += 1
                t["prompt_tokens"] += len(ids)
                t["cached_prompt_tokens"] += cached or 0
                t["decode_s"] += time.perf_counter() - t0
                if last is not None:
                    t["completion_tokens"] += last.stats.generation_tokens
                    self._last = last.stats
                    if last.detail is not None:
                        self._count_syncs(last.detail, last.stats.generation_tokens)

    def _count_syncs(self, detail, n_tokens: int) -> None:
        """Host syncs of one run: counted when the decode stats carry them (hot-path counters), else
        estimated from the forward and one-sync counters (see `stats`)."""
        n_moe = len(self.engine.model.moe_layers)
        ok = detail.one_sync_tries - detail.one_sync_fallbacks
        if hasattr(detail, "n_rounds"):  # speculative: verify passes, reruns, drafted tokens
            forwards = detail.n_rounds + detail.n_reruns
            readbacks = detail.n_rounds + detail.n_drafted
            counted = getattr(detail, "host_syncs", None)
            counted = None if counted is None else counted + detail.n_drafted  # + the drafter's readbacks
            self._spec["drafted"] += detail.n_drafted
            self._spec["accepted"] += detail.n_accepted
            self._spec["rounds"] += detail.n_rounds
        else:  # plain: one decode step per token after the first
            forwards = max(0, n_tokens - 1)
            readbacks = n_tokens
            per = getattr(detail, "host_syncs_per_token", None)
            counted = None if per is None else per * forwards
        s = self._syncs
        s["forwards"] += forwards
        s["one_sync_forwards"] += ok
        s["tokens"] += n_tokens
        if counted is not None:
            s["counted"] += counted
        else:
            s["estimated"] += ok + (forwards - ok) * n_moe + detail.one_sync_fallbacks + readbacks

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        om = self.engine.model
        c = om.counters()
        hits, misses = c["hits"], c["misses"]
        with self._lock:
            totals, last, syncs, spec = dict(self._totals), self._last, dict(self._syncs), dict(self._spec)
        out = {
            "uptime_s": round(time.time() - self.started, 1),
            "requests": totals,
            "expert_cache": {"hit_rate": hits / (hits + misses) if hits + misses else None, "hits": hits,
                             "misses": misses, "evictions": c.get("evictions", 0),
                             "budget_bytes": om.plan.budget_bytes, "fraction_of_experts": om.plan.fraction},
            "io": {"bytes_read": c["bytes_read"], "load_wait_ms": round(c["load_wait_ms"], 3),
                   "prefetch_used": c.get("prefetch_hits", 0),
                   "prefetch_wasted": c.get("prefetch_wasted", 0) + c.get("prefetch_cancelled", 0)},
            "host_syncs": {"total": syncs["counted"] + syncs["estimated"],
                           "per_token": (syncs["counted"] + syncs["estimated"]) / syncs["tokens"]
                           if syncs["tokens"] else None,
                           "counted": syncs["counted"], "estimated": syncs["estimated"],
                           "forwards": syncs["forwards"], "one_sync_forwards": syncs["one_sync_forwards"],
                           "how": "counted by the decode loop when it reports them; otherwise estimated: 1 per "
                                  "one-sync forward, 1 per MoE layer per other forward (+1 per failed one-sync "
                                  "try), 1 per token or drafted-token readback; prefill not counted"},
            "speculative": None,
            "memory": _memory(om),
            "last_request": None,
        }
        if self.engine.draft is not None:
            d = self.engine.draft
            out["speculative"] = {"drafter": str(d.path), "num_draft": d.num_draft, "predictor": d.predictor,
                                  "cutoff": d.cutoff, "rounds": spec["rounds"],
                                  "acceptance": spec["accepted"] / spec["drafted"] if spec["drafted"] else None,
                                  "acceptance_last_request": getattr(last, "acceptance", None)}
        if last is not None:
            out["last_request"] = last.to_json()  # runtime.api RunStats (docs/json.md)
        return out


def _prompt_pool(engine, size: int):
    """A PromptCachePool for plain decoding; None with a drafter (runtime.api takes no prompt cache there)."""
    from runtime.decode import PromptCache

    if engine.draft is not None:
        return None
    om = engine.model
    return PromptCachePool(lambda: PromptCache(om.model), size)


def _memory(om) -> dict:
    import mlx.core as mx
    import psutil

    rss = psutil.Process(os.getpid()).memory_info().rss
    return {"rss_bytes": rss, "mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
            "resident_weight_bytes": om.store.resident_bytes, "expert_cache_bytes": om.plan.budget_bytes,
            "available_bytes": psutil.virtual_memory().available}
