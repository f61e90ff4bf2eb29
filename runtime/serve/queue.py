"""The generation queue: one worker thread owns the model; requests run alone or batched.

Requests are started first come, first served. Each job streams `JobEvent`s back to the asyncio
loop of the request that submitted it; text is cut at the request's stop strings here, so a
stopped generation stops decoding too.

With `max_batch` > 1 (`--max-batch`), a batchable job (Backend.batchable: plain decoding, no seed)
that the worker takes while other jobs wait starts a batch (runtime/serve/batch_run.py): waiting
batchable jobs join it between decode steps, up to `max_batch` at once, until it empties. A job
that finds nobody waiting runs alone on the one-request path (prompt-cache pool, one-sync pass,
lookahead): a batch of one decodes slower than that path (bench/results/batch.txt, B=1 rows). When
jobs wait while it runs, it hands over after its current token: it goes on as the first member of a
batch (its KV taken from its prompt cache, its stop matcher and token count carried) and they join.

At most `max_queue` jobs wait or run at once: `submit` raises QueueFull beyond that (the route
answers 429 with Retry-After). With `request_timeout_s`, a generation that has run that long
stops before its next token and ends with finish_reason "length" (the text so far is kept); the
prompt's prefill is not interrupted.

Invariants: the model is only touched by the worker thread; at most `max_batch` jobs generate at once; a job whose `cancel` is set (its
client went away) is skipped if still queued, or stopped before its next token if running, and
the worker goes on with the next job; every job ends with exactly one event of kind "done" or
"error"; an exception in one job never stops the worker; `pending` counts submitted jobs not yet
ended, so the queue bound holds however jobs end.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.serve.stops import StopMatcher

__all__ = ["GenerationQueue", "Job", "JobEvent", "QueueFull"]

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """`max_queue` jobs are already waiting or running; `retry_after_s` is a guess at when one ends."""

    def __init__(self, pending: int, retry_after_s: int):
        super().__init__(f"{pending} requests are already queued or running (--max-queue); retry in "
                         f"{retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class JobEvent:
    kind: str  # "text", "done" or "error"
    text: str = ""
    finish_reason: str | None = None  # done: "stop" or "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # done: prompt tokens reused from the prompt cache
    error: str = ""
    stop_sequence: str | None = None  # done: the request's stop string that ended it (None: EOS or length)


@dataclass
class Job:
    ids: list[int]
    request: Any  # a CompletionRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    checked_at: float = 0.0  # event-loop time the request handler last checked its client was still there

    def put(self, event: JobEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone (server shutting down)
            self.cancel.set()


class GenerationQueue:
    """`submit` from the event loop; `backend.stream(ids, request)` runs on the worker thread."""

    def __init__(self, backend, max_queue: int = 16, request_timeout_s: float | None = None, max_batch: int = 1):
        if max_batch < 1:
            raise ValueError(f"--max-batch {max_batch}; expected >= 1 (1: one request at a time)")
        self.backend = backend
        self.max_queue, self.request_timeout_s, self.max_batch = max_queue, request_timeout_s, max_batch
        self.batching = max_batch > 1 and getattr(backend, "can_batch", False)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._held: deque = deque()  # a job (or the stop sentinel) taken out of turn by a batch, run next
        self._lock = threading.Lock()
        self.active: Job | None = None
        self.running = 0  # jobs generating now (a batch's members, or the one running alone)
        self.pending = 0  # submitted and not yet ended
        self._run_s = 0.0  # seconds the ended jobs ran, for Retry-After
        self.counts = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0, "timed_out": 0, "refused": 0,
                       "handed_over": 0}
        self._thread = threading.Thread(target=self._run, name="specmoe-generation", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], request) -> Job:
        job = Job(ids, request, asyncio.get_running_loop())
        with self._lock:
            if self.pending >= self.max_queue:
                self.counts["refused"] += 1
                ended = sum(self.counts[k] for k in ("completed", "cancelled", "failed"))
                mean_s = self._run_s / ended if ended else 1.0
                raise QueueFull(self.pending, max(1, int(mean_s * self.pending + 0.999)))
            self.counts["submitted"] += 1
            self.pending += 1
        self._jobs.put(job)
        return job

    def status(self) -> dict:
        with self._lock:
            return {"mode": self._mode(), "max_batch": self.max_batch if self.batching else 1,
                    "queued": self._jobs.qsize() + len(self._held), "busy": self.running > 0,
                    "running": self.running, "max_queue": self.max_queue, **self.counts}

    def _mode(self) -> str:
        if self.batching:
            return (f"up to {self.max_batch} concurrent requests batched (plain decoding; seeded requests and a "
                    "request with nobody waiting run one request at a time)")
        if self.max_batch > 1:
            return "one request at a time (queued, first come first served; speculative or --kv-bits: not batched)"
        return "one request at a time (queued, first come first served)"

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _count(self, key: str, started: float | None = None, timed_out: bool = False) -> None:
        """One job ended as `key` (completed, cancelled or failed) after running since `started`."""
        with self._lock:
            self.counts[key] += 1
            self.pending -= 1
            if timed_out:
                self.counts["timed_out"] += 1
            if started is not None:
                self._run_s += time.monotonic() - started

    def end(self, job: Job, key: str, started: float | None = None, timed_out: bool = False) -> None:
        """A batched job ended as `key` (completed, cancelled or failed); `timed_out` also counts it as such."""
        self._count(key, started, timed_out)

    def set_active(self, n: int) -> None:
        """`n` jobs are generating now (the batch's members)."""
        with self._lock:
            self.running = n

    def take_batchable(self) -> Job | None:
        """For a running batch: the next waiting job if it can join, else None (and it stays first in line).
        Cancelled waiting jobs are ended on the way."""
        while True:
            if self._held:
                return None
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return None
            if job is not None and job.cancel.is_set():
                self._count("cancelled")
                job.put(JobEvent("error", error="cancelled"))
                continue
            if job is None or not self.backend.batchable(job.request):
                self._held.append(job)
                return None
            return job

    def _next(self) -> Job | None:
        return self._held.popleft() if self._held else self._jobs.get()

    def _run(self) -> None:
        from runtime.serve.batch_run import BatchRun

        while True:
            job = self._next()
            if job is None:
                return
            if job.cancel.is_set():
                self._count("cancelled")
                job.put(JobEvent("error", error="cancelled"))
                continue
            if self.batching and self.backend.batchable(job.request) and not self._jobs.empty():
                BatchRun(self, self.backend, self.max_batch).run(job)  # ends every job it admitted
                self.set_active(0)
                continue
            with self._lock:
                self.active, self.running = job, 1
            started = time.monotonic()
            try:
                self._serve(job, started)
            except Exception as e:  # one bad job must not stop the server
                log.exception("generation failed")
                self._count("failed", started)
                job.put(JobEvent("error", error=f"{type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self.active, self.running = None, 0

    def _serve(self, job: Job, started: float) -> None:
        request = job.request
        stops = StopMatcher(request.stop)
        n, finish, cached, timed_out = 0, "length", None, False
        deadline = None if self.request_timeout_s is None else started + self.request_timeout_s
        run = self.backend.stream(job.ids, request)
        tokens, handover = [], False
        try:
            for response in run:
                if job.cancel.is_set():
                    break
                n += 1
                if self.batching:  # what a hand-over to a batch carries
                    tokens.append(response.token)
                cached = getattr(response, "cached_tokens", cached)
                text = stops.feed(response.text)
                if text:
                    job.put(JobEvent("text", text=text))
                if stops.stopped:
                    finish = "stop"
                    break
                if response.finish_reason is not None:
                    finish = response.finish_reason
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True  # --request-timeout: ends as if max_tokens were reached
                    break
                if self.batching and not self._jobs.empty() and self.backend.batchable(request):
                    handover = True  # others wait: this request goes on in a batch with them
                    break
        finally:
            run.close()  # ends the backend's stream (drafter taps removed, caches kept consistent)
        if job.cancel.is_set():
            self._count("cancelled", started)
            job.put(JobEvent("error", error="cancelled"))
            return
        if handover:
            from runtime.serve.batch_run import BatchRun, Resume

            with self._lock:
                self.counts["handed_over"] += 1

            resume = Resume(tokens, stops, started, cached, getattr(self.backend, "last_prompt_cache", None))
            BatchRun(self, self.backend, self.max_batch).run(job, resume)  # ends the job and every one it admits
            return
        tail = stops.flush()
        if tail:
            job.put(JobEvent("text", text=tail))
        self._count("completed", started, timed_out)
        job.put(JobEvent("done", finish_reason=finish, prompt_tokens=len(job.ids), completion_tokens=n,
                         stop_sequence=stops.matched,
                         cached_tokens=cached))
