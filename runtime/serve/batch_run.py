"""A batch of concurrent requests decoded together: the generation worker drives one BatchDecoder.

`BatchRun(queue, backend, max_batch).run(first)` starts a BatchDecoder (runtime/decode/batch.py:
mlx-lm's BatchGenerator over the paged model, each step reading the union of the batch's experts
once) with `first`, and between steps takes more waiting jobs from the queue until `max_batch`
sequences are in it: a newcomer is inserted (its prompt prefilled by the BatchGenerator) and
joins the generation batch at a following step. After each step every member's token goes to its
own job: a streaming detokenizer, the request's StopMatcher (held-back text), its events. A member
leaves when it finishes (end of sequence, its max_tokens), matches a stop string, is cancelled
(its client went away), or reaches --request-timeout; the others go on. The run returns when no
member is left and no batchable job waits.

`run(first, resume)` goes on with a request that ran alone until others came to wait
(GenerationQueue hands it over after a token): its prompt cache is rolled back to what it holds of
prompt + emitted tokens (PromptCache.reuse, at most all but the last), passed to the BatchGenerator
as that sequence's cache (mlx-lm merges it into the batch's caches, as mlx_lm.server passes its
prompt caches), and the rest is prefilled; its stop matcher, token count and start time carry over,
and its detokenizer is replayed over the emitted tokens, so the text goes on where it was.

Per request as on the one-at-a-time path: the same events, text, finish_reason and
completion_tokens (the end-of-sequence token counted, not shown); its own sampler (temperature,
top_p, top_k, min_p). Not batched (left for the queue to run alone): requests with a seed, and
every request of an engine that cannot batch (speculative, --kv-bits; Backend.batchable). A job
that cannot join stops admission, so jobs still start in arrival order.

The prompt-cache pool (runtime/serve/prompt_pool.py) per request, as on the one-at-a-time path: a newcomer takes
the entry sharing the longest prefix with its prompt, rolled back to it (PromptCache.reuse), as its sequence's
cache (mlx-lm's all_tokens: those tokens) and prefills the rest (cached_tokens counts them); the entry is out of the
pool while the member runs, so no other member rolls it back. When a member ends (finished, stopped, timed out),
its KV -- mlx-lm extracts one sequence's cache from the batch caches (GenerationBatch.Response.prompt_cache, or
BatchGenerator.remove(..., return_prompt_caches=True)), as mlx_lm.server returns a request's cache to its LRU
prompt cache -- goes back into the pool as its newest entry, replacing the entries it extends (the conversation's
earlier turn); a cancelled member's entry goes back as it took it.

Invariants: only the worker thread runs this; every admitted job ends with exactly one "done" or
"error" event and is counted once by the queue (GenerationQueue.end); a token reaches only the job
whose uid the BatchGenerator gave it; an exception in the decoder ends every member with an error
and closes the decoder; nothing is left in the decoder when run returns; a cache kept in the pool holds exactly
its tokens (its length checked) and is evaluated on the worker thread that made it (MLX streams are per thread).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from runtime.decode import common_prefix
from runtime.serve.queue import JobEvent
from runtime.serve.stops import StopMatcher

__all__ = ["BatchRun"]

log = logging.getLogger(__name__)


@dataclass
class Resume:
    """A request that ran alone and goes on in a batch: what it has produced and what it holds."""

    tokens: list[int]  # the tokens it has emitted (every one fed to its prompt cache)
    stops: StopMatcher  # its stop matcher, held-back text included
    started: float  # when it started (its --request-timeout counts from there)
    cached: int | None  # prompt tokens its run took from the prompt cache
    prompt_cache: object = None  # its runtime.decode.PromptCache (None: it had none), rolled back here


@dataclass
class _Member:
    job: object  # runtime.serve.queue.Job
    detok: object  # mlx-lm's streaming detokenizer, one per request
    stops: StopMatcher
    started: float
    deadline: float | None
    n: int = 0  # tokens received (the end-of-sequence token included)
    host_syncs: int = 0  # this member's share of the steps' host syncs
    timed_out: bool = False
    finish: str | None = None  # the BatchGenerator's finish_reason: "stop" (end of sequence) or "length"
    n0: int = 0  # tokens emitted before it joined (a resumed run), counted in that run's record
    cached: int | None = None  # prompt tokens taken from the prompt cache (its pool entry, or a resumed run's own)
    entry: object = None  # the pool entry its cache came from (out of the pool while it runs; back if it is cancelled)
    t0: float = field(default_factory=time.perf_counter)


class BatchRun:
    def __init__(self, queue, backend, max_batch: int):
        self.queue, self.backend, self.max_batch = queue, backend, max_batch

    def run(self, first, resume: Resume | None = None) -> None:
        """Decode `first` (a run going on from `resume`, if given) and the jobs that join, until none is left."""
        try:
            decoder = self.backend.open_batch(self.max_batch)
        except Exception as e:
            self._fail(first, e, time.monotonic())
            return
        members: dict[int, _Member] = {}
        try:
            job = first
            while True:
                while job is not None and len(members) < self.max_batch:
                    try:
                        self._admit(decoder, members, job, resume if job is first else None)
                    except Exception as e:  # this request cannot join (its prompt or settings): it alone fails
                        self._fail(job, e, time.monotonic())
                    job = self.queue.take_batchable() if len(members) < self.max_batch else None
                if not members:
                    return
                syncs0 = self.backend.host_syncs()
                responses = decoder.next()
                self._share_syncs(members, [r.uid for r in responses], self.backend.host_syncs() - syncs0)
                for r in responses:
                    member = self._member_of(members, r.uid)
                    if member is not None and self._feed(member, r):
                        self._leave(decoder, members, r.uid, reported=r.finish_reason is not None,
                                    kept=(r.prompt_cache, r.all_tokens) if r.finish_reason is not None else None)
                now = time.monotonic()
                for uid, member in list(members.items()):
                    if member.job.cancel.is_set():
                        self._leave(decoder, members, uid, reported=False)
                    elif member.deadline is not None and now >= member.deadline:
                        member.timed_out = True  # --request-timeout: ends as if max_tokens were reached
                        self._leave(decoder, members, uid, reported=False)
                job = self.queue.take_batchable() if len(members) < self.max_batch else None
        except Exception as e:  # the batch cannot go on: every member ends with the error
            log.exception("batched generation failed")
            for uid in list(members):
                m = members.pop(uid)
                self._fail(m.job, e, m.started)
        finally:
            decoder.close()
            self.backend.batch_idle()

    def _fail(self, job, e: Exception, started: float) -> None:
        self.queue.end(job, "failed", started)
        job.put(JobEvent("error", error=f"{type(e).__name__}: {e}"))

    def _admit(self, decoder, members: dict, job, resume: Resume | None = None) -> None:
        req = job.request
        sampler = make_sampler(temp=req.temperature, top_p=req.top_p, min_p=req.min_p, top_k=req.top_k)
        timeout = self.queue.request_timeout_s
        detok = self.backend.tokenizer.detokenizer
        prefix: list[int] = []  # the tokens a cache passed in holds (mlx-lm's all_tokens)
        cached = resume.cached if resume else None
        if resume is None:
            started, stops, done = time.monotonic(), StopMatcher(req.stop), []
            prompt, caches = job.ids, None
            entry, k = self._checkout(job.ids)  # a conversation's earlier turn: its KV from the pool, the rest prefilled
            if k:
                prompt, caches, prefix, cached = job.ids[k:], [entry.cache], job.ids[:k], k
            else:
                entry = None
        else:  # its cache rolled back to what it holds of prompt + tokens (all but the last), the rest prefilled
            started, stops, done = resume.started, resume.stops, resume.tokens
            full = job.ids + done
            pc = resume.prompt_cache
            k = pc.reuse(full) if pc is not None else 0
            self._checkout_entry(pc)
            entry = pc if k else None
            prompt, caches, prefix = full[k:], ([pc.cache] if k else None), full[:k]
            for t in done:  # the detokenizer picks up where the run's left off: the same text segments follow
                detok.add_token(t)
            detok.last_segment
        (uid,) = decoder.insert([prompt], [req.max_tokens - len(done)], caches=caches,
                                all_tokens=[prefix] if caches else None, samplers=[sampler])
        members[uid] = _Member(job, detok, stops, started, None if timeout is None else started + timeout,
                               n=len(done), n0=len(done), cached=cached, entry=entry)
        self.queue.set_active(len(members))

    # -- the prompt-cache pool (runtime/serve/prompt_pool.py), as the one-request path uses it --------------------
    def _checkout(self, ids: list[int]):
        """(the pool's entry sharing the longest prefix with `ids`, rolled back to it; tokens it saves), or (None, 0).
        The entry leaves the pool while its cache waits in the batch: no other member rolls it back meanwhile."""
        pool = self.backend.pool
        if pool is None or not pool.entries:
            return None, 0
        entry = max(reversed(pool.entries), key=lambda e: common_prefix(e.tokens, ids))  # ties: most recent
        if not common_prefix(entry.tokens, ids):
            return None, 0
        k = entry.reuse(ids)
        self._checkout_entry(entry)
        return entry, k

    def _checkout_entry(self, entry) -> None:
        pool = self.backend.pool
        if pool is not None and entry in pool.entries:
            pool.entries.remove(entry)

    def _keep(self, cache: list, tokens: list[int]) -> None:
        """A member's KV (mlx-lm's per-sequence cache extracted from the batch, holding `tokens`) into the prompt-cache
        pool as its most recent entry; entries it extends (the conversation's earlier turns) leave, then the least
        recently used ones beyond the pool's size. A cache whose length is not its tokens' is not kept."""
        pool = self.backend.pool
        offsets = {c.offset for c in cache if c.is_trimmable() and hasattr(c, "offset")}
        if pool is None or not cache or not tokens or offsets - {len(tokens)}:
            return
        mx.eval([c.state for c in cache])  # here, on this thread's streams (MLX streams are per thread)
        entry = pool.factory()
        entry.cache, entry.tokens = list(cache), [int(t) for t in tokens]
        entry.snapshot()
        self._return(entry)

    def _return(self, entry) -> None:
        """`entry` into the pool as its newest; entries it extends leave, then the oldest beyond the pool's size."""
        pool = self.backend.pool
        if pool is None or not entry.tokens:
            return
        pool.entries = [e for e in pool.entries if common_prefix(e.tokens, entry.tokens) < len(e.tokens)]
        pool.entries.append(entry)
        del pool.entries[: max(0, len(pool.entries) - pool.size)]

    @staticmethod
    def _member_of(members: dict, uid: int):
        """The job a BatchGenerator response belongs to (None: it left already)."""
        return members.get(uid)

    @staticmethod
    def _share_syncs(members: dict, uids: list[int], syncs: int) -> None:
        """The step's host syncs shared among the sequences it decoded (the first takes the remainder)."""
        here = [u for u in uids if u in members] or list(members)[:1]
        if not here:
            return
        share, rest = divmod(syncs, len(here))
        for i, u in enumerate(here):
            members[u].host_syncs += share + (rest if i == 0 else 0)

    def _feed(self, m: _Member, r) -> bool:
        """One token for one member; True when the member is done (finished or stopped by a stop string)."""
        if m.job.cancel.is_set():
            return False  # left at the end of this step, as cancelled
        m.n += 1
        if r.finish_reason != "stop":
            m.detok.add_token(r.token)
        if r.finish_reason is not None:
            m.finish = r.finish_reason
            m.detok.finalize()
        text = m.stops.feed(m.detok.last_segment)
        if text:
            m.job.put(JobEvent("text", text=text))
        return m.stops.stopped or r.finish_reason is not None

    def _leave(self, decoder, members: dict, uid: int, reported: bool, kept: tuple | None = None) -> None:
        """End one member: removed from the decoder unless the BatchGenerator already finished it (then `kept` is
        its (cache, tokens)); its KV kept in the prompt-cache pool unless it was cancelled; its events, its record,
        its count."""
        m = members.pop(uid)
        job = m.job
        if not reported:
            kept = decoder.remove([uid], return_caches=not job.cancel.is_set()).get(uid)
        if kept is not None and not job.cancel.is_set():
            self._keep(*kept)
        elif job.cancel.is_set() and m.entry is not None:
            self._return(m.entry)  # what it took, as it was (mlx-lm copied it into the batch)
        self.queue.set_active(len(members))
        n = m.n
        record = {"prompt_tokens": 0 if m.n0 else len(job.ids), "completion_tokens": n - m.n0,
                  "host_syncs": m.host_syncs, "forwards": n - m.n0 if reported else None,
                  "one_sync_forwards": 0 if reported else None}
        self.backend.add_run(record, None if m.n0 else m.cached, time.perf_counter() - m.t0, new_request=not m.n0)
        if job.cancel.is_set():
            self.queue.end(job, "cancelled", m.started)
            job.put(JobEvent("error", error="cancelled"))
            return
        tail = m.stops.flush()
        if tail:
            job.put(JobEvent("text", text=tail))
        finish = "stop" if m.stops.stopped else (m.finish or "length")
        self.queue.end(job, "completed", m.started, timed_out=m.timed_out)
        job.put(JobEvent("done", finish_reason=finish, prompt_tokens=len(job.ids), completion_tokens=n,
                                 stop_sequence=m.stops.matched, cached_tokens=m.cached))
