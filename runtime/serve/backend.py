"""What the server and the chat REPL generate with: one loaded engine, its tokenizer and its stats.

`encode` turns a request into prompt ids with mlx-lm's conventions (the tokenizer's chat template
with the generation prompt; without a template, mlx_lm.server's plain role transcript);
`stream` yields runtime.api responses; `stats` is what GET /v1/specmoe/stats reports.

Counters (lifetime, since the server started; `last_request` is the same record for one run):
every run adds its prompt and completion tokens and the host syncs the expert cache counted
during it (router read-backs, device-pass syncs and token read-backs, prefill included); a run whose decoder
reported its forwards (it ran to end of sequence or max_tokens) also adds those forwards and
how many of them took one host sync. A run ended early (stop string, disconnect,
--request-timeout) has no decoder report: its tokens and syncs count, its forwards do not, and
`unreported_runs` says how many such runs there were.

Batched requests (runtime/serve/batch_run.py, `--max-batch` > 1) add the same record through
`add_run`: their host syncs are each step's syncs shared among the step's sequences (so the
lifetime total is still the sum of the records), a finished one reports one forward per token
(each a batch forward, none of them one-sync), and they use no prompt cache. `batch_stats` is what
/health and /v1/specmoe/stats report about batching: steps, sequences per step (current, max seen,
mean, histogram), and the decode steps' unique expert lookups against their sum over sequences.

Invariants: only the generation worker (or the REPL's one thread) calls `stream`; a chat request
with one user message encodes to exactly the ids `specmoe generate -p TEXT` uses, so greedy
output is the same text; one_sync_forwards <= forwards; the lifetime counters are the sums of
the per-run records; no filesystem path is reported unless `stats(paths=True)`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
    def __init__(self, engine, *, chat_template_args: dict | None = None,
                 prompt_cache_size: int = 2, kv_bits: int | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.kv_bits = kv_bits  # --kv-bits: quantized KV cache (plain decoding)
        self.chat_template_args = dict(chat_template_args or {})
        self.started = time.time()
        self._lock = threading.Lock()
        self._totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0,
                        "decode_s": 0.0}
        self._syncs = {"host_syncs": 0, "forwards": 0, "one_sync_forwards": 0, "reported_tokens": 0,
                       "unreported_runs": 0}
        self._spec = {"drafted": 0, "accepted": 0, "rounds": 0}
        self._last = None  # RunStats of the last finished request
        self._last_counts = None  # that request's counter record (what it added to the lifetime counters)
        self.pool = _prompt_pool(engine, prompt_cache_size)  # None: speculative (no prompt cache yet)
        self.last_prompt_cache = None  # the pool's cache the latest run used (a hand-over to a batch starts from it)
        self._batch = {"steps": 0, "sequences": 0, "current": 0, "max_seen": 0, "histogram": {},
                       "unique_experts": 0, "summed_experts": 0, "reads": 0}

    # -- batching (runtime/serve/batch_run.py) ----------------------------------------------
    @property
    def can_batch(self) -> bool:
        """Plain decoding on full-precision KV: speculative (--draft) and --kv-bits requests run one at a time."""
        return self.engine.draft is None and not self.kv_bits

    def batchable(self, request) -> bool:
        """A request that may join a batch: the engine can batch and the request sets no seed (a seed
        reproduces one run's sampling, which the batch's shared random state cannot)."""
        return self.can_batch and getattr(request, "seed", None) is None

    def open_batch(self, max_batch: int):
        """A BatchDecoder over the engine's model for up to `max_batch` sequences (the worker thread only)."""
        from runtime.decode import BatchDecoder

        return BatchDecoder(self.engine.model, stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
                            completion_batch_size=max_batch, prefill_batch_size=max_batch, on_step=self._batch_step)

    def _batch_step(self, step) -> None:
        with self._lock:
            b = self._batch
            b["steps"] += 1
            b["sequences"] += step.n_sequences
            b["current"] = step.n_sequences
            b["max_seen"] = max(b["max_seen"], step.n_sequences)
            b["histogram"][step.n_sequences] = b["histogram"].get(step.n_sequences, 0) + 1
            b["unique_experts"] += step.unique_experts
            b["summed_experts"] += step.summed_experts
            b["reads"] += step.reads

    def batch_idle(self) -> None:
        """The batch emptied: no sequence decodes now."""
        with self._lock:
            self._batch["current"] = 0

    def batch_stats(self) -> dict:
        with self._lock:
            b = dict(self._batch)
            b["histogram"] = {str(k): v for k, v in sorted(self._batch["histogram"].items())}
        steps = b["steps"]
        return {**b, "mean_sequences": b["sequences"] / steps if steps else None,
                "unique_per_step": b["unique_experts"] / steps if steps else None,
                "summed_per_step": b["summed_experts"] / steps if steps else None,
                "unique_share": b["unique_experts"] / b["summed_experts"] if b["summed_experts"] else None,
                "how": "steps: batch decode steps; sequences: tokens they decoded (current: the last step's batch, 0 "
                       "when idle); unique_experts: per step and MoE layer, the union of the batch's experts (each "
                       "looked up and read if absent once); summed_experts: each sequence's own experts summed (what "
                       "one-at-a-time steps would look up); reads: experts the steps read from disk"}

    # -- prompts -----------------------------------------------------------------------------
    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
        """`tools` and `template_kwargs` (e.g. enable_thinking) go to the chat template, as mlx_lm.server passes them."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            kwargs = {**self.chat_template_args, **(template_kwargs or {})}
            if tools:
                kwargs["tools"] = tools
            return list(tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
        from mlx_lm.server import convert_chat

        return list(tok.encode(convert_chat(messages)))

    def encode_text(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))

    def encode(self, request) -> list[int]:
        if request.kind != "chat":
            return self.encode_text(request.prompt)
        return self.encode_messages(request.messages, getattr(request, "tools", None),
                                    getattr(request, "template_kwargs", None))

    # -- generation --------------------------------------------------------------------------
    def reset_prompt_cache(self) -> None:
        if self.pool is not None:
            self.pool.clear()

    def stream(self, ids: list[int], request):
        """Pieces for `ids` under the request's sampling settings (runtime.api.stream_generate), the
        conversation's KV taken from the prompt cache pool when decoding plainly."""
        from runtime.api import stream_generate

        t0 = time.perf_counter()
        syncs0 = self._host_syncs()
        last, cached = None, None
        extra = {"kv_bits": self.kv_bits} if self.kv_bits else {}
        self.last_prompt_cache = None
        if self.pool is not None:
            extra["prompt_cache"] = cache = self.last_prompt_cache = self.pool.take(ids)
        try:
            for last in stream_generate(self.engine, ids, request.max_tokens, temp=request.temperature,
                                        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
                                        seed=request.seed, **extra):  # decoding as the engine was loaded
                if self.pool is not None and cached is None:
                    cached = cache.reused  # set by the prefill, before the first token
                yield Piece(last.text, last.token, last.finish_reason, last.stats, cached)
        finally:
            n = last.stats.generation_tokens if last is not None else 0
            record = {"prompt_tokens": len(ids), "completion_tokens": n, "host_syncs": self._host_syncs() - syncs0,
                      **_forwards(last.detail if last is not None else None, n)}
            self.add_run(record, cached, time.perf_counter() - t0, last.stats if last is not None else None)

    def add_run(self, record: dict, cached: int | None, seconds: float, run_stats=None, new_request: bool = True) -> None:
        """Add one request's record (prompt_tokens, completion_tokens, host_syncs, forwards, one_sync_forwards;
        forwards None: ended early) to the lifetime counters; it becomes `last_request`. `new_request` False:
        the record continues a request already counted (a run handed over to a batch)."""
        n = record["completion_tokens"]
        last = run_stats
        with self._lock:
            t = self._totals
            t["requests"] += int(new_request)
            t["prompt_tokens"] += record["prompt_tokens"]
            t["completion_tokens"] += n
            t["cached_prompt_tokens"] += cached or 0
            t["decode_s"] += seconds
            s = self._syncs
            s["host_syncs"] += record["host_syncs"]
            if record["forwards"] is None:
                s["unreported_runs"] += 1
            else:
                s["forwards"] += record["forwards"]
                s["one_sync_forwards"] += record["one_sync_forwards"]
                s["reported_tokens"] += n
            spec = getattr(last, "speculative", None) if last is not None else None
            if spec is not None:  # the drafter's part of the run so far: known however the run ended
                self._spec["drafted"] += spec.drafted
                self._spec["accepted"] += spec.accepted
                self._spec["rounds"] += spec.rounds
            self._last = last
            self._last_counts = record

    def host_syncs(self) -> int:
        """Host syncs the expert cache has counted since load."""
        return self._host_syncs()

    def _host_syncs(self) -> int:
        return self.engine.model.cache.host_syncs

    # -- observability -----------------------------------------------------------------------
    def stats(self, paths: bool = False) -> dict:
        """What GET /v1/specmoe/stats reports; `paths` adds the drafter's and the store's directories."""
        om = self.engine.model
        c = om.counters()
        hits, misses = c["hits"], c["misses"]
        with self._lock:
            totals, last, syncs, spec = dict(self._totals), self._last, dict(self._syncs), dict(self._spec)
            counts = self._last_counts
        out = {
            "uptime_s": round(time.time() - self.started, 1),
            "requests": totals,
            "expert_cache": {"hit_rate": hits / (hits + misses) if hits + misses else None, "hits": hits,
                             "misses": misses, "evictions": c.get("evictions", 0),
                             "budget_bytes": om.plan.budget_bytes, "fraction_of_experts": om.plan.fraction},
            "io": {"bytes_read": c["bytes_read"], "load_wait_ms": round(c["load_wait_ms"], 3),
                   "prefetch_used": c.get("prefetch_hits", 0),
                   "prefetch_wasted": c.get("prefetch_wasted", 0) + c.get("prefetch_cancelled", 0)},
            "host_syncs": {"total": syncs["host_syncs"],
                           "per_token": syncs["host_syncs"] / totals["completion_tokens"]
                           if totals["completion_tokens"] else None,
                           "forwards": syncs["forwards"], "one_sync_forwards": syncs["one_sync_forwards"],
                           "reported_tokens": syncs["reported_tokens"], "unreported_runs": syncs["unreported_runs"],
                           "how": "total: host syncs the expert cache counted (router read-backs, device-pass syncs, "
                                  "plain decoding's token read-backs; prefill included). forwards: "
                                  "model forwards of runs that ran to their end (plain: every forward after the "
                                  "prompt, one per token without device passes; speculative: verify passes and "
                                  "re-runs), reported_tokens their tokens; runs ended early (stop string, "
                                  "disconnect, timeout) are unreported_runs"},
            "batching": self.batch_stats(),
            "speculative": None,
            "memory": _memory(om),
            "last_request": None,
        }
        if self.engine.draft is not None:
            d = self.engine.draft
            out["speculative"] = {"drafter": str(d.path) if paths else Path(d.path).name, "num_draft": d.num_draft, "predictor": d.predictor,
                                  "cutoff": d.cutoff, "rounds": spec["rounds"],
                                  "acceptance": spec["accepted"] / spec["drafted"] if spec["drafted"] else None,
                                  "acceptance_last_request": getattr(last, "acceptance", None)}
        if counts is not None:  # runtime.api RunStats (docs/json.md); a batched request has only its counters
            out["last_request"] = {**(last.to_json() if last is not None else {}), **counts}
        if paths:
            out["paths"] = {"store": str(om.store.model_dir)}
        return out


def _forwards(detail, n_tokens: int) -> dict:
    """A run's forwards and one-sync forwards from its decoder's report (None: the run ended early)."""
    if detail is None:
        return {"forwards": None, "one_sync_forwards": None}
    tries = getattr(detail, "one_sync_tries", 0)
    one_sync = tries - getattr(detail, "one_sync_fallbacks", 0)
    if hasattr(detail, "n_rounds"):  # speculative: verify passes and re-runs of accepted tokens
        return {"forwards": detail.n_rounds + detail.n_reruns, "one_sync_forwards": one_sync}
    # plain: with device passes every forward after the prompt is one (counted, with the one queued after the
    # last token as mlx-lm's generate_step queues it); without, one forward per token
    return {"forwards": tries or n_tokens, "one_sync_forwards": one_sync}


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
